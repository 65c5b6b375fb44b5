"""TP's collectives as autograd functions: Megatron's f and g, and their sequence-parallel halves.

A column-parallel matmul followed by a row-parallel one needs exactly one collective in forward
and one in backward (Shoeybi et al. 2019, "Megatron-LM", arXiv 1909.08053, §3, Figure 3):

=====================================  ==========================  ============================
operator                               forward                     backward
=====================================  ==========================  ============================
**f**  :func:`copy_to_tp`              identity                    all-reduce (SUM) over tp
**g**  :func:`reduce_from_tp`          all-reduce (SUM) over tp    identity
=====================================  ==========================  ============================

f sits where a replicated activation enters the TP region (before the column-parallel matmuls);
g where it ends (after the row-parallel matmul). With sequence parallelism (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, §4.2.2,
Figure 5) the activations outside the region are split along the sequence, and each all-reduce
becomes its two halves (an all-reduce is a reduce-scatter followed by an all-gather):

====================================  ==============================  ==============================
operator                              forward                         backward
====================================  ==============================  ==============================
**g** :func:`gather_from_sp`          all-gather along the sequence   reduce-scatter along the
(replaces f at the region's entry)                                    sequence
**ḡ** :func:`reduce_scatter_to_sp`    reduce-scatter along the        all-gather along the sequence
(replaces g at the region's exit)     sequence
====================================  ==============================  ==============================

(The SP paper reuses the letters: its g/ḡ are these two, not Megatron-LM's g.) Each rank sends
the same bytes as with f/g (JAX scaling book ch. 5): a ring all-reduce of S bytes sends
2(n−1)/n·S, an all-gather or reduce-scatter of the same S (n−1)/n·S each.

Every collective goes through :mod:`shardwise.comm`, so ``topo.ledger`` books it: forward ones
under tag ``"tp_fwd"``, backward ones under ``"tp_bwd"``. ``axis`` names the topology axis
(normally ``"tp"``). Shapes: ``b`` batch, ``s`` sequence, ``d`` hidden, ``n`` the axis size.
"""

from __future__ import annotations

import torch

from ... import comm

AXIS = "tp"
FWD, BWD = "tp_fwd", "tp_bwd"


def _all_reduce(x: torch.Tensor, topo, axis: str, tag: str) -> torch.Tensor:
    """SUM all-reduce of a copy of ``x`` (autograd may still need the original)."""
    y = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(y, topo, axis, tag=tag)
    return y


def _all_gather(x: torch.Tensor, topo, axis: str, dim: int, tag: str) -> torch.Tensor:
    """[..., k, ...] (k at ``dim``) on each rank → [..., n·k, ...], rank i's shard at i·k."""
    n = topo.size(axis)
    shard = x.movedim(dim, 0).contiguous()  # gather works on the leading dim
    out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
    comm.all_gather(out, shard, topo, axis, tag=tag)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, topo, axis: str, dim: int, tag: str) -> torch.Tensor:
    """[..., n·k, ...] partial sums on each rank → [..., k, ...]: rank i's chunk of the SUM."""
    n = topo.size(axis)
    full = x.movedim(dim, 0).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"reduce_scatter along dim {dim}: size {full.shape[0]} is not "
                         f"divisible by the {axis} size {n}")
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    comm.reduce_scatter(out, full, topo, axis, tag=tag)
    return out.movedim(0, dim).contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's **f**. Forward: identity (no collective). Backward: all-reduce (SUM) of the
    gradient over ``axis``.

    x: [b, s, d] replicated over tp → [b, s, d] replicated; its gradient arrives as a partial sum
    (each rank's weight shard contributes part of ∂L/∂x) and leaves complete on every rank."""

    @staticmethod
    def forward(ctx, x, topo, axis):
        ctx.topo, ctx.axis = topo, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.topo, ctx.axis, BWD), None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's **g**. Forward: all-reduce (SUM) over ``axis``. Backward: identity (no
    collective).

    x: [b, s, d] partial sums (one per rank's shard of the contraction dim) → [b, s, d] the full
    sum, replicated over tp; the gradient of a replicated output is already complete."""

    @staticmethod
    def forward(ctx, x, topo, axis):
        return _all_reduce(x, topo, axis, FWD)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromSP(torch.autograd.Function):
    """Sequence-parallel entry into the TP region (replaces f). Forward: all-gather along the
    sequence dim ``dim`` over ``axis``. Backward: reduce-scatter (SUM) along the same dim.

    x: [b, s/n, d] (this rank's sequence shard) → [b, s, d] replicated. Backward: [b, s, d]
    partial gradients → [b, s/n, d], the summed gradient of this rank's shard."""

    @staticmethod
    def forward(ctx, x, topo, axis, dim):
        ctx.topo, ctx.axis, ctx.dim = topo, axis, dim
        return _all_gather(x, topo, axis, dim, FWD)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.topo, ctx.axis, ctx.dim, BWD), None, None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence-parallel exit from the TP region (replaces g). Forward: reduce-scatter (SUM)
    along the sequence dim ``dim`` over ``axis``. Backward: all-gather along the same dim.

    x: [b, s, d] partial sums → [b, s/n, d], this rank's sequence shard of the sum. Backward:
    [b, s/n, d] → [b, s, d] (every rank needs the whole gradient for its weight shard)."""

    @staticmethod
    def forward(ctx, x, topo, axis, dim):
        ctx.topo, ctx.axis, ctx.dim = topo, axis, dim
        return _reduce_scatter(x, topo, axis, dim, FWD)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.topo, ctx.axis, ctx.dim, BWD), None, None, None


def copy_to_tp(x: torch.Tensor, topo, axis: str = AXIS) -> torch.Tensor:
    """f: forward identity, backward all-reduce over ``axis``. See :class:`CopyToTP`."""
    return CopyToTP.apply(x, topo, axis)


def reduce_from_tp(x: torch.Tensor, topo, axis: str = AXIS) -> torch.Tensor:
    """g: forward all-reduce over ``axis``, backward identity. See :class:`ReduceFromTP`."""
    return ReduceFromTP.apply(x, topo, axis)


def gather_from_sp(x: torch.Tensor, topo, axis: str = AXIS, dim: int = 1) -> torch.Tensor:
    """SP entry: forward all-gather along ``dim``, backward reduce-scatter.
    [b, s/n, d] → [b, s, d]."""
    return GatherFromSP.apply(x, topo, axis, dim)


def reduce_scatter_to_sp(x: torch.Tensor, topo, axis: str = AXIS, dim: int = 1) -> torch.Tensor:
    """SP exit: forward reduce-scatter along ``dim``, backward all-gather.
    [b, s, d] → [b, s/n, d]."""
    return ReduceScatterToSP.apply(x, topo, axis, dim)

