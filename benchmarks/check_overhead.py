"""Step time with ``--check-collectives off | step | every``, alternating in one run (issue 18).

    OMP_NUM_THREADS=1 python -m shardwise.launch --nproc 2 benchmarks/check_overhead.py \\
        [--layout dp=2|tp=2] [--model small] [--steps 5] [--rounds 3]

One model (explicit engine, same seed and batches), one topology; the mode of its collective
checks is switched between blocks of ``--steps`` steps (off, step, every, off, step, every, …,
after one warm-up step per mode), so drift of the machine hits every mode alike. Prints, on
rank 0, the median step time per mode, its ratio to ``off``, the collectives per step, and the
median time of one step-boundary check alone (``fingerprint.check`` timed inside the step).
"""

import argparse
import statistics
import time

import torch.distributed as dist

from shardwise.comm import fingerprint
from shardwise.config import TrainConfig
from shardwise.parallel.apply import parallelize
from shardwise.parallel.layout import parse_layout
from shardwise.tools.bench.harness import make_run, make_workload, timed_step
from shardwise.topology import Topology, init_distributed

MODES = ("off", "step", "every")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="dp=2")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    a = ap.parse_args()
    init_distributed("cpu")
    lay = parse_layout(a.layout)
    topo = Topology(lay.pp, lay.dp, lay.tp)
    cfg = TrainConfig(model=a.model, seq_len=a.seq_len, micro_batch=a.micro_batch)
    work = make_workload(a.model, a.seq_len, 4096, 4096)
    run = make_run(lambda m: parallelize(m, topo, lay), a.model, work,
                   cfg, a.micro_batch * lay.dp, lay.dp, topo.index("dp"))
    checks = topo.checks
    check_s: list[float] = []
    orig = checks.check

    def timed_check(*args, **kw):  # the boundary check alone
        t0 = time.perf_counter()
        orig(*args, **kw)
        if checks.mode != "off":
            check_s.append(time.perf_counter() - t0)

    checks.check = timed_check
    times = {m: [] for m in MODES}
    per_step = {}
    for mode in MODES:  # warm-up, one step each
        checks.mode = mode
        timed_step(run, work, a.micro_batch, topo)
    for _ in range(a.rounds):
        for mode in MODES:
            checks.mode = mode
            for _ in range(a.steps):
                before = sum(checks.seq.values())
                dt, _res = timed_step(run, work, a.micro_batch, topo)
                times[mode].append(dt)
                if mode != "off":
                    per_step[mode] = sum(checks.seq.values()) - before
    checks.mode = "step"
    fingerprint.check(topo)  # the last block's collectives agree too
    if dist.get_rank() == 0:
        off = statistics.median(times["off"])
        print(f"check overhead: {a.model}, {a.layout}, {a.rounds} rounds × {a.steps} steps per "
              f"mode, {a.micro_batch} × {a.seq_len} tokens per rank per step")
        for mode in MODES:
            med = statistics.median(times[mode])
            n = per_step.get(mode, per_step.get("step", 0))
            print(f"  {mode:5s}: median step {med * 1e3:8.2f} ms, / off {med / off:6.3f}, "
                  f"{n} collectives per step")
        print(f"  one step-boundary check (step and every): median "
              f"{statistics.median(check_s) * 1e3:.2f} ms over {len(check_s)} checks")


if __name__ == "__main__":
    main()
