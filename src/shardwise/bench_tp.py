"""TP benchmark worker: explicit vs DTensor TP step time; activation bytes with SP vs without.

Run inside a world of tp ranks (``tp = WORLD_SIZE``; dp = pp = 1). Four variants — explicit TP,
DTensor TP, each without and with SP — run alternately (A B C D A B C D …, ``rounds`` times
``steps`` timed steps each, after one warm-up step per variant) on identical models and batches,
so drift in the machine's speed hits all alike. Reported per variant:

* median step time and tokens/s; explicit / DTensor step-time ratio at the same SP setting
  (target ≤ 1.0, docs/architecture.md);
* ledger bytes per step / :func:`~shardwise.parallel.tensor.tp_step_bytes_formula` (the DTensor
  variants book their collectives during the warm-up step only: the booking dispatch mode costs
  Python time per op, so the timed steps run without it);
* activation bytes: bytes of the tensors autograd saves for backward in one forward of one
  micro-batch on this rank (``torch.autograd.graph.saved_tensors_hooks``; storages counted once,
  parameters excluded). SP keeps the norm inputs (and dropout masks) on s/n positions, so it
  should be smaller (Korthikanti et al. 2022, §4.2.2, Table 2: per layer sbh(10 + 24/t + 5as/ht)
  → sbh(34/t + 5as/ht) for their GPT in fp16; ours is a fp32 Llama, so compare the ratio, not
  the formula).

Writes ``bench_tp.json`` and ``bench_tp.md`` into ``out``; rank 0 prints the Markdown table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from .bench_layout import alternate, make_run, make_workload, timed_step
from .config import TrainConfig
from .models import build_model
from .parallel.dtensor_tp import parallelize_tensor_dtensor
from .parallel.tensor import parallelize_tensor, tp_step_bytes_formula, validate_tp
from .topology import Topology, init_distributed

VARIANTS = {
    "explicit TP": dict(kind="explicit", sp=False),
    "DTensor TP": dict(kind="torch", sp=False),
    "explicit TP+SP": dict(kind="explicit", sp=True),
    "DTensor TP+SP": dict(kind="torch", sp=True),
}


def activation_bytes(engine, batch: dict) -> int:
    """Bytes autograd saves for backward in one forward of ``batch`` on this rank (each storage
    once; parameter storages excluded). Runs the forward and the loss, then discards the graph."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def storages(t):  # DTensor and funcol's AsyncCollectiveTensor wrap plain tensors
        if is_traceable_wrapper_subclass(t):
            for attr in t.__tensor_flatten__()[0]:
                yield from storages(getattr(t, attr))
        elif isinstance(t, torch.Tensor):
            yield t.untyped_storage()

    params = {st.data_ptr() for p in engine.module.parameters() for st in storages(p)}
    seen: dict[int, int] = {}

    def pack(t):
        for st in storages(t):
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.loss_sum_and_count(batch)
    return sum(seen.values())


def bench_tp_worker(args) -> int:
    """``args``: ``model`` (preset), ``steps``, ``rounds``, ``seq_len``, ``micro_batch``
    (sequences per step per rank), ``out``; tp = world size. Returns 0."""
    import torch.distributed as dist

    init_distributed("cpu", 300)
    tp = dist.get_world_size()
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    mcfg = build_model(args.model, vocab_size=work.vocab_size).config
    validate_tp(mcfg, tp, True, args.seq_len)  # before any collective
    topo = Topology(tp=tp)
    runs = {}
    for name, kw in VARIANTS.items():
        wrap = (lambda m, sp=kw["sp"]: parallelize_tensor(m, topo, sp=sp)) \
            if kw["kind"] == "explicit" else \
            (lambda m, sp=kw["sp"]: parallelize_tensor_dtensor(m, topo, sp=sp))
        runs[name] = make_run(wrap, args.model, work, cfg, args.micro_batch, 1, 0) | kw

    def one_step(r):
        return timed_step(r, work, args.micro_batch, topo)[0]

    (probe,) = work.batches(torch.arange(args.micro_batch), args.micro_batch)
    for r in runs.values():  # warm-up step, booked; activation bytes; then DTensor unbooked
        one_step(r)
        r["ledger_bytes"] = topo.ledger.step_bytes()
        r["activation_bytes"] = activation_bytes(r["engine"], probe)
        if r["kind"] == "torch":
            r["engine"].book_collectives = False
    alternate(runs, args.rounds, args.steps, one_step)  # A B C D A B C D …
    tokens = args.micro_batch * args.seq_len
    results = []
    for name, r in runs.items():
        med = statistics.median(r["times"])
        twin = "DTensor TP+SP" if r["sp"] else "DTensor TP"
        formula = tp_step_bytes_formula(mcfg, args.micro_batch, args.seq_len, tp, r["sp"])
        results.append({"variant": name, "median_step_s": med, "tokens_per_s": tokens / med,
                        "vs_dtensor": med / statistics.median(runs[twin]["times"]),
                        "ledger_bytes": r["ledger_bytes"], "formula_bytes": formula["total"],
                        "activation_bytes": r["activation_bytes"],
                        "steps_timed": len(r["times"])})
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in build_model(args.model, vocab_size=4096).parameters())
        head = (f"TP bench: model {args.model} ({params / 1e6:.2f} M params), tp={tp}, "
                f"{args.micro_batch} × {args.seq_len} tokens per step, {args.rounds} rounds × "
                f"{args.steps} steps per variant, torch {torch.__version__}")
        lines = [head, "", "| variant | median step (ms) | tokens/s | step time / DTensor | "
                 "ledger bytes / formula | activation bytes (1 micro-batch) |",
                 "|---|---:|---:|---:|---:|---:|"]
        for x in results:
            lines.append(f"| {x['variant']} | {x['median_step_s'] * 1e3:.1f} | "
                         f"{x['tokens_per_s']:,.0f} | {x['vs_dtensor']:.3f} | "
                         f"{x['ledger_bytes'] / x['formula_bytes']:.4f} | "
                         f"{x['activation_bytes']:,} |")
        by = {x["variant"]: x for x in results}
        for eng in ("explicit TP", "DTensor TP"):
            lines.append(f"\n{eng}: activation bytes with SP / without = "
                         f"{by[eng + '+SP']['activation_bytes'] / by[eng]['activation_bytes']:.3f}")
        md = "\n".join(lines)
        print(md)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tp.md").write_text(md + "\n")
        (out / "bench_tp.json").write_text(json.dumps({"config": vars(args) | {"tp": tp},
                                                       "results": results}, indent=2,
                                                      default=str))
    return 0
