"""``shardwise bench --layout L``: any layout, explicit engine vs torch engine, alternating.

For each layout (verify's syntax, :func:`shardwise.parallel.apply.parse_layout`: ``dp=2``,
``dp=2,tp=2,zero=3``, ``pp=2,dp=2,tp=2,1f1b,m=4`` …) every rank of one spawned world builds the
sub-topology ``Topology(pp, dp, tp, ranks=range(pp·dp·tp))``; its members build the layout twice
with :func:`~shardwise.parallel.apply.parallelize`, ``engine="explicit"`` and ``engine="torch"``,
from the same seed (identical weights), each with its own AdamW and the same batches. Then:

1. one warm-up step per engine (discarded). It is the step whose collectives are compared with
   the formula: ledger bytes this rank sent / :func:`shardwise.formulas.step_bytes_formula`
   (target 1.00), and the model-state bytes this rank holds after the optimizer step
   (``engine.model_state_bytes``: parameters + gradients + AdamW state) /
   :func:`shardwise.formulas.memory_formula` where one exists (DP 16Ψ, ZeRO 4Ψ+4Ψ+8Ψ/N … —
   Rajbhandari et al. 2020 §3.1, §5). Engines that book PyTorch's collectives through a
   dispatch mode (DTensor TP: ``book_collectives``) then stop booking, as in ``--suite tp``:
   the booking costs Python time per op that the explicit engine does not pay;
2. ``rounds`` rounds of ``steps`` timed steps per engine, alternating A B A B …, so that drift in
   the machine's speed (other jobs on the same cores) hits both engines alike. The order of the
   timed blocks is recorded (``order`` in ``bench.json``);
3. per engine: the median step time (a step ends when the slowest rank of the layout finishes:
   the maximum over ranks of each rank's median), tokens/s = global tokens per step (sequences ×
   seq_len, all dp replicas) / median, and the explicit / torch step-time ratio (target ≤ 1.0,
   the shared ARCHITECTURE sketch's "Numbers we hold ourselves to").

4. context parallelism with the ring (``cp=N``): one more step of the explicit engine, not
   timed with the others, with :attr:`~shardwise.parallel.cp.ContextParallelAttention.timings`
   on in every attention layer of every rank: each ring exchange gives (seconds from its issue
   to its wait, seconds blocked in the wait). The transfer window is their sum (issue → wait
   returns), the exposed part is the time blocked, and the ring's overlap is 1 − Σ blocked /
   Σ window over the layout's ranks (1: every transfer hidden behind the block compute that ran
   meanwhile; 0: none). It is a column of the explicit row, not a suite of its own: it is a
   property of that layout's explicit engine, measured in the same world on the same batches,
   and cp has no variant to set it against (PyTorch's ``context_parallel`` does not run on CPU,
   and the ring has no non-overlapped mode).

A layout or engine that raises (not built yet, refused, crashed mid-step) gets a row with the
error instead of numbers; the other rows still run. An engine that the layout's checks refuse
(a :class:`ShardwiseConfigError` before any collective — the torch engine with cp on CPU) is
shown as ``refused`` with the whole reason. Rank 0 prints a Markdown table and writes
``bench.md``, ``bench.json`` and ``bench.png`` (bars: median step time per layout and engine,
with the ratio on top) into ``out``.

Bytes, seconds and memory are per rank; the ledger ratio is Σ over the layout's ranks of ledger
bytes / Σ of formula bytes (``worst_rank_deviation``: max over ranks of |ledger/formula − 1|).
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from operator import itemgetter
from pathlib import Path

import torch

from ... import comm
from ...config import TrainConfig
from ...errors import ShardwiseConfigError
from ...formulas import memory_formula, step_bytes_formula
from ...parallel.apply import parallelize
from ...parallel.layout import Layout, parse_layout
from ...precision import Precision
from ...topology import Topology, init_distributed
from .harness import alternate, make_run, make_workload, markdown_table, timed_step, write_report

ENGINES = ("explicit", "torch")
# one float64 vector per (rank, engine) in the all-gather, in this order
_FIELDS = ("member", "failed", "median_s", "ledger_bytes", "formula_bytes", "mem_bytes",
           "mem_formula_bytes", "steps_timed", "ring_exchanges", "ring_window_s",
           "ring_blocked_s", "ring_unblocked")
HIDDEN_S = 1e-4  # a ring wait that blocked less than this: the transfer was already done


def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return msg if len(msg) <= 160 else msg[:157] + "…"


def _disable_booking(engine) -> bool:
    """Stop dispatch-mode booking of PyTorch's collectives (DTensor) after the booked step."""
    found = False
    loss_fn = getattr(engine, "loss_fn", None)  # dp × tp: the loss function books DTensor's
    for m in [*engine.modules(), *([loss_fn] if loss_fn is not None else [])]:
        if hasattr(m, "book_collectives"):
            m.book_collectives = False
            found = True
    return found


