"""TP's collectives as autograd functions: Megatron's f and g, and their sequence-parallel halves.

A column-parallel matmul followed by a row-parallel one needs one collective in forward and one
in backward (Shoeybi et al. 2019, "Megatron-LM", arXiv 1909.08053, §3, Figure 3): **f** at the
TP region's entry (identity forward, all-reduce backward) and **g** at its exit (all-reduce
forward, identity backward). With sequence parallelism (Korthikanti et al. 2022, arXiv
2205.05198, §4.2.2, Figure 5) each all-reduce becomes its two halves: all-gather forward /
reduce-scatter backward at the entry, the converse at the exit. Each rank sends the same bytes
(JAX scaling book ch. 5): a ring all-reduce of S bytes sends 2(n−1)/n·S, an all-gather or
reduce-scatter (n−1)/n·S. Both tables: docs/tensor-parallel.md §1.

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


def along(x: torch.Tensor, topo, axis: str, dim: int, tag: str, *,
           gather: bool) -> torch.Tensor:
    """All-gather along ``dim`` ([.., k, ..] on each rank → [.., n·k, ..], rank i's shard at
    i·k) or reduce-scatter ([.., n·k, ..] partial sums → [.., k, ..], rank i's chunk of the SUM)."""
    n = topo.size(axis)
    src = x.movedim(dim, 0).contiguous()  # the collectives work on the leading dim
    if not gather and src.shape[0] % n:
        raise ValueError(f"reduce_scatter along dim {dim}: size {src.shape[0]} is not "
                         f"divisible by the {axis} size {n}")
    rows = n * src.shape[0] if gather else src.shape[0] // n
    out = src.new_empty((rows, *src.shape[1:]))
    (comm.all_gather if gather else comm.reduce_scatter)(out, src, topo, axis, tag=tag)
    return out.movedim(0, dim).contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's **f**. Forward: identity (no collective). Backward: all-reduce (SUM) over
    ``axis`` of the gradient, a partial sum on each rank (its weight shard's part of ∂L/∂x).
    x: [b, s, d] replicated over tp → [b, s, d] replicated."""

    @staticmethod
    def forward(ctx, x, topo, axis):
        ctx.topo, ctx.axis = topo, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.topo, ctx.axis, BWD), None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's **g**. Forward: all-reduce (SUM) over ``axis``. Backward: identity (no
    collective: the gradient of a replicated output is complete). x: [b, s, d] partial sums (one
    per rank's shard of the contraction dim) → [b, s, d] the full sum, replicated over tp."""

    @staticmethod
    def forward(ctx, x, topo, axis):
        return _all_reduce(x, topo, axis, FWD)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromSP(torch.autograd.Function):
    """SP entry into the TP region (replaces f). Forward: all-gather along the sequence dim
    ``dim`` over ``axis``, x: [b, s/n, d] → [b, s, d] replicated. Backward: reduce-scatter (SUM)
    along the same dim, [b, s, d] partial gradients → [b, s/n, d]."""

    @staticmethod
    def forward(ctx, x, topo, axis, dim):
        ctx.topo, ctx.axis, ctx.dim = topo, axis, dim
        return along(x, topo, axis, dim, FWD, gather=True)

    @staticmethod
    def backward(ctx, grad):
        return along(grad, ctx.topo, ctx.axis, ctx.dim, BWD, gather=False), None, None, None


class ReduceScatterToSP(torch.autograd.Function):
    """SP exit from the TP region (replaces g). Forward: reduce-scatter (SUM) along the sequence
    dim ``dim`` over ``axis``, x: [b, s, d] partial sums → [b, s/n, d]. Backward: all-gather along
    the same dim, [b, s/n, d] → [b, s, d] (each rank's weight shard needs the whole gradient)."""

    @staticmethod
    def forward(ctx, x, topo, axis, dim):
        ctx.topo, ctx.axis, ctx.dim = topo, axis, dim
        return along(x, topo, axis, dim, FWD, gather=False)

    @staticmethod
    def backward(ctx, grad):
        return along(grad, ctx.topo, ctx.axis, ctx.dim, BWD, gather=True), None, None, None
