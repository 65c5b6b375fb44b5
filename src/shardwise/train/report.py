"""What the training loop reports about a run's layout and traffic: the process groups (log lines
at start), the bytes of the first step next to the layout's formula (log lines), and the step's
collectives as ``ledger.json`` in the run folder (rank 0). The formulas are
:func:`shardwise.formulas.step_bytes_formula`'s; the bytes are the ledger's (phase "step")."""

from __future__ import annotations

from pathlib import Path

from ..config import TrainConfig
from ..formulas import step_bytes_formula
from ..topology import AXES


def describe_groups(topo) -> list[str]:
    """Log lines: the mesh shape and, per axis of size > 1, the global ranks of each group
    (from ``topo.grid`` [pp, dp, cp, tp], tp innermost; shown as [pp, dp, tp] when cp = 1),
    and with expert parallelism the ep and edp groups inside each data line."""
    grid = topo.grid
    if grid.dim() == 4 and grid.shape[2] == 1:
        grid = grid.squeeze(2)
    axes = AXES if grid.dim() == 4 else tuple(a for a in AXES if a != "cp")
    names = ", ".join(axes)
    if grid.dim() == 4:
        rule = (f"((pp·{topo.size('dp')} + dp)·{topo.size('cp')} + cp)·{topo.size('tp')} + tp")
    else:
        rule = f"(pp·{topo.size('dp')} + dp)·{topo.size('tp')} + tp"
    lines = [f"  mesh ({names}) = {tuple(grid.shape)}, rank r = {rule}"]
    groups = {axis: grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
              for dim, axis in enumerate(axes) if grid.shape[dim] > 1}
    if grid.dim() == 4:  # cp > 1: the gradient sync's dp × cp lines (the data axis)
        p, dp, cp, tp = grid.shape
        groups["dp_cp (gradients)"] = grid.permute(0, 3, 1, 2).reshape(p * tp, dp * cp).tolist()
    if getattr(topo, "dp_replicate", 1) > 1:  # HSDP inside each dp line
        p, dp, cp, tp = topo.grid.shape
        lines_dp = topo.grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist()
        shard = dp // topo.dp_replicate
        groups["dp_shard (ZeRO shards)"] = [ln[r:r + shard] for ln in lines_dp
                                            for r in range(0, dp, shard)]
        groups["dp_replicate (replicas)"] = [ln[j::shard] for ln in lines_dp
                                             for j in range(shard)]
    if getattr(topo, "ep", 1) > 1:  # expert parallelism inside each data line
        p, dp, cp, tp = topo.grid.shape
        data = topo.grid.permute(0, 3, 1, 2).reshape(p * tp, dp * cp).tolist()
        ep = topo.size("ep")
        groups["ep (experts shared out)"] = [line[g:g + ep] for line in data
                                             for g in range(0, dp * cp, ep)]
        if ep < dp * cp:
            groups["edp (expert gradients)"] = [line[j::ep] for line in data
                                                for j in range(ep)]
    for axis, lines_of in groups.items():
        lines.append(f"    {axis} groups: " + " ".join(
            "{" + ",".join(map(str, g)) + "}" for g in lines_of))
    return lines


ZERO_WORDS = {  # what each stage shards over the data axis (ZeRO paper §5; ZeRO-3 = FSDP)
    0: ("DP", "parameters, gradients and {opt} replicated over {over}"),
    1: ("ZeRO-1", "{opt} sharded over {over} (parameters and gradients replicated)"),
    2: ("ZeRO-2", "gradients and {opt} sharded over {over} (parameters replicated)"),
    3: ("ZeRO-3 / FSDP", "parameters, gradients and {opt} sharded over {over}"),
}


