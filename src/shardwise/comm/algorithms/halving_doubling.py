"""Recursive halving and doubling (Rabenseifner): reduce-scatter, all-gather, all-reduce in
log₂ p steps, for any group size.

For p = 2^k ranks, step t pairs index v with v XOR 2^(k−1−t) (halving, for the reduce-scatter):
each keeps half of its current range of segments, sends the other half and adds the partner's
copy of its own half. After k steps rank v holds segment v reduced. Recursive doubling (the
all-gather) runs the steps backwards, doubling the range held. All-reduce = the two.

Not a power of two (n = p + r, p = 2^⌊log₂ n⌋): "the extra ranks fold in first" (Rabenseifner
2004; Thakur, Rabenseifner & Gropp 2005 §4.4). Among the first 2r indices, each even one sends its
whole vector to the odd one after it and sits out; the p remaining ranks (virtual index v: i//2
below 2r, i−r above) run the power-of-two algorithm, and at the end each odd one sends the
extra its result. For reduce-scatter the p virtual segments are the blocks of the ranks each
virtual rank stands for (two blocks below r, one above), so the segments are uneven.

α-β costs (S bytes of the full buffer; the fold's terms only when n ≠ p), Thakur et al. 2005
§4.4, JAX scaling book ch. 5:

================  ===========================================  ==========================
algorithm         time                                         bytes sent
================  ===========================================  ==========================
all-reduce        2·log₂p·α + 2(p−1)/p·S·β  [+ 2(α + S·β)]     p ranks: 2(p−1)/p·S
                                                               (+ S on the r odd ones);
                                                               the r extras: S
reduce-scatter    log₂p·α + (p−1)/p·S·β  [+ α + S·β + α + S/n·β]  (n−1)/n·S on every rank
                                                               but the r extras: S
all-gather        log₂p·α + (p−1)/p·S·β  [+ α + S/n·β + α + S·β]  Σ_t |range_t| (see
                                                               :func:`all_gather`)
================  ===========================================  ==========================

So for a power of two the bandwidth term equals the ring's with log₂p latency terms instead of
n−1; otherwise the fold costs an extra S·β: the ring wins for large messages. Summation order:
the fold adds x_odd ⊕ x_even, then segment v is summed along the binary tree of the halving
steps, own ⊕ partner's, on one rank only, and copied: identical on every rank.
"""

from __future__ import annotations

import torch

from .p2p import Peers, combine_, split_bounds, wait


