"""The one layer the algorithms are written over: ``isend`` / ``irecv`` between the ranks of one
process group, counting every byte handed to ``send``.

A :class:`Peers` is one rank's view of a group for the length of one collective: its index, the
global rank of every index, and a tally of what it sent (``sent_bytes``, and per algorithm step
and peer in ``log``, which ``shardwise trace`` prints). Buffers are split into chunks of at most
``chunk_bytes`` (:meth:`Peers.pieces`), so a long message becomes several sends that the next
hop can forward as each arrives (pipelining; Patarasuk & Yuan 2009 §3). Sender and receiver cut
a region of the same length the same way, so every send meets a receive of its size; an empty
region sends nothing.

Every message carries :data:`TAG`: gloo matches point-to-point messages by (peer, tag), so the
collectives' messages cannot be taken by a pipeline's receive on the same group. ``wait()``
uses the process group's timeout (gloo: the context's; NCCL: the watchdog), so a peer that never
sends raises torch's timeout error instead of hanging; :mod:`shardwise.comm.ops` names it.
Nothing here is backend-specific: the same calls run on gloo and NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAG = 1717  # our collectives' point-to-point tag (issue 17); pipeline sends use tag 0

CHUNK_BYTES = 512 * 1024  # default pipelining chunk: a few gloo messages' overhead per MiB


class Peers:
    """One rank's view of a group of ``len(ranks)`` ranks. ``ranks[j]`` is the global rank of
    index ``j``; ``index`` is this rank's. ``sent_bytes``: bytes handed to :meth:`isend` so far;
    ``log``: {(step, peer index): bytes} for the same sends."""

    def __init__(self, group, ranks: list[int], index: int, chunk_bytes: int | None = None):
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes  # read at each call
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes {chunk_bytes} must be ≥ 1")
        self.group, self.ranks, self.index = group, list(ranks), index
        self.n = len(self.ranks)
        self.chunk_bytes = chunk_bytes
        self.sent_bytes = 0
        self.log: dict[tuple[int, int], int] = {}

    def pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (1-D, contiguous) cut into views of at most ``chunk_bytes`` (at least one
        element each); [] for an empty ``t``."""
        if t.numel() == 0:
            return []
        return list(t.split(max(1, self.chunk_bytes // t.element_size())))

    def isend(self, t: torch.Tensor, to: int, step: int):
        """Start sending ``t`` to index ``to``; returns the work (None for an empty ``t``)."""
        if t.numel() == 0:
            return None
        nbytes = t.numel() * t.element_size()
        self.sent_bytes += nbytes
        self.log[step, to] = self.log.get((step, to), 0) + nbytes
        return dist.isend(t, dst=self.ranks[to], group=self.group, tag=TAG)

    def irecv(self, t: torch.Tensor, frm: int):
        """Start receiving into ``t`` from index ``frm``; returns the work (None if empty)."""
        if t.numel() == 0:
            return None
        return dist.irecv(t, src=self.ranks[frm], group=self.group, tag=TAG)

    def send_all(self, t: torch.Tensor, to: int, step: int) -> list:
        """:meth:`isend` every piece of ``t``; returns the works."""
        return [self.isend(c, to, step) for c in self.pieces(t)]

    def recv_all(self, t: torch.Tensor, frm: int) -> list:
        """:meth:`irecv` every piece of ``t``; returns the works."""
        return [self.irecv(c, frm) for c in self.pieces(t)]


def wait(works) -> None:
    """Wait for every work (None entries are empty messages)."""
    for w in works:
        if w is not None:
            w.wait()


def combine_(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    """``acc ← acc ⊕ incoming`` in place, ⊕ = ``op`` ("sum", "max", "min"). One fp rounding per
    element; the order of operands is each algorithm's, fixed, so results are reproducible."""
    if op == "sum":
        acc.add_(incoming)
    elif op == "max":
        torch.maximum(acc, incoming, out=acc)
    elif op == "min":
        torch.minimum(acc, incoming, out=acc)
    else:
        raise ValueError(f"reduction op {op!r}: choose sum, max or min")


def split_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal contiguous blocks of ``numel`` elements: the first
    ``numel % parts`` blocks get one element more (as ``torch.tensor_split``). Length parts+1."""
    q, r = divmod(numel, parts)
    out = [0]
    for j in range(parts):
        out.append(out[-1] + q + (1 if j < r else 0))
    return out
