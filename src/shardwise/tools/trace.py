"""``shardwise trace``: one training step of a layout, every collective in sight.

:func:`trace_worker` runs one step of a layout on synthetic data (two under a pipeline, tracing
the second, warm one); rank 0 prints every collective of the step (op, axis, group size, tag,
dtype, shape, the bytes booked by the formula and, under ``--collectives ring|tree|auto``,
the bytes really handed to send, each algorithm step's sends beneath it, ms), then per tag
the ledger's bytes next to the formula of
:func:`shardwise.formulas.step_bytes_formula`, and the model state this rank holds next to
:func:`shardwise.formulas.memory_formula`. Under ``--cp N`` it then prints the cp section
(:func:`ring_section`, :func:`allgather_section`): read back from the ledger's records in the
order they were booked, the ring's sends block by block — at each ring step t, whose K/V this
rank holds, the chunk pairs it computes with them, what it sends to which cp rank and what it
receives, its bytes next to 2·b·(s/cp)·k·hd·elem — for every layer and pass of the first
micro-batch, and the number of sends against (n − 1)·L·m and n·L·m; or, for ``--cp-method
allgather``, each layer's all-gather and reduce-scatter.

:func:`trace_pipeline` gathers one step's action timestamps from every pp rank
(:func:`~shardwise.report.timeline.gather_timeline`, a collective over "pp") and draws
them with :mod:`shardwise.viz.timeline`: ``<name>.png`` (ranks × time, one colour per action
kind) and ``<name>.trace.json`` (Chrome trace, opens in ui.perfetto.dev). ``shardwise trace
--pp 4 --schedule 1f1b --microbatches 8`` calls it after its step; so does ``shardwise bench
--suite pp``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .. import comm
from ..comm.ledger import sent_total
from ..config import TrainConfig
from ..formulas import memory_formula, step_bytes_formula
from ..parallel.apply import Layout, parallelize
from ..precision import Precision
from ..parallel.cp import ContextParallelAttention, chunk_ids
from ..parallel.cp.attention import _pairs
from ..topology import Topology
from ..train.step import train_step
from ..train.workload import SyntheticLMWorkload
from ..report.timeline import gather_timeline
from ..viz.timeline import bubble_of, draw_timeline, write_chrome_trace
from .verify import build_case, verify_workload


def trace_pipeline(engine, topo, out_dir, name: str = "pipeline_timeline",
                   title: str | None = None) -> dict | None:
    """Gather ``engine``'s last step (every pp rank must call this: it is a collective over
    "pp") and, on pp index 0 of dp index 0, write ``out_dir/<name>.png`` and
    ``out_dir/<name>.trace.json``. Returns ``{"png", "trace", "bubble", "events"}`` there
    (bubble: measured fraction; events: times in seconds), None on the other ranks."""
    events = gather_timeline(engine, topo)
    if topo.index("pp") != 0 or topo.index("dp") != 0:
        return None
    out = Path(out_dir)
    p = topo.size("pp")
    m = max((e.microbatch for e in events), default=-1) + 1
    title = title or (f"{engine.schedule_name}: pp={p}, m={m}, v={engine.v} — real run, "
                      f"{type(engine).__name__}")
    png = draw_timeline(events, out / f"{name}.png", title=title, unit="seconds")
    trace = write_chrome_trace(events, out / f"{name}.trace.json", time_scale=1e6)
    return {"png": str(png), "trace": str(trace), "bubble": bubble_of(events, p),
            "events": events}


def _ratio(measured: float, formula: float | None) -> str:
    return f"{measured / formula:.4f}" if formula else "—"


def _sent(b: float | None) -> str:
    return "—" if b is None else f"{b:,.1f}"


def _expand(rec, topo) -> list[str]:
    """One line per step of a collective our algorithms ran: the sends to each peer (global
    rank), e.g. ``      step 0: → rank 1  18,560 B``."""
    out = []
    for step, to, b in rec.sends:
        peer = topo.global_rank(rec.axis, to)
        out.append(f"{'':>9}step {step}: → rank {peer} {b:>12,} B")
    return out


def trace_worker(cfg: TrainConfig, show_ranks: str = "0") -> int:
    """One training step of ``cfg``'s layout on synthetic data; rank ``show_ranks`` (a rank, or
    "all": each in turn) prints every collective of its step in the order it issued them and,
    per tag, the ledger's bytes next to the formula."""
    import os

    import torch.distributed as dist

    from ..config import validate
    from ..topology import init_distributed

    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed(cfg.device, cfg.timeout)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, cp=cfg.cp, ep=cfg.ep, dp_replicate=cfg.dp_replicate,
                    device=cfg.device,
                    timeout_s=cfg.timeout,
                    collectives=cfg.collectives, check_collectives=cfg.check_collectives)
    work = (verify_workload(cfg.model, cfg.seed, cfg.model_overrides())
            if cfg.model.startswith("mlp")
            else SyntheticLMWorkload(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                     num_train=cfg.global_batch, num_val=1, seed=cfg.seed))
    layout = Layout.from_config(cfg)
    model, engine, opt, sched = build_case(
        cfg.model, work, cfg, lambda m: parallelize(
            m.to(topo.device), topo, layout, engine=cfg.engine, bucket_mb=cfg.bucket_mb,
            overlap=cfg.overlap, prefetch=cfg.prefetch,
            reshard_after_forward=cfg.reshard_after_forward,
            layers_per_stage=cfg.stage_split(), seed=cfg.seed,
            precision=Precision.from_config(cfg)),
        overrides={**cfg.model_overrides(), "ac": cfg.ac})
    # --ac: a recompute's collectives (TP) are booked apart from the step (phase "recompute")
    from ..models import set_activation_checkpointing

    set_activation_checkpointing(model, cfg.ac, lambda: topo.ledger.phase("recompute"))
    micro_batch, n_micro = cfg.microbatching()
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    for _ in range(2 if layout.pp > 1 else 1):  # pipeline: trace the second, warm step
        first = len(topo.ledger.records)  # this step's records, the recompute's too (cp view)
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro_batch), opt,
                         topo, max_norm=cfg.grad_clip, scheduler=sched, dtype=cfg.dtype,
                         measure_memory=True)
    mem, mem_formula = res.state_bytes, memory_formula(engine, topo)
    recs = topo.ledger.step_records()
    formula = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                 sequences=cfg.global_batch // cfg.dp, seq_len=cfg.seq_len,
                                 dtype=cfg.dtype)
    pictures = None
    if layout.pp > 1:  # the real run's timeline (every pp rank takes part; pp index 0 draws)
        pictures = trace_pipeline(engine, topo, cfg.out or "runs/trace",
                                  name=f"trace_{cfg.schedule}")
    measured = {}
    for r in recs:
        measured[r.tag] = measured.get(r.tag, 0.0) + r.wire_bytes
    # every rank reports its totals; rank 0 prints its own records and every rank's totals
    totals = torch.tensor([sum(measured.values()), formula["total"]], dtype=torch.float64)
    gathered = torch.zeros(topo.world_size * 2, dtype=torch.float64)
    with topo.ledger.phase("verify"):
        comm.all_gather(gathered, totals, topo, "world")
    split = ep_split_matrices(engine, topo) if layout.ep > 1 else None
    # issue order: records are booked when they complete (an irecv posted first can be booked
    # after later sends); each says when it was launched
    if all(r.issued is not None for r in recs):
        recs = sorted(recs, key=lambda r: r.issued)
        order = "in the order it issued them"
    else:
        order = "in the order they completed (this engine's records carry no launch time)"
    shown = range(topo.world_size) if show_ranks == "all" else [int(show_ranks)]
    text = ""
    if dist.get_rank() in shown:  # each shown rank writes its part; rank 0 prints them in order
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _print_rank(cfg, work, layout, topo, engine, recs, order, measured, formula,
                        gathered, mem, mem_formula, pictures, split, first, n_micro)
        text = buf.getvalue()
    texts = [None] * topo.world_size
    dist.all_gather_object(texts, text)  # outside the ledger: not part of the step
    if dist.get_rank() == 0:
        print("\n".join(t.rstrip("\n") for t in texts if t), flush=True)
    return 0


