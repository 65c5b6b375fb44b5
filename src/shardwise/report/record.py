"""What a training run records for its report, beyond ``metrics.jsonl``: ``RUN/report_data.json``.

The training loop calls a :class:`RunRecorder` at three points (every rank calls; rank 0
writes):

* :meth:`RunRecorder.start` — once the layout is built: the command line, the mesh and each
  axis's groups, the pipeline stages' blocks, the epoch bookkeeping (the dropped tail), and
  where this invocation resumed from (appended to ``invocations``, so a run resumed twice keeps
  three entries).
* :meth:`RunRecorder.first_step` — after the first step this invocation takes: that step's
  collectives one by one (what ``shardwise trace`` prints), the formula by tag, and every
  rank's ledger bytes, formula bytes and model-state bytes (one ``all_gather`` over the whole
  layout, phase ``"report"``, outside the step's bytes).
* :meth:`RunRecorder.timeline` — under a pipeline, after the second step (warm): every pp
  rank's action timestamps (:func:`shardwise.report.timeline.gather_timeline`, a collective over
  pp, phase ``"trace"``) and the measured bubble next to (p − 1)/(m + p − 1).

:func:`axis_bytes` adds ``comm_<axis>_bytes`` (this rank's ledger bytes of the step per mesh
axis) to each ``metrics.jsonl`` record. Nothing here raises into the loop for a write error of
the report file: the report is a view of the run, never a reason to stop it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from ..errors import ShardwiseFileError
from ..readers import read_json

log = logging.getLogger("shardwise")

FILE = "report_data.json"
_started: set[str] = set()  # run folders whose recording this process started (rank 0)


def started_here(out) -> bool:
    """Whether this process began recording the run folder ``out`` (its crash report may be
    written there; a run refused before that, e.g. by a busy folder, must not touch it)."""
    return str(Path(out).resolve()) in _started


def axis_bytes(topo) -> dict[str, float]:
    """``{"comm_<axis>_bytes": bytes}``: this rank's ledger bytes (phase "step") of the current
    step per mesh axis it used (e.g. ``comm_dp_bytes``, ``comm_tp_bytes``); their sum is the
    record's ``comm_bytes``."""
    out: dict[str, float] = {}
    for r in topo.ledger.step_records():
        key = f"comm_{r.axis}_bytes"
        out[key] = out.get(key, 0.0) + r.wire_bytes
    return out


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user would retype it: ``shardwise train --dp 2 …`` (``python -m
    shardwise`` and the console script both show as ``shardwise``)."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) >= 4 and argv[-2] == "--out" and argv[-4:-2] == argv[-2:]:
        argv = argv[:-2]  # the local launcher appends the --out it was already given
    head = Path(argv[0]).name if argv else "shardwise"
    if head in ("__main__.py", "shardwise", "-m", "-c") or not argv:
        head = "shardwise"
    return shlex.join([head, *argv[1:]])


def mesh_groups(pp: int, dp: int, cp: int, tp: int) -> dict:
    """The global ranks of the mesh [pp, dp, cp, tp] (tp innermost: rank r = ((pp·dp + dp)·cp
    + cp)·tp + tp, :class:`shardwise.topology.Topology`) and the lines of each axis of size > 1
    (move the axis last, flatten the others). Pure Python: the report draws it."""
    grid = [[[[((a * dp + b) * cp + c) * tp + d for d in range(tp)] for c in range(cp)]
             for b in range(dp)] for a in range(pp)]
    coords = {grid[a][b][c][d]: {"pp": a, "dp": b, "cp": c, "tp": d}
              for a in range(pp) for b in range(dp) for c in range(cp) for d in range(tp)}
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    groups = {}
    for axis, n in sizes.items():
        if n < 2:
            continue
        lines: dict[tuple, list[int]] = {}
        for r in sorted(coords):
            key = tuple(v for k, v in coords[r].items() if k != axis)
            lines.setdefault(key, []).append(r)
        groups[axis] = list(lines.values())
    return {"shape": [pp, dp, cp, tp], "grid": grid, "groups": groups,
            "coords": {str(r): c for r, c in coords.items()}}


