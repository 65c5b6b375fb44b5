"""What this rank holds, as boxes of full-shape tensors: the form of a shard-by-shard checkpoint.

A gradient sync says what it holds of each tensor in the tp-local shape (:class:`Piece`: the whole
tensor, or a flat range of it — a ZeRO slice may begin and end inside a parameter); the placement
a transform recorded (:class:`.params.Placement`: tp dim and unpadded size, ep experts) or a
DTensor's own placements then put it in the *full* shape: :func:`full_boxes` gives each
:class:`Box` (the tensor, the full shape, its offsets), which a checkpoint writes as one chunk
of a full-shape tensor (DCP's ``ChunkStorageMetadata``), no collective and no copy.

A flat range ``[lo, lo + n)`` of a row-major tensor is not a box in general: :func:`flat_boxes`
cuts it into at most 2·ndim − 1 boxes (the partial first row, the whole rows, the partial last
row, recursively), each a contiguous view of the range. How the boxes make the checkpoint
layout-free, and what is written once: docs/checkpointing.md, "Shard by shard".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .params import is_dtensor, placement


class Piece(NamedTuple):
    """What a sync holds of one tensor of parameter ``fqn``: ``key`` "model" (the parameter) or
    the optimizer-state key ("exp_avg", "exp_avg_sq", "step", "momentum_buffer"); ``tensor``
    the whole tensor in the parameter's tp-local shape (``lo`` None; a DTensor stays one), or
    elements ``[lo, lo + tensor.numel())`` of its row-major flattening (``tensor`` 1-D)."""

    key: str
    fqn: str
    tensor: torch.Tensor
    lo: int | None = None


class Box(NamedTuple):
    """One box of a full-shape tensor that this rank holds: ``key`` "model.<FQN>" or
    "optimizer.<FQN>.<state key>" (the checkpoint's names), ``tensor`` its values (shape =
    the box's sizes; a view, never a copy), ``shape`` the full (unpadded) tensor's shape,
    ``offsets`` where the box starts in it."""

    key: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def flat_boxes(shape: tuple[int, ...], lo: int, n: int) -> list[tuple[tuple, tuple, int]]:
    """Elements ``[lo, lo + n)`` of a row-major tensor of ``shape`` as boxes: [(offsets, sizes,
    start)], ``start`` the box's first element within the range (the box is elements ``[start,
    start + Π sizes)`` of the range, contiguous). Row by row: the partial first row and the
    partial last row recursively, the whole rows between as one box."""
    if n <= 0:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (n,) if shape else (), 0)]
    row = math.prod(shape[1:])
    r0, r1 = lo // row, -(-(lo + n) // row)
    out: list = []

    def inside(r: int, a: int, b: int, start: int) -> None:  # elements [a, b) of row r
        for off, sz, s in flat_boxes(shape[1:], a, b - a):
            out.append(((r, *off), (1, *sz), start + s))

    if r1 - r0 == 1:
        inside(r0, lo - r0 * row, lo + n - r0 * row, 0)
        return out
    start = 0
    if lo % row:
        inside(r0, lo - r0 * row, row, 0)
        start = (r0 + 1) * row - lo
    end = lo + n
    whole0, whole1 = -(-lo // row), end // row  # whole rows [whole0, whole1)
    if whole1 > whole0:
        out.append(((whole0, *[0] * (len(shape) - 1)), (whole1 - whole0, *shape[1:]), start))
        start += (whole1 - whole0) * row
    if end % row:
        inside(whole1, 0, end - whole1 * row, start)
    return out


def full_boxes(piece: Piece, param, topo) -> list[Box]:
    """The :class:`Box` es of ``piece`` (of parameter ``param``, this rank's tp-local one) in
    the full shape, no collective: a DTensor's local tensor at the offset its placements give
    (``compute_local_shape_and_global_offset``); else the piece's boxes in the tp-local shape
    (:func:`flat_boxes` for a flat range), moved by this rank's tp chunk (``tp_dim``: index ×
    local size) and ep experts (dim 0: index × local count), the tp padding cut (a box wholly in
    the padding is dropped). A 0-dim tensor (AdamW's ``step``) is one box of shape ()."""
    key = "model." + piece.fqn if piece.key == "model" else f"optimizer.{piece.fqn}.{piece.key}"
    t = piece.tensor.detach()
    if t.dim() == 0:
        return [Box(key, t, (), ())]
    if is_dtensor(t):
        return [_dtensor_box(key, t)]
    local_shape = tuple(param.shape)
    if piece.lo is None:
        boxes = [((0,) * len(local_shape), local_shape, t)]
    else:
        flat = t.reshape(-1)
        boxes = [(off, sz, flat[s: s + math.prod(sz)].view(sz))
                 for off, sz, s in flat_boxes(local_shape, piece.lo, flat.numel())]
    pl, shape, out = placement(param), list(local_shape), []
    shift = [0] * len(local_shape)
    if pl.tp_dim is not None:
        shape[pl.tp_dim] = pl.tp_full
        shift[pl.tp_dim] = topo.index("tp") * local_shape[pl.tp_dim]
    if pl.ep_full is not None:
        shape[0] = pl.ep_full
        shift[0] = topo.index("ep") * local_shape[0]
    for off, sz, v in boxes:
        off = [o + s for o, s in zip(off, shift)]
        if pl.tp_dim is not None:  # the vocabulary's padding rows: cut, never written
            d = pl.tp_dim
            keep = min(sz[d], pl.tp_full - off[d])
            if keep <= 0:
                continue
            v = v.narrow(d, 0, keep)
        out.append(Box(key, v, tuple(shape), tuple(off)))
    return out


def _dtensor_box(key: str, t) -> Box:
    """A DTensor's local shard as one box. Raises ``NotImplementedError`` for a placement whose
    local shard is no box of the full tensor (the offsets would be wrong)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(sizes) != tuple(local.shape):
        raise NotImplementedError(f"{key}: DTensor placements {t.placements} give a local "
                                  f"shard {tuple(local.shape)} that is not the box "
                                  f"{tuple(sizes)} at {tuple(offsets)}")
    return Box(key, local, tuple(t.shape), tuple(offsets))


def flat_pieces(flats, optimizer=None, *, params: bool = True) -> list[Piece]:
    """ZeRO's slices (:class:`.zero.flat.FlatShards`, their owner's ``optimizer``) as
    :class:`Piece` s, no collective and no copy: each parameter's elements in ``shard``
    (``params``; the padding is no parameter's), and each optimizer piece's state tensors
    (``step`` whole) at the piece's flat position in its parameter (``piece.zero_slot``)."""
    out = []
    if params:
        out = [Piece("model", f.fqns[j], f.shard[a - f.lo: b - f.lo], a - f.offsets[j])
               for f in flats for j, a, b in f.pieces()]
    for group in (optimizer.param_groups if optimizer is not None else ()):
        for piece in group["params"]:
            fi, j, a, _ = piece.zero_slot
            fqn, at = flats[fi].fqns[j], a - flats[fi].offsets[j]
            for k, v in optimizer.state.get(piece, {}).items():
                if torch.is_tensor(v):
                    out.append(Piece(k, fqn, v) if v.dim() == 0 else
                               Piece(k, fqn, v.reshape(-1), at))
    return out
