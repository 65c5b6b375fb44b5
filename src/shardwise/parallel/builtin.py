"""The same layouts through PyTorch's own implementations (``--engine torch``).

DP → ``torch.nn.parallel.DistributedDataParallel`` over the topology's dp process group. DDP
buckets and overlaps exactly as :class:`shardwise.parallel.data.DataParallel` does; we give it a
documented communication hook (``register_comm_hook``) that all-reduces each bucket through
:mod:`shardwise.comm`, so the ledger sees DDP's traffic too, and that **sums** instead of
averaging, because shardwise already divides each rank's loss by the global token count (see the
math in :mod:`shardwise.parallel.data`). Everything else — bucketing, hooks, ``no_sync`` — is DDP's.
"""

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from .engine import Engine


def _ledger_sum_hook(topo, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: SUM-all-reduce the bucket's flat gradient buffer over dp, booked in the
    ledger. Returns the future DDP waits on."""
    return comm.all_reduce_future(bucket.buffer(), topo, "dp", tag="grad")


class TorchDataParallel(Engine):
    """DDP with the same interface as :class:`~shardwise.parallel.data.DataParallel`."""

    def __init__(self, module: nn.Module, topo, bucket_mb: float = 25.0):
        super().__init__(module)
        self.topo = topo
        # DDP broadcasts rank 0's parameters at construction (its own call, not in the ledger).
        # Buffers (RoPE tables) are deterministic: no need to sync them every forward.
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})
        self.ddp = DDP(module, process_group=topo.group("dp"), bucket_cap_mb=bucket_mb,
                       **no_buffer_sync)
        self.ddp.register_comm_hook(topo, _ledger_sum_hook)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def sync_gradients(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.ddp.no_sync()

    def finish_gradient_sync(self) -> None:
        """Nothing to do: DDP waits for its buckets at the end of backward."""

