"""``shardwise bench --suite dp | zero | tp | pp``: one strategy, our engine against PyTorch's.

Each suite is a worker body (every rank of the world ``shardwise bench`` spawns; ``args`` are
its flags, :mod:`shardwise.cli` is the only parser). Its variants are built through
:func:`~shardwise.parallel.apply.parallelize` from the same seed, so all start from identical
weights and see the same batches, and are timed alternately (A B C A B C …, ``args.rounds``
times ``args.steps`` steps each, after one warm-up step per variant: :func:`.harness.alternate`),
so drift in the machine's speed hits every variant alike. Rank 0 prints the Markdown table and
writes it with the numbers into ``args.out`` (:func:`.harness.write_report`):

========  =========================================================  ===================
suite     variants                                                   files
========  =========================================================  ===================
``dp``    explicit DP with and without bucket overlap, DDP           ``bench.{md,json}``
``zero``  explicit ZeRO-3 with and without prefetch, FSDP2           ``bench_zero.…``
``tp``    explicit TP and DTensor TP, each without and with SP       ``bench_tp.…``
``pp``    each schedule: measured bubble vs simulator vs formula;  ``bench_pp.…`` and the
          explicit vs ``torch.distributed.pipelining``               bubble's timeline
``collectives``  every op × size × n: native, ring, tree          ``bench_collectives.…``
          (nccl-tests columns, α-β fit; :mod:`.collectives`)         (+ ``.png``)
``zero-collectives``  ZeRO-2/3 with ``--collectives`` native vs   ``bench_zero_collectives_dp<n>.…``
          ring, alternating
``checks``  ``--check-collectives`` off, step, every on dp, tp, pp     ``bench_checks.…``
          (:mod:`.checks`)
========  =========================================================  ===================
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from ...config import TrainConfig
from ...models import build_model
from ...parallel.apply import Layout, parallelize
from ...parallel.dp import dp_grad_bytes_formula
from ...parallel.pp import SCHEDULES, bubble_formula, build_schedule, simulate, validate_pp
from ...parallel.tp import TPOptions, tp_step_bytes_formula, validate_tp
from ...report.timeline import gather_timeline
from ...topology import Topology, init_distributed
from ...train.workload import SyntheticLMWorkload
from ...viz.timeline import bubble_of
from ..trace import trace_pipeline
from .checks import bench_checks
from .collectives import bench_collectives, bench_zero_collectives
from .harness import alternate, make_run, make_workload, timed_step, write_report


def _world() -> int:
    """Join the spawned world (gloo on CPU, 300 s collective timeout); its size."""
    init_distributed("cpu", 300)
    return dist.get_world_size()


def _median_table(ratio_title: str, ratio_key: str, *extra):
    """The columns every suite's table starts with: variant, median step, tokens/s, a ratio."""
    return [("variant", "---", lambda x: x["variant"]),
            ("median step (ms)", "---:", lambda x: f"{x['median_step_s'] * 1e3:.1f}"),
            ("tokens/s", "---:", lambda x: f"{x['tokens_per_s']:,.0f}"),
            (ratio_title, "---:", lambda x: f"{x[ratio_key]:.3f}"), *extra]


# ---------------------------------------------------------------- dp: explicit DP vs DDP

DP_VARIANTS = {
    "explicit DP (overlap)": dict(engine="explicit", overlap=True),
    "explicit DP (no overlap)": dict(engine="explicit", overlap=False),
    "torch DDP": dict(engine="torch", overlap=True),
}