def stage_blocks(cfg) -> list[dict] | None:
    """Per pipeline rank: the transformer blocks of each of its chunks (``[{"pp": s, "chunks":
    [[first, last], …], "head": bool}]``, chunk c of rank s is the schedule's placement's stage,
    :func:`~shardwise.parallel.pp.schedules.stage_of`: c·p + s, or under a V s and 2p−1−s; the
    first stage also holds the embedding, the last the head, on rank p−1 or under a V rank 0),
    None without a pipeline or when the split cannot be worked out (an MLP test model)."""
    if cfg.pp < 2:
        return None
    try:
        from ..parallel.pp.schedules import default_chunks, placement_of, stages_of
        from ..parallel.pp.split import split_layers

        v = cfg.virtual_stages or default_chunks(cfg.schedule)
        ranges = split_layers(cfg.model_layers(), cfg.pp * v, cfg.stage_split())
        where = placement_of(cfg.schedule)
    except Exception:  # noqa: BLE001 — the picture goes without the block names
        return None
    return [{"pp": s, "chunks": [[ranges[t].start, ranges[t].stop - 1]
                                 for t in stages_of(s, cfg.pp, v, where)],
             "head": cfg.pp * v - 1 in stages_of(s, cfg.pp, v, where)}  # rank 0 under a V
            for s in range(cfg.pp)]


