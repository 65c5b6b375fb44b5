"""Parallel strategies, each a transform over a plain model (see docs/architecture.md)."""