def bench_dp(args) -> int:
    """Explicit DP (bucket overlap on, off) vs PyTorch DDP over dp = world size. Reports the
    median step time, tokens/s, step time / DDP, and the ledger's gradient bytes against
    :func:`~shardwise.parallel.dp.dp_grad_bytes_formula` (2(n−1)/n · gradient bytes, a ring
    all-reduce). ``args``: ``model``, ``steps``, ``rounds``, ``seq_len``, ``micro_batch``
    (sequences per rank per step), ``bucket_mb``, ``out``."""
    n = _world()
    topo = Topology(dp=n, collectives=args.collectives)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    global_batch = args.micro_batch * n
    runs = {name: make_run(lambda m, kw=kw: parallelize(m, topo, engine=kw["engine"],
                                                         bucket_mb=args.bucket_mb,
                                                         overlap=kw["overlap"]),
                           args.model, work, cfg, global_batch, n, topo.index("dp"))
            for name, kw in DP_VARIANTS.items()}

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
        ratio = ("ledger grad bytes / formula", "---:", lambda x: format(
            x["grad_bytes_ledger"] / formula if formula else float("nan"), ".4f"))
        write_report(results, _median_table("step time / DDP", "vs_torch_ddp", ratio),
                     args.out, "bench", head=head,
                     data={"config": vars(args) | {"dp": n}, "results": results})
    return 0


# ---------------------------------------------------------------- zero: explicit ZeRO-3 vs FSDP2

ZERO_VARIANTS = {
    "explicit ZeRO-3 (prefetch)": dict(engine="explicit", prefetch=True),
    "explicit ZeRO-3 (no prefetch)": dict(engine="explicit", prefetch=False),
    "FSDP2 (ZeRO-3)": dict(engine="torch"),
}
ZERO_BASELINE = "FSDP2 (ZeRO-3)"


def bench_zero(args) -> int:
    """Explicit ZeRO-3 (prefetch on, off) vs PyTorch FSDP2 over dp = world size. Reports per
    variant: median step time, tokens/s, step time relative to FSDP2, the ledger's bytes per
    step (gradient reduce-scatters + parameter all-gathers + the grad-norm scalar) against the
    engine's :func:`~shardwise.parallel.zero.zero_step_bytes_formula`, model-state bytes per
    rank against :func:`~shardwise.parallel.zero.zero_memory_formula`, and (explicit) the peak
    of gathered parameters. ``args``: ``model``, ``steps``, ``rounds``, ``seq_len``,
    ``micro_batch``, ``out``."""
    n = _world()
    topo = Topology(dp=n, collectives=args.collectives)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    global_batch = args.micro_batch * n
    layout = Layout(dp=n, zero=3)
    runs = {name: make_run(lambda m, kw=kw: parallelize(m, topo, layout, **kw), args.model,
                           work, cfg, global_batch, n, topo.index("dp"))
            for name, kw in ZERO_VARIANTS.items()}

    def one_step(r):
        dt, _ = timed_step(r, work, args.micro_batch, topo, zero_grad=False)
        r["bytes"] = {t: topo.ledger.step_bytes(t) for t in ("grad", "param", "grad_norm")}
        r["state"] = r["engine"].model_state_bytes(r["opt"])
        return dt

    for r in runs.values():  # warm-up
        one_step(r)
    alternate(runs, args.rounds, args.steps, one_step)  # A B C A B C …
    base = statistics.median(runs[ZERO_BASELINE]["times"])
    tokens = global_batch * args.seq_len
    results = []
    for name, r in runs.items():
        med = statistics.median(r["times"])
        formula = r["engine"].grad_sync.step_bytes_formula(1)  # the ZeRO sync's
        ledger = sum(r["bytes"].values())
        mem = r["engine"].memory_formula()["total"]
        results.append({
            "variant": name, "median_step_s": med, "tokens_per_s": tokens / med,
            "vs_fsdp2": med / base, "ledger_bytes": ledger, "formula_bytes": formula["total"],
            "ledger_by_tag": r["bytes"], "model_state_bytes": r["state"],
            "memory_formula_bytes": mem, "gathered_params_peak": r["state"].get(
                "gathered_params_peak"), "steps_timed": len(r["times"])})
    if dist.get_rank() == 0:
        psi = runs[ZERO_BASELINE]["engine"].grad_sync.numel
        head = (f"ZeRO-3 bench: model {args.model} ({psi / 1e6:.2f} M params), dp={n}, "
                f"{args.micro_batch} × {args.seq_len} tokens per rank per step, {args.rounds} "
                f"rounds × {args.steps} steps per variant, torch {torch.__version__}")
        peak = ("gathered peak (MiB)", "---:", lambda x: "—" if x["gathered_params_peak"] is None
                else f"{x['gathered_params_peak'] / 2**20:.2f}")
        columns = _median_table(
            "step time / FSDP2", "vs_fsdp2",
            ("ledger bytes / formula", "---:",
             lambda x: f"{x['ledger_bytes'] / x['formula_bytes']:.4f}"),
            ("model state / formula", "---:",
             lambda x: f"{x['model_state_bytes']['total'] / x['memory_formula_bytes']:.4f}"),
            peak)
        write_report(results, columns, args.out, "bench_zero", head=head,
                     data={"config": vars(args) | {"dp": n}, "results": results})
    return 0


