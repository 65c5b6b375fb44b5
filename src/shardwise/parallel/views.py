"""Full shape ⇄ what this rank holds: the views parity checks and layout-free checkpoints read.

A transform records how it split each parameter (:class:`.params.Placement`; DTensors carry
their own placements); these functions read that record, once for every layout:

* :func:`to_full` — tensors shaped like a parameter's tp (or ep) shard → the full (unpadded)
  shape: one all_gather over tp per dtype for the whole list, one over ep for expert shards,
  and :func:`full_tensors` for DTensors (one gather per mesh dim);
* :func:`to_local` — the inverse, no collective (of a lazy tensor it reads only this rank's
  part: :func:`local_box`, :func:`local_flat_range`, :func:`read_flat`); :func:`~.params.shard_of` — how
  TP cuts a plain weight;
* :func:`full_shape` — the full shape of a parameter's tensor.

Every gather runs in ledger phase and tag ``gather``, outside a step's bytes. ``t.full_tensor()``
per DTensor would issue one or two unbooked collectives each.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch import nn

from .. import comm
from ..lazy import LazyTensor
from .params import ep_sharded, is_dtensor, placement, shard_of  # noqa: F401 (re-exported)


# -- full shape ⇄ this rank's tp shard ------------------------------------------------------------
def full_shape(p) -> tuple[int, ...]:
    """The full (unpadded) shape of the tensor whose tp shard ``p`` is (a DTensor knows it)."""
    if is_dtensor(p):
        return tuple(p.shape)
    shape, pl = list(p.shape), placement(p)
    if pl.tp_dim is not None:
        shape[pl.tp_dim] = pl.tp_full
    if pl.ep_full is not None:
        shape[0] = pl.ep_full
    return tuple(shape)


def to_local(full, p: nn.Parameter, topo, copy: bool = True, dtype=None) -> torch.Tensor:
    """The inverse of :func:`to_full`: this rank's part of a full-shape tensor shaped like
    parameter ``p`` (its tp shard, zero padding where ``p`` is padded; a DTensor cut like ``p``
    with ``distribute_tensor(..., src_data_rank=None)``, local slicing), on ``p``'s device and
    dtype (``dtype``: another, e.g. the fp32 master of a bf16 parameter). No collective.
    ``copy=False``: a view of ``full`` where no padding or conversion is needed (for a caller
    that copies it at once: one full tensor less at its peak). ``full``
    may be a :class:`~shardwise.lazy.LazyTensor`: only this rank's part is read
    (:func:`local_box`). Raises ``ValueError`` when ``full`` is not ``p``'s full shape."""
    if tuple(full.shape) != full_shape(p):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} for a parameter of full shape "
                         f"{full_shape(p)}: saved from another model?")
    if isinstance(full, LazyTensor):
        box = local_box(full, p, topo)
        if box is None:  # a cut the box cannot describe (a strided FSDP2-over-TP shard)
            full = full.read()
        elif is_dtensor(p):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(box.read().to(p.device, dtype or p.dtype), p.device_mesh,
                                      p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        else:
            pl = placement(p)
            local = box.read().to(p.device, dtype or p.dtype)
            if pl.tp_dim is not None and local.shape[pl.tp_dim] < p.shape[pl.tp_dim]:
                pad = list(local.shape)  # the padded tail of the last tp rank(s): zeros
                pad[pl.tp_dim] = p.shape[pl.tp_dim] - local.shape[pl.tp_dim]
                local = torch.cat([local, local.new_zeros(pad)], dim=pl.tp_dim)
            return local
    full = full.detach().to(p.device, dtype or p.dtype)
    if is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.clone(), p.device_mesh, p.placements, src_data_rank=None)
    pl = placement(p)
    keep = (lambda t: t.clone()) if copy else (lambda t: t)
    if pl.ep_full is not None:  # this ep rank's experts (never tp-split)
        per = pl.ep_full // topo.size("ep")
        return keep(full.narrow(0, topo.index("ep") * per, per))
    if pl.tp_dim is None:
        return keep(full)
    padded = p.shape[pl.tp_dim] * topo.size("tp")
    if not copy and padded == full.shape[pl.tp_dim]:  # no padding: a view of the chunk
        k = padded // topo.size("tp")
        return full.narrow(pl.tp_dim, topo.index("tp") * k, k)
    return shard_of(full, pl.tp_dim, topo, padded=padded)