def fold(n: int) -> tuple[int, int]:
    """(p, r): the largest power of two p ≤ n, and the r = n − p extra ranks."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def virtual(i: int, r: int) -> int | None:
    """Virtual index of real index ``i`` in the power-of-two phase (None: an extra, sits out)."""
    if i < 2 * r:
        return None if i % 2 == 0 else i // 2
    return i - r


def real(v: int, r: int) -> int:
    """Real index of virtual index ``v``."""
    return 2 * v + 1 if v < r else v + r


def _halving(acc, tmp, peers: Peers, v: int, p: int, r: int, seg: list[int], op: str,
             step: int) -> list:
    """Recursive halving over the p virtual ranks on ``acc`` (in place): on return
    ``acc[seg[v]:seg[v+1]]`` is reduced. ``tmp``: scratch like ``acc``. Returns send works."""
    lo, hi, mask, sends = 0, p, p >> 1, []
    while mask:
        partner = real(v ^ mask, r)
        mid = lo + mask
        keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
        sends += peers.send_all(acc[seg[give[0]]:seg[give[1]]], partner, step)
        part, mine = peers.pieces(tmp[seg[keep[0]]:seg[keep[1]]]), \
            peers.pieces(acc[seg[keep[0]]:seg[keep[1]]])
        works = [peers.irecv(c, partner) for c in part]
        for w, c, o in zip(works, part, mine):
            w.wait()
            combine_(o, c, op)  # own ⊕ partner's
        lo, hi = keep
        mask >>= 1
        step += 1
    return sends


def _doubling(y, peers: Peers, v: int, p: int, r: int, seg: list[int], step: int) -> list:
    """Recursive doubling over the p virtual ranks, in place in ``y``: it holds segment v and
    receives all the others. Returns send works."""
    mask, sends = 1, []
    while mask < p:
        pv = v ^ mask
        mine, theirs = (v // mask) * mask, (pv // mask) * mask
        sends += peers.send_all(y[seg[mine]:seg[mine + mask]], real(pv, r), step)
        wait(peers.recv_all(y[seg[theirs]:seg[theirs + mask]], real(pv, r)))
        mask <<= 1
        step += 1
    return sends


def all_reduce(x: torch.Tensor, peers: Peers, op: str = "sum") -> None:
    """Rabenseifner all-reduce of the flat ``x`` [N] in place (module table for the bytes)."""
    n, i = peers.n, peers.index
    p, r = fold(n)
    v = virtual(i, r)
    if v is None:  # an extra: fold in (send done before x is overwritten), wait for the result
        wait(peers.send_all(x, i + 1, step=0))
        wait(peers.recv_all(x, i + 1))
        return
    tmp = torch.empty_like(x)
    if i < 2 * r:  # fold: x ← x_odd ⊕ x_even
        wait(peers.recv_all(tmp, i - 1))
        combine_(x, tmp, op)
    seg = split_bounds(x.numel(), p)
    sends = _halving(x, tmp, peers, v, p, r, seg, op, step=1)
    sends += _doubling(x, peers, v, p, r, seg, step=1 + p.bit_length() - 1)
    if i < 2 * r:
        sends += peers.send_all(x, i - 1, step=2 * (p.bit_length() - 1) + 1)
    wait(sends)


def _virtual_segments(n: int, r: int, k: int) -> list[int]:
    """Offsets of the p virtual segments of a buffer of n blocks of k elements: virtual rank v
    stands for blocks 2v, 2v+1 (v < r) or block v + r."""
    p = n - r
    return [k * (2 * v if v < r else v + r) for v in range(p)] + [n * k]


def reduce_scatter(x: torch.Tensor, peers: Peers, op: str = "sum") -> torch.Tensor:
    """Recursive-halving reduce-scatter of the flat ``x`` [n·k] (not modified): returns this
    rank's block [k] of the reduction. Sends (n−1)/n·S, or S on the r extras."""
    n, i = peers.n, peers.index
    k = x.numel() // n
    p, r = fold(n)
    v = virtual(i, r)
    if v is None:
        out = torch.empty(k, dtype=x.dtype, device=x.device)
        sends = peers.send_all(x, i + 1, step=0)
        wait(peers.recv_all(out, i + 1))
        wait(sends)
        return out
    acc, tmp = x.clone(), torch.empty_like(x)
    if i < 2 * r:
        wait(peers.recv_all(tmp, i - 1))
        combine_(acc, tmp, op)
    sends = _halving(acc, tmp, peers, v, p, r, _virtual_segments(n, r, k), op, step=1)
    if i < 2 * r:  # hand the extra its block
        sends += peers.send_all(acc[(i - 1) * k:i * k], i - 1, step=p.bit_length())
    wait(sends)
    return acc[i * k:(i + 1) * k]


def all_gather(y: torch.Tensor, peers: Peers) -> None:
    """Recursive-doubling all-gather in place: ``y`` [n·k] holds this rank's block at
    i·k:(i+1)·k and receives every other. Bytes sent: an extra k·e (its block, e bytes per
    element); virtual rank v Σ_{m=1,2,…,p/2} |aligned range of m segments holding v| (segments
    of 2k below r, k above), plus (n−1)·k·e on the odd ranks below 2r (the extra's share)."""
    n, i = peers.n, peers.index
    k = y.numel() // n
    p, r = fold(n)
    v = virtual(i, r)
    if v is None:
        sends = peers.send_all(y[i * k:(i + 1) * k], i + 1, step=0)
        wait(peers.recv_all(y[:i * k], i + 1))
        wait(peers.recv_all(y[(i + 1) * k:], i + 1))
        wait(sends)
        return
    if i < 2 * r:
        wait(peers.recv_all(y[(i - 1) * k:i * k], i - 1))
    sends = _doubling(y, peers, v, p, r, _virtual_segments(n, r, k), step=1)
    if i < 2 * r:
        last = p.bit_length()
        sends += peers.send_all(y[:(i - 1) * k], i - 1, step=last)
        sends += peers.send_all(y[i * k:], i - 1, step=last)
    wait(sends)
