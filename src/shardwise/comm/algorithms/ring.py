"""Ring reduce-scatter, all-gather and all-reduce; chain (pipelined ring) broadcast and reduce.

The n ranks form a ring, index i sending to i+1 and receiving from i−1 (mod n). The buffer of
N elements is cut into n blocks (``bounds``; uneven when n does not divide N, see
:func:`~.p2p.split_bounds`). In each of n−1 steps every rank sends one block and receives one, so
every link carries the same load at the same time; with every block cut into chunks, a rank
forwards a chunk as soon as it has reduced it, so the steps overlap (pipelining).

Costs in the α-β model (α: latency per message, seconds; β: seconds per byte; S: bytes of the
full buffer; chunking left out), from Thakur, Rabenseifner & Gropp 2005 §4 and Patarasuk & Yuan
2009 (who prove the all-reduce's bandwidth term optimal), JAX scaling book ch. 5:

==================  ========================  ============================================
algorithm           time                      bytes sent by rank i
==================  ========================  ============================================
reduce-scatter      (n−1)α + (n−1)/n·S·β      S − |block i|      ((n−1)/n·S when even)
all-gather          (n−1)α + (n−1)/n·S·β      S − |block i+1|
all-reduce          2(n−1)α + 2(n−1)/n·S·β    the two above
chain broadcast     (n−2+C)(α + S/C·β)        S, except the last of the chain: 0
chain reduce        (n−2+C)(α + S/C·β)        S, except the root: 0
==================  ========================  ============================================

(C = number of chunks.) Summation order: block j is summed along the ring starting at rank j+1,
((x_{j+1} + x_{j+2}) + …) + x_j, on one rank only, then copied, so every rank holds bitwise the
same all-reduced result.
"""

from __future__ import annotations

import torch

from .p2p import Peers, combine_, wait


def reduce_scatter(x: torch.Tensor, peers: Peers, bounds: list[int], op: str = "sum"
                   ) -> torch.Tensor:
    """Ring reduce-scatter of the flat ``x`` [N] (not modified): returns block ``index`` of the
    reduction, ``[bounds[i+1] − bounds[i]]``, in a scratch buffer. ``bounds``: n+1 offsets.
    Sends S − |block i| bytes (module table)."""
    n, i = peers.n, peers.index
    right, left = (i + 1) % n, (i - 1) % n

    def blk(j):
        j %= n
        return slice(bounds[j], bounds[j + 1])

    tmp = torch.empty_like(x)
    sends = peers.send_all(x[blk(i - 1)], right, step=0)  # step 0: my own block i−1, raw
    for s in range(n - 1):
        j = i - s - 2  # the block that arrives in step s (left's block of step s−1, reduced)
        mine, acc = peers.pieces(x[blk(j)]), peers.pieces(tmp[blk(j)])
        works = [peers.irecv(c, left) for c in acc]
        for w, c, o in zip(works, acc, mine):
            w.wait()
            combine_(c, o, op)  # incoming partial ⊕ my own contribution
            if s < n - 2:  # forward at once: the pipeline
                sends.append(peers.isend(c, right, step=s + 1))
    wait(sends)
    return tmp[blk(i)]


def all_gather(y: torch.Tensor, peers: Peers, bounds: list[int], step0: int = 0) -> None:
    """Ring all-gather in place: ``y`` [N] holds this rank's block at ``bounds[i]:bounds[i+1]``
    and receives every other rank's. Sends S − |block i+1| bytes. ``step0``: the first step's
    number in ``peers.log``."""
    n, i = peers.n, peers.index
    right, left = (i + 1) % n, (i - 1) % n

    def blk(j):
        j %= n
        return slice(bounds[j], bounds[j + 1])

    sends = peers.send_all(y[blk(i)], right, step=step0)
    for s in range(n - 1):
        chunks = peers.pieces(y[blk(i - s - 1)])
        works = [peers.irecv(c, left) for c in chunks]
        for w, c in zip(works, chunks):
            w.wait()
            if s < n - 2:
                sends.append(peers.isend(c, right, step=step0 + s + 1))
    wait(sends)


def all_reduce(x: torch.Tensor, peers: Peers, op: str = "sum", bounds: list[int] | None = None
               ) -> None:
    """Ring all-reduce of the flat ``x`` [N] in place: reduce-scatter, then all-gather
    (Patarasuk & Yuan 2009). Sends 2S − |block i| − |block i+1| bytes ((2(n−1)/n)·S even)."""
    from .p2p import split_bounds

    bounds = bounds or split_bounds(x.numel(), peers.n)
    mine = reduce_scatter(x, peers, bounds, op)
    x[bounds[peers.index]:bounds[peers.index + 1]].copy_(mine)
    all_gather(x, peers, bounds, step0=peers.n - 1)


def broadcast(x: torch.Tensor, peers: Peers, src: int) -> None:
    """Chain broadcast of the flat ``x`` [N] in place from index ``src``: src → src+1 → … , each
    rank forwarding every chunk as it arrives. Every rank but the chain's last sends S bytes."""
    n = peers.n
    v = (peers.index - src) % n  # position along the chain
    nxt, prv = (peers.index + 1) % n, (peers.index - 1) % n
    if v == 0:
        wait(peers.send_all(x, nxt, step=0))
        return
    chunks, sends = peers.pieces(x), []
    works = [peers.irecv(c, prv) for c in chunks]
    for w, c in zip(works, chunks):
        w.wait()
        if v < n - 1:
            sends.append(peers.isend(c, nxt, step=v))
    wait(sends)


def reduce(x: torch.Tensor, peers: Peers, dst: int, op: str = "sum") -> None:
    """Chain reduce of the flat ``x`` [N] to index ``dst`` (in place there; other ranks' ``x``
    unchanged): dst−1 → dst−2 → … → dst+1 → dst, each rank adding its own and forwarding chunk
    by chunk. Result on dst: x_dst ⊕ ((… (x_{dst−1} ⊕ x_{dst−2}) ⊕ …) ⊕ x_{dst+1}) (indices mod
    n). Every rank but dst sends S bytes."""
    n = peers.n
    v = (peers.index - dst) % n
    nxt, prv = (peers.index + 1) % n, (peers.index - 1) % n  # receive from nxt, send to prv
    if v == n - 1:
        wait(peers.send_all(x, prv, step=0))
        return
    tmp = torch.empty_like(x)
    acc, mine = peers.pieces(tmp), peers.pieces(x)
    works, sends = [peers.irecv(c, nxt) for c in acc], []
    for w, c, o in zip(works, acc, mine):
        w.wait()
        if v == 0:
            combine_(o, c, op)  # the root: its own ⊕ the chain's partial, in place
        else:
            combine_(c, o, op)
            sends.append(peers.isend(c, prv, step=n - 1 - v))
    wait(sends)
