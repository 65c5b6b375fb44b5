"""Worker for tests/test_desync.py, run by the local launcher (``python -m shardwise.launch``),
3 ranks, one fault per world (the fault ends it), ``--check-collectives step``, a
process-group timeout of TIMEOUT_S seconds, flight records in ``<out>/flight``. Argument:
``<out> <mode>``.

``shape``  (b) in step 1 rank 1 all-reduces float32 [8] over dp (tag "grad") where ranks 0
           and 2 all-reduce float32 [4]: on gloo a rank that receives 8 floats where it
           expects 4 aborts in gloo's own size check (SIGABRT) before any check of ours can
           speak; the launcher diagnoses it from the ranks' positions in its store.
``kill``   (f) steps 1–3 each all-reduce "grad" then "loss" (float32 [4] over dp, collectives
           #2k−1 and #2k of step k); in step 3 rank 2 SIGKILLs itself between the two.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import fingerprint
from shardwise.topology import Topology, init_distributed

TIMEOUT_S = 60.0


def main(out, mode):
    init_distributed("cpu", timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    with open(f"{out}/pid{rank}", "w") as f:  # the test checks that no rank outlives the run
        f.write(str(os.getpid()))
    topo = Topology(dp=dist.get_world_size(), timeout_s=TIMEOUT_S, check_collectives="step")
    topo.checks.flight_dir = f"{out}/flight"
    for step in range(1, 4):
        fingerprint.check(topo, step)
        n = 8 if (mode == "shape" and rank == 1) else 4
        comm.all_reduce(torch.ones(n), topo, "dp", tag="grad")
        if mode == "kill" and step == 3 and rank == 2:
            print(f"[test] rank {rank}: SIGKILL in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(torch.ones(4), topo, "dp", tag="loss")
    fingerprint.check(topo, 4)
    print(f"[test] rank {rank}: no fault took effect", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