def _dp_implementation(layout, engine: str) -> str:
    """What runs the data axis on ``engine``, and its traffic: the table of
    :func:`shardwise.parallel.apply.dp_sync` (a whole model) and of
    :func:`shardwise.parallel.apply._pipeline` (a pipeline stage)."""
    z = layout.zero
    if layout.pp > 1:  # a stage: our DP (no overlap), ZeRO-1 (ours, or torch's optimizer)
        dp = "our DP: gradients all-reduced in buckets after the last micro-batch (parallel/dp)"
        if z == 1:
            return ("our pipeline-stage ZeRO-1: gradients reduce-scattered, updated parameters "
                    "all-gathered (parallel/zero/stage_zero1.py)" if engine == "explicit"
                    else f"ZeroRedundancyOptimizer over {dp}")
        return dp
    flat = "gradients reduce-scattered, updated parameters all-gathered (flat shards, " \
           "parallel/zero)"
    if engine == "explicit":
        return {0: "our DP: gradients all-reduced in buckets (parallel/dp)",
                1: f"our ZeRO-1: {flat}", 2: f"our ZeRO-2: {flat}",
                3: "our ZeRO-3: each unit all-gathered before use and freed after, gradients "
                   "reduce-scattered (parallel/zero)"}[z]
    if layout.cp > 1:
        return "DDP inside torch's context_parallel"
    if layout.tp > 1:  # FSDP2 over DTensor TP (parallel/zero/fsdp2.py)
        return {0: "FSDP2 replicate over DTensor TP: gradients all-reduced",
                1: "FSDP2 fully_shard without resharding after forward, over DTensor TP "
                   "(PyTorch has no optimizer-state-only sharding of DTensor parameters: "
                   "parameters and gradients are sharded too, ZeRO-2's traffic)",
                2: "FSDP2 fully_shard without resharding after forward, over DTensor TP",
                3: "FSDP2 fully_shard over DTensor TP"}[z]
    return {0: "DDP: gradients all-reduced in buckets",
            1: "ZeroRedundancyOptimizer over DDP: gradients all-reduced, updated parameters "
               "broadcast from their owners",
            2: "FSDP2 fully_shard(reshard_after_forward=False): parameters sharded at rest too, "
               "gathered once per micro-step",
            3: "FSDP2 fully_shard: each unit all-gathered before use and freed after, gradients "
               "reduce-scattered"}[z]


def describe_layout(layout, engine: str = "explicit", *, optimizer: str = "adamw",
                    microbatches: int = 0) -> list[str]:
    """Start-up lines naming ``layout`` (a :class:`~shardwise.parallel.layout.Layout`) in the
    field's words, one per dimension that splits something, each with what ``engine`` runs it
    with: the data axis as DP, ZeRO-1 (optimizer state), ZeRO-2 (+ gradients) or ZeRO-3 / FSDP
    (+ parameters), HSDP's replicas × shards; Megatron TP (+ SP); CP; EP; the pipeline's
    schedule, chunks, ``microbatches`` and placement. E.g. for ``--dp 4 --zero 3``:
    ``"  ZeRO-3 / FSDP: parameters, gradients and AdamW state sharded over dp = 4 — our ZeRO-3:
    each unit all-gathered before use and freed after, …"``. A world of one: no parallelism."""
    from ..parallel.pp.schedules import placement_of

    opt = "AdamW state" if optimizer == "adamw" else "optimizer state (Muon's and AdamW's)"
    lines = []
    data = layout.dp * layout.cp
    if data > 1:  # parameters are replicated over dp × cp: the gradient sync's axis
        over = f"dp × cp = {layout.dp} × {layout.cp}" if layout.cp > 1 else f"dp = {layout.dp}"
        name, what = ZERO_WORDS[layout.zero]
        if layout.dp_replicate > 1:  # HSDP: ZeRO within each shard group, replicas across
            r, shard = layout.dp_replicate, layout.dp_shard
            over = (f"dp_shard = {shard}" + (f" × cp = {layout.cp}" if layout.cp > 1 else "")
                    + f" within each replica, the shards' gradients all-reduced across "
                      f"dp_replicate = {r} replicas")
            name = f"HSDP (dp = {r} replicas × {shard} shards) with {name}"
        impl = _dp_implementation(layout, engine)
        if layout.dp_replicate > 1 and engine == "torch":
            impl += " on a 2-D (dp_replicate, dp_shard) mesh"
        lines.append(f"{name}: {what.format(opt=opt, over=over)} — {impl}")
    if layout.tp > 1:
        impl = ("our column- and row-parallel layers (parallel/tp)" if engine == "explicit" else
                "DTensor TP: parallelize_module and loss_parallel (parallel/tp/dtensor.py)")
        sp = (" + sequence parallelism (norms and dropout on 1/tp of the sequence)"
              if layout.sp else "")
        lines.append(f"TP: Megatron tensor parallelism over tp = {layout.tp}, weight matrices "
                     f"split by columns then rows{sp} — {impl}")
    if layout.cp > 1:
        how = ("ring attention (K/V blocks passed around the ring)"
               if layout.cp_method == "ring" else "all-gathered K/V (Llama 3's)")
        impl = "our attention (parallel/cp)" if engine == "explicit" else \
            "torch's context_parallel"
        lines.append(f"CP: each sequence split over cp = {layout.cp}, {how} — {impl}")
    if layout.ep > 1:
        lines.append(f"EP: the experts shared out over ep = {layout.ep} ranks of the data axis, "
                     "tokens dispatched by all-to-all — ours (parallel/ep)")
    if layout.pp > 1:
        v, place = layout.chunks, placement_of(layout.schedule)
        where = (f"V placement: pp rank r holds stages r and {2 * layout.pp - 1}−r"
                 if place == "v" else
                 "loop placement: stage s on pp rank s mod pp" if v > 1 else
                 "stage s on pp rank s")
        m = f", m = {microbatches} micro-batches" if microbatches else ""
        impl = ("our schedule runner (parallel/pp)" if engine == "explicit"
                else "torch.distributed.pipelining")
        lines.append(f"PP: {layout.pp} ranks × {v} stage{'s' if v > 1 else ''} each, schedule "
                     f"{layout.schedule}{m}, {where} — {impl}")
    if not lines:
        lines.append("one process: no parallelism (the single-process reference)")
    return [f"  {line}" for line in lines]


