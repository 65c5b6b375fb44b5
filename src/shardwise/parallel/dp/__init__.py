"""Data parallelism: every dp rank holds the whole model and a slice of the global batch; the
gradients are summed over dp. Read :mod:`.data_parallel` (:class:`GradBuckets`, the bucketed,
overlapped all-reduce, and :class:`DataParallel`), then its PyTorch twin :mod:`.ddp` (DDP with a
ledger-booked comm hook). The math and the measurements: docs/data-parallel.md.

From learn/ (``learn/dp.py``'s names → here):

* ``∂W_in[D, F] {U_X}`` summed by ``dist.all_reduce(flat)`` (one buffer, after backward) →
  :class:`~.data_parallel.GradBuckets`: buckets, each all-reduced as soon as backward has
  filled it (tag ``grad``); expert shards (over "edp") too: :class:`~.data_parallel.GradSync`
* ``init_params()`` (the same weights on every rank) → :class:`~.data_parallel.DataParallel`
  broadcasts from dp index 0 (tag ``init``); the engine calls its
  :meth:`~.data_parallel.DataParallel.finish_gradient_sync` after the last backward
* ``x.chunk(n)[rank]`` (``In[B_X, D]``) → :class:`shardwise.data.sampler.DistributedSampler`
* ``/ (B * D)`` (the global count) → each micro-batch's loss sum divided by the step's global
  token count, ``denom`` of :meth:`~..runner.NoPipelining.forward_backward`
* ``2(n−1)/n · 4Ψ`` and ``16Ψ`` → :func:`~.data_parallel.dp_grad_bytes_formula`,
  :func:`~.data_parallel.dp_memory_formula`; PyTorch's DDP: :class:`~.ddp.DDPSync`
"""

from ...comm.torch_booking import ddp_comm_hook
from ..params import REDUCE_DTYPES, reduce_torch_dtype
from .data_parallel import (DataParallel, GradBuckets, dp_grad_bytes_formula,
                            dp_memory_formula)
from .ddp import DDPSync

__all__ = ["REDUCE_DTYPES", "DataParallel", "GradBuckets", "DDPSync",
           "ddp_comm_hook", "dp_grad_bytes_formula", "dp_memory_formula", "reduce_torch_dtype"]
