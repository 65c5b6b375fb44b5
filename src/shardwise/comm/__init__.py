"""Explicit collectives, each booked in a ledger (see :mod:`.ledger` for what is counted)."""

from .ledger import CommRecord, Ledger, ring_bytes
from .ops import (Handle, all_gather, all_reduce, all_reduce_future, all_to_all,
                  all_to_all_v, broadcast, broadcast_coalesced, broadcast_object, recv, reduce,
                  reduce_scatter, send)

__all__ = ["CommRecord", "Ledger", "ring_bytes", "Handle", "all_gather", "all_reduce",
           "all_reduce_future", "all_to_all", "all_to_all_v", "broadcast", "broadcast_coalesced",
           "broadcast_object", "recv",
           "reduce", "reduce_scatter", "send"]
