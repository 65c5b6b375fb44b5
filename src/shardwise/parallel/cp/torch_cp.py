"""Context parallelism through PyTorch's own implementation (``--engine torch --cp N``, CUDA).

``torch.distributed.tensor.experimental.context_parallel`` patches
``scaled_dot_product_attention`` with its ring attention over a cp device mesh while inside the
context. We use it for dp × cp with DDP over the data axis (dp × cp): the train step has already
cut each micro-batch to this rank's two chunks (:func:`.split.shard_sequence`, the head-tail
split that torch's default load balancer, ``_HeadTailLoadBalancer``, also makes), so the context
is given only a position buffer to shard, and each rank checks that torch's split of it equals
ours before any attention runs. Forward and backward of every micro-batch run inside the
context (its ring's backward dispatches through DTensor there).

Not on CPU: torch 2.13 has no sharding rule for the CPU attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``), so :func:`.split.validate_cp` refuses
it there. Wired for CUDA and not yet run on a GPU (docs/context-parallel.md says what was
verified where); tp, pp and ZeRO with cp run on the explicit engine.
"""

from __future__ import annotations

import contextlib

import torch

from ..dp.ddp import TorchDataParallel
from .split import zigzag_positions


@contextlib.contextmanager
def torch_context_parallel(topo, seq_len: int):
    """torch's ``context_parallel`` over ``topo.mesh["cp"]`` for sequences of ``seq_len``
    tokens (the whole sequence), after checking that its head-tail split of the positions is
    :func:`.split.zigzag_positions` of this rank. Raises ``RuntimeError`` if it is not."""
    from torch.distributed.tensor.experimental import context_parallel

    positions = torch.arange(seq_len, device=topo.device)
    with context_parallel(topo.mesh["cp"], buffers=[positions], buffer_seq_dims=[0],
                          no_restore_buffers={positions}):
        mine = zigzag_positions(seq_len, topo.size("cp"), topo.index("cp"), topo.device)
        if not torch.equal(positions, mine):
            raise RuntimeError(
                f"torch's context_parallel split the sequence as {positions.tolist()[:8]}… on "
                f"cp rank {topo.index('cp')}, shard_sequence as {mine.tolist()[:8]}…: this "
                "torch's load balancer differs from the head-tail split; use --engine explicit")
        yield


class TorchContextParallel(TorchDataParallel):
    """dp × cp on the torch engine: DDP over the data axis ("dp_cp"), each step's micro-batches
    (already this rank's chunks [b, s/cp]) forward and backward inside
    :func:`torch_context_parallel`. Bytes: DDP's gradient all-reduce; the ring's own traffic is
    torch's (not booked in the ledger: it bypasses :mod:`shardwise.comm`)."""

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        seq_len = microbatches[0]["input_ids"].shape[1] * self.topo.size("cp")
        with torch_context_parallel(self.topo, seq_len):
            return super().forward_backward(microbatches, denom, dtype)

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with torch_context_parallel(self.topo, batch["input_ids"].shape[1] * self.topo.size("cp")):
            return super().loss_sum_and_count(batch)
