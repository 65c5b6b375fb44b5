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


def step_context(topo):
    """The context the torch engine's dp × cp step and evaluation run in: given the local
    sequence length of this rank's chunks (s/cp), :func:`torch_context_parallel` over the whole
    sequence (s). Composed with DDP over the data axis ("dp_cp") by
    :func:`~shardwise.parallel.apply.parallelize`. Bytes: DDP's gradient all-reduce; the ring's
    own traffic is torch's (not booked in the ledger: it bypasses :mod:`shardwise.comm`)."""
    return lambda local_len: torch_context_parallel(topo, local_len * topo.size("cp"))
