"""Collectives written out over point-to-point sends: ring, recursive halving-doubling,
binomial tree, pairwise exchange. :mod:`shardwise.comm.ops` calls them when a topology's
``collectives`` is not "native"; nothing else should.

=================  ================  =========================  ===================
op                 ``ring``          ``tree``                   module
=================  ================  =========================  ===================
all_reduce         ring              halving_doubling           :mod:`.ring`, :mod:`.halving_doubling`
reduce_scatter     ring              halving_doubling
all_gather         ring              halving_doubling (doubling)
broadcast          chain             binomial                   :mod:`.ring`, :mod:`.tree`
reduce             chain             binomial
all_to_all         pairwise          pairwise                   :mod:`.pairwise`
all_to_all_v       pairwise          pairwise                   :mod:`.pairwise`
=================  ================  =========================  ===================

``auto`` takes, per call, whichever of the two the α-β model of :mod:`.cost` predicts faster for
the message size and group size. Each function below returns the bytes this rank handed to send
for it; they are also tallied in the :class:`~.p2p.Peers` it was given (``sent_bytes``, and per
step and peer in ``log``).
"""

from __future__ import annotations

import functools

import torch

from ...errors import ShardwiseConfigError
from . import halving_doubling, pairwise, ring, tree
from .cost import BETA_S_PER_BYTE, ALPHA_S, sent_bytes, time_s
from .p2p import CHUNK_BYTES, Peers, split_bounds

MODES = ("native", "ring", "tree", "auto")

CHOICE = {
    "ring": {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring",
             "broadcast": "chain", "reduce": "chain", "all_to_all": "pairwise",
             "all_to_all_v": "pairwise"},
    "tree": {"all_reduce": "halving_doubling", "reduce_scatter": "halving_doubling",
             "all_gather": "halving_doubling", "broadcast": "binomial", "reduce": "binomial",
             "all_to_all": "pairwise", "all_to_all_v": "pairwise"},
}


def check_collectives(value, flag: str = "--collectives") -> str:
    """Return ``value`` if it is one of :data:`MODES`, else raise :class:`ShardwiseConfigError`
    naming the choices (call it on every rank before any collective)."""
    if value not in MODES:
        raise ShardwiseConfigError(
            f"{flag} {value!r} is not an implementation of the collectives: choose native (the "
            "backend's own: gloo, NCCL), ring, tree (halving-doubling, binomial trees) or auto "
            f"(the faster of the two by the α-β model), e.g. {flag} ring")
    return value


def choose(op: str, mode: str, size_bytes: float, n: int, alpha: float = ALPHA_S,
           beta: float = BETA_S_PER_BYTE, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """The algorithm ``mode`` runs ``op`` on ``size_bytes`` over ``n`` ranks with; None means
    the backend's own (mode "native", or a group of one)."""
    check_collectives(mode, "collectives")
    if mode == "native" or n <= 1:
        return None
    if mode in CHOICE:
        return CHOICE[mode][op]
    options = {CHOICE["ring"][op], CHOICE["tree"][op]}
    if len(options) == 1:
        return options.pop()
    return min(sorted(options), key=lambda a: time_s(op, a, size_bytes, n, alpha, beta,
                                                     chunk_bytes))


def _counted(fn):
    """``fn``, returning the bytes its :class:`Peers` argument sent during the call."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        peers = next(a for a in args if isinstance(a, Peers))
        before = peers.sent_bytes
        fn(*args, **kwargs)
        return peers.sent_bytes - before
    return wrapper


@_counted
def all_reduce(x: torch.Tensor, peers: Peers, algorithm: str, op: str = "sum") -> int:
    """All-reduce the flat contiguous ``x`` [N] in place by ``algorithm``."""
    {"ring": ring.all_reduce, "halving_doubling": halving_doubling.all_reduce}[algorithm](
        x, peers, op)


@_counted
def reduce_scatter(out: torch.Tensor, x: torch.Tensor, peers: Peers, algorithm: str,
                   op: str = "sum") -> int:
    """Reduce the flat ``x`` [n·k] and leave this rank's block in ``out`` [k]."""
    if algorithm == "ring":
        res = ring.reduce_scatter(x, peers, split_bounds(x.numel(), peers.n), op)
    else:
        res = halving_doubling.reduce_scatter(x, peers, op)
    out.copy_(res)


@_counted
def all_gather(y: torch.Tensor, shard: torch.Tensor, peers: Peers, algorithm: str) -> int:
    """Gather every rank's ``shard`` [k] into the flat ``y`` [n·k] (index i's at i·k)."""
    k, i = shard.numel(), peers.index
    y[i * k:(i + 1) * k].copy_(shard)
    if algorithm == "ring":
        ring.all_gather(y, peers, [j * k for j in range(peers.n + 1)])
    else:
        halving_doubling.all_gather(y, peers)


@_counted
def broadcast(x: torch.Tensor, peers: Peers, algorithm: str, src: int) -> int:
    """Broadcast the flat ``x`` [N] in place from index ``src``."""
    {"chain": ring.broadcast, "binomial": tree.broadcast}[algorithm](x, peers, src)


@_counted
def reduce(x: torch.Tensor, peers: Peers, algorithm: str, dst: int, op: str = "sum") -> int:
    """Reduce the flat ``x`` [N] to index ``dst`` (in place there)."""
    {"chain": ring.reduce, "binomial": tree.reduce}[algorithm](x, peers, dst, op)


@_counted
def all_to_all(out: torch.Tensor, x: torch.Tensor, peers: Peers, algorithm: str) -> int:
    """Block j of the flat ``x`` [n·k] to index j; ``out`` [n·k] gets block i from index i."""
    pairwise.all_to_all(out, x, peers)


@_counted
def all_to_all_v(out: torch.Tensor, x: torch.Tensor, peers: Peers, algorithm: str,
                 send_bounds: list[int], recv_bounds: list[int]) -> int:
    """Uneven blocks (:func:`.pairwise.all_to_all_v`): ``x``'s elements between
    ``send_bounds[j]`` and ``send_bounds[j+1]`` to index j, ``out``'s from index j."""
    pairwise.all_to_all_v(out, x, peers, send_bounds, recv_bounds)


__all__ = ["MODES", "CHOICE", "check_collectives", "choose", "Peers", "all_reduce",
           "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "all_to_all_v",
           "time_s",
           "sent_bytes", "CHUNK_BYTES"]