def _with_recompute_phase(engine, topo):
    """--ac: book the collectives a recompute re-issues (TP) under phase "recompute", so the
    step's ledger still matches the formula (see shardwise.models.ac)."""
    from ...models import set_activation_checkpointing

    mode = next((m.ac_mode for m in engine.modules() if hasattr(m, "ac_mode")), "none")
    set_activation_checkpointing(engine, mode, lambda: topo.ledger.phase("recompute"))
    return engine


def bench_one_layout(layout: Layout, topo, args, order: list) -> dict:
    """Run the explicit and the torch engine of ``layout`` on this member rank of ``topo``;
    returns ``{engine: {...}}`` with this rank's numbers or ``{"error": text}``."""
    from ...parallel.pp.schedules import min_microbatches

    n_micro = layout.microbatches or (min_microbatches(layout.schedule, layout.pp)
                                      if layout.pp > 1 else 1)
    dp = layout.dp
    global_batch = args.micro_batch * n_micro * dp
    work = make_workload(args.model, args.seq_len, args.vocab,
                         max(256, global_batch * (2 + args.rounds * args.steps)))
    seq_len = args.seq_len if work.kind == "lm" else 1
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    model_kw = {}
    if args.n_layers:
        model_kw["n_layers"] = args.n_layers
    if args.ac and args.ac != "none":
        model_kw["ac"] = args.ac
    runs: dict[str, dict] = {}
    for eng in ENGINES:
        try:
            runs[eng] = make_run(
                lambda m, eng=eng: _with_recompute_phase(parallelize(
                    m, topo, layout, engine=eng, bucket_mb=args.bucket_mb, seed=0,
                    precision=Precision.of(reduce=getattr(args, "reduce_dtype", "fp32"))),
                    topo),
                args.model, work, cfg, global_batch, dp, topo.index("dp"), **model_kw)
        except ShardwiseConfigError as e:  # refused by the layout's checks: the whole reason
            runs[eng] = {"error": str(e), "refused": True, "times": []}
            if topo.rank == 0:
                print(f"[bench] {layout.name()} {eng}: refused: {e}", file=sys.stderr, flush=True)
        except Exception as e:  # not built yet / crashed while building: a row saying so
            runs[eng] = {"error": _short(e), "times": []}
            if topo.rank == 0:  # the same error on every rank: print it once
                print(f"[bench] {layout.name()} {eng}: {runs[eng]['error']}",
                      file=sys.stderr, flush=True)

    def step(r, **kw):
        try:
            dt, res = timed_step(r, work, args.micro_batch, topo, dtype=args.dtype, **kw)
            return dt, res
        except Exception as e:
            r["error"] = _short(e)
            traceback.print_exc()
            return float("nan"), None

    for eng, r in runs.items():  # warm-up: the booked step, compared with the formulas
        if r.get("error"):
            continue
        _, res = step(r, measure_memory=True)
        if res is None:
            continue
        formula = step_bytes_formula(r["engine"], topo, micro_steps=n_micro,
                                     sequences=global_batch // dp, seq_len=seq_len,
                                     dtype=args.dtype)
        r["ledger_bytes"] = topo.ledger.step_bytes()
        r["formula_bytes"] = formula["total"]
        r["ledger_by_tag"], r["seconds_by_tag"] = {}, {}
        for rec in topo.ledger.step_records():  # bytes; seconds launch → completion (async:
            key = f"{rec.tag}@{rec.axis}"        # includes the overlapped compute)
            r["ledger_by_tag"][key] = r["ledger_by_tag"].get(key, 0.0) + rec.wire_bytes
            r["seconds_by_tag"][key] = r["seconds_by_tag"].get(key, 0.0) + rec.seconds
        r["formula_by_tag"] = {k: v for k, v in formula.items() if k != "total"}
        r["mem"] = res.state_bytes
        mf = memory_formula(r["engine"], topo)
        r["mem_formula"] = mf["total"] if mf else None
        r["booking_off"] = _disable_booking(r["engine"])

    def timed(r):
        if r.get("error"):
            return float("nan")
        return step(r)[0]

    alternate(runs, args.rounds, args.steps, timed, order)
    if layout.cp > 1 and layout.cp_method == "ring" and not runs["explicit"].get("error"):
        ring_overlap_step(runs["explicit"], step)
    out = {}
    for eng, r in runs.items():
        times = [t for t in r["times"] if t == t]
        if r.get("error") or not times:
            out[eng] = {"error": r.get("error", "no timed step"),
                        **({"refused": True} if r.get("refused") else {})}
            continue
        out[eng] = {"median_s": statistics.median(times), "steps_timed": len(times),
                    "times_s": r["times"],
                    "ledger_bytes": r["ledger_bytes"], "formula_bytes": r["formula_bytes"],
                    "ledger_by_tag": r["ledger_by_tag"], "formula_by_tag": r["formula_by_tag"],
                    "seconds_by_tag": r["seconds_by_tag"],
                    "mem": r["mem"], "mem_formula": r["mem_formula"],
                    "booking_off_after_warmup": r["booking_off"],
                    **({"ring": r["ring"]} if "ring" in r else {})}
    out["_meta"] = {"global_batch": global_batch, "n_micro": n_micro,
                    "tokens_per_step": global_batch * seq_len}
    return out


