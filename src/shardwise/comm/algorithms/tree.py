"""Binomial-tree broadcast and reduce (Thakur, Rabenseifner & Gropp 2005 §4.1).

Relative to the root, index v's parent is v with its lowest set bit cleared, and its children
are v + m for every power of two m below that bit (below n for the root) with v + m < n. A
broadcast reaches every rank in L = ⌈log₂ n⌉ rounds, each rank sending the whole buffer once per
child; a reduce runs the same tree upwards. Chunks are forwarded down (or added and sent up) as
they arrive, so the levels overlap for long buffers.

α-β cost: L·(α + S·β) (S: bytes of the buffer), against the chain's (n−2+C)(α + S/C·β) and the
ring's; for short messages the log₂ n latency terms win, for long ones the tree sends S
per child from the same link (JAX scaling book ch. 5). Bytes sent by index v: S × its number of
children (the root ⌈log₂ n⌉·S, the leaves 0; n−1 sends of S in all) for broadcast, S on every
non-root rank for reduce. Reduce's summation order: x_v ⊕ child v+1's partial ⊕ child v+2's ⊕
child v+4's …, in that order, at every node: the same on every run.
"""

from __future__ import annotations

import torch

from .p2p import Peers, combine_, wait


def tree_of(v: int, n: int) -> tuple[int | None, list[int]]:
    """(parent, children) of relative index ``v`` in the binomial tree of ``n`` ranks (parent
    None for the root). Children are listed largest subtree first (v + m, m decreasing)."""
    mask, parent = 1, None
    while mask < n:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children, m = [], mask >> 1
    while m:
        if v + m < n:
            children.append(v + m)
        m >>= 1
    return parent, children


def _round(v: int, child: int, n: int) -> int:
    """The round (0-based) in which v sends to ``child``: ⌈log₂ n⌉ − 1 − log₂(child − v)."""
    return (n - 1).bit_length() - (child - v).bit_length()


def broadcast(x: torch.Tensor, peers: Peers, src: int) -> None:
    """Binomial broadcast of the flat ``x`` [N] in place from index ``src``."""
    n = peers.n
    v = (peers.index - src) % n
    parent, children = tree_of(v, n)
    glob = [(c + src) % n for c in children]
    chunks, sends = peers.pieces(x), []
    works = [peers.irecv(c, (parent + src) % n) for c in chunks] if parent is not None \
        else [None] * len(chunks)
    for w, c in zip(works, chunks):
        if w is not None:
            w.wait()
        for child, g in zip(children, glob):
            sends.append(peers.isend(c, g, step=_round(v, child, n)))
    wait(sends)


def reduce(x: torch.Tensor, peers: Peers, dst: int, op: str = "sum") -> None:
    """Binomial reduce of the flat ``x`` [N] to index ``dst`` (in place there; other ranks'
    ``x`` unchanged)."""
    n = peers.n
    v = (peers.index - dst) % n
    parent, children = tree_of(v, n)
    children = children[::-1]  # smallest subtree first: x_v ⊕ (v+1) ⊕ (v+2) ⊕ (v+4) …
    acc = x if parent is None or not children else x.clone()
    mine = peers.pieces(acc)
    scratch = [torch.empty_like(x) for _ in children]
    incoming = [peers.pieces(s) for s in scratch]
    works = [[peers.irecv(c, (child + dst) % n) for c in inc]
             for child, inc in zip(children, incoming)]
    sends = []
    for k, a in enumerate(mine):
        for j in range(len(children)):
            works[j][k].wait()
            combine_(a, incoming[j][k], op)
        if parent is not None:
            sends.append(peers.isend(a, (parent + dst) % n, step=(v & -v).bit_length() - 1))
    wait(sends)
