"""Pipeline benchmark and trace: measured bubble vs the formula, explicit vs PyTorch pipelining.

``bench_pp_worker(args)`` (run on every rank of a spawned world of ``args.pp`` ranks):

1. **Bubble**: the explicit engine, 1F1B (or ``args.schedule``), m = ``args.microbatches``;
   every rank timestamps its actions (``engine.timeline``); the timelines are gathered and the
   measured bubble 1 − Σ busy / (p · makespan) is compared with (p−1)/(m+p−1) (Narayanan et al.
   2021 §2.2.1), median over the timed steps. Target: measured / formula ≤ 1.10.
2. **Step time**: for each schedule, the explicit engine and ``--engine torch``
   (torch.distributed.pipelining), alternating A B A B … on identical models and batches, median
   step time and the ratio explicit / torch.

``trace_pipeline(engine, topo, out_dir)`` gathers one step's action timestamps from every pp rank
and writes ``<name>.png`` (ranks × time, one colour per action kind) and ``<name>.trace.json``
(Chrome trace, opens in ui.perfetto.dev). ``shardwise trace --pp 4 --schedule 1f1b
--microbatches 8`` calls it after its step.

Standalone: ``python -m shardwise.bench_pp [bench|trace] --pp 4 --microbatches 8`` spawns the
ranks itself (gloo, localhost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from .bench_layout import alternate, make_run, timed_step
from .config import TrainConfig
from .models import build_model
from .parallel.pipeline import SCHEDULES, bubble_formula, build_pipeline, validate_pp
from .parallel.pipeline.runtime import gather_timeline
from .topology import Topology, init_distributed
from .train.workload import SyntheticLMWorkload
from .viz.timeline import bubble_of, trace_pipeline


def _setup(args, p):
    work = SyntheticLMWorkload(vocab_size=args.vocab, seq_len=args.seq_len,
                               num_train=max(256, args.micro_batch * args.microbatches * 4),
                               num_val=1, seed=0)
    cfg = TrainConfig(model=args.model, lr=1e-4)
    return work, cfg


def _make(args, topo, work, cfg, engine, schedule):
    return make_run(lambda m: build_pipeline(m, topo, engine=engine, schedule=schedule,
                                             microbatches=args.microbatches),
                    args.model, work, cfg, args.micro_batch * args.microbatches, 1, 0,
                    n_layers=args.n_layers)


def _step(run, work, args, topo):
    return timed_step(run, work, args.micro_batch, topo)[0]


def bench_pp_worker(args) -> int:
    """Run the benchmark on this rank (world size = args.pp); rank 0 prints the Markdown table
    and writes ``bench_pp.{md,json}`` into ``args.out``."""
    import torch.distributed as dist

    init_distributed("cpu", 300)
    p = dist.get_world_size()
    validate_pp(args.n_layers, p, args.schedule, args.microbatches,
                args.micro_batch * args.microbatches)
    topo = Topology(pp=p)
    work, cfg = _setup(args, p)
    # 1. measured bubble of the explicit engine
    run = _make(args, topo, work, cfg, "explicit", args.schedule)
    bubbles = []
    _step(run, work, args, topo)  # warm-up
    for _ in range(args.steps):
        _step(run, work, args, topo)
        bubbles.append(bubble_of(gather_timeline(run["engine"], topo), p))
    if dist.get_rank() == 0:
        trace_pipeline(run["engine"], topo, args.out, name=f"bench_{args.schedule}_timeline")
    else:
        trace_pipeline(run["engine"], topo, args.out)
    v = run["engine"].v
    formula = bubble_formula(args.schedule, p, args.microbatches, v)
    measured = statistics.median(bubbles)
    # 2. explicit vs torch, per schedule, alternating
    rows = []
    for schedule in () if args.bubble_only else SCHEDULES:
        try:
            validate_pp(args.n_layers, p, schedule, args.microbatches)
        except Exception as e:  # e.g. interleaving with an m it cannot split
            rows.append({"schedule": schedule, "skipped": str(e)})
            continue
        runs = {e: _make(args, topo, work, cfg, e, schedule) for e in ("explicit", "torch")}
        for r in runs.values():
            _step(r, work, args, topo)  # warm-up
        alternate(runs, args.rounds, args.steps, lambda r: _step(r, work, args, topo))
        med = {e: statistics.median(r["times"]) for e, r in runs.items()}
        rows.append({"schedule": schedule, "explicit_s": med["explicit"], "torch_s": med["torch"],
                     "ratio": med["explicit"] / med["torch"],
                     "steps_timed": len(runs["explicit"]["times"])})
    if dist.get_rank() == 0:
        params = sum(pp.numel() for pp in build_model(args.model, vocab_size=work.vocab_size,
                                                      n_layers=args.n_layers).parameters())
        lines = [f"PP bench: model {args.model} ({params / 1e6:.2f} M params, {args.n_layers} "
                 f"layers), pp={p}, m={args.microbatches} microbatches of {args.micro_batch} × "
                 f"{args.seq_len} tokens, torch {torch.__version__}, "
                 f"{torch.get_num_threads()} thread(s) per rank",
                 "",
                 f"Bubble ({args.schedule}, explicit engine, median of {len(bubbles)} steps): "
                 f"measured {measured:.4f}, formula (p−1)/(m+p−1) = {formula:.4f}, "
                 f"measured / formula = {measured / formula:.3f} (target ≤ 1.10)",
                 "",
                 "| schedule | explicit median step (ms) | torch median step (ms) | "
                 "explicit / torch |", "|---|---:|---:|---:|"]
        for r in rows:
            if "skipped" in r:
                lines.append(f"| {r['schedule']} | skipped: {r['skipped']} | | |")
            else:
                lines.append(f"| {r['schedule']} | {r['explicit_s'] * 1e3:.1f} | "
                             f"{r['torch_s'] * 1e3:.1f} | {r['ratio']:.3f} |")
        md = "\n".join(lines)
        print(md)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_pp.md").write_text(md + "\n")
        (out / "bench_pp.json").write_text(json.dumps({
            "config": vars(args) | {"pp": p}, "bubble": {"schedule": args.schedule,
                                                          "measured": measured,
                                                          "per_step": bubbles,
                                                          "formula": formula,
                                                          "ratio": measured / formula},
            "step_time": rows}, indent=2, default=str))
    return 0


def trace_pp_worker(args) -> int:
    """One training step of the explicit engine; rank 0 writes the timeline PNG + trace and
    prints the measured bubble next to the formula."""
    import torch.distributed as dist

    init_distributed("cpu", 300)
    p = dist.get_world_size()
    validate_pp(args.n_layers, p, args.schedule, args.microbatches,
                args.micro_batch * args.microbatches)
    topo = Topology(pp=p)
    work, cfg = _setup(args, p)
    run = _make(args, topo, work, cfg, "explicit", args.schedule)
    _step(run, work, args, topo)  # warm-up
    _step(run, work, args, topo)
    info = trace_pipeline(run["engine"], topo, args.out,
                          name=f"trace_{args.schedule}_pp{p}_m{args.microbatches}")
    if info is not None:
        formula = bubble_formula(args.schedule, p, args.microbatches, run["engine"].v)
        print(f"trace: {info['png']} and {info['trace']}; measured bubble {info['bubble']:.4f}, "
              f"formula {formula:.4f}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench_pp",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("bench", "trace"), nargs="?", default="bench")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--model", default="small")
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bubble-only", action="store_true",
                    help="measure the bubble only (skip explicit vs torch step times)")
    ap.add_argument("--out", default="benchmarks/results")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from .launch import is_worker, spawn

    args = parse_args(argv)
    if not is_worker():
        return spawn(sys.argv[1:] if argv is None else list(argv), args.pp,
                     program=[sys.executable, "-m", "shardwise.bench_pp"])
    return (bench_pp_worker if args.command == "bench" else trace_pp_worker)(args)


if __name__ == "__main__":
    sys.exit(main())
