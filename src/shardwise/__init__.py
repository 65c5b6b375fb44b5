"""shardwise: N-D parallel training for PyTorch with every collective in sight."""

__version__ = "0.1.0"
