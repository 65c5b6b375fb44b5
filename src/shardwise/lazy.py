"""A full-shape tensor read only in the parts asked for: how a rank loads its slice of a weight
from a safetensors file or a DCP checkpoint without holding the whole tensor.

A :class:`LazyTensor` knows its shape and dtype and a ``read_fn(offsets, sizes)`` that returns
one box of it (a contiguous tensor of ``sizes``, starting at ``offsets``). Cutting it
(``t[a:b, c:d]``, :meth:`~LazyTensor.narrow`, :meth:`~LazyTensor.t`, :func:`stack`) reads
nothing; :meth:`~LazyTensor.read` reads the box the cuts describe. So the renaming code that
maps a checkpoint's tensors onto ours (transposes, a fused ``c_attn`` split in three, per-expert
tensors stacked) runs unchanged on lazy tensors, and the engine asks each one for the part its
rank holds (:func:`shardwise.parallel.views.to_local`). Each box a source reads is counted under
:func:`counting` (the tests' proof that a rank reads only what it keeps).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch

ReadFn = Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]

_COUNTERS: list[dict[str, list[int]]] = []


@contextlib.contextmanager
def counting():
    """Within it, every box a source reads is recorded: yields ``{source name: [elements of
    each read, in order]}``."""
    reads: dict[str, list[int]] = {}
    _COUNTERS.append(reads)
    try:
        yield reads
    finally:
        _COUNTERS.remove(reads)


class LazyTensor:
    """A tensor of ``shape`` and ``dtype`` whose values are read on demand by ``read_fn`` (one
    box at a time). ``name``: the source's name for it (what :func:`counting` records)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, read_fn: ReadFn,
                 name: str = ""):
        self.shape, self.dtype, self._read, self.name = torch.Size(shape), dtype, read_fn, name

    @classmethod
    def source(cls, shape: Sequence[int], dtype: torch.dtype, read_fn: ReadFn,
               name: str) -> LazyTensor:
        """A tensor straight from a file: its reads are what :func:`counting` records."""
        def counted(offsets, sizes):
            for c in _COUNTERS:
                c.setdefault(name, []).append(math.prod(sizes))
            return read_fn(offsets, sizes)

        return cls(shape, dtype, counted, name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def read(self) -> torch.Tensor:
        """The whole (possibly cut) tensor, read now: a new contiguous tensor."""
        return self._read((0,) * self.ndim, tuple(self.shape))

    def box(self, offsets: Sequence[int], sizes: Sequence[int]) -> LazyTensor:
        """The box ``[o, o + s)`` on every dim, not read yet. Raises ``IndexError`` outside."""
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, self.shape)):
            raise IndexError(f"box at {tuple(offsets)} of {tuple(sizes)} is outside a tensor of "
                             f"shape {tuple(self.shape)}")
        base, parent = tuple(offsets), self._read
        return LazyTensor(sizes, self.dtype,
                          lambda o, s: parent(tuple(a + b for a, b in zip(base, o)), s),
                          self.name)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        offsets, sizes = [0] * self.ndim, list(self.shape)
        offsets[dim], sizes[dim] = start, length
        return self.box(offsets, sizes)

    def __getitem__(self, index) -> LazyTensor:
        """Basic indexing: slices with step 1 and integers (``t[a:b]``, ``t[:, c:d]``, ``t[j]``:
        an integer drops its dim); anything else TypeError."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim or not all(
                isinstance(i, int) or (isinstance(i, slice) and i.step in (None, 1))
                for i in index):
            raise TypeError(f"a LazyTensor takes integers and slices with step 1, not {index!r}")
        offsets, sizes, dropped = [0] * self.ndim, list(self.shape), []
        for d, i in enumerate(index):
            if isinstance(i, int):
                if not -self.shape[d] <= i < self.shape[d]:
                    raise IndexError(f"index {i} is out of bounds for dim {d} of size "
                                     f"{self.shape[d]}")
                offsets[d], sizes[d] = i % self.shape[d], 1
                dropped.append(d)
            else:
                a, b, _ = i.indices(self.shape[d])
                offsets[d], sizes[d] = a, max(0, b - a)
        box = self.box(offsets, sizes)
        if not dropped:
            return box
        parent = box._read

        def read(o, s):  # the dropped dims back as size 1 at offset 0, then squeezed
            o, s = list(o), list(s)
            for d in dropped:
                o.insert(d, 0)
                s.insert(d, 1)
            return parent(tuple(o), tuple(s)).reshape(tuple(
                n for d, n in enumerate(s) if d not in dropped))

        return LazyTensor([n for d, n in enumerate(sizes) if d not in dropped], self.dtype,
                          read, self.name)

    def contiguous(self) -> LazyTensor:
        """Itself: every read is a new contiguous tensor."""
        return self

    def float(self) -> LazyTensor:
        """Read as fp32."""
        parent = self._read
        return LazyTensor(self.shape, torch.float32, lambda o, s: parent(o, s).float(),
                          self.name)

    def t(self) -> LazyTensor:
        """The transpose of a 2-D tensor (a box of it reads the transposed box)."""
        if self.ndim != 2:
            raise ValueError(f"t() expects a 2-D tensor, not shape {tuple(self.shape)}")
        parent = self._read
        return LazyTensor(self.shape[::-1], self.dtype,
                          lambda o, s: parent(o[::-1], s[::-1]).t().contiguous(), self.name)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name or '?'}, {tuple(self.shape)}, {self.dtype})"


def stack(parts: Sequence) -> torch.Tensor | LazyTensor:
    """``torch.stack(parts)`` on dim 0; for lazy parts a lazy stack (a box reads only the parts
    and the part of each it covers). Raises ``RuntimeError`` when the shapes differ (as torch)."""
    if not all(isinstance(p, LazyTensor) for p in parts):  # plain (or mixed): read, stack
        return torch.stack([materialize(p) for p in parts])
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise RuntimeError(f"stack expects each tensor to be equal size, but got {sorted(shapes)}")
    parts = list(parts)
    first = parts[0]

    def read(o, s):
        rows = [parts[j]._read(o[1:], s[1:]) for j in range(o[0], o[0] + s[0])]
        return torch.stack(rows) if rows else torch.empty(s, dtype=first.dtype)

    return LazyTensor((len(parts), *first.shape), first.dtype, read, first.name)


def cat(parts: Sequence, dim: int = 0) -> torch.Tensor | LazyTensor:
    """``torch.cat(parts, dim)``; for lazy parts a lazy concatenation (a box reads only the
    parts it overlaps, and of each only the overlap)."""
    if not any(isinstance(p, LazyTensor) for p in parts):
        return torch.cat(list(parts), dim)
    parts = list(parts)
    first = parts[0]
    dim = dim % first.ndim
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.shape[dim])
    shape = list(first.shape)
    shape[dim] = starts[-1]

    def read(o, s):
        lo, hi, pieces = o[dim], o[dim] + s[dim], []
        for p, a, b in zip(parts, starts, starts[1:]):
            x, y = max(lo, a), min(hi, b)
            if x < y:
                oo, ss = list(o), list(s)
                oo[dim], ss[dim] = x - a, y - x
                pieces.append(p.box(oo, ss).read() if isinstance(p, LazyTensor)
                              else p[tuple(slice(q, q + n) for q, n in zip(oo, ss))])
        return torch.cat(pieces, dim) if pieces else torch.empty(s, dtype=first.dtype)

    return LazyTensor(shape, first.dtype, read, first.name)


def materialize(t) -> torch.Tensor:
    """A tensor as is; a :class:`LazyTensor` read whole."""
    return t.read() if isinstance(t, LazyTensor) else t