def _print_rank(cfg, work, layout, topo, engine, recs, order, measured, formula, gathered,
                mem, mem_formula, pictures, split, first, n_micro) -> None:
    """What ``trace`` prints for this rank: its collectives, per tag and axis against the
    formula, the model state, the pipeline's bubble, the cp and ep sections."""
    import torch.distributed as dist

    from ..models import LlamaConfig, preset_config

    mcfg = preset_config(cfg.model, work.vocab_size or 4096, **cfg.model_overrides())
    if isinstance(mcfg, LlamaConfig):
        mcfg.tie_embeddings = cfg.tie_embeddings
    me = dist.get_rank()
    print(f"trace: one step of {cfg.model} ({mcfg.num_params():,} parameters in the model), "
          f"{layout.name()} = {topo.describe()}, engine={cfg.engine}; rank {me}'s "
          f"collectives, {order}:")
    notes = any(r.note for r in recs)  # what the strategy noted at launch (ZeRO-3: the unit)
    print(f"{'#':>3} {'op':<15} {'axis':<5} {'n':>2} {'tag':<9} {'dtype':<8} {'shape':<16} "
          f"{'S bytes':>12} {'booked bytes':>13} {'sent bytes':>12} {'impl':<17} "
          f"{'ms':>8}" + ("  for (block/unit, direction)" if notes else ""))
    for i, r in enumerate(recs):
        print(f"{i:>3} {r.op:<15} {r.axis:<5} {r.group_size:>2} {r.tag:<9} {r.dtype:<8} "
              f"{str(list(r.shape)):<16} {r.size_bytes:>12,} {r.wire_bytes:>13,.1f} "
              f"{_sent(r.sent_bytes):>12} {r.impl:<17} {r.seconds * 1e3:>8.2f}"
              + (f"  {r.note}" if notes else ""))
        for line in _expand(r, topo):
            print(line)
    print(f"{'tag':<20} {'ledger bytes':>16} {'formula bytes':>16} {'ratio':>8} "
          f"{'sent bytes':>14} {'sent/formula':>12}")
    for tag in sorted(set(measured) | {k for k in formula if k != "total"}):
        m, f = measured.get(tag, 0.0), formula.get(tag, 0.0)
        if m or f:  # tags this layout does not use (0 = 0) are left out
            sent = sent_total([r for r in recs if r.tag == tag])
            print(f"{tag:<20} {m:>16,.1f} {f:>16,.1f} {_ratio(m, f):>8} "
                  f"{_sent(sent):>14} {_ratio(sent, f) if sent is not None else '—':>12}")
    total, sent = sum(measured.values()), sent_total(recs)
    print(f"{f'total (rank {me})':<20} {total:>16,.1f} {formula['total']:>16,.1f} "
          f"{_ratio(total, formula['total']):>8} {_sent(sent):>14} "
          f"{_ratio(sent, formula['total']) if sent is not None else '—':>12}")
    for line in axis_lines(recs, formula):
        print(line)
    print("(booked: the ring formula's bytes, what the ledger compares with the layout's "
          "formula; sent: the bytes handed to send, measured under --collectives "
          f"ring|tree|auto, — for the backend's own; this run: --collectives "
          f"{cfg.collectives})")
    g = gathered.view(-1, 2)
    worst = max((abs(a / b - 1) if b else abs(a)) for a, b in g.tolist())
    print(f"all {topo.world_size} ranks: ledger / formula within {worst:.2e} of 1")
    print(f"{f'model state (rank {me})':<20} {'measured bytes':>16} {'formula bytes':>16} "
          f"{'ratio':>8}")
    for key in ("params", "grads", "optimizer", "total"):
        f = mem_formula.get(key) if mem_formula else None
        shown = f"{f:,.1f}" if f is not None else "—"
        print(f"{key:<20} {mem[key]:>16,} {shown:>16} {_ratio(mem[key], f):>8}")
    if mem_formula:
        print("(optimizer: the formula's 8Ψ leaves out AdamW's fp32 step counter per tensor)"
              if cfg.optimizer != "muon" else "(optimizer: the formula (AdamW 8Ψ on its "
              "tensors, Muon 4Ψ on its matrices) leaves out the fp32 step counter per tensor)")
    else:
        print(f"(no closed form wired for {type(engine).__name__}'s memory: measured only)")
    if "gathered_params_peak" in mem:
        print(f"ZeRO-3 gathered-parameter peak: {mem['gathered_params_peak']:,} bytes")
    if layout.pp > 1 and dist.get_rank() == 0:  # where the layers are (the V: docs §1)
        from ..parallel.pp.split import describe_placement

        print(f"pipeline stages ({cfg.schedule}):")
        for line in describe_placement(cfg.model_layers(), layout.pp, cfg.schedule,
                                       cfg.virtual_stages or None, cfg.stage_split()):
            print(f"  {line}")
    if pictures:
        print(f"pipeline timeline of this run: {pictures['png']} (Perfetto: "
              f"{pictures['trace']})")
        print(bubble_line(pictures["bubble"], cfg.schedule, layout.pp, n_micro,
                          getattr(engine, "v", 1), topo.world_size))
    if layout.cp > 1:
        print()
        for line in _cp_lines(cfg, mcfg, engine, topo, recs, first, n_micro):
            print(line)
    if split is not None:
        print()
        for line in ep_section(split, mcfg.d_model):
            print(line)