# ---------------------------------------------------------------- tp: explicit TP vs DTensor

TP_VARIANTS = {
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
        engine.loss_fn.loss_sum_and_count(batch)  # with grad (the engine's evaluation is no_grad)
    return sum(seen.values())


def bench_tp(args) -> int:
    """Explicit TP vs DTensor TP, each without and with SP, over tp = world size (dp = pp = 1).
    Reported per variant:

    * median step time and tokens/s; explicit / DTensor step-time ratio at the same SP setting
      (target ≤ 1.0, docs/architecture.md);
    * ledger bytes per step / :func:`~shardwise.parallel.tp.tp_step_bytes_formula` (the
      DTensor variants book their collectives during the warm-up step only: the booking dispatch
      mode costs Python time per op, so the timed steps run without it);
    * activation bytes (:func:`activation_bytes`): bytes of the tensors autograd saves for
      backward in one forward of one micro-batch on this rank. SP keeps the norm inputs (and
      dropout masks) on s/n positions, so it should be smaller (Korthikanti et al. 2022, §4.2.2,
      Table 2: per layer sbh(10 + 24/t + 5as/ht) → sbh(34/t + 5as/ht) for their GPT in fp16;
      ours is a fp32 Llama, so compare the ratio, not the formula).

    ``args``: ``model`` (preset), ``steps``, ``rounds``, ``seq_len``, ``micro_batch`` (sequences
    per step per rank), ``out``."""
    tp = _world()
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, 4096, 4096)
    mcfg = build_model(args.model, vocab_size=work.vocab_size).config
    validate_tp(mcfg, tp, TPOptions(sp=True), args.seq_len)  # before any collective
    topo = Topology(tp=tp, collectives=args.collectives)
    runs = {name: make_run(lambda m, kw=kw: parallelize(m, topo, Layout(tp=tp, sp=kw["sp"]),
                                                         engine=kw["kind"]),
                           args.model, work, cfg, args.micro_batch, 1, 0) | kw
            for name, kw in TP_VARIANTS.items()}

    def one_step(r):
        return timed_step(r, work, args.micro_batch, topo)[0]

    (probe,) = work.batches(torch.arange(args.micro_batch), args.micro_batch)
    for r in runs.values():  # warm-up step, booked; activation bytes; then DTensor unbooked
        one_step(r)
        r["ledger_bytes"] = topo.ledger.step_bytes()
        r["activation_bytes"] = activation_bytes(r["engine"], probe)
        if r["kind"] == "torch":
            r["engine"].loss_fn.book_collectives = False
    alternate(runs, args.rounds, args.steps, one_step)  # A B C D A B C D …
    tokens = args.micro_batch * args.seq_len
    results = []
    for name, r in runs.items():
        med = statistics.median(r["times"])
        twin = "DTensor TP+SP" if r["sp"] else "DTensor TP"
        formula = tp_step_bytes_formula(mcfg, args.micro_batch, args.seq_len, tp,
                                        TPOptions(sp=r["sp"]))
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
        columns = _median_table(
            "step time / DTensor", "vs_dtensor",
            ("ledger bytes / formula", "---:",
             lambda x: f"{x['ledger_bytes'] / x['formula_bytes']:.4f}"),
            ("activation bytes (1 micro-batch)", "---:", lambda x: f"{x['activation_bytes']:,}"))
        by = {x["variant"]: x for x in results}
        tail = [f"\n{eng}: activation bytes with SP / without = "
                f"{by[eng + '+SP']['activation_bytes'] / by[eng]['activation_bytes']:.3f}"
                for eng in ("explicit TP", "DTensor TP")]
        write_report(results, columns, args.out, "bench_tp", head=head, tail=tail,
                     data={"config": vars(args) | {"tp": tp}, "results": results})
    return 0