def ring_overlap_step(run: dict, step) -> None:
    """One more step of ``run`` (``step(run)``, the explicit engine of a ring cp layout) with
    :attr:`ContextParallelAttention.timings` on in every attention layer; sets ``run["ring"]``
    to this rank's ``{"exchanges", "window_s", "blocked_s", "unblocked"}``: the ring exchanges
    of the step (K/V forward and backward, dK/dV), Σ (issue → wait returns), Σ time blocked in
    wait, and how many waits blocked less than :data:`HIDDEN_S`."""
    from ...parallel.cp import ContextParallelAttention

    cores = [m for m in run["engine"].modules() if isinstance(m, ContextParallelAttention)]
    timings: list = []
    for m in cores:
        m.timings = timings
    try:
        step(run)
    finally:
        for m in cores:
            m.timings = None
    run["ring"] = {"exchanges": len(timings), "window_s": sum(a + b for a, b in timings),
                   "blocked_s": sum(b for _, b in timings),
                   "unblocked": sum(b < HIDDEN_S for _, b in timings)}


def _parse(text: str):
    """(Layout, None), or (None, why) for a layout ``check_supported`` refuses (a row of the
    table). Raises :class:`ShardwiseConfigError` for text that is not a layout at all."""
    try:
        return parse_layout(text), None
    except ShardwiseConfigError as e:
        if "write each layout as" in str(e):  # syntax: the user must fix the command line
            raise
        return None, str(e)


def check_layouts(texts: list[str]) -> int:
    """Parse every layout (syntax errors raise :class:`ShardwiseConfigError` before anything is
    spawned); return the ranks the largest runnable one needs (at least 1)."""
    return max([1] + [lay.world for lay, _ in map(_parse, texts) if lay is not None])