def bubble_line(measured: float, schedule: str, p: int, m: int, v: int, world: int) -> str:
    """The measured bubble next to its closed form (:func:`~shardwise.parallel.pp.simulate.
    bubble_formula`: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved), and why
    they differ on a small CPU machine."""
    import os

    from ..parallel.pp.simulate import bubble_formula

    text = {"gpipe": f"(p−1)/(m+p−1) = ({p}−1)/({m}+{p}−1)",
            "1f1b": f"(p−1)/(m+p−1) = ({p}−1)/({m}+{p}−1)",
            "interleaved-1f1b": f"(p−1)/(v·m+p−1) = ({p}−1)/({v}·{m}+{p}−1)",
            "zbv": f"(p−1)/(6m+p−1) = ({p}−1)/(6·{m}+{p}−1)",
            "dualpipev": f"(p−1)/(6m+p−1) = ({p}−1)/(6·{m}+{p}−1)"}.get(
                schedule, f"{schedule}'s formula (F, B, W of equal cost)")
    try:
        f = bubble_formula(schedule, p, m, v)
    except ValueError:  # zbv with m < 2p−1: no closed form, the simulator's (equal costs)
        from ..parallel.pp import build_schedule, simulate

        f = simulate(build_schedule(schedule, p, m, v)).bubble_fraction
        text = "the simulator's (no closed form below m = 2p−1)"
    return (f"bubble: measured {measured:.3f}, formula {text} = {f:.3f}. The formula assumes "
            f"equal stages and free messages; here a stage's work is a few small matmuls, so "
            f"each send/recv's latency and the per-action Python overhead, with {world} ranks "
            f"on {os.cpu_count()} CPU cores, weigh as much as the compute (`shardwise bench "
            f"--suite pp` measures it on a bigger model)")


