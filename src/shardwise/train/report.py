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