def _vector(res: dict | None) -> torch.Tensor:
    v = torch.zeros(len(ENGINES), len(_FIELDS), dtype=torch.float64)
    if res is None:
        return v
    for i, eng in enumerate(ENGINES):
        r = res[eng]
        v[i, 0] = 1.0
        if "error" in r:
            v[i, 1] = 1.0
            continue
        ring = r.get("ring", {})
        v[i, 2:] = torch.tensor([r["median_s"], r["ledger_bytes"], r["formula_bytes"],
                                 r["mem"]["total"], r["mem_formula"] or 0.0, r["steps_timed"],
                                 ring.get("exchanges", 0), ring.get("window_s", 0.0),
                                 ring.get("blocked_s", 0.0), ring.get("unblocked", 0)],
                                dtype=torch.float64)
    return v


def bench_layouts_worker(args) -> int:
    """Worker body (every rank of the spawned world). ``args``: ``layouts`` (strings),
    ``model``, ``steps``, ``rounds``, ``seq_len``, ``micro_batch``, ``dtype``, ``ac``,
    ``n_layers``, ``vocab``, ``bucket_mb``, ``timeout``, ``out``. Returns 0 (a failing layout is
    a row of the table, not a failure of the command)."""
    import torch.distributed as dist

    layouts = [(s, *_parse(s)) for s in args.layouts]  # refused layouts become rows
    init_distributed("cpu", args.timeout)
    world = dist.get_world_size()
    for s, lay, _ in layouts:
        if lay is not None and lay.world > world:
            raise ShardwiseConfigError(f"layout {s} needs {lay.world} ranks but the bench runs "
                                       f"{world}: raise --nproc or drop the layout")
    rank = dist.get_rank()
    everyone = Topology(dp=world, timeout_s=args.timeout)
    rows, order_all = [], {}
    for s, lay, refused in layouts:
        if lay is None:
            rows.append({"layout": s, "error": refused})
            continue
        topo = Topology(lay.pp, lay.dp, lay.tp, cp=lay.cp, ranks=range(lay.world),
                        timeout_s=args.timeout, collectives=args.collectives)
        order: list[str] = []
        res = None
        if topo.member:
            try:
                res = bench_one_layout(lay, topo, args, order)
            except Exception as e:
                traceback.print_exc()
                res = {eng: {"error": _short(e)} for eng in ENGINES} | {"_meta": {}}
        vec = _vector(res)
        gathered = torch.zeros(world, *vec.shape, dtype=torch.float64)
        with everyone.ledger.phase("bench"):
            comm.all_gather(gathered.view(-1), vec.view(-1), everyone, "world")
        if rank == 0:
            rows.append(_row(s, lay, res, gathered, order))
            order_all[lay.name()] = order
    if rank == 0:
        report(rows, args, world)
    return 0


