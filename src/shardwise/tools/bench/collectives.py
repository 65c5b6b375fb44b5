"""``shardwise bench --suite collectives`` and ``--suite zero-collectives``: our point-to-point
algorithms against the backend's own, in the style of nccl-tests.

**collectives** — for each op (all_reduce, reduce_scatter, all_gather, broadcast, all_to_all),
size S (1 KiB … ``--max-mb`` MiB, ×4 apart), group size n (2 and the world) and implementation
(``native``: gloo's or NCCL's; ``ring``; ``tree``), the time of one call (the slowest rank's
mean over repetitions, after a barrier), and, as nccl-tests define them (nccl-tests
doc/PERFORMANCE.md):

* ``algbw`` = S / time (bytes per second; S as the ledger books it: all_gather's output,
  reduce_scatter's input, all_to_all's per-rank input);
* ``busbw`` = algbw × the factor that makes it comparable with a link's bandwidth: 2(n−1)/n for
  all_reduce, (n−1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast;
* ``wire / formula``: bytes put on the wire per call over all ranks / n · (the ring formula of
  :func:`~shardwise.comm.ledger.ring_bytes`). For ours, the bytes handed to send (exact). For
  ``native``, measured outside the process: the ``lo`` interface's transmitted-bytes counter in
  ``/proc/net/dev`` around the repetitions (TCP and gloo headers included; every process on the
  machine counts, so it needs a quiet machine), and the ranks' own ``wchar`` of
  ``/proc/self/io`` (bytes passed to write(2)/writev(2): gloo's socket writes, only this job's).

Per (op, n, implementation) an α-β fit: ours by least squares on the algorithm's own model,
t = α·A(S) + β·B(S) with A, B the coefficients of :func:`~shardwise.comm.algorithms.time_s`;
native on t = a + S/bw. Rows weighted by 1/t (relative error). A PNG of time against size
per implementation if matplotlib is installed. Writes ``bench_collectives.{md,json,png}``.

**zero-collectives** — the payoff: explicit ZeRO-2 and ZeRO-3 over dp = world size, with
``--collectives native`` and ``ring`` alternating (A B A B …) on identical models and batches:
median step (the slowest rank's), ring / native (of the medians, and paired: the median over
rounds of each round's ratio on rank 0), and per step the gradient bytes (tag ``grad``) booked
by the formula, handed to send (ring) and seen on the wire (``lo`` and ``wchar``, whole step).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from ... import comm
from ...comm import algorithms
from ...comm.ledger import ring_bytes, sent_total
from ...config import TrainConfig
from ...parallel.apply import Layout, parallelize
from ...topology import Topology, init_distributed
from .harness import alternate, make_run, make_workload, timed_step, write_report

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
IMPLS = ("native", "ring", "tree")
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0}


def lo_tx_bytes() -> int | None:
    """Bytes transmitted so far on the loopback interface (``/proc/net/dev``), or None."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    except OSError:
        return None
    return None