def axis_lines(recs, formula: dict) -> list[str]:
    """Per mesh axis: the step's ledger bytes and the formula's, each formula tag attributed to
    the axis its collectives ran on (a tag whose records span several axes, e.g. ``loss`` over
    dp and pp, is shown as one row "a+b")."""
    axes_of: dict[str, set] = {}
    ledger: dict[str, float] = {}
    for r in recs:
        axes_of.setdefault(r.tag, set()).add(r.axis)
    for r in recs:
        key = "+".join(sorted(axes_of[r.tag]))
        ledger[key] = ledger.get(key, 0.0) + r.wire_bytes
    want: dict[str, float] = {}
    for tag, v in formula.items():
        if tag != "total" and v:
            key = "+".join(sorted(axes_of.get(tag, {"(no record)"})))
            want[key] = want.get(key, 0.0) + v
    out = [f"{'axis':<20} {'ledger bytes':>16} {'formula bytes':>16} {'ratio':>8}"]
    for key in sorted(set(ledger) | set(want)):
        m, f = ledger.get(key, 0.0), want.get(key, 0.0)
        out.append(f"{key:<20} {m:>16,.1f} {f:>16,.1f} {_ratio(m, f):>8}")
    return out


def ep_split_matrices(engine, topo) -> torch.Tensor:
    """The step's all-to-all split matrices of this rank's ep group: [L_moe, ep, ep] int64,
    entry [l, i, j] = token rows ep rank i sent to ep rank j in MoE layer l (all micro-batches,
    forward dispatch; the combine sends them back). One all_gather over "ep" (phase
    ``"verify"``, outside the step); every rank calls it."""
    from ..parallel.ep import split_matrix

    mine = torch.tensor(split_matrix(engine.module), dtype=torch.long)  # [L, ep]
    n = topo.size("ep")
    rows = torch.zeros(n * mine.numel(), dtype=torch.long)
    with topo.ledger.phase("verify"):
        comm.all_gather(rows, mine.reshape(-1), topo, "ep", tag="trace")
    return rows.view(n, *mine.shape).permute(1, 0, 2)  # [L, sender, receiver]


