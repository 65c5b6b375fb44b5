"""Worker for tests/test_collective_timeout.py: 2 ranks; rank 0 alone calls a collective of
shardwise.comm on a group whose timeout is TIMEOUT_S seconds (the others never join it), and
records what it raised and how long it took. Rank 1 waits on the store (not a collective, so it
cannot pair with rank 0's call) until rank 0 is done, with its own timeout, and records that.

Cases, each on its own Topology (a group that timed out is left broken):
``sync``: ``comm.all_reduce`` of float32 [4], tag "loss"; ``async``: ``comm.all_gather`` of a
float32 [3] shard into [6] with ``async_op=True`` then ``Handle.wait()``, tag "param";
``ring``: ``comm.reduce_scatter`` of float32 [8] by our ring (isend/irecv), tag "grad";
``tree``: the ``async`` case by our recursive doubling.
Writes ``<out>/rank<r>.json``."""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.errors import CollectiveTimeout, ShardwiseConfigError
from shardwise.topology import Topology, init_distributed

TIMEOUT_S = 3.0
# case → --collectives of its topology: our point-to-point algorithms respect the timeout too
COLLECTIVES = {"sync": "native", "async": "native", "ring": "ring", "tree": "tree"}
WAIT_S = 60.0  # rank 1's own limit while rank 0 times out


def _alone(case, fn):
    """Run ``fn`` (a collective only rank 0 issues); {"case", what was raised, seconds}."""
    t0 = time.perf_counter()
    rec = {"case": case, "type": None, "message": None}
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type
        rec.update(type=type(e).__name__, message=str(e),
                   config_error=isinstance(e, ShardwiseConfigError),
                   collective_timeout=isinstance(e, CollectiveTimeout),
                   cause=repr(e.__cause__) if e.__cause__ is not None else None)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def main(out):
    init_distributed("cpu", timeout_s=30)
    rank = dist.get_rank()
    topos = {c: Topology(dp=2, ranks=range(2), timeout_s=TIMEOUT_S, collectives=coll)
             for c, coll in COLLECTIVES.items()}
    store = dist.distributed_c10d._get_default_store()
    res = {"rank": rank, "cases": []}
    if rank == 0:
        res["cases"].append(_alone("sync", lambda: comm.all_reduce(
            torch.ones(4), topos["sync"], "dp", tag="loss")))

        def gather():
            h = comm.all_gather(torch.empty(6), torch.ones(3), topos["async"], "dp",
                                tag="param", async_op=True)
            h.wait()

        res["cases"].append(_alone("async", gather))
        res["cases"].append(_alone("ring", lambda: comm.reduce_scatter(
            torch.empty(4), torch.ones(8), topos["ring"], "dp", tag="grad")))

        def tree_gather():
            comm.all_gather(torch.empty(6), torch.ones(3), topos["tree"], "dp", tag="param",
                            async_op=True).wait()

        res["cases"].append(_alone("tree", tree_gather))
        store.set("timeout_cases_done", "1")
    else:
        t0 = time.perf_counter()
        store.wait(["timeout_cases_done"], datetime.timedelta(seconds=WAIT_S))
        res["waited_s"] = time.perf_counter() - t0
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)
    # no barrier on the broken groups (it would pair with rank 0's failed call); the store is
    # enough to leave together. Rank 0 hosts the store, so it leaves last: rank 1's "done" is
    # its last store call (a rank 0 that left first would reset rank 1's pending wait)
    if rank == 0:
        store.set("timeout_exit_0", "1")
        store.wait(["timeout_exit_1"], datetime.timedelta(seconds=WAIT_S))
    else:
        store.wait(["timeout_exit_0"], datetime.timedelta(seconds=WAIT_S))
        store.set("timeout_exit_1", "1")


if __name__ == "__main__":
    main(sys.argv[1])