def _row(text: str, lay: Layout, res: dict, g: torch.Tensor, order: list) -> dict:
    """Combine every rank's vector (``g``: [world, engines, fields]) with rank 0's details."""
    row = {"layout": lay.name(), "world": lay.world, "order": order,
           **{k: res["_meta"].get(k) for k in ("global_batch", "n_micro", "tokens_per_step")}}
    for i, eng in enumerate(ENGINES):
        members = g[:, i, 0] == 1
        gm = g[members, i]
        if bool((gm[:, 1] == 1).any()):
            mine = res[eng].get("error") if "error" in res[eng] else None
            bad = [int(r) for r in torch.nonzero(members).flatten()
                   if g[r, i, 1] == 1]
            row[eng] = {"error": mine or f"failed on rank(s) {bad} (see their stderr)",
                        **({"refused": True} if res[eng].get("refused") else {})}
            continue
        med = float(gm[:, 2].max())
        ledger, formula = gm[:, 3], gm[:, 4]
        dev = float(max((abs(a / b - 1) if b else abs(a)) for a, b in
                        zip(ledger.tolist(), formula.tolist())))
        mem_i = int(gm[:, 5].argmax())
        mf = float(gm[mem_i, 6]) or None
        row[eng] = {
            "median_step_s": med,
            "tokens_per_s": row["tokens_per_step"] / med,
            "ledger_bytes_rank0": res[eng]["ledger_bytes"],
            "formula_bytes_rank0": res[eng]["formula_bytes"],
            "ledger_by_tag_rank0": res[eng]["ledger_by_tag"],
            "formula_by_tag_rank0": res[eng]["formula_by_tag"],
            "comm_seconds_by_tag_rank0": res[eng]["seconds_by_tag"],
            "ledger_over_formula": float(ledger.sum() / formula.sum()) if formula.sum() else None,
            "worst_rank_deviation": dev,
            "model_state_bytes_max_rank": float(gm[mem_i, 5]),
            "memory_formula_bytes": mf,
            "memory_over_formula": float(gm[mem_i, 5]) / mf if mf else None,
            "model_state_rank0": res[eng]["mem"],
            "steps_timed": int(gm[0, 7]),
            "step_times_s_rank0": res[eng]["times_s"],
            "booking_off_after_warmup": res[eng]["booking_off_after_warmup"],
        }
        if float(gm[:, 8].sum()):  # ring cp: Σ over the layout's ranks, and each rank's
            window, blocked = gm[:, 9], gm[:, 10]
            row[eng]["ring_overlap"] = {
                "exchanges_per_rank": int(gm[0, 8]), "unblocked": int(gm[:, 11].sum()),
                "window_s": float(window.sum()), "blocked_s": float(blocked.sum()),
                "overlap": 1.0 - float(blocked.sum() / window.sum()),
                "overlap_per_rank": (1.0 - blocked / window).tolist()}
    e, t = row["explicit"], row["torch"]
    both = "median_step_s" in e and "median_step_s" in t
    row["explicit_over_torch"] = e["median_step_s"] / t["median_step_s"] if both else None
    row["explicit_over_torch_paired"] = (
        paired_ratio(e["step_times_s_rank0"], t["step_times_s_rank0"],
                     len(order) // 2 or 1) if both else None)
    # the fastest step of each engine: the one least disturbed by other jobs on the cores
    row["explicit_over_torch_min"] = (min(e["step_times_s_rank0"]) /
                                      min(t["step_times_s_rank0"]) if both else None)
    return row


def paired_ratio(a: list[float], b: list[float], rounds: int) -> float | None:
    """Median over rounds of median(A's block) / median(B's block): each round's two blocks ran
    back to back, so slow drift of the machine cancels within a pair (rank 0's times)."""
    if not a or not b or len(a) % rounds or len(b) % rounds:
        return None
    ka, kb = len(a) // rounds, len(b) // rounds
    return statistics.median(statistics.median(a[i * ka:(i + 1) * ka]) /
                             statistics.median(b[i * kb:(i + 1) * kb]) for i in range(rounds))


def _fmt(x, spec, dash="—"):
    return dash if x is None else format(x, spec)


# the table: one line per (layout, engine); a refused layout is one line
COLUMNS = [(title, align, itemgetter(i)) for i, (title, align) in enumerate([
    ("layout", "---"), ("ranks", "---:"), ("engine", "---"), ("median step (ms)", "---:"),
    ("tokens/s", "---:"), ("ledger / formula", "---:"), ("model state / rank (MiB)", "---:"),
    ("state / formula", "---:"), ("explicit / torch (paired)", "---:"),
    ("ring overlap", "---:")])]


def _cells(rows: list[dict]) -> list[list]:
    """The cells of :data:`COLUMNS` for every line of the table (None: left blank)."""
    out = []
    for row in rows:
        if "error" in row:
            out.append([row["layout"], None, None, f"refused: {row['error']}"] + [None] * 6)
            continue
        for eng in ENGINES:
            r = row[eng]
            ratio = (f"{_fmt(row['explicit_over_torch'], '.3f')} "
                     f"({_fmt(row.get('explicit_over_torch_paired'), '.3f')})"
                     if eng == "explicit" else "")
            if "error" in r:
                why = "refused" if r.get("refused") else "error"
                out.append([row["layout"], row["world"], eng, f"{why}: {r['error']}"]
                           + [None] * 4 + [ratio, None])
                continue
            ring = r.get("ring_overlap")
            out.append([row["layout"], row["world"], eng, f"{r['median_step_s'] * 1e3:.1f}",
                        f"{r['tokens_per_s']:,.0f}", _fmt(r["ledger_over_formula"], ".4f"),
                        f"{r['model_state_bytes_max_rank'] / 2**20:.2f}",
                        _fmt(r["memory_over_formula"], ".4f"), ratio,
                        f"{ring['overlap']:.3f}" if ring else None])
    return out


def ring_lines(rows: list[dict]) -> list[str]:
    """The lines under the table for each ring cp row: the overlap step's numbers."""
    out = []
    for row in rows:
        ring = row.get("explicit", {}).get("ring_overlap")
        if ring:
            worst = min(ring["overlap_per_rank"])
            out.append(f"ring overlap, {row['layout']} (one more explicit step, "
                       f"ContextParallelAttention.timings on every rank): {row['world']} ranks × "
                       f"{ring['exchanges_per_rank']} ring exchanges; transfer window (issue → "
                       f"wait returns) Σ {ring['window_s'] * 1e3:.1f} ms, blocked in wait "
                       f"(exposed) Σ {ring['blocked_s'] * 1e3:.1f} ms; overlap 1 − blocked / "
                       f"window = {ring['overlap']:.3f} (worst rank {worst:.3f}); "
                       f"{ring['unblocked']} of {row['world'] * ring['exchanges_per_rank']} "
                       f"waits blocked < {HIDDEN_S * 1e3:g} ms")
    return out


def format_table(rows: list[dict]) -> str:
    """The Markdown table of :func:`bench_layouts_worker`'s rows."""
    return markdown_table(_cells(rows), COLUMNS)


def draw_chart(rows: list[dict], path: Path, title: str) -> Path | None:
    """Grouped bars: median step time (ms) per layout, explicit vs torch; the ratio on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(ok) + 2), 4))
    xs = range(len(ok))
    w = 0.38
    for k, (eng, color) in enumerate(zip(ENGINES, ("tab:blue", "tab:orange"))):
        vals = [r[eng].get("median_step_s", 0.0) * 1e3 for r in ok]
        ax.bar([x + (k - 0.5) * w for x in xs], vals, w, label=eng, color=color)
    for x, r in zip(xs, ok):
        top = max(r[e].get("median_step_s", 0.0) for e in ENGINES) * 1e3
        label = (f"{r['explicit_over_torch']:.2f}×" if r["explicit_over_torch"] is not None
                 else "error")
        ax.text(x, top * 1.02, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r["layout"] for r in ok], rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.15 * max(max(r[e].get("median_step_s", 0.0) for e in ENGINES)
                              for r in ok) * 1e3 or 1.0)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(rows: list[dict], args, world: int) -> None:
    """Rank 0: print the table; write ``bench.md``, ``bench.json``, ``bench.png`` in ``out``."""
    head = (f"Layout bench: model {args.model}, {args.micro_batch} × {args.seq_len} tokens per "
            f"micro-batch, dtype {args.dtype}, {args.rounds} rounds × {args.steps} timed steps "
            f"per engine (A B A B …, after 1 warm-up step), {world} processes, torch "
            f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    ring = ring_lines(rows)
    write_report(_cells(rows), COLUMNS, args.out, "bench", head=head,
                 data={"config": config | {"world": world}, "rows": rows},
                 tail=([""] + ring) if ring else ())
    out = Path(args.out)
    png = draw_chart(rows, out / "bench.png", f"explicit vs torch, {args.model}, {world} "
                     "processes (ratio above the bars)")
    if png:
        print(f"bench: {out / 'bench.md'}, {out / 'bench.json'}, {png}", flush=True)
