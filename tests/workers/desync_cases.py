"""Worker for tests/test_desync.py: 3 ranks, one desync injected per case, each on its own
Topology (a group left with a stuck collective is not reused), a process-group timeout of
TIMEOUT_S seconds (the bound a check must beat by far). Every rank records what it raised, the
seconds from the fault to the raise, and writes ``<out>/rank<r>.json``.

Cases (rank ODD is the one that misbehaves; the others do the right thing):

``extra``  (a) ``--check-collectives step``: in step 1 every rank all-reduces float32 [4] over
           dp, tag "grad"; rank ODD then all-reduces float32 [4], tag "extra", once more; all
           reach the check before step 2.
``shape``  (b) ``every``: in step 1 rank ODD all-reduces float32 [8] where the others use [4]
           (``step`` cannot catch it on gloo: the receiver of the longer buffer aborts in
           gloo's own size check before any check of ours runs; see fingerprint.py).
``save``   (e) ``step``: after step 1, rank 0 alone "saves": it all-gathers float32 [3] shards
           into [9] (tag "checkpoint", phase "checkpoint"), as a save on rank 0 only would;
           every rank reaches the check before step 2.
``compute`` (c) ``step`` with ``hang_after_s`` = HANG_AFTER_S and flight records in
           ``<out>/flight``: rank ODD "computes" (sleeps HANG_AFTER_S + 3 s) after step 1's
           all-reduce; the others wait at the check before step 2 and, after HANG_AFTER_S,
           write their flight records and raise CollectiveHang naming rank ODD as silent.
``clean``  the same as ``extra`` without the fault, on ``step``: no error (the check cannot
           fail without a cause).
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import fingerprint
from shardwise.errors import CollectiveMismatch, CollectiveTimeout
from shardwise.topology import Topology, init_distributed

TIMEOUT_S = 60.0
ODD = 1
HANG_AFTER_S = 2.0
CASES = {"extra": "step", "shape": "every", "save": "step", "compute": "step", "clean": "step"}


def step_one(topo, rank, case, mark):
    """Step 1 of ``case`` on this rank; ``mark["t"]``: when the fault began (the faulty call,
    or, on a rank that does nothing wrong, when it issued its last good collective)."""
    fingerprint.check(topo, 1)
    with topo.ledger.phase("init"):
        comm.broadcast(torch.zeros(2), topo, "dp", tag="param")
    n = 8 if (case == "shape" and rank == ODD) else 4
    mark["t"] = time.perf_counter()
    comm.all_reduce(torch.ones(n), topo, "dp", tag="grad")
    if case != "shape":
        mark["t"] = time.perf_counter()
    if case == "extra" and rank == ODD:
        mark["t"] = time.perf_counter()
        comm.all_reduce(torch.ones(4), topo, "dp", tag="extra")
    if case == "compute" and rank == ODD:
        time.sleep(HANG_AFTER_S + 3.0)  # stuck in compute, past --hang-after
    if case == "save" and rank == 0:
        mark["t"] = time.perf_counter()
        with topo.ledger.phase("checkpoint"):
            comm.all_gather(torch.empty(9), torch.ones(3), topo, "dp", tag="checkpoint")
    fingerprint.check(topo, 2)


def main(out):
    init_distributed("cpu", timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    res = {"rank": rank, "cases": {}}
    for case, mode in CASES.items():
        topo = Topology(dp=dist.get_world_size(), timeout_s=TIMEOUT_S, check_collectives=mode)
        if case == "compute":
            topo.checks.hang_after_s, topo.checks.flight_dir = HANG_AFTER_S, f"{out}/flight"
        else:  # every rank that raises writes its record there (shardwise doctor reads them)
            topo.checks.flight_dir = f"{out}/flight_{case}"
        mark = {"t": time.perf_counter()}
        rec = {"type": None, "message": None}
        try:
            step_one(topo, rank, case, mark)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            rec.update(type=type(e).__name__, message=str(e),
                       mismatch=isinstance(e, CollectiveMismatch),
                       timeout=isinstance(e, CollectiveTimeout))
        rec["seconds"] = time.perf_counter() - mark["t"]
        res["cases"][case] = rec
        # the cases stay apart: the next one starts when every rank is done with this one (the
        # store, not a collective: a stuck collective of this case must not pair with it)
        store = dist.distributed_c10d._get_default_store()
        store.add(f"desync/{case}/done", 1)
        while int(store.add(f"desync/{case}/done", 0)) < dist.get_world_size():
            time.sleep(0.01)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)
    # leave together (rank 0 hosts the store, so it leaves last); stuck collectives of the
    # broken groups die with the processes
    store = dist.distributed_c10d._get_default_store()
    store.add("desync/exit", 1)
    if rank == 0:
        while int(store.add("desync/exit", 0)) < dist.get_world_size():
            time.sleep(0.01)
        time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
