"""The collectives themselves: a ring all-reduce = reduce-scatter + all-gather, from send/recv.

Every strategy script uses three collectives. Over n ranks, a tensor of S bytes cut into n
chunks of S/n (Patarasuk & Yuan 2009; scaling book ch. 3, "Sharded Matrices"):

    reduce-scatter  A[I] {U_X} → A[I_X]   rank r ends with the sum over ranks of chunk r only
    all-gather      A[I_X]     → A[I]     every rank ends with every chunk
    all-reduce      A[I] {U_X} → A[I]     = reduce-scatter, then all-gather

On a ring (rank r sends to r + 1, receives from r − 1), each takes n − 1 steps of one chunk:

    reduce-scatter  at step t, send my running sum of chunk (r − t − 1) mod n, receive chunk
                    (r − t − 2) mod n and add my own part to it; after n − 1 steps I hold
                    chunk r summed over all ranks.          sends (n − 1)/n · S
    all-gather      at step t, send the finished chunk (r − t) mod n, receive (r − t − 1) mod n.
                                                            sends (n − 1)/n · S
    all-reduce      both:                                   sends 2(n − 1)/n · S

No rank sends more than 2S whatever n is: why the ring is bandwidth-optimal. It pays n − 1
latencies per phase, which is why trees win for small messages (docs/collectives.md).

This script runs each one by hand on a small tensor, prints every send, and checks the result
against torch's own ``dist.reduce_scatter`` / ``dist.all_gather`` / ``dist.all_reduce``.
Use 4 ranks: at n = 2 each phase is one step, and the ring's 2(n−1)/n · S equals the naive
(n−1) · S it is compared with.

Run:  shardwise learn collectives --nproc 4
      torchrun --nproc-per-node 4 -m shardwise.learn.collectives
Next: docs/collectives.md → src/shardwise/comm/algorithms/ →
      shardwise.comm.algorithms.ring.reduce_scatter, then its all_gather and all_reduce →
      shardwise trace --collectives ring --dp 2 --zero 3 --model mlp-tiny
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.learn._common import book, finish, need, run, setup


def ring_step(send: torch.Tensor, recv: torch.Tensor, rank: int, n: int, what: str,
              show: bool) -> None:
    """Send ``send`` to rank + 1 and receive ``recv`` from rank − 1 (isend: no deadlock)."""
    work = dist.isend(send.contiguous(), (rank + 1) % n)
    dist.recv(recv, (rank - 1) % n)
    work.wait()
    book("send", send, n, "ring", f"{what} → rank {(rank + 1) % n}", show)


def reduce_scatter(x: torch.Tensor, rank: int, n: int, show: bool) -> torch.Tensor:
    """x [n·c] {U_X} (my unreduced copy) → chunk ``rank`` of Σ_ranks x, [c]."""
    chunks = [c.clone() for c in x.chunk(n)]  # my running sums, one per chunk
    for t in range(n - 1):
        out, into = (rank - t - 1) % n, (rank - t - 2) % n
        got = torch.empty_like(chunks[into])
        ring_step(chunks[out], got, rank, n, f"step {t}: partial sum of chunk {out}", show)
        chunks[into] += got  # the sum so far of chunk `into`, plus my part
    return chunks[rank]


def all_gather(mine: torch.Tensor, rank: int, n: int, show: bool) -> torch.Tensor:
    """my chunk [c] (chunk ``rank``) → every rank's chunks, concatenated [n·c]."""
    chunks = [torch.empty_like(mine) for _ in range(n)]
    chunks[rank] = mine
    for t in range(n - 1):
        out, into = (rank - t) % n, (rank - t - 1) % n
        ring_step(chunks[out], chunks[into], rank, n, f"step {t}: summed chunk {out}", show)
    return torch.cat(chunks)


def check(n: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    need(n >= 2, f"a collective needs at least 2 ranks (got {n}): use --nproc 2 or more")


def main(argv: list[str] | None = None) -> None:
    rank, n, device, out = setup(argv)
    check(n)
    x = torch.arange(4.0 * n, device=device) * (rank + 1)  # A[I] {U_X}: my part of a sum, [4n]
    S = x.numel() * x.element_size()
    if rank == 0:
        print(f"{n} ranks, A[{x.numel()}] fp32, S = {S} B, chunks of S/n = {S // n} B "
              "(a send row's S column below is the one chunk it sends)")
        print(f"reduce-scatter, n − 1 = {n - 1} steps (rank 0's sends):")
    mine = reduce_scatter(x, rank, n, rank == 0)
    want = torch.empty_like(mine)
    dist.reduce_scatter(want, list(x.chunk(n)))  # torch's own, to check against
    assert torch.equal(mine, want), f"rank {rank}: ring reduce-scatter {mine} != torch's {want}"
    if rank == 0:
        print("all-gather of the reduced chunks, n − 1 steps:")
    full = all_gather(mine, rank, n, rank == 0)
    ref = x.clone()
    dist.all_reduce(ref)  # all-reduce = reduce-scatter + all-gather: torch's in one call
    assert torch.equal(full, ref), f"rank {rank}: ring all-reduce {full} != torch's {ref}"
    sent = 2 * (n - 1) * S / n
    if rank == 0:
        print(f"all-reduce by hand = dist.all_reduce on every rank; rank 0 sent {sent:.0f} B "
              f"= 2(n−1)/n · S = 2·{n - 1}/{n}·{S}; a naive 'send all to rank 0' would cost "
              f"rank 0 {(n - 1) * S} B of receives")
    finish(rank, [], {}, "collectives", out)


if __name__ == "__main__":
    run(main)