# ---------------------------------------------------------------- pp: bubble, explicit vs torch

def bench_pp(args) -> int:
    """Pipeline over pp = world size (``args.pp``), model ``args.model`` with ``args.n_layers``
    layers, ``args.microbatches`` microbatches of ``args.micro_batch`` sequences:

    1. **Bubble of ``args.schedule``**: the explicit engine (1F1B by default); every rank
       timestamps its actions (``engine.timeline``); the timelines are gathered and the measured
       bubble 1 − Σ busy / (p · makespan) is compared with the closed form
       (:func:`~shardwise.parallel.pp.bubble_formula`; (p−1)/(m+p−1) for 1F1B, Narayanan et al.
       2021 §2.2.1), median over the timed steps. Target: measured / formula ≤ 1.10. The last
       step's timeline is written as ``bench_<schedule>_timeline.{png,trace.json}``
       (:func:`~..trace.trace_pipeline`);
    2. **Every schedule** (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev): the explicit
       engine and (unless ``args.bubble_only``) ``engine="torch"`` (torch.distributed.
       pipelining), alternating A B A B … on identical models and batches: median step time,
       the ratio explicit / torch, and the explicit engine's measured bubble (median over its
       timed steps) against the simulator's (:func:`~shardwise.parallel.pp.simulate`, T_F =
       T_B = T_W, free communication) and the closed form. A schedule the layout cannot run
       (e.g. interleaving with an m it cannot split, dualpipev with m < 2p) is a row saying
       why."""
    p = _world()
    validate_pp(args.n_layers, p, args.schedule, args.microbatches,
                args.micro_batch * args.microbatches)
    topo = Topology(pp=p, collectives=args.collectives)
    work = SyntheticLMWorkload(vocab_size=args.vocab, seq_len=args.seq_len,
                               num_train=max(256, args.micro_batch * args.microbatches * 4),
                               num_val=1, seed=0)
    cfg = TrainConfig(model=args.model, lr=1e-4)

    def make(engine, schedule):
        layout = Layout(pp=p, schedule=schedule, microbatches=args.microbatches)
        run = make_run(lambda m: parallelize(m, topo, layout, engine=engine), args.model, work,
                       cfg, args.micro_batch * args.microbatches, 1, 0, n_layers=args.n_layers)
        if engine == "explicit":  # its actions are timestamped: a bubble per step
            run["bubbles"] = []
        return run

    def step(run):
        seconds = timed_step(run, work, args.micro_batch, topo)[0]
        if "bubbles" in run:  # gathered over pp after the timed step (a collective)
            run["bubbles"].append(bubble_of(gather_timeline(run["engine"], topo), p))
        return seconds

    # 1. measured bubble of the explicit engine
    run = make("explicit", args.schedule)
    step(run)  # warm-up
    run["bubbles"] = []
    for _ in range(args.steps):
        step(run)
    bubbles = run["bubbles"]
    if dist.get_rank() == 0:
        trace_pipeline(run["engine"], topo, args.out, name=f"bench_{args.schedule}_timeline")
    else:
        trace_pipeline(run["engine"], topo, args.out)
    formula = bubble_formula(args.schedule, p, args.microbatches, run["engine"].v)
    measured = statistics.median(bubbles)
    # 2. every schedule: explicit (its bubble) vs torch, alternating
    rows = []
    engines = ("explicit",) if args.bubble_only else ("explicit", "torch")
    for schedule in SCHEDULES:
        try:
            v = validate_pp(args.n_layers, p, schedule, args.microbatches)
        except Exception as e:  # e.g. interleaving with an m it cannot split
            rows.append({"schedule": schedule, "skipped": str(e)})
            continue
        runs = {e: make(e, schedule) for e in engines}
        for r in runs.values():
            step(r)  # warm-up
        runs["explicit"]["bubbles"] = []
        alternate(runs, args.rounds, args.steps, step)
        med = {e: statistics.median(r["times"]) for e, r in runs.items()}
        try:
            closed = bubble_formula(schedule, p, args.microbatches, v)
        except ValueError:  # zbv with m < 2p−1: no closed form, the simulator's number
            closed = None
        row = {"schedule": schedule, "v": v, "explicit_s": med["explicit"],
               "bubble": statistics.median(runs["explicit"]["bubbles"]),
               "bubble_per_step": runs["explicit"]["bubbles"],
               "simulated": simulate(build_schedule(schedule, p, args.microbatches,
                                                    v)).bubble_fraction,
               "formula": closed, "steps_timed": len(runs["explicit"]["times"])}
        if "torch" in med:
            row |= {"torch_s": med["torch"], "ratio": med["explicit"] / med["torch"]}
        rows.append(row)
    if dist.get_rank() == 0:
        params = sum(x.numel() for x in build_model(args.model, vocab_size=work.vocab_size,
                                                    n_layers=args.n_layers).parameters())
        head = (f"PP bench: model {args.model} ({params / 1e6:.2f} M params, {args.n_layers} "
                f"layers), pp={p}, m={args.microbatches} microbatches of {args.micro_batch} × "
                f"{args.seq_len} tokens, torch {torch.__version__}, "
                f"{torch.get_num_threads()} thread(s) per rank\n\n"
                f"Bubble ({args.schedule}, explicit engine, median of {len(bubbles)} steps): "
                f"measured {measured:.4f}, formula {formula:.4f}, "
                f"measured / formula = {measured / formula:.3f} (target ≤ 1.10)\n\n"
                f"simulated and formula: equal stages (T_F = T_B = T_W) and free messages; "
                f"measured: wall time per rank, {p} ranks on {os.cpu_count()} CPU core(s) here "
                f"(a rank's compute slows while others compute, so filling a bubble also "
                f"stretches the others' work), the V schedules' rank 0 holding the embedding "
                f"and the head, every send/recv's latency: docs/pipeline-parallel.md §9")

        def cell(key, fmt):
            return lambda r: (None if "skipped" in r or r.get(key) is None
                              else fmt(r[key]))

        columns = [("schedule", "---", lambda r: r["schedule"]),  # a skipped one says why
                   ("explicit median step (ms)", "---:", lambda r: f"skipped: {r['skipped']}"
                    if "skipped" in r else f"{r['explicit_s'] * 1e3:.1f}"),
                   ("torch median step (ms)", "---:", cell("torch_s", lambda x: f"{x * 1e3:.1f}")),
                   ("explicit / torch", "---:", cell("ratio", lambda x: f"{x:.3f}")),
                   ("bubble measured", "---:", cell("bubble", lambda x: f"{x:.4f}")),
                   ("simulated", "---:", cell("simulated", lambda x: f"{x:.4f}")),
                   ("formula", "---:", cell("formula", lambda x: f"{x:.4f}")),
                   ("measured / formula", "---:",
                    lambda r: None if "skipped" in r or r.get("formula") is None
                    else f"{r['bubble'] / r['formula']:.2f}")]
        bubble = {"schedule": args.schedule, "measured": measured, "per_step": bubbles,
                  "formula": formula, "ratio": measured / formula}
        write_report(rows, columns, args.out, "bench_pp", head=head,
                     data={"config": vars(args) | {"pp": p}, "bubble": bubble,
                           "step_time": rows})
    return 0


SUITES = {"dp": bench_dp, "zero": bench_zero, "tp": bench_tp, "pp": bench_pp,
          "collectives": bench_collectives, "zero-collectives": bench_zero_collectives,
          "checks": bench_checks}
