"""Worker for tests/test_run_safety.py: a non-finite state is never checkpointed (2 ranks, dp=2).

Train one step and save it (finite: committed), then poison AdamW's ``exp_avg`` of one parameter
on rank 1 only and save again: the all-reduced flag must make *both* ranks refuse, with the same
:class:`~shardwise.checkpoint.DivergedError`, and write nothing. Each rank dumps
``<out>/nonfinite_rank<r>.json``: {"error_type", "message"}; the pytest process reads the folder.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.checkpoint import Checkpointer
from shardwise.train.optim import build_optimizer, build_scheduler
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

CFG = TrainConfig(model="tiny", lr=3e-3, warmup_steps=1, steps=4, grad_clip=1.0, seed=0)


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    topo = Topology(1, 2, 1, timeout_s=60)
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    torch.manual_seed(0)
    engine = parallelize(build_model("tiny", vocab_size=67), topo, Layout(dp=2), seed=0)
    opt = build_optimizer(engine, CFG)
    sched = build_scheduler(opt, CFG)
    sampler = work.sampler(8, topo.size("dp"), topo.index("dp"), CFG.seed)
    ck = Checkpointer(out, topo)
    result = {"error_type": None, "message": None}
    for step in (1, 2):
        train_step(engine, work.batches(sampler.next_local_batch(), 2), opt, topo,
                   max_norm=CFG.grad_clip, scheduler=sched)
        if step == 2 and rank == 1:  # one rank's optimizer state goes non-finite
            state = next(iter(opt.state.values()))
            state["exp_avg"].view(-1)[0] = float("nan")
        try:
            ck.save(step, engine, opt, scheduler=sched, sampler=sampler)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            result = {"error_type": type(e).__name__, "message": str(e)}
    ck.close()
    Path(out, f"nonfinite_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
