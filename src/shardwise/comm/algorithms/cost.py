"""The α-β model of every algorithm here, and ``auto``'s choice by it.

A message of m bytes between two ranks costs α + m·β (α: latency, seconds; β: seconds per byte,
the inverse of the link bandwidth); a step in which every rank sends one message and receives
one costs the same (full-duplex links, no contention). Reduction arithmetic (the γ term) is
left out. Sources: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH" §4 (every formula below); Patarasuk & Yuan 2009 (ring all-reduce,
bandwidth optimal); JAX scaling book ch. 5 ("Sharded Matrices", collective costs).

``S`` is the collective's full logical buffer in bytes, as the ledger books it (all_gather: the
gathered output; reduce_scatter: the unreduced input; all_to_all: one rank's input), ``n`` the
group size, p = 2^⌊log₂ n⌋, k = log₂ p, L = ⌈log₂ n⌉, C the number of pipelining chunks.
"""

from __future__ import annotations

import math

from .halving_doubling import fold
from .tree import tree_of

# gloo over the loopback interface of the 2-core development machine, fitted by
# ``shardwise bench --suite collectives`` (benchmarks/README.md, "Collectives"): the ring
# all-reduce's fit. ``auto`` uses these unless given others.
ALPHA_S = 700e-6
BETA_S_PER_BYTE = 1 / 0.57e9


def time_s(op: str, algorithm: str, S: float, n: int, alpha: float = ALPHA_S,
           beta: float = BETA_S_PER_BYTE, chunk_bytes: int = 512 * 1024) -> float:
    """Predicted seconds of ``op`` by ``algorithm`` on S bytes over n ranks. Raises ValueError
    for a pair that does not exist."""
    if n <= 1:
        return 0.0
    p, r = fold(n)
    k, L = p.bit_length() - 1, (n - 1).bit_length()
    C = max(1, math.ceil(S / chunk_bytes))
    extra = r > 0
    table = {
        ("all_reduce", "ring"): 2 * (n - 1) * alpha + 2 * (n - 1) / n * S * beta,
        ("reduce_scatter", "ring"): (n - 1) * alpha + (n - 1) / n * S * beta,
        ("all_gather", "ring"): (n - 1) * alpha + (n - 1) / n * S * beta,
        ("all_reduce", "halving_doubling"): 2 * k * alpha + 2 * (p - 1) / p * S * beta
        + extra * 2 * (alpha + S * beta),
        ("reduce_scatter", "halving_doubling"): k * alpha + (p - 1) / p * S * beta
        + extra * (2 * alpha + S * beta + S / n * beta),
        ("all_gather", "halving_doubling"): k * alpha + (p - 1) / p * S * beta
        + extra * (2 * alpha + S / n * beta + (n - 1) / n * S * beta),
        ("broadcast", "chain"): (n - 2 + C) * (alpha + S / C * beta),
        ("reduce", "chain"): (n - 2 + C) * (alpha + S / C * beta),
        ("broadcast", "binomial"): L * (alpha + S * beta),
        ("reduce", "binomial"): L * (alpha + S * beta),
        ("all_to_all", "pairwise"): (n - 1) * alpha + (n - 1) / n * S * beta,
    }
    if (op, algorithm) not in table:
        raise ValueError(f"no α-β formula for {op} by {algorithm!r}")
    return table[op, algorithm]


def sent_bytes(op: str, algorithm: str, S: float, n: int, index: int, root: int = 0) -> float:
    """Bytes index ``index`` hands to send for ``op`` by ``algorithm`` when S splits into n
    equal blocks (for all_reduce by halving-doubling: into p equal segments), derived in each
    algorithm's module docstring. ``root``: broadcast/reduce's root index."""
    if n <= 1:
        return 0.0
    p, r = fold(n)
    v = (index - root) % n
    extra = index < 2 * r and index % 2 == 0
    partner = index < 2 * r and index % 2 == 1
    b = S / n
    if algorithm in ("ring", "pairwise"):
        return {"all_reduce": 2 * (S - b)}.get(op, S - b)
    if algorithm == "chain":
        return 0.0 if (op == "broadcast" and v == n - 1) or (op == "reduce" and v == 0) else S
    if algorithm == "binomial":
        if op == "reduce":
            return 0.0 if v == 0 else S
        return S * len(tree_of(v, n)[1])
    if algorithm == "halving_doubling":
        if op == "all_reduce":
            return S if extra else 2 * (p - 1) / p * S + (S if partner else 0.0)
        if op == "reduce_scatter":
            return S if extra else S - b
        if op == "all_gather":
            if extra:
                return b
            w = index // 2 if partner else index - r
            seg = [2 * b if u < r else b for u in range(p)]
            total, m = 0.0, 1
            while m < p:
                lo = (w // m) * m
                total += sum(seg[lo:lo + m])
                m <<= 1
            return total + (S - b if partner else 0.0)
    raise ValueError(f"no byte formula for {op} by {algorithm!r}")