def local_box(full: LazyTensor, p: nn.Parameter, topo) -> LazyTensor | None:
    """The part of lazy ``full`` that :func:`to_local` keeps for ``p``, not read yet: the ep
    rank's experts on dim 0, the tp chunk (without the zero padding, which reads nothing), a
    DTensor's local box (``compute_local_shape_and_global_offset``: Shard/Replicate
    placements), else the whole. None for a DTensor placement that is no box (FSDP2 over TP
    shards dim 0 strided): the caller reads the whole tensor."""
    if is_dtensor(p):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if not all(type(q) in (Shard, Replicate) for q in p.placements):
            return None
        sizes, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                               p.placements)
        if tuple(sizes) != tuple(p.to_local().shape):  # FSDP2 cuts otherwise: stay safe
            return None
        return full.box(offsets, sizes)
    pl = placement(p)
    if pl.ep_full is not None:
        per = pl.ep_full // topo.size("ep")
        return full.narrow(0, topo.index("ep") * per, per)
    if pl.tp_dim is None:
        return full
    k, n = p.shape[pl.tp_dim], full.shape[pl.tp_dim]
    start = topo.index("tp") * k
    return full.narrow(pl.tp_dim, min(start, n), max(0, min(k, n - start)))


def local_flat_range(full, p: nn.Parameter, topo, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``to_local(full, p, topo).reshape(-1)`` (a ZeRO-3 rank's piece of
    a parameter); of a :class:`~shardwise.lazy.LazyTensor` exactly those elements are read
    (:func:`read_flat`). Raises as :func:`to_local`."""
    if isinstance(full, LazyTensor) and tuple(full.shape) == full_shape(p) and p.dim() > 0:
        box = local_box(full, p, topo)
        if box is not None and tuple(box.shape) == tuple(p.shape):  # not padded
            return read_flat(box, lo, hi).to(p.device, p.dtype)
    return to_local(full, p, topo, copy=False).reshape(-1)[lo:hi]


def read_flat(t: LazyTensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of lazy ``t`` flattened (row-major), reading only them: the whole
    rows of dim 0 inside the range as one box, the partial first and last rows by recursing
    into them (at most 2·ndim + 1 reads)."""
    if t.ndim <= 1:
        return t.narrow(0, lo, hi - lo).read() if t.ndim else t.read().reshape(-1)[lo:hi]
    row = math.prod(t.shape[1:])
    r0, r1 = lo // row, -(-hi // row)
    if r1 - r0 == 1:  # inside one row
        return read_flat(t[r0], lo - r0 * row, hi - r0 * row)
    head = read_flat(t[r0], lo - r0 * row, row)
    tail = read_flat(t[r1 - 1], 0, hi - (r1 - 1) * row)
    mid = t.narrow(0, r0 + 1, r1 - r0 - 2).read().reshape(-1)
    return torch.cat([head, mid, tail])


def to_full(pairs: list[tuple[torch.Tensor, nn.Parameter]], topo,
            cache: dict | None = None) -> list[torch.Tensor]:
    """Full-shape copies of tensors ``t`` shaped like their parameter ``p``'s tp shard: a shard
    ``[.., V_pad/n, ..]`` (split on ``placement(p).tp_dim``) becomes ``[.., V, ..]`` with the
    padding cut; a tensor of a replicated parameter is copied; DTensors (the PyTorch engines)
    are gathered over their mesh by :func:`full_tensors` (``cache``: its element
    positions per layout, kept by the caller).

    One all_gather over tp per dtype for the whole list (phase ``"gather"``, tag ``"gather"``,
    outside the step's bytes): each rank concatenates its shards, each moved to put the sharded
    dim first and flattened, into ``[Σ numel]``; the gather gives ``[n, Σ numel]``, and a
    tensor's columns of every rank's row, stacked in rank order on the sharded dim, are the full
    tensor. Collective over tp when any tensor is sharded: every tp rank passes the same
    parameters in the same order. Expert shards (``placement(p).ep_full``) are gathered the same
    way over "ep" (one all_gather for all, phase ``"gather"``): rank order on dim 0."""
    n = topo.size("tp") if topo is not None else 1
    out: list = [None] * len(pairs)
    experts = [i for i, (t, p) in enumerate(pairs) if not is_dtensor(t) and ep_sharded(p)]
    if experts and topo.size("ep") > 1:
        for i, t in zip(experts, _gather_dim0([pairs[i][0] for i in experts], topo, "ep")):
            out[i] = t
    dtensors = [i for i, (t, _) in enumerate(pairs) if is_dtensor(t)]
    if dtensors:
        for i, t in zip(dtensors, full_tensors([pairs[i][0] for i in dtensors], topo, cache)):
            out[i] = t
    by_dtype: dict = {}
    for i, (t, p) in enumerate(pairs):
        if out[i] is not None:
            continue
        if n > 1 and placement(p).tp_dim is not None:
            by_dtype.setdefault(t.dtype, []).append(i)
        else:
            out[i] = t.detach().clone()
    for idx in by_dtype.values():
        shards = [pairs[i][0].detach().movedim(placement(pairs[i][1]).tp_dim, 0).contiguous()
                  for i in idx]
        flat = torch.cat([s.reshape(-1) for s in shards])  # [Σ numel]
        rows = flat.new_empty(n * flat.numel())
        with topo.ledger.phase("gather"):
            comm.all_gather(rows, flat, topo, "tp", tag="gather")
        rows, start = rows.view(n, -1), 0  # [n, Σ numel]
        for i, s in zip(idx, shards):
            pl = placement(pairs[i][1])
            whole = rows[:, start:start + s.numel()].reshape(n * s.shape[0], *s.shape[1:])
            out[i] = whole[: pl.tp_full].movedim(0, pl.tp_dim).contiguous()
            start += s.numel()
    return out


def _gather_dim0(tensors: list[torch.Tensor], topo, axis: str) -> list[torch.Tensor]:
    """Each tensor [k, ...] gathered over ``axis`` into [n·k, ...] in rank order: one all_gather
    of their concatenation (one dtype; phase ``"gather"``, tag ``"gather"``)."""
    n = topo.size(axis)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    rows = flat.new_empty(n * flat.numel())
    with topo.ledger.phase("gather"):
        comm.all_gather(rows, flat, topo, axis, tag="gather")
    rows, start, out = rows.view(n, -1), 0, []
    for t in tensors:
        out.append(rows[:, start:start + t.numel()].reshape(n * t.shape[0], *t.shape[1:]))
        start += t.numel()
    return out


# -- DTensors: one gather per mesh dim -------------------------------------------------------------
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


# -- a whole model's views: {FQN: tensor} and AdamW's state --------------------------------------
def full_named(local: dict[str, torch.Tensor], params: dict[str, nn.Parameter], topo,
               cache: dict) -> dict[str, torch.Tensor]:
    """{FQN: full-shape tensor} of ``local`` ({FQN: tensor in the tp-local shape of
    ``params[FQN]``}): :func:`to_full`, one gather for all."""
    names = list(local)
    return dict(zip(names, to_full([(local[n], params[n]) for n in names], topo, cache)))


def full_state(local: dict[str, dict], params: dict[str, nn.Parameter], topo,
               cache: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{FQN: {state key: tensor}}: AdamW's ``exp_avg``/``exp_avg_sq`` of ``local`` (tp-local
    shape) in the parameter's *full* shape by :func:`to_full` (one gather for all), ``step``
    and non-tensors copied. Parameters with no state yet are absent."""
    out, where, pairs = {}, [], []
    for n, st in local.items():
        entry = out[n] = {}
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                where.append((entry, k))
                pairs.append((v, params[n]))
            else:
                entry[k] = v.detach().clone() if torch.is_tensor(v) else v
    for (entry, k), t in zip(where, to_full(pairs, topo, cache)):
        entry[k] = t
    return out


def local_state(state: dict[str, dict], named: list[tuple[str, nn.Parameter]],
                topo) -> dict[str, dict]:
    """The inverse of :func:`full_state` for the ``named`` parameters: each tensor cut to this
    rank's tp shard (:func:`to_local`), tp-local shape. No collective. Raises ``KeyError``
    naming the FQNs ``named`` needs but ``state`` lacks, ``ValueError`` for a tensor whose
    shape is not its parameter's."""
    missing = [n for n, _ in named if n not in state]
    if missing:
        raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return {n: {k: (to_local(v, p, topo, dtype=v.dtype) if torch.is_tensor(v) and k != "step"
                    else v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in state[n].items()} for n, p in named}
