"""ZeRO-3 benchmark: explicit ZeRO-3 (prefetch on, prefetch off) vs PyTorch FSDP2, in one run.

Variants run alternately (A B C A B C …, ``rounds`` times ``steps`` steps each, after one warm-up
step per variant) on identical models and batches, so drift in the machine's speed hits every
variant alike. Reported per variant: median step time, tokens/s, step time relative to FSDP2, the
ledger's bytes per step (gradient reduce-scatters + parameter all-gathers + the grad-norm scalar)
against :func:`shardwise.parallel.zero.zero_step_bytes_formula`, model-state bytes per rank against
:func:`~shardwise.parallel.zero.zero_memory_formula`, and (explicit) the peak of gathered
parameters. Writes ``bench_zero.md`` and ``bench_zero.json`` into ``out``; rank 0 prints the table.

Standalone: ``python -m shardwise.bench_zero [--nproc 2] [--model small] [--steps 5]
[--rounds 3] [--seq-len 128] [--micro-batch 8] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from .bench_layout import alternate, make_run, make_workload, timed_step
from .config import TrainConfig
from .parallel.fsdp import TorchZero
from .parallel.zero import ZeroDataParallel
from .topology import Topology, init_distributed

VARIANTS = {
    "explicit ZeRO-3 (prefetch)": lambda m, topo: ZeroDataParallel(m, topo, 3, prefetch=True),
    "explicit ZeRO-3 (no prefetch)": lambda m, topo: ZeroDataParallel(m, topo, 3, prefetch=False),
    "FSDP2 (ZeRO-3)": lambda m, topo: TorchZero(m, topo, 3),
}
BASELINE = "FSDP2 (ZeRO-3)"


def bench_zero(args) -> int:
    """Worker body (one rank of an ``args.nproc``-rank world). ``args``: ``model``, ``steps``,
    ``rounds``, ``seq_len``, ``micro_batch``, ``out``. Returns 0."""
    import torch.distributed as dist

    init_distributed("cpu", 300)
    n = dist.get_world_size()
    topo = Topology(dp=n)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    global_batch = args.micro_batch * n
    runs = {name: make_run(lambda m, make=make: make(m, topo), args.model, work, cfg,
                           global_batch, n, topo.index("dp"))
            for name, make in VARIANTS.items()}

    def one_step(r):
        dt, _ = timed_step(r, work, args.micro_batch, topo, zero_grad=False)
        r["bytes"] = {t: topo.ledger.step_bytes(t) for t in ("grad", "param", "grad_norm")}
        r["state"] = r["engine"].model_state_bytes(r["opt"])
        return dt

    for r in runs.values():  # warm-up
        one_step(r)
    alternate(runs, args.rounds, args.steps, one_step)  # A B C A B C …
    base = statistics.median(runs[BASELINE]["times"])
    tokens = global_batch * args.seq_len
    results = []
    for name, r in runs.items():
        med = statistics.median(r["times"])
        formula = r["engine"].step_bytes_formula(1)
        ledger = sum(r["bytes"].values())
        mem = r["engine"].memory_formula()["total"]
        results.append({
            "variant": name, "median_step_s": med, "tokens_per_s": tokens / med,
            "vs_fsdp2": med / base, "ledger_bytes": ledger, "formula_bytes": formula["total"],
            "ledger_by_tag": r["bytes"], "model_state_bytes": r["state"],
            "memory_formula_bytes": mem, "gathered_params_peak": r["state"].get(
                "gathered_params_peak"), "steps_timed": len(r["times"])})
    if dist.get_rank() == 0:
        psi = runs[BASELINE]["engine"].numel
        lines = [f"ZeRO-3 bench: model {args.model} ({psi / 1e6:.2f} M params), dp={n}, "
                 f"{args.micro_batch} × {args.seq_len} tokens per rank per step, {args.rounds} "
                 f"rounds × {args.steps} steps per variant, torch {torch.__version__}", "",
                 "| variant | median step (ms) | tokens/s | step time / FSDP2 | ledger bytes / "
                 "formula | model state / formula | gathered peak (MiB) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for x in results:
            peak = x["gathered_params_peak"]
            lines.append(
                f"| {x['variant']} | {x['median_step_s'] * 1e3:.1f} | {x['tokens_per_s']:,.0f} "
                f"| {x['vs_fsdp2']:.3f} | {x['ledger_bytes'] / x['formula_bytes']:.4f} "
                f"| {x['model_state_bytes']['total'] / x['memory_formula_bytes']:.4f} "
                f"| {'—' if peak is None else f'{peak / 2**20:.2f}'} |")
        md = "\n".join(lines)
        print(md)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_zero.md").write_text(md + "\n")
        (out / "bench_zero.json").write_text(json.dumps(
            {"config": vars(args) | {"dp": n}, "results": results}, indent=2, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shardwise.bench_zero", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="A B C A B C … rounds")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results")
    return p


def main(argv: list[str] | None = None) -> int:
    from .launch import is_worker, spawn

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if is_worker():
        code = bench_zero(args)
        import torch.distributed as dist

        dist.destroy_process_group()
        return code
    return spawn(argv, args.nproc, program=[sys.executable, "-m", "shardwise.bench_zero"])


if __name__ == "__main__":
    sys.exit(main())
