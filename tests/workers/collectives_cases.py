"""Worker for tests/test_collectives.py: every algorithm of shardwise.comm.algorithms, through
comm/ops.py (``topo.collectives`` = "ring" and "tree"), against torch's own collective on the
same group (``topo.collectives = "native"``) and against an fp64 sum of every rank's input
(each rank regenerates all inputs from their seeds), for n = 2 … 8 ranks (sub-groups of a world
of 8), even and uneven sizes, several chunks per message (``CHUNK_BYTES`` set to 64). Writes
``<out>/rank<r>.pt``: a list of case dicts (see ``case()``), each with this rank's results."""

import sys

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm.algorithms import p2p
from shardwise.topology import Topology, init_distributed

MODES = ("ring", "tree")


def inputs(seed: int, n: int, numel: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's input of one case: uniform in [−1, 1), from seed (seed, rank)."""
    return [torch.rand(numel, generator=torch.Generator().manual_seed(seed * 100 + j),
                       dtype=dtype) * 2 - 1 for j in range(n)]


def main(out):
    init_distributed("cpu", timeout_s=60)
    world, rank = dist.get_world_size(), dist.get_rank()
    p2p.CHUNK_BYTES = 64  # 16 fp32 per message: even 13 elements cross in one, 50 in four
    topos = {n: Topology(dp=n, ranks=range(n), timeout_s=60) for n in range(2, world + 1)}
    cases = []
    for n, topo in topos.items():
        if not topo.member:
            continue
        i = topo.index("dp")
        seed = 1000 * n  # the same sequence on every member of this group

        def run(mode, fn):
            topo.collectives = mode
            topo.ledger.clear()
            res = fn()
            rec = topo.ledger.records[-1]
            return res, {"sent_bytes": rec.sent_bytes, "wire_bytes": rec.wire_bytes,
                         "impl": rec.impl, "sends": rec.sends}

        def both(mode, fn):  # (torch's result, ours, our ledger record)
            native, _ = run("native", fn)
            return (native, *run(mode, fn))

        def case(op, mode, **kw):
            cases.append({"n": n, "index": i, "op": op, "mode": mode, **kw})

        for numel in (1, n - 1, 13, 50, 4 * n):  # fewer elements than ranks, uneven, even
            for red in ("sum", "max", "avg"):
                seed += 1
                xs = inputs(seed, n, numel)
                for mode in MODES:
                    native, ours, rec = both(mode, lambda: _all_reduce(xs[i], topo, red))
                    case("all_reduce", mode, numel=numel, red=red, ours=ours, native=native,
                         **sums(xs), **rec)
        for k in (1, 3, 50):
            seed += 1
            xs = inputs(seed, n, n * k)
            for mode in MODES:
                native, ours, rec = both(mode, lambda: _reduce_scatter(xs[i], topo, k))
                case("reduce_scatter", mode, k=k, ours=ours, native=native,
                     **sums(xs, slice(i * k, (i + 1) * k)),
                     input_unchanged=torch.equal(xs[i], inputs(seed, n, n * k)[i]), **rec)
                native, ours, rec = both(mode, lambda: _all_gather(xs[i][:k], topo, k))
                case("all_gather", mode, k=k, ours=ours, native=native, **rec)
                native, ours, rec = both(mode, lambda: _all_to_all(xs[i], topo))
                case("all_to_all", mode, k=k, ours=ours, native=native, **rec)
        for numel in (1, 37):
            for root in sorted({0, n // 2, n - 1}):
                seed += 1
                xs = inputs(seed, n, numel)
                for mode in MODES:
                    native, ours, rec = both(mode, lambda: _broadcast(xs[i], topo, root))
                    case("broadcast", mode, numel=numel, root=root, ours=ours, native=native,
                         **rec)
                    native, ours, rec = both(mode, lambda: _reduce(xs[i], topo, root))
                    case("reduce", mode, numel=numel, root=root, ours=ours,
                         native=native if i == root else None, **sums(xs),
                         unchanged=i == root or torch.equal(ours, xs[i]), **rec)
        # a non-contiguous tensor (a transposed view) is reduced in place all the same
        seed += 1
        xs = inputs(seed, n, 12)
        for mode in MODES:
            topo.collectives = mode
            t = xs[i].clone().view(3, 4).t()
            comm.all_reduce(t, topo, "dp")
            case("all_reduce_strided", mode, ours=t.contiguous().view(-1),
                 **sums([x.view(3, 4).t().reshape(-1) for x in xs]))
        # async_op: a handle that is already done; all_reduce_future: a completed future
        for mode in MODES:
            topo.collectives = mode
            a = xs[i].clone()
            comm.all_reduce(a, topo, "dp", async_op=True).wait()
            b = comm.all_reduce_future(xs[i].clone(), topo, "dp").wait()
            case("async", mode, ours=a, other=b)
    torch.save(cases, f"{out}/rank{rank}.pt")
    topos[world].collectives = "native"
    dist.barrier()
    dist.destroy_process_group()


def sums(xs, part=slice(None)) -> dict:
    """The fp64 sum of every rank's input (``exact``) and of their magnitudes (``absum``)."""
    return {"exact": torch.stack([x.double() for x in xs]).sum(0)[part],
            "absum": torch.stack([x.double().abs() for x in xs]).sum(0)[part]}


def _all_reduce(x, topo, red):
    y = x.clone()
    comm.all_reduce(y, topo, "dp", op=red)
    return y


def _reduce_scatter(x, topo, k):
    out = torch.empty(k)
    comm.reduce_scatter(out, x, topo, "dp")
    return out


def _all_gather(shard, topo, k):
    out = torch.empty(topo.size("dp") * k)
    comm.all_gather(out, shard.clone(), topo, "dp")
    return out


def _all_to_all(x, topo):
    out = torch.empty_like(x)
    comm.all_to_all(out, x.clone(), topo, "dp")
    return out


def _broadcast(x, topo, root):
    y = x.clone()
    comm.broadcast(y, topo, "dp", src=root)
    return y


def _reduce(x, topo, root):
    y = x.clone()
    comm.reduce(y, topo, "dp", dst=root)
    return y


if __name__ == "__main__":
    main(sys.argv[1])
