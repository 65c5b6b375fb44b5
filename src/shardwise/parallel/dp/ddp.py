"""The same layouts through PyTorch's own implementations (``--engine torch``).

DP → ``torch.nn.parallel.DistributedDataParallel`` over the topology's data axis (dp, or dp × cp
with context parallelism: :mod:`..cp.torch_cp`). DDP
buckets and overlaps exactly as :class:`shardwise.parallel.dp.DataParallel` does; we give it a
documented communication hook (``register_comm_hook``,
:func:`shardwise.comm.torch_booking.ddp_comm_hook`) that all-reduces each bucket through
:mod:`shardwise.comm`, so the ledger sees DDP's traffic too, and that **sums** instead of
averaging, because shardwise already divides each rank's loss by the global token count (see the
math in :mod:`shardwise.parallel.dp`). Everything else — bucketing, hooks, ``no_sync`` — is DDP's.
"""

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...comm.torch_booking import ddp_comm_hook
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import reduce_bytes
from .data_parallel import dp_grad_bytes_formula, dp_memory_formula


class DDPSync(Sync):
    """DDP over ``topo``'s data axis as a plain gradient sync, the twin of
    :class:`~shardwise.parallel.dp.DataParallel` (the loss function runs :attr:`forward_module`,
    DDP's wrapper). ``precision.reduce_dtype``: "fp32" | "bf16" (bf16 compression hook, booked
    in the ledger). ``step_context``: torch's ``context_parallel`` with cp > 1
    (:func:`..cp.torch_cp.step_context`), else None."""

    def __init__(self, module: nn.Module, topo, bucket_mb: float = 25.0,
                 precision: Precision = FP32, step_context=None):
        precision.reduce_torch  # checked before any collective
        hook = ddp_comm_hook(precision.reduce_dtype)
        super().__init__(module, topo)
        self.precision, self.step_context = precision, step_context
        # DDP broadcasts rank 0's parameters at construction (its own call, not in the ledger).
        # Buffers (RoPE tables) are deterministic: no need to sync them every forward.
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})
        self.ddp = DDP(module, process_group=topo.group(topo.data_axis),
                       bucket_cap_mb=bucket_mb, **no_buffer_sync)
        self.ddp.register_comm_hook(topo, hook)

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp

    def sync_gradients(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.ddp.no_sync()

    def finish_gradient_sync(self) -> None:
        """Nothing to do: DDP waits for its buckets at the end of backward."""

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int,
                      precision: Precision = FP32) -> dict[str, float]:
        """{"grad": 2(n−1)/n · Ψ · b_r} (:func:`.data_parallel.dp_grad_bytes_formula`): one SUM
        all-reduce of every gradient per step, b_r = 4 (fp32) or 2 (bf16 compression)."""
        b = reduce_bytes(self.precision.reduce_dtype)
        psi = sum(p.numel() for p in self.module.parameters())
        return {"grad": dp_grad_bytes_formula(psi * b, self.topo.size(self.topo.data_axis))}

    def memory_formula(self) -> dict[str, float]:
        """:func:`.data_parallel.dp_memory_formula` of this replica."""
        return dp_memory_formula(sum(p.numel() for p in dict.fromkeys(self.module.parameters())))

