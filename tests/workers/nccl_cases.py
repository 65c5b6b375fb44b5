"""Worker for tests/test_nccl_hazards.py: 4 gloo ranks build two layouts' topologies and record
(1) the order in which every process group was created (``Topology.group_record``), (2) what
happens when a planted batch_isend_irecv claim meets a group our sends already use, and (3)
what a planted CPU tensor does when the topology's device is an accelerator, and (4) the gloo
event-loop threads its sub-groups started. Each rank dumps
``<out>/rank<r>.pt``."""

import sys

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm.groups import NcclHazard, claim_p2p, p2p_style
from shardwise.topology import Topology, init_distributed


def _threads_named(name: str) -> int | None:
    """Threads of this process named ``name`` (Linux /proc; None elsewhere)."""
    import os

    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                count += f.read().strip() == name
        except OSError:  # the thread ended meanwhile
            pass
    return count


def main(out):
    init_distributed("cpu", timeout_s=60)
    pp2 = Topology(pp=2, dp=2, tp=1, timeout_s=60)
    tp2 = Topology(pp=1, dp=2, tp=2, ep=2, timeout_s=60)
    r = pp2.rank
    res = {"records": [pp2.group_record, tp2.group_record]}
    # CPU sub-groups share this process's one gloo device: one TCP event-loop thread for all of
    # them (comm/groups.py), not one per group; the default group keeps a device of its own
    res["backend"] = dist.get_backend(tp2.group("dp"))
    res["groups_joined"] = sum(r in line for _, line in pp2.group_record + tp2.group_record)
    res["loop_threads"] = _threads_named("gloo_tcp_loop")

    # our sends claim "single" on pp; PyTorch's pipelining gets its own communicator
    x = torch.full((3,), float(r))
    if pp2.index("pp") == 0:
        comm.send(x, pp2, "pp", 1, tag="nccl")
    else:
        comm.recv(x, pp2, "pp", 0, tag="nccl")
    res["recv"] = x.clone()
    res["pp_style"] = p2p_style(pp2.group("pp"))
    batch = pp2.p2p_group("pp", "batch")
    res["batch_is_own_group"] = batch is not pp2.group("pp")
    res["batch_style"] = p2p_style(batch)
    try:  # planted mix: batch_isend_irecv on the communicator our sends use
        claim_p2p(pp2.group("pp"), "batch")
        res["mix"] = "accepted"
    except NcclHazard as e:
        res["mix"] = str(e)

    # planted CPU tensor on an accelerator topology: refused on every rank before the collective
    real = tp2.device
    tp2.device = torch.device("cuda", 0)  # never used to allocate: the check runs first
    try:
        comm.all_reduce(torch.ones(2), tp2, "dp", tag="nccl_scalar")
        res["device_check"] = "accepted"
    except NcclHazard as e:
        res["device_check"] = str(e)
    tp2.device = real
    y = torch.ones(2)
    comm.all_reduce(y, tp2, "dp", tag="after")  # the world is still in step
    res["after"] = y
    torch.save(res, f"{out}/rank{r}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