def ep_section(split: torch.Tensor, d: int) -> list[str]:
    """The ep section of the trace: per MoE layer, which ep rank sent how many token rows to
    which (the routing made visible), and the off-diagonal rows × d × 4 bytes each rank sends
    in the dispatch (the combine returns the transpose)."""
    n = split.shape[1]
    out = [f"ep: the all-to-all split matrices (token rows, forward dispatch; rank 0's ep "
           f"group; row = sender, column = receiver; combine = transpose; row bytes = d·4 = "
           f"{d * 4})"]
    for layer, m in enumerate(split.tolist()):
        out.append(f"  MoE layer {layer}:  " + " ".join(f"→{j:<7}" for j in range(n))
                   + "  sent to others (bytes)")
        for i, row in enumerate(m):
            others = sum(row) - row[i]
            out.append(f"    ep {i:<8}" + " ".join(f"{x:<8}" for x in row)
                       + f"  {others:,} rows = {others * d * 4:,} B")
    return out


def _cp_lines(cfg, mcfg, engine, topo, recs, first: int, n_micro: int) -> list[str]:
    """The cp section of the trace (rank 0): :func:`ring_section` or
    :func:`allgather_section` over this step's records (``first``: where they start in the
    ledger), with the K/V message formula 2·b·(s/cp)·k·hd·elem worked out for this run."""
    n, tp = topo.size("cp"), topo.size("tp")
    b, k, hd = cfg.microbatching()[0], mcfg.n_kv_heads // tp, mcfg.head_dim
    elem = 2 if cfg.dtype == "bf16" else 4
    kv = 2 * b * (cfg.seq_len // n) * k * hd
    heads = "k" if tp == 1 else "(n_kv_heads/tp)"
    text = (f"2·b·(s/cp)·{heads}·hd·{{e}} = 2·{b}·({cfg.seq_len}/{n})·{k}·{hd}·{{e}}")
    layers = [name.removesuffix(".core") for name, mod in engine.module.named_modules()
              if isinstance(mod, ContextParallelAttention)]
    numbers = {id(r): i for i, r in enumerate(recs)}  # the rows of the table above
    mine = [r for r in topo.ledger.records[first:] if r.phase in ("step", "recompute")]
    if cfg.cp_method == "allgather":
        return allgather_section(mine, numbers, topo, layers, n_micro,
                                 (kv * elem, text.format(e=elem)))
    return ring_section(mine, numbers, topo, layers, n_micro, (kv * elem, text.format(e=elem)),
                        (kv * 4, text.format(e=4)))


# ---------------------------------------------------------------- cp: the ring, block by block

def _ring_pattern(n: int, backward: bool) -> list[tuple[str, int]]:
    """The (tag, ring step t that issued it) of one ring-attention pass's exchanges over n cp
    ranks, in the order they are booked (a send is booked when its wait returns, see
    :mod:`shardwise.parallel.cp.attention`): forward t = 0 … n − 2 K/V; backward K/V at t = 0,
    then at each t ≥ 1 the dK/dV accumulator issued at t − 1 before that step's K/V, and after
    the last step the accumulator issued at n − 1."""
    if not backward:
        return [("cp_kv", t) for t in range(n - 1)]
    out = [("cp_kv", 0)]
    for t in range(1, n - 1):
        out += [("cp_dkv", t - 1), ("cp_kv", t)]
    return out + [("cp_dkv", n - 2), ("cp_dkv", n - 1)]


def ring_passes(exchanges: list[dict], n: int) -> tuple[list[dict], list[dict]]:
    """Cut ``exchanges`` (this rank's ring exchanges of one phase in booking order, each a dict
    with ``tag``) into passes: ``({"kind": "forward" | "backward", "steps": [(tag, t, ex)]}
    …, the exchanges left over)``. A backward pass starts K/V then dK/dV (n = 2: K/V, dK/dV,
    dK/dV), a forward pass is n − 1 K/V alone, so the cut is unique."""
    passes, i = [], 0
    while i < len(exchanges):
        for kind in ("backward", "forward"):
            pat = _ring_pattern(n, kind == "backward")
            got = [e["tag"] for e in exchanges[i:i + len(pat)]]
            if got == [tag for tag, _ in pat]:
                passes.append({"kind": kind, "steps": [
                    (tag, t, e) for (tag, t), e in zip(pat, exchanges[i:i + len(pat)])]})
                i += len(pat)
                break
        else:
            return passes, exchanges[i:]
    return passes, []


def _exchanges(records: list, numbers: dict) -> dict[str, list[dict]]:
    """{phase: [exchange]} from ``records``: each send on the cp axis (tag cp_kv / cp_dkv) with
    the receive booked right after it (one ring exchange's wait); ``numbers``: id(record) → its
    row in the trace's table (step records only)."""
    out: dict[str, list[dict]] = {}
    cp = [r for r in records if r.axis == "cp" and r.tag in ("cp_kv", "cp_dkv")
          and r.op in ("send", "recv")]
    for a, b in zip(cp[::2], cp[1::2]):
        if a.op != "send" or b.op != "recv" or a.tag != b.tag:
            raise ValueError(f"ring records out of order: {a.op} {a.tag}, {b.op} {b.tag}")
        out.setdefault(a.phase, []).append({"tag": a.tag, "send": a, "recv": b,
                                            "rows": (numbers.get(id(a)), numbers.get(id(b)))})
    if len(cp) % 2:
        raise ValueError("a ring send without its receive")
    return out


def _block(n: int, j: int) -> str:
    lo, hi = chunk_ids(n, j)
    return f"cp {j}'s (chunks {lo}, {hi})"


def _pairs_text(n: int, me: int, holder: int) -> str:
    """The chunk pairs rank ``me`` computes at a ring step holding ``holder``'s K/V: key chunk
    B · query chunk A, full if B < A, causal if B = A; skipped if B > A (attention._pairs)."""
    done = {(chunk_ids(n, holder)[kb], chunk_ids(n, me)[qa]): causal
            for qa, kb, causal in _pairs(n, me, holder)}
    every = [(b, a) for a in chunk_ids(n, me) for b in chunk_ids(n, holder)]
    shown = ", ".join(f"K{b}·Q{a} {'causal' if done[b, a] else 'full'}"
                      for b, a in every if (b, a) in done)
    skipped = [f"K{b}·Q{a}" for b, a in every if (b, a) not in done]
    return shown + (f"; {', '.join(skipped)} skipped" if skipped else "")


def _rows(ex: dict) -> str:
    a, b = ex["rows"]
    return f"#{a}/#{b}" if a is not None else "(recompute)"


def ring_section(records: list, numbers: dict, topo, layers: list[str], m: int,
                 kv: tuple[float, str], dkv: tuple[float, str]) -> list[str]:
    """The lines of ``trace --cp N`` (ring method) for this rank: its ring steps, block by
    block, for every layer and pass of micro-batch 0 (the others are checked to be the same),
    then the counts of sends against (n − 1)·L·m and n·L·m, and each message's bytes against
    its formula. ``records``: the step's records of phases "step" and "recompute" in booking
    order; ``layers``: this rank's attention layers in order (L); ``m``: micro-batches per step;
    ``kv``/``dkv``: (bytes of one K/V / dK/dV message by the formula, the formula written
    out)."""
    n, me = topo.size("cp"), topo.index("cp")
    nxt, prv = (me + 1) % n, (me - 1) % n
    lo, hi = chunk_ids(n, me)
    lines = [f"ring attention, cp rank {me} of {n} (global rank {topo.rank}): it holds chunks "
             f"{lo} and {hi} of the {2 * n} of each sequence; at ring step t it holds the K/V "
             f"of cp rank ({me} − t) mod {n},",
             f"  sends them on to cp rank {nxt} while it computes with them (key chunk B · "
             "query chunk A: full if B < A, causal if B = A, skipped if B > A)",
             f"  one K/V message   = {kv[1]} = {kv[0]:,.0f} B",
             f"  one dK/dV message = {dkv[1]} = {dkv[0]:,.0f} B (fp32 accumulators)"]
    by_phase = _exchanges(records, numbers)
    L = len(layers)
    counts = {}  # (pass, tag) → sends found
    worst = 0.0
    same = True  # every pass of micro-batch ≥ 1 has the steps of micro-batch 0
    for phase in ("step", "recompute"):
        passes, left = ring_passes(by_phase.get(phase, []), n)
        if left:
            lines.append(f"  {len(left)} {phase} exchange(s) fit no ring pass: "
                         f"{[e['tag'] for e in left]}")
        seen = {"forward": 0, "backward": 0}
        for p in passes:
            kind = "recompute" if phase == "recompute" else p["kind"]
            k = seen[p["kind"]]
            seen[p["kind"]] += 1
            # forward runs the layers in order; backward, and the recompute (--ac) just before
            # each layer's backward, in reverse
            layer = layers[k % L] if kind == "forward" else layers[L - 1 - k % L]
            for tag, t, ex in p["steps"]:
                counts[kind, tag] = counts.get((kind, tag), 0) + 1
                want = kv[0] if tag == "cp_kv" else dkv[0]
                for r in (ex["send"], ex["recv"]):
                    worst = max(worst, abs(r.size_bytes / want - 1))
            if k >= L:  # micro-batches ≥ 1: the same ring steps as micro-batch 0
                same &= [(tag, t) for tag, t, _ in p["steps"]] == _ring_pattern(
                    n, p["kind"] == "backward")
                continue
            lines.append(f"{layer} {kind}, micro-batch 0:")
            steps = {}
            for tag, t, ex in p["steps"]:
                steps.setdefault(t, []).append((tag, ex))
            for t in range(n):
                j = (me - t) % n
                lines.append(f"  t={t}  holds {_block(n, j)} K/V: {_pairs_text(n, me, j)}")
                for tag, ex in sorted(steps.get(t, []), key=lambda x: x[0] != "cp_kv"):
                    what = "K/V  " if tag == "cp_kv" else "dK/dV"
                    # the accumulator's n-th send (t = n − 1) reaches its owner, and this rank
                    # receives its own, complete
                    desc = (f"{what} of cp {j} → cp {nxt} (its owner), receives cp {me}'s "
                            f"(complete) ← cp {prv}" if tag == "cp_dkv" and t == n - 1 else
                            f"{what} of cp {j} → cp {nxt}, receives cp {(j - 1) % n}'s "
                            f"← cp {prv}")
                    sent, got = ex["send"].size_bytes, ex["recv"].size_bytes
                    want = kv[0] if tag == "cp_kv" else dkv[0]
                    lines.append(f"       {_rows(ex):<11} {desc:<66} {sent:>9,} B  "
                                 f"{sent / want:.4f}"
                                 f"{'' if got == sent else f'  (received {got:,} B)'}")
                if t == n - 1 and p["kind"] != "backward":
                    lines.append("       (last step: nothing sent)")
    if m > 1:
        lines.append(("micro-batch 1: " if m == 2 else f"micro-batches 1–{m - 1}: ")
                     + ("the same ring steps for every layer and pass" if same
                        else "NOT the same ring steps as micro-batch 0"))
    lines.append(f"ring sends on cp rank {me}, counted in the ledger against the expected "
                 f"(L = {L} attention layers here, m = {m} micro-batches, n = {n}):")
    f = n - 1
    for kind, tag, what, mult, text in (
            ("forward", "cp_kv", "K/V", f, "(n−1)·L·m"),
            ("backward", "cp_kv", "K/V", f, "(n−1)·L·m"),
            ("backward", "cp_dkv", "dK/dV", n, "n·L·m")):
        got, want = counts.get((kind, tag), 0), mult * L * m
        lines.append(f"  {kind:<9} {what:<6} ({tag:<6}) {got:>4} sends, expected {text} = "
                     f"{mult}·{L}·{m} = {want}{'' if got == want else '  MISMATCH'}")
    if counts.get(("recompute", "cp_kv")):
        lines.append(f"  recompute K/V    (cp_kv ) {counts['recompute', 'cp_kv']:>4} sends "
                     "(--ac: phase recompute, outside the step's formula)")
    lines.append(f"  every message's bytes / formula: within {worst:.2e} of 1")
    return lines


def allgather_section(records: list, numbers: dict, topo, layers: list[str], m: int,
                      kv: tuple[float, str]) -> list[str]:
    """The lines of ``trace --cp N --cp-method allgather`` for this rank: per layer and pass
    of micro-batch 0 its all-gather of K/V (cp_kv) or reduce-scatter of dK/dV (cp_dkv), S =
    n·KV, booked (n − 1)/n · S, next to the formula; then the counts against L·m each."""
    n, L = topo.size("cp"), len(layers)
    want = comm.ring_bytes("all_gather", n * kv[0], n)
    lines = [f"all-gather attention, cp rank {topo.index('cp')} of {n}: per layer and "
             "micro-batch one all_gather of K/V (cp_kv) in forward and one reduce_scatter of "
             "dK/dV (cp_dkv) in backward",
             f"  KV = {kv[1]} = {kv[0]:,.0f} B; S = n·KV = {n * kv[0]:,.0f} B; booked "
             f"(n−1)/n·S = {want:,.1f} B"]
    counts, worst = {}, 0.0
    ops = {"all_gather": "cp_kv", "reduce_scatter": "cp_dkv"}
    for r in records:
        if r.axis != "cp" or ops.get(r.op) != r.tag:
            continue
        kind = ("recompute" if r.phase == "recompute" else
                "forward" if r.op == "all_gather" else "backward")
        k = counts.get(kind, 0)
        counts[kind] = k + 1
        worst = max(worst, abs(r.wire_bytes / want - 1))
        if k < L:
            layer = layers[L - 1 - k] if kind != "forward" else layers[k]
            row = f"#{numbers[id(r)]}" if id(r) in numbers else "(recompute)"
            lines.append(f"{layer} {kind:<9} micro-batch 0: {row:<11} {r.op:<14} {r.tag:<6} "
                         f"S {r.size_bytes:>10,} B  booked {r.wire_bytes:>10,.1f} B  "
                         f"{r.wire_bytes / want:.4f}")
    for kind, what in (("forward", "all_gather"), ("backward", "reduce_scatter")):
        got = counts.get(kind, 0)
        lines.append(f"  {kind:<9} {what:<14} {got:>4}, expected L·m = {L}·{m} = {L * m}"
                     f"{'' if got == L * m else '  MISMATCH'}")
    if counts.get("recompute"):
        lines.append(f"  recompute all_gather {counts['recompute']:>4} (--ac: phase recompute)")
    lines.append(f"  every collective's booked bytes / formula: within {worst:.2e} of 1")
    return lines
