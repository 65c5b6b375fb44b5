"""Full-shape copies of DTensors in one gather per mesh dim: the PyTorch engines' side of
:func:`.params.to_full` (parity checks, layout-free checkpoints).

``t.full_tensor()`` per tensor issues one or two collectives each, unbooked; :func:`full_tensors`
issues one all_gather per mesh dim for the whole list, through :mod:`shardwise.comm` (phase and
tag ``gather``, outside a step's bytes).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import comm


@contextlib.contextmanager
def _quiet_redistribute():
    """``full_tensor()`` of a ``_StridedShard`` DTensor logs a warning per call (two all-gathers
    instead of one): silence it while gathering for parity checks."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class _Positions:
    """Where a batch of DTensors' local elements go in their concatenated full tensors: ``length``
    the padded local length every rank sends, and, over the gathered rows, ``valid`` (a bool mask
    [mesh size · length]) and ``index`` (the flat full position of each valid element)."""

    def __init__(self, length: int, valid: torch.Tensor, index: torch.Tensor):
        self.length, self.valid, self.index = length, valid, index


def _gather_mesh(flat: torch.Tensor, axes: tuple[str, ...], topo) -> torch.Tensor:
    """All-gather ``flat`` [L] over every dim of a mesh named ``axes`` (one
    :func:`shardwise.comm.all_gather` per dim, last dim first; phase and tag ``"gather"``):
    [Π sizes · L], the rows of every rank of the mesh in a fixed order."""
    with topo.ledger.phase("gather"):
        for axis in reversed(axes):
            rows = flat.new_empty(topo.size(axis) * flat.numel())
            comm.all_gather(rows, flat, topo, axis, tag="gather")
            flat = rows
    return flat


def _positions(tensors: list, axes: tuple[str, ...], topo) -> _Positions:
    """The :class:`_Positions` of ``tensors`` (DTensors on one mesh named ``axes``, Shard /
    _StridedShard / Replicate placements). Each rank cuts the full positions ``arange(numel)``
    exactly as DTensor cuts the data (``distribute_tensor(..., src_data_rank=None)``: local
    slicing, no collective), marks the copies held at a non-zero coordinate of a Replicate mesh
    dim as -1 (each element then has one owner), and the positions are gathered like the values
    will be. Collective over the mesh: one all_reduce (max) and one all_gather per mesh dim.
    Raises ``RuntimeError`` if the owners do not cover each element exactly once."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mine, offset = [], 0
    for t in tensors:
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        pos = torch.arange(t.numel(), dtype=torch.int64, device=t.to_local().device).view(t.shape)
        pos = distribute_tensor(pos, mesh, t.placements, src_data_rank=None).to_local()
        pos = pos.reshape(-1) + offset
        if any(isinstance(pl, Replicate) and c != 0 for pl, c in zip(t.placements, coord)):
            pos = torch.full_like(pos, -1)
        mine.append(pos)
        offset += t.numel()
    local = torch.cat(mine)
    length = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    with topo.ledger.phase("gather"):
        for axis in axes:
            comm.all_reduce(length, topo, axis, op="max", tag="gather")
    padded = torch.full((int(length),), -1, dtype=torch.int64, device=local.device)
    padded[: local.numel()] = local
    rows = _gather_mesh(padded, axes, topo)
    valid = rows >= 0
    index = rows[valid]
    if index.numel() != offset or not bool(
            (torch.bincount(index, minlength=offset) == 1).all()):
        raise RuntimeError("full_tensors: the local shards do not cover each element exactly "
                           "once (a DTensor layout this gather does not support)")
    return _Positions(int(length), valid, index)


@torch.no_grad()
def full_tensors(tensors: list, topo, cache: dict | None = None) -> list[torch.Tensor]:
    """Full-shape copies of ``tensors``: DTensors (Shard, ``_StridedShard`` or Replicate on any
    mesh whose dims are ``topo``'s axes) are gathered, plain tensors are cloned. The same result
    as ``t.full_tensor()`` per tensor, in one all_gather per mesh dim per (mesh, dtype) for the
    whole list instead of one or two per tensor.

    Each rank concatenates its local shards flattened ([Σ local numel], padded to the longest
    rank's length), the mesh gathers the rows, and each element is placed at its full position
    from :func:`_positions` (computed once per layout and kept in ``cache``, e.g. an engine's
    dict). Booked in ``topo.ledger`` (phase and tag ``"gather"``, outside a step's bytes).
    A tensor with a Partial placement falls back to ``full_tensor()`` (its own reduction).
    Collective over the mesh: every rank passes the same tensors in the same order."""
    from torch.distributed.tensor import DTensor, Partial

    out: list = [None] * len(tensors)
    batches: dict = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            out[i] = t.detach().clone()
        elif any(isinstance(pl, Partial) for pl in t.placements):
            with _quiet_redistribute():
                out[i] = t.full_tensor().detach().clone()
        else:
            batches.setdefault((tuple(t.device_mesh.mesh_dim_names), t.dtype), []).append(i)
    for (axes, _), idx in batches.items():
        key = (axes, tuple((tuple(tensors[i].shape), tuple(tensors[i].placements)) for i in idx))
        where = cache.get(key) if cache is not None else None
        if where is None:
            where = _positions([tensors[i] for i in idx], axes, topo)
            if cache is not None:
                cache[key] = where
        local = torch.cat([tensors[i].to_local().detach().reshape(-1) for i in idx])
        send = local.new_zeros(where.length)
        send[: local.numel()] = local
        rows = _gather_mesh(send, axes, topo)
        flat = local.new_empty(where.index.numel())
        flat[where.index] = rows[where.valid]
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            # own storage (torch.save keeps all of a view's)
            out[i] = piece.view(tensors[i].shape).clone()
    return out
