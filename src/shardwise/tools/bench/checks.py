"""``shardwise bench --suite checks``: step time with ``--check-collectives off | step | every``.

For each layout (dp=N, tp=N and pp=N over the N ranks, explicit engine, model ``args.model``),
one model and one topology; the mode of its collective checks is switched between blocks of
``args.steps`` steps (off, step, every, off, …, ``args.rounds`` times, after one warm-up step
per mode), so drift of the machine hits every mode alike. Rank 0 prints, per layout and mode,
the median step time, its ratio to ``off``, the collectives and point-to-point messages per
step, and the median time of one step-boundary check alone (``fingerprint.check`` timed inside
the step); it writes ``bench_checks.{md,json}`` into ``args.out``. The pipeline layout runs
``max(4, N)`` microbatches of ``args.micro_batch // 2`` sequences per step.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist

from ...comm import fingerprint
from ...config import TrainConfig
from ...parallel.apply import parallelize
from ...parallel.layout import parse_layout
from ...topology import Topology, init_distributed
from .harness import make_run, make_workload, timed_step

MODES = ("off", "step", "every")


def measure(layout: str, model: str, steps: int, rounds: int, seq_len: int,
            micro_batch: int) -> dict:
    """Alternate the three modes on one ``layout`` (verify's syntax, e.g. "tp=2"); every rank
    calls it. Returns {mode: {"median_step_s", "ratio", "collectives", "messages"}} and
    "check_s" (the median of one boundary check, s)."""
    lay = parse_layout(layout)
    topo = Topology(lay.pp, lay.dp, lay.tp)
    m = max(4, lay.pp) if lay.pp > 1 else 1
    mb = max(1, micro_batch // 2) if lay.pp > 1 else micro_batch
    cfg = TrainConfig(model=model, seq_len=seq_len, micro_batch=mb, pp=lay.pp,
                      microbatches=m if lay.pp > 1 else 0)
    work = make_workload(model, seq_len, 4096, 4096)
    # m microbatches of mb sequences per rank and step (timed_step cuts the batch into them)
    run = make_run(lambda mod: parallelize(mod, topo, lay), model, work, cfg, mb * m * lay.dp,
                   lay.dp, topo.index("dp"))
    checks = topo.checks
    check_s: list[float] = []
    orig = checks.check

    def timed_check(*a, **kw):  # the boundary check alone
        t0 = time.perf_counter()
        orig(*a, **kw)
        if checks.mode != "off":
            check_s.append(time.perf_counter() - t0)

    checks.check = timed_check
    times = {mode: [] for mode in MODES}
    per_step: dict = {}
    for mode in MODES:  # warm-up, one step each
        checks.mode = mode
        timed_step(run, work, mb, topo)
    for _ in range(rounds):
        for mode in MODES:
            checks.mode = mode
            for _ in range(steps):
                before = (sum(checks.seq.values()), sum(checks.sent.values()))
                dt, _res = timed_step(run, work, mb, topo)
                times[mode].append(dt)
                if mode != "off":
                    per_step[mode] = (sum(checks.seq.values()) - before[0],
                                      sum(checks.sent.values()) - before[1])
    checks.mode = "step"
    fingerprint.check(topo)  # the last block's collectives agree too
    off = statistics.median(times["off"])
    out = {mode: {"median_step_s": statistics.median(times[mode]),
                  "ratio": statistics.median(times[mode]) / off,
                  "collectives": per_step.get(mode, per_step.get("step", (0, 0)))[0],
                  "messages": per_step.get(mode, per_step.get("step", (0, 0)))[1]}
           for mode in MODES}
    out["check_s"] = statistics.median(check_s) if check_s else 0.0
    return out


def bench_checks(args) -> int:
    """The suite's worker body (every rank): :func:`measure` on dp=N, tp=N, pp=N; rank 0
    prints and writes the table."""
    init_distributed("cpu", getattr(args, "timeout", 300.0))
    n = dist.get_world_size()
    layouts = getattr(args, "check_layouts", None) or [f"dp={n}", f"tp={n}", f"pp={n}"]
    rows = {lay: measure(lay, args.model, args.steps, args.rounds, args.seq_len,
                         args.micro_batch) for lay in layouts}
    if dist.get_rank() != 0:
        return 0
    lines = [f"check overhead: {args.model}, {args.rounds} rounds × {args.steps} steps per mode",
             "", "| layout | collectives / step | messages sent / step (rank 0) | off (median "
             "step) | step / off | every / off | one check (median) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for lay, r in rows.items():
        lines.append(f"| {lay} | {r['step']['collectives']} | {r['step']['messages']} | "
                     f"{r['off']['median_step_s'] * 1e3:.1f} ms | {r['step']['ratio']:.3f} | "
                     f"{r['every']['ratio']:.3f} | {r['check_s'] * 1e3:.1f} ms |")
    text = "\n".join(lines)
    print(text, flush=True)
    out = Path(getattr(args, "out", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_checks.md").write_text(text + "\n")
    (out / "bench_checks.json").write_text(json.dumps(rows, indent=1))
    return 0