def wchar() -> int | None:
    """Bytes this process passed to write(2)-like calls (``/proc/self/io``), or None."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _call(op: str, topo, bufs: dict) -> None:
    """One collective ``op`` over "dp" on the preallocated ``bufs``."""
    if op == "all_reduce":
        comm.all_reduce(bufs["x"], topo, "dp", tag="bench")
    elif op == "reduce_scatter":
        comm.reduce_scatter(bufs["shard"], bufs["x"], topo, "dp", tag="bench")
    elif op == "all_gather":
        comm.all_gather(bufs["x"], bufs["shard"], topo, "dp", tag="bench")
    elif op == "broadcast":
        comm.broadcast(bufs["x"], topo, "dp", src=0, tag="bench")
    else:
        comm.all_to_all(bufs["y"], bufs["x"], topo, "dp", tag="bench")


def _measure(op, impl, S, topo, reps):
    """(slowest rank's mean seconds per call, Σ over ranks of bytes handed to send per call or
    None, lo bytes per call or None (rank 0), Σ wchar per call)."""
    n = topo.size("dp")
    numel = S // 4
    bufs = {"x": torch.ones(numel), "shard": torch.ones(numel // n), "y": torch.empty(numel)}
    topo.collectives = impl
    _call(op, topo, bufs)  # warm-up (connections, allocations)
    topo.ledger.clear()
    _barrier(topo)
    lo0, w0 = lo_tx_bytes(), wchar()
    t0 = time.perf_counter()
    for _ in range(reps):
        _call(op, topo, bufs)
    dt = (time.perf_counter() - t0) / reps
    w1 = wchar()
    _barrier(topo)
    lo1 = lo_tx_bytes()
    sent = sent_total([r for r in topo.ledger.records if r.tag == "bench"])
    v = torch.tensor([dt, -1.0 if sent is None else sent / reps,
                      -1.0 if w0 is None or w1 is None else (w1 - w0) / reps], dtype=torch.float64)
    mx, sm = v.clone(), v.clone()
    comm.all_reduce(mx, topo, "dp", op="max", tag="bench")
    comm.all_reduce(sm, topo, "dp", tag="bench")
    topo.ledger.clear()
    lo = (lo1 - lo0) / reps if lo0 is not None and lo1 is not None else None
    return float(mx[0]), (float(sm[1]) if mx[1] >= 0 else None), lo, \
        (float(sm[2]) if sm[2] >= 0 else None)


def _barrier(topo) -> None:
    """Every rank of ``topo`` waits for the others (a native 4-byte all-reduce)."""
    mode, topo.collectives = topo.collectives, "native"
    comm.all_reduce(torch.zeros(1), topo, "world", tag="barrier")
    topo.collectives = mode


def _sizes(max_mb: float) -> list[int]:
    out, s = [], 1024
    while s <= max_mb * 2**20:
        out.append(s)
        s *= 4
    return out


def fit(op: str, impl: str, n: int, sizes, times) -> dict:
    """α (s), β (s/byte) and bandwidth (bytes/s) of ``impl``'s α-β model fitted to ``times``
    (relative least squares). ``native``: t = α + S·β."""
    rows = []
    for S in sizes:
        if impl == "native":
            rows.append((1.0, float(S)))
        else:
            alg = algorithms.choose(op, impl, S, n)
            rows.append((algorithms.time_s(op, alg, S, n, 1.0, 0.0),
                         algorithms.time_s(op, alg, S, n, 0.0, 1.0)))
    A = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    A, t = A / t[:, None], torch.ones_like(t)  # weight 1/t: each row's relative error
    alpha, beta = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
    if alpha < 0 or beta < 0:  # non-negative: fit the one coefficient that stays
        j = 0 if beta < 0 else 1
        best = float((A[:, j] @ t) / (A[:, j] @ A[:, j]))
        alpha, beta = (best, 0.0) if j == 0 else (0.0, best)
    return {"op": op, "impl": impl, "n": n, "alpha_s": alpha, "beta_s_per_byte": beta,
            "bandwidth_bytes_per_s": 1 / beta if beta > 0 else math.inf}


def bench_collectives(args) -> int:
    """The nccl-tests-style table (module docstring). ``args``: ``max_mb``, ``steps`` (the most
    repetitions per cell; fewer for large sizes), ``out``."""
    init_distributed(getattr(args, "device", "cpu"), args.timeout)
    world = dist.get_world_size()
    world_topo = Topology(dp=world, timeout_s=args.timeout)
    ns = sorted({2, world}) if world > 2 else [2]
    topos = {n: Topology(dp=n, ranks=range(n), timeout_s=args.timeout) for n in ns}
    rows = []
    for n in ns:
        topo = topos[n]
        for op in OPS:
            for S in _sizes(args.max_mb):
                S -= S % (4 * n)  # whole fp32 elements, n equal blocks
                reps = max(2, min(args.steps, int(32 * 2**20 // S)))
                for impl in IMPLS:
                    _barrier(world_topo)
                    if not topo.member:
                        continue
                    dt, sent, lo, wc = _measure(op, impl, S, topo, reps)
                    formula = n * ring_bytes(op, S, n)
                    algbw = S / dt
                    rows.append({
                        "op": op, "n": n, "size_bytes": S, "impl": impl,
                        "algorithm": algorithms.choose(op, impl, S, n) or "backend",
                        "reps": reps, "time_s": dt, "algbw": algbw,
                        "busbw": algbw * BUSBW_FACTOR[op](n),
                        "sent_over_formula": None if sent is None else sent / formula,
                        "lo_over_formula": None if lo is None else lo / formula,
                        "wchar_over_formula": None if wc is None else wc / formula})
    fits = []
    for n in ns:
        for op in OPS:
            for impl in IMPLS:
                sel = [r for r in rows if r["n"] == n and r["op"] == op and r["impl"] == impl]
                if len(sel) >= 2:
                    fits.append(fit(op, impl, n, [r["size_bytes"] for r in sel],
                                    [r["time_s"] for r in sel]))
    if dist.get_rank() == 0:
        _report(rows, fits, args, world)
    return 0


def _ratio(x) -> str | None:
    return None if x is None else f"{x:.3f}"


def _report(rows, fits, args, world) -> None:
    columns = [("op", "---", lambda r: r["op"]), ("n", "---:", lambda r: str(r["n"])),
               ("size", "---:", lambda r: _size(r["size_bytes"])),
               ("impl", "---", lambda r: r["impl"]), ("algorithm", "---", lambda r: r["algorithm"]),
               ("time (µs)", "---:", lambda r: f"{r['time_s'] * 1e6:,.0f}"),
               ("algbw (GB/s)", "---:", lambda r: f"{r['algbw'] / 1e9:.3f}"),
               ("busbw (GB/s)", "---:", lambda r: f"{r['busbw'] / 1e9:.3f}"),
               ("sent / formula", "---:", lambda r: _ratio(r["sent_over_formula"])),
               ("lo / formula", "---:", lambda r: _ratio(r["lo_over_formula"])),
               ("wchar / formula", "---:", lambda r: _ratio(r["wchar_over_formula"]))]
    tail = ["", "α-β fit per implementation (relative least squares over the sizes):", "",
            "| op | n | impl | α (µs) | bandwidth 1/β (GB/s) |", "|---|---:|---|---:|---:|"]
    for f in fits:
        tail.append(f"| {f['op']} | {f['n']} | {f['impl']} | {f['alpha_s'] * 1e6:.1f} | "
                    f"{f['bandwidth_bytes_per_s'] / 1e9:.3f} |")
    png = _plot(rows, args.out)
    if png:
        tail.append(f"\nplot: {png}")
    head = (f"collectives bench: {world} ranks, {torch.distributed.get_backend()} on "
            f"{getattr(args, 'device', 'cpu')}, fp32, sizes 1 KiB … {args.max_mb:g} MiB, up to "
            f"{args.steps} calls per cell; time = slowest rank's mean; torch {torch.__version__}")
    write_report(rows, columns, args.out, "bench_collectives", head=head,
                 data={"config": vars(args), "rows": rows, "fits": fits}, tail=tail)


def _size(b: int) -> str:
    for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.0f} {unit}"
    return f"{b} B"


def _plot(rows, out) -> str | None:
    """Time against size, one line per implementation, one panel per op (the largest n)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = max(r["n"] for r in rows)
    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.6), sharey=True)
    for ax, op in zip(axes, OPS):
        for impl in IMPLS:
            sel = [r for r in rows if r["n"] == n and r["op"] == op and r["impl"] == impl]
            ax.loglog([r["size_bytes"] for r in sel], [r["time_s"] * 1e6 for r in sel],
                      marker="o", label=impl)
        ax.set_title(f"{op}, n={n}")
        ax.set_xlabel("size (bytes)")
    axes[0].set_ylabel("time per call (µs)")
    axes[0].legend()
    fig.tight_layout()
    path = os.path.join(out, "bench_collectives.png")
    os.makedirs(out, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the ZeRO-2/3 payoff

def bench_zero_collectives(args) -> int:
    """Explicit ZeRO-2 and ZeRO-3 over dp = world size, ``--collectives`` native vs ring,
    alternating (module docstring). ``args``: ``model``, ``steps``, ``rounds``, ``seq_len``,
    ``micro_batch``, ``out``."""
    init_distributed("cpu", args.timeout)
    n = dist.get_world_size()
    world_topo = Topology(dp=n, timeout_s=args.timeout)
    topos = {impl: Topology(dp=n, timeout_s=args.timeout, collectives=impl)
             for impl in ("native", "ring")}
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
    work = make_workload(args.model, args.seq_len, args.vocab or 4096, 4096)
    global_batch = args.micro_batch * n
    runs = {}
    for zero in (2, 3):
        for impl, topo in topos.items():
            run = make_run(lambda m, t=topo, z=zero: parallelize(m, t, Layout(dp=n, zero=z)),
                           args.model, work, cfg, global_batch, n, topo.index("dp"))
            runs[f"ZeRO-{zero} {impl}"] = {**run, "topo": topo, "zero": zero, "impl": impl,
                                           "lo": [], "wchar": [], "sent": [], "booked": []}

    def one_step(r):
        topo = r["topo"]
        _barrier(world_topo)
        lo0, w0 = lo_tx_bytes(), wchar()
        dt, _ = timed_step(r, work, args.micro_batch, topo)
        w1 = wchar()
        _barrier(world_topo)
        lo1 = lo_tx_bytes()
        grad = [x for x in topo.ledger.step_records() if x.tag == "grad"]
        r["booked"].append(sum(x.wire_bytes for x in grad))
        r["sent"].append(sent_total(grad))
        r["lo"].append(None if lo0 is None or lo1 is None else lo1 - lo0)
        r["wchar"].append(None if w0 is None or w1 is None else w1 - w0)
        return dt

    for r in runs.values():  # warm-up
        one_step(r)
        for k in ("lo", "wchar", "sent", "booked", "times"):
            r[k].clear()
    order: list[str] = []
    alternate(runs, args.rounds, args.steps, one_step, order)
    results = []
    for name, r in runs.items():
        # every rank's step time, wchar and sent bytes, summed or maxed over the ranks
        v = torch.tensor([statistics.median(r["times"]),
                          statistics.median([w for w in r["wchar"] if w is not None] or [-1]),
                          r["booked"][-1], r["sent"][-1] if r["sent"][-1] is not None else -1.0],
                         dtype=torch.float64)
        mx, sm = v.clone(), v.clone()
        comm.all_reduce(mx, world_topo, "world", op="max", tag="bench")
        comm.all_reduce(sm, world_topo, "world", tag="bench")
        results.append({"variant": name, "zero": r["zero"], "impl": r["impl"],
                        "median_step_s": float(mx[0]),
                        "grad_booked_bytes_all_ranks": float(sm[2]),
                        "grad_sent_bytes_all_ranks": float(sm[3]) if mx[3] >= 0 else None,
                        "step_wchar_bytes_all_ranks": float(sm[1]) if mx[1] >= 0 else None,
                        "step_lo_bytes": statistics.median([x for x in r["lo"] if x is not None]
                                                           or [float("nan")]),
                        "steps_timed": len(r["times"])})
    if dist.get_rank() == 0:
        native = {x["zero"]: x for x in results if x["impl"] == "native"}
        for x in results:
            x["vs_native"] = x["median_step_s"] / native[x["zero"]]["median_step_s"]
            # per round: this variant's median / native's median in the same round (rank 0's
            # steps), then the median over rounds: drift between rounds cancels
            mine, base = runs[x["variant"]]["times"], runs[f"ZeRO-{x['zero']} native"]["times"]
            per_round = [(mine[k:k + args.steps], base[k:k + args.steps])
                         for k in range(0, len(mine), args.steps)]
            x["vs_native_paired"] = statistics.median(
                statistics.median(a) / statistics.median(b) for a, b in per_round)
            x["wchar_vs_native"] = (x["step_wchar_bytes_all_ranks"] or math.nan) / \
                (native[x["zero"]]["step_wchar_bytes_all_ranks"] or math.nan)
        columns = [("variant", "---", lambda x: x["variant"]),
                   ("median step (ms)", "---:", lambda x: f"{x['median_step_s'] * 1e3:.1f}"),
                   ("step / native", "---:", lambda x: f"{x['vs_native']:.3f}"),
                   ("paired", "---:", lambda x: f"{x['vs_native_paired']:.3f}"),
                   ("grad booked (MB, all ranks)", "---:",
                    lambda x: f"{x['grad_booked_bytes_all_ranks'] / 1e6:.2f}"),
                   ("grad sent (MB)", "---:", lambda x: None if x["grad_sent_bytes_all_ranks"]
                    is None else f"{x['grad_sent_bytes_all_ranks'] / 1e6:.2f}"),
                   ("step wchar (MB)", "---:", lambda x: None if x["step_wchar_bytes_all_ranks"]
                    is None else f"{x['step_wchar_bytes_all_ranks'] / 1e6:.2f}"),
                   ("step lo (MB)", "---:", lambda x: f"{x['step_lo_bytes'] / 1e6:.2f}"),
                   ("wchar / native", "---:", lambda x: f"{x['wchar_vs_native']:.3f}")]
        head = (f"ZeRO-2/3 payoff: model {args.model}, dp={n}, {args.micro_batch} × "
                f"{args.seq_len} tokens per rank per step, {args.rounds} rounds × {args.steps} "
                f"steps per variant, alternating; --collectives native vs ring; "
                f"torch {torch.__version__}")
        write_report(results, columns, args.out, f"bench_zero_collectives_dp{n}", head=head,
                     data={"config": vars(args) | {"dp": n}, "order": order,
                           "results": results})
    return 0
