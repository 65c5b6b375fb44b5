"""Worker for tests/test_comm.py: every collective of shardwise.comm on a pp=1 × dp=2 × tp=2 world
of 4 ranks; each rank dumps what it got and its ledger to ``<out>/rank<r>.pt``."""

import gc
import sys
import weakref

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.topology import Topology, init_distributed


def main(out):
    init_distributed("cpu", timeout_s=60)
    topo = Topology(pp=1, dp=2, tp=2, timeout_s=60)
    r = topo.rank
    res = {"coords": topo.coords}
    x = torch.arange(6, dtype=torch.float32) + 10 * r
    comm.all_reduce(x, topo, "tp")
    res["all_reduce_tp"] = x
    y = torch.full((3,), float(r + 1))
    comm.all_reduce(y, topo, "dp", op="avg", async_op=True).wait()
    res["all_reduce_dp_avg"] = y
    m = torch.tensor([float(r)])
    comm.all_reduce(m, topo, "world", op="max")
    res["all_reduce_world_max"] = m
    g = torch.empty(2, 3)
    comm.all_gather(g, torch.full((1, 3), float(r)), topo, "tp")
    res["all_gather_tp"] = g
    full = torch.arange(8, dtype=torch.float64) * (r + 1)
    shard = torch.empty(4, dtype=torch.float64)
    comm.reduce_scatter(shard, full, topo, "dp")
    res["reduce_scatter_dp"] = shard
    # async, its input dropped by the caller before the wait (ZeRO's flat gradient, issue 53):
    # the Handle keeps the dtype and shape only, the backend what it still reads
    full = torch.arange(8, dtype=torch.float64) * (r + 1)
    alive, shard = weakref.ref(full), torch.empty(4, dtype=torch.float64)
    handle = comm.reduce_scatter(shard, full, topo, "dp", async_op=True)
    del full
    gc.collect()
    res["async_input_alive"] = alive() is not None
    handle.wait()
    res["reduce_scatter_dp_async"] = shard
    b = torch.full((5,), float(r))
    comm.broadcast(b, topo, "dp", src=1)
    res["broadcast_dp_src1"] = b
    a_in = torch.tensor([10.0 * r, 10.0 * r + 1])
    a_out = torch.empty(2)
    comm.all_to_all(a_out, a_in, topo, "tp")
    res["all_to_all_tp"] = a_out
    # point to point along tp: index 0 sends, index 1 receives
    buf = torch.full((7,), float(r), dtype=torch.float32)
    if topo.index("tp") == 0:
        comm.send(buf, topo, "tp", dst=1)
    else:
        comm.recv(buf, topo, "tp", src=0)
    res["p2p_tp"] = buf
    res["records"] = [vars(rec) for rec in topo.ledger.records]
    torch.save(res, f"{out}/rank{r}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
