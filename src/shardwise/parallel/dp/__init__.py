"""Data parallelism: every dp rank holds the whole model and a slice of the global batch; the
gradients are summed over dp. Read :mod:`.data_parallel` (:class:`GradBuckets`, the bucketed,
overlapped all-reduce, and :class:`DataParallel`), then its PyTorch twin :mod:`.ddp` (DDP with a
ledger-booked comm hook). The math and the measurements: docs/data-parallel.md.
"""

from ...comm.torch_booking import ddp_comm_hook
from ..params import REDUCE_DTYPES, reduce_torch_dtype
from .data_parallel import (DataParallel, GradBuckets, dp_grad_bytes_formula,
                            dp_memory_formula)
from .ddp import DDPSync

__all__ = ["REDUCE_DTYPES", "DataParallel", "GradBuckets", "DDPSync",
           "ddp_comm_hook", "dp_grad_bytes_formula", "dp_memory_formula", "reduce_torch_dtype"]