class RunRecorder:
    """Collects the report's extra data on every rank; writes ``out/report_data.json`` on
    rank 0 (``enabled``). Each method is a collective only where its docstring says so."""

    def __init__(self, out, enabled: bool):
        self.path = Path(out) / FILE
        self.enabled = enabled
        self.data: dict = {}
        if enabled and self.path.is_file():  # a resumed run: keep the earlier invocations
            try:
                self.data = read_json(self.path, FILE)
            except ShardwiseFileError:
                self.data = {}
        self.data["format"] = 1

    def _write(self) -> None:
        if not self.enabled:
            return
        try:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            os.replace(tmp, self.path)
        except OSError as e:  # the run goes on; the report will say what it lacks
            log.warning(f"report: could not write {self.path}: {e}")

    def _rank0(self, what: str, fill) -> None:
        """Run ``fill()`` (rank 0's bookkeeping, no collective) and write the file; an error is
        one warning, never the run's end (the other ranks would not know to stop)."""
        if not self.enabled:
            return
        try:
            fill()
        except Exception as e:  # noqa: BLE001 — best effort by design
            log.warning(f"report: could not record {what}: {e!r}")
        self._write()

    def start(self, cfg, topo, *, resume_from=None, start_step: int = 0, epoch=None,
              n_params: int | None = None, group_lines: list[str] | None = None) -> None:
        """Record this invocation (rank 0; no collective). ``group_lines``: the log's lines
        of the groups (:func:`shardwise.train.report.describe_groups`), shown as text."""
        self._rank0("the run's start", lambda: self._start(
            cfg, topo, resume_from, start_step, epoch, n_params, group_lines))

    def _start(self, cfg, topo, resume_from, start_step, epoch, n_params, group_lines):
        _started.add(str(self.path.parent.resolve()))
        resumed_layout = None
        if resume_from is not None:
            try:
                resumed_layout = read_json(Path(resume_from) / "meta.json", "checkpoint").get(
                    "layout")
            except ShardwiseFileError:
                pass
        self.data.setdefault("invocations", []).append({
            "command": command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "start_step": start_step, "steps": cfg.steps, "layout": topo.describe(),
            "world_size": topo.world_size, "engine": cfg.engine,
            "resumed_from": str(resume_from) if resume_from is not None else None,
            "resumed_layout": resumed_layout})
        self.data["mesh"] = mesh_groups(cfg.pp, cfg.dp, cfg.cp, cfg.tp)
        self.data["mesh"]["lines"] = list(group_lines or [])
        self.data["stages"] = stage_blocks(cfg)
        self.data["epoch"] = dict(epoch or {})
        self.data["params"] = n_params
        self.data["microbatching"] = list(cfg.microbatching())

    def first_step(self, topo, engine, cfg, res) -> None:
        """After the first step of this invocation. Collective over the whole layout (every
        rank calls it): one ``all_gather`` of [ledger bytes, formula bytes, params, grads,
        optimizer, formula params, grads, optimizer] fp64 per rank, phase ``"report"``."""
        import torch

        from .. import comm
        from ..formulas import memory_formula, step_bytes_formula

        recs = topo.ledger.step_records()
        n_micro = cfg.microbatching()[1]
        try:
            formula = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                         sequences=cfg.global_batch // cfg.dp,
                                         seq_len=cfg.seq_len, dtype=cfg.dtype)
        except Exception:  # noqa: BLE001 — the same on every rank: the report goes without
            formula = None
        try:
            mem_f = memory_formula(engine, topo)
        except Exception:  # noqa: BLE001
            mem_f = None
        mem = res.state_bytes or {}
        nan = float("nan")
        keys = ("params", "grads", "optimizer")
        mine = torch.tensor(
            [sum(r.wire_bytes for r in recs), formula["total"] if formula else nan]
            + [float(mem.get(k, nan)) for k in keys]
            + [float(mem_f[k]) if mem_f and mem_f.get(k) is not None else nan for k in keys],
            dtype=torch.float64).to(topo.device)
        everyone = torch.zeros(topo.world_size * mine.numel(), dtype=torch.float64,
                               device=topo.device)
        with topo.ledger.phase("report"):
            comm.all_gather(everyone, mine, topo, "world", tag="report")
        everyone = everyone.cpu()
        self._rank0("the first step", lambda: self._first_step(
            topo, everyone, recs, formula, keys))

    def _first_step(self, topo, everyone, recs, formula, keys) -> None:
        import torch

        rows = everyone.view(topo.world_size, -1).tolist()
        fin = (lambda x: None if x != x else x)  # NaN → null
        self.data["first_step"] = {
            "step": (self.data.get("invocations") or [{}])[-1].get("start_step", 0) + 1,
            "records": [{"op": r.op, "axis": r.axis, "n": r.group_size, "tag": r.tag,
                         "dtype": r.dtype, "shape": list(r.shape), "size_bytes": r.size_bytes,
                         "wire_bytes": r.wire_bytes, "sent_bytes": r.sent_bytes,
                         "impl": r.impl, "ms": r.seconds * 1e3} for r in recs],
            "formula": formula,
            "per_rank": [{"rank": i, "ledger_bytes": row[0], "formula_bytes": fin(row[1]),
                          "mem": {k: fin(row[2 + j]) for j, k in enumerate(keys)},
                          "mem_formula": {k: fin(row[5 + j]) for j, k in enumerate(keys)}}
                         for i, row in enumerate(rows)],
            "memory_note": ("activations are not measured (no allocator statistics on CPU)"
                            if topo.device.type != "cuda" else None),
        }
        if topo.device.type == "cuda":
            self.data["first_step"]["cuda_peak_bytes_rank0"] = torch.cuda.max_memory_allocated()

    def timeline(self, engine, topo, cfg) -> None:
        """Under a pipeline (no-op otherwise, and for engines without action timestamps):
        collective over pp on every rank (:func:`~shardwise.report.timeline.gather_timeline`)."""
        if topo.size("pp") < 2 or not getattr(engine, "timeline", None):
            return
        from .timeline import gather_timeline

        events = gather_timeline(engine, topo)
        self._rank0("the pipeline timeline", lambda: self._timeline(events, engine, topo, cfg))

    def _timeline(self, events, engine, topo, cfg) -> None:
        from ..viz.timeline import bubble_of

        p = topo.size("pp")
        m = max((e.microbatch for e in events), default=-1) + 1
        v = getattr(engine, "v", 1) or 1
        # an engine that exposes only whole steps (kind STEP: torch pipelining) has no bubble
        # to measure; the microbatches are then the config's
        whole = all(e.kind == "STEP" for e in events)
        if whole:
            m = cfg.microbatching()[1]
        self.data["timeline"] = {
            "p": p, "m": m, "v": v, "schedule": getattr(engine, "schedule_name", cfg.schedule),
            "bubble": None if whole else bubble_of(events, p),
            "formula": (p - 1) / (v * m + p - 1) if m else None,
            "events": [[e.rank, e.kind, e.microbatch, e.chunk, e.start, e.end] for e in events]}