def describe_traffic(topo, engine, cfg: TrainConfig) -> list[str]:
    """Log lines after step 1: the bytes this rank sent in the step per axis, *measured* by the
    ledger (phase "step"), next to the layout's formula total (:mod:`shardwise.formulas`), and
    what a recompute (``--ac``) re-sent. Every rank computes it; rank 0 logs."""
    per_axis: dict[str, float] = {}
    for r in topo.ledger.step_records():
        per_axis[r.axis] = per_axis.get(r.axis, 0.0) + r.wire_bytes
    measured = sum(per_axis.values())
    _, n_micro = cfg.microbatching()
    try:
        formula = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                     sequences=cfg.global_batch // cfg.dp, seq_len=cfg.seq_len,
                                     dtype=cfg.dtype)["total"]
        ratio = f"{measured / formula:.4f}" if formula else "—"
        tail = f"; formula {formula:,.0f} B, ledger/formula {ratio}"
    except NotImplementedError:
        tail = "; no formula for this engine"
    parts = ", ".join(f"{a} {b:,.0f} B" for a, b in sorted(per_axis.items()) if b)
    lines = [f"  traffic per step (rank 0, ledger of step 1): {parts or 'none'} = "
             f"{measured:,.0f} B{tail}"]
    recompute = sum(r.wire_bytes for r in topo.ledger.records[topo.ledger._step_start:]
                    if r.phase == "recompute")
    if recompute:
        lines.append(f"  recompute (--ac {cfg.ac}) re-sent {recompute:,.0f} B in backward, "
                     "booked outside the step (phase \"recompute\")")
    return lines


def write_ledger_json(path: Path, topo, engine, cfg: TrainConfig) -> None:
    """One step's collectives next to the formula of the layout (see :mod:`shardwise.formulas`)."""
    micro_batch, n_micro = cfg.microbatching()
    expected = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                  sequences=cfg.global_batch // cfg.dp, seq_len=cfg.seq_len,
                                  dtype=cfg.dtype)
    measured = topo.ledger.step_bytes()
    topo.ledger.to_json(path, extra={
        "layout": topo.describe(), "engine": cfg.engine,
        "formula": expected, "measured_total": measured,
        "ratio": (measured / expected["total"]) if expected["total"] else None,
    })
