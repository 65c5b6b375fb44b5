"""``shardwise trace``: one training step of a layout, every collective in sight.

:func:`trace_worker` runs one step of a layout on synthetic data (two under a pipeline, tracing
the second, warm one); rank 0 prints every collective of the step (op, axis, group size, tag,
dtype, shape, the bytes booked by the formula and, under ``--collectives ring|tree|auto``,
the bytes really handed to send, each algorithm step's sends beneath it, ms), then per tag
the ledger's bytes next to the formula of
:func:`shardwise.formulas.step_bytes_formula`, and the model state this rank holds next to
:func:`shardwise.formulas.memory_formula`.

:func:`trace_pipeline` gathers one step's action timestamps from every pp rank
(:func:`gather_timeline`, a collective over "pp") and draws
them with :mod:`shardwise.viz.timeline`: ``<name>.png`` (ranks × time, one colour per action
kind) and ``<name>.trace.json`` (Chrome trace, opens in ui.perfetto.dev). ``shardwise trace
--pp 4 --schedule 1f1b --microbatches 8`` calls it after its step; so does ``shardwise bench
--suite pp``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import comm
from ..comm.ledger import sent_total
from ..config import TrainConfig
from ..formulas import memory_formula, step_bytes_formula
from ..parallel.apply import Layout, parallelize
from ..parallel.pp import KINDS, Event
from ..topology import Topology
from ..train.step import train_step
from ..train.workload import SyntheticLMWorkload
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


def trace_worker(cfg: TrainConfig) -> int:
    """One training step of ``cfg``'s layout on synthetic data; rank 0 prints every collective
    of the step and, per tag, the ledger's bytes next to the formula."""
    import os

    import torch.distributed as dist

    from ..config import validate
    from ..topology import init_distributed

    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed(cfg.device, cfg.timeout)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, cp=cfg.cp, device=cfg.device, timeout_s=cfg.timeout,
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
            layers_per_stage=cfg.stage_split(), seed=cfg.seed, reduce_dtype=cfg.reduce_dtype),
        overrides={**cfg.model_overrides(), "ac": cfg.ac})
    # --ac: a recompute's collectives (TP) are booked apart from the step (phase "recompute")
    from ..models import set_activation_checkpointing

    set_activation_checkpointing(model, cfg.ac, lambda: topo.ledger.phase("recompute"))
    micro_batch, n_micro = cfg.microbatching()
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    for _ in range(2 if layout.pp > 1 else 1):  # pipeline: trace the second, warm step
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
    if dist.get_rank() == 0:
        from ..models import LlamaConfig, preset_config

        mcfg = preset_config(cfg.model, work.vocab_size or 4096, **cfg.model_overrides())
        if isinstance(mcfg, LlamaConfig):
            mcfg.tie_embeddings = cfg.tie_embeddings
        print(f"trace: one step of {cfg.model} ({mcfg.num_params():,} parameters in the model), "
              f"{layout.name()} = {topo.describe()}, engine={cfg.engine}; rank 0's collectives:")
        print(f"{'#':>3} {'op':<15} {'axis':<5} {'n':>2} {'tag':<9} {'dtype':<8} {'shape':<16} "
              f"{'S bytes':>12} {'booked bytes':>13} {'sent bytes':>12} {'impl':<17} "
              f"{'ms':>8}")
        for i, r in enumerate(recs):
            print(f"{i:>3} {r.op:<15} {r.axis:<5} {r.group_size:>2} {r.tag:<9} {r.dtype:<8} "
                  f"{str(list(r.shape)):<16} {r.size_bytes:>12,} {r.wire_bytes:>13,.1f} "
                  f"{_sent(r.sent_bytes):>12} {r.impl:<17} {r.seconds * 1e3:>8.2f}")
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
        print(f"{'total (rank 0)':<20} {total:>16,.1f} {formula['total']:>16,.1f} "
              f"{_ratio(total, formula['total']):>8} {_sent(sent):>14} "
              f"{_ratio(sent, formula['total']) if sent is not None else '—':>12}")
        print("(booked: the ring formula's bytes, what the ledger compares with the layout's "
              "formula; sent: the bytes handed to send, measured under --collectives "
              f"ring|tree|auto, — for the backend's own; this run: --collectives "
              f"{cfg.collectives})")
        g = gathered.view(-1, 2)
        worst = max((abs(a / b - 1) if b else abs(a)) for a, b in g.tolist())
        print(f"all {topo.world_size} ranks: ledger / formula within {worst:.2e} of 1")
        print(f"{'model state (rank 0)':<20} {'measured bytes':>16} {'formula bytes':>16} "
              f"{'ratio':>8}")
        for key in ("params", "grads", "optimizer", "total"):
            f = mem_formula.get(key) if mem_formula else None
            shown = f"{f:,.1f}" if f is not None else "—"
            print(f"{key:<20} {mem[key]:>16,} {shown:>16} {_ratio(mem[key], f):>8}")
        if mem_formula:
            print("(optimizer: the formula's 8Ψ leaves out AdamW's fp32 step counter per tensor)")
        else:
            print(f"(no closed form wired for {type(engine).__name__}'s memory: measured only)")
        if "gathered_params_peak" in mem:
            print(f"ZeRO-3 gathered-parameter peak: {mem['gathered_params_peak']:,} bytes")
        if pictures:
            print(f"pipeline timeline of this run: {pictures['png']} (Perfetto: "
                  f"{pictures['trace']}); measured bubble {pictures['bubble']:.3f}")
    return 0


def gather_timeline(engine, topo) -> list:
    """Every pp rank's action timestamps of ``engine``'s last step, on every rank of the pp
    line, as :class:`~shardwise.parallel.pp.Event` s with times in seconds from the earliest start.

    Collective over "pp" (call it on every rank of the line): one all_reduce(max) of the row
    count and one all_gather of [rows, 6] fp64 (kind, microbatch, chunk, peer, start, end),
    booked in phase "trace". Timestamps are ``time.time()``: one host's clock is shared by its
    processes; across hosts they are only as aligned as the hosts' clocks."""
    kinds = KINDS + ("STEP",)
    rows = torch.tensor([[kinds.index(k), mb, c, peer, t0, t1]
                         for k, mb, c, peer, t0, t1 in engine.timeline],
                        dtype=torch.float64).reshape(-1, 6)
    device = next(engine.module.parameters()).device
    n = torch.tensor([float(len(rows))], dtype=torch.float64, device=device)
    p = topo.size("pp")
    with topo.ledger.phase("trace"):
        comm.all_reduce(n, topo, "pp", op="max", tag="trace")
        n = int(n.item())
        mine = torch.full((n, 6), -1.0, dtype=torch.float64)
        mine[: len(rows)] = rows
        mine = mine.to(device)
        everyone = torch.empty((p * n, 6), dtype=torch.float64, device=device)
        comm.all_gather(everyone, mine, topo, "pp", tag="trace")
    everyone = everyone.cpu()
    valid = everyone[:, 0] >= 0
    t_min = float(everyone[valid, 4].min()) if valid.any() else 0.0
    events = []
    for i, (k, mb, c, peer, t0, t1) in enumerate(everyone.tolist()):
        if k < 0:
            continue
        events.append(Event(rank=i // n, kind=kinds[int(k)], microbatch=int(mb), chunk=int(c),
                            start=t0 - t_min, end=t1 - t_min,
                            peer=None if peer < 0 else int(peer)))
    return events
