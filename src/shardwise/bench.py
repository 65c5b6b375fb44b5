"""``shardwise bench``: explicit DP vs PyTorch DDP, and bucket overlap on vs off, in one run.

Variants are run alternately (A B C A B C …, ``--rounds`` times ``--steps`` steps each, after one
warm-up step per variant) on identical models and batches, so drift in the machine's speed hits
every variant alike. Reports the median step time, tokens/s, the explicit/torch ratio, and the
ledger's gradient bytes against 2(n−1)/n · gradient bytes. Writes ``bench.json`` and ``bench.md``
into ``--out``; rank 0 prints the Markdown table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from .bench_layout import alternate, make_run, make_workload, timed_step
from .config import TrainConfig
from .parallel.apply import parallelize
from .parallel.data import dp_grad_bytes_formula
from .topology import Topology, init_distributed

VARIANTS = {
    "explicit DP (overlap)": dict(engine="explicit", overlap=True),
    "explicit DP (no overlap)": dict(engine="explicit", overlap=False),
    "torch DDP": dict(engine="torch", overlap=True),
}


def bench_worker(args) -> int:
    import torch.distributed as dist

    init_distributed("cpu", 300)
    n = dist.get_world_size()
    topo = Topology(dp=n)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    global_batch = args.micro_batch * n
    runs = {name: make_run(lambda m, kw=kw: parallelize(m, topo, engine=kw["engine"],
                                                         bucket_mb=args.bucket_mb,
                                                         overlap=kw["overlap"]),
                           args.model, work, cfg, global_batch, n, topo.index("dp"))
            for name, kw in VARIANTS.items()}

    def one_step(r):
        dt, _ = timed_step(r, work, args.micro_batch, topo)
        r["grad_bytes_ledger"] = topo.ledger.step_bytes("grad")
        return dt

    for r in runs.values():  # warm-up
        one_step(r)
    alternate(runs, args.rounds, args.steps, one_step)  # A B C A B C …
    model = next(iter(runs.values()))["engine"].module
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    formula = dp_grad_bytes_formula(grad_bytes, n)
    tokens = global_batch * args.seq_len
    torch_median = statistics.median(runs["torch DDP"]["times"])
    results = []
    for name, r in runs.items():
        med = statistics.median(r["times"])
        results.append({"variant": name, "median_step_s": med, "tokens_per_s": tokens / med,
                        "vs_torch_ddp": med / torch_median,
                        "grad_bytes_ledger": r["grad_bytes_ledger"],
                        "grad_bytes_formula": formula, "steps_timed": len(r["times"])})
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        head = (f"DP bench: model {args.model} ({params / 1e6:.2f} M params), dp={n}, "
                f"{args.micro_batch} × {args.seq_len} tokens per rank per step, bucket "
                f"{args.bucket_mb} MB, {args.rounds} rounds × {args.steps} steps per variant, "
                f"torch {torch.__version__}")
        lines = [head, "", "| variant | median step (ms) | tokens/s | step time / DDP | "
                 "ledger grad bytes / formula |", "|---|---:|---:|---:|---:|"]
        for x in results:
            lines.append(f"| {x['variant']} | {x['median_step_s'] * 1e3:.1f} | "
                         f"{x['tokens_per_s']:,.0f} | {x['vs_torch_ddp']:.3f} | "
                         f"{x['grad_bytes_ledger'] / formula if formula else float('nan'):.4f} |")
        md = "\n".join(lines)
        print(md)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(md + "\n")
        (out / "bench.json").write_text(json.dumps({"config": vars(args) | {"dp": n},
                                                    "results": results}, indent=2, default=str))
    return 0
