"""A run folder read back for the report (pure Python: no torch, no process group).

:func:`load_run` reads what ``shardwise train`` leaves (``metrics.jsonl``, ``config.toml``,
``ledger.json``, ``report_data.json``, ``summary.json``, ``sample.txt``, ``checkpoints/``);
every file may be missing (a crashed or older run) and the report shows what there is.
:func:`loss_delta` is the comparison's per-step |Δloss| and its first step over the threshold;
:func:`warnings` the run's clipped steps, non-finite steps and dropped epoch tails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ShardwiseConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

THRESHOLD = 1e-5  # |Δloss| the comparison calls equal: verify's rtol at loss ≈ 1 (parity.py)
# verify's per-step rule |Δ| ≤ ATOL + RTOL·|ref| (shardwise.parity.RTOL, ATOL; kept here as
# numbers so reading a run needs no torch; tests/test_report.py checks they agree)
RTOL, ATOL = 1e-5, 1e-6


# what a folder that is not shardwise's, or a damaged one, is told to do instead
FIX = "give a folder that shardwise train wrote (or remove the file)"


def _json(path: Path):
    """The JSON object in ``path``; None when the file is missing or does not parse (a crash may
    leave either: the report shows what there is). Raises :class:`ShardwiseConfigError` for
    valid JSON that is not an object (``[1]``): every such file shardwise writes holds one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict):
        raise ShardwiseConfigError(f"{path} holds a JSON "
                                   f"{type(value).__name__} ({_short(value)}), not the object "
                                   f"shardwise train writes there: {FIX}")
    return value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_metrics(path: Path) -> list[dict]:
    """The records of ``metrics.jsonl`` (a torn last line, as a crash may leave, is skipped);
    a step logged twice (a resume that redid it) keeps its last record."""
    rows: dict[int, dict] = {}
    try:
        text = path.read_text()
    except OSError:
        return []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            raise ShardwiseConfigError(
                f"{path}:{no}: a JSON {type(rec).__name__} ({_short(rec)}), "
                f"not a record {{\"step\": N, ...}} as shardwise train writes: {FIX}")
        step = rec.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ShardwiseConfigError(
                f"{path}:{no}: \"step\" is {_short(step)}, not an integer "
                f"as shardwise train writes: {FIX}")
        rows[step] = {**rows.get(step, {}), **rec} if step == 0 else rec
    return [rows[k] for k in sorted(rows)]


def read_config(path: Path) -> dict:
    """``config.toml`` as a dict ({} when missing or unreadable)."""
    if tomllib is None or not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def checkpoints(run: Path) -> list[dict]:
    """Each ``checkpoints/step_N`` folder: step, layout, world size, complete, finite, whether
    the optimizer state was saved, and whether ``latest`` points at it."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    try:
        latest = (root / "latest").read_text().strip()
    except OSError:
        latest = None
    out = []
    for d in sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[-1])
                    if p.name.split("_")[-1].isdigit() else -1):
        meta = _json(d / "meta.json") or {}
        out.append({"name": d.name, "step": meta.get("step"), "layout": meta.get("layout"),
                    "world_size": meta.get("world_size"), "complete": (d / "COMPLETE").exists(),
                    "finite": meta.get("finite"), "optimizer": meta.get("optimizer_saved"),
                    "latest": d.name == latest})
    return out


def load_run(path) -> dict:
    """Everything the report shows about the run folder ``path``. Raises FileNotFoundError
    when ``path`` is not a folder."""
    run = Path(path)
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a run folder (no such directory)")
    sample = run / "sample.txt"
    return {
        "path": str(run), "name": run.name,
        "metrics": read_metrics(run / "metrics.jsonl"),
        "config": read_config(run / "config.toml"),
        "ledger": _json(run / "ledger.json"),
        "extra": _json(run / "report_data.json") or {},
        "summary": _json(run / "summary.json"),
        "sample": sample.read_text(errors="replace") if sample.is_file() else None,
        "checkpoints": checkpoints(run),
        "has_timeline_png": (run / "pipeline_timeline.png").is_file(),
    }


def series(run: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of every record with a numeric ``key`` (steps ≥ 1 for training fields)."""
    return [(r["step"], float(r[key])) for r in run["metrics"]
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def loss_delta(a: list[tuple[int, float]], b: list[tuple[int, float]],
               threshold: float = THRESHOLD) -> dict:
    """Per-step |Δloss| between two loss curves on the steps both logged.

    Returns ``{"steps", "delta" (list of |a − b|, NaN where either is not finite and they are
    not both the same non-finite value), "max", "first_over" (the first step where |Δ| >
    threshold or is NaN, None if none), "equal" (True when every |Δ| ≤ threshold), "common"
    (how many steps both have), "only_a", "only_b" (steps one run has and the other lacks),
    "rel_over" (the steps over verify's rule ATOL + RTOL·|a|)}``.
    """
    da, db = dict(a), dict(b)
    steps = sorted(set(da) & set(db))
    delta, first = [], None
    for s in steps:
        x, y = da[s], db[s]
        if math.isfinite(x) and math.isfinite(y):
            d = abs(x - y)
        else:
            d = 0.0 if (x == y or (math.isnan(x) and math.isnan(y))) else math.nan
        delta.append(d)
        if first is None and not d <= threshold:
            first = s
    finite = [d for d in delta if math.isfinite(d)]
    # verify's rule, relative to run a's loss: the steps over ATOL + RTOL·|a|
    rel_over = [s for s, d in zip(steps, delta)
                if not d <= ATOL + RTOL * (abs(da[s]) if math.isfinite(da[s]) else 0.0)]
    return {"steps": steps, "delta": delta, "max": max(finite) if finite else None,
            "rel_over": rel_over,
            "first_over": first, "equal": bool(steps) and first is None,
            "common": len(steps), "only_a": sorted(set(da) - set(db)),
            "only_b": sorted(set(db) - set(da)), "threshold": threshold}


def warnings(run: dict) -> list[dict]:
    """The run's warnings, each ``{"kind", "text", "steps"}``: steps whose gradient norm
    exceeded ``grad_clip`` (clipped to it; the logged norm is the pre-clip total), steps whose
    loss or gradient norm was not finite (the loop stops there: ``DivergedError``), and the
    epoch tail each pass over the data drops (fewer sequences than one global batch)."""
    out = []
    cfg = run["config"]
    clip = cfg.get("grad_clip")
    rows = [r for r in run["metrics"] if "loss" in r]
    if clip:
        clipped = [r["step"] for r in rows
                   if isinstance(r.get("grad_norm"), (int, float)) and r["grad_norm"] > clip]
        if clipped:
            out.append({"kind": "clipped", "steps": clipped,
                        "text": f"{len(clipped)} of {len(rows)} steps had a gradient norm above "
                                f"--grad-clip {clip:g} and were clipped to it"})
    bad = [r["step"] for r in rows
           if not all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
                      for k in ("loss", "grad_norm") if k in r)]
    if bad:
        out.append({"kind": "nonfinite", "steps": bad,
                    "text": f"non-finite loss or gradient norm at step {bad[0]}: the run "
                            "stopped there (DivergedError; resume from the last good "
                            "checkpoint with a lower --lr)"})
    epoch = run["extra"].get("epoch") or {}
    dropped = epoch.get("dropped_per_epoch") or (run["summary"] or {}).get("dropped_per_epoch")
    per_epoch = epoch.get("steps_per_epoch") or (run["summary"] or {}).get("steps_per_epoch")
    if dropped:
        last = rows[-1]["step"] if rows else 0
        epochs = last / per_epoch if per_epoch else 0
        out.append({"kind": "dropped", "steps": [],
                    "text": f"each epoch drops its last {dropped:,} sequences (fewer than one "
                            f"global batch; a new shuffle each epoch, so different ones); this "
                            f"run covered {epochs:.3f} epochs of {per_epoch:,} steps"})
    return out


def config_diff(runs: list[dict]) -> list[tuple[str, list]]:
    """The config keys whose values differ between runs (``out`` excluded: every run has its
    own), as (key, [value per run]) sorted by key."""
    keys = sorted(set().union(*(r["config"] for r in runs)) - {"out"})
    rows = []
    for k in keys:
        vals = [r["config"].get(k, "—") for r in runs]
        if any(v != vals[0] for v in vals[1:]):
            rows.append((k, vals))
    return rows


def axis_traffic(run: dict) -> list[dict]:
    """Per mesh axis of step 1: the ledger's bytes (rank 0) and the formula's, each formula
    tag attributed to the axes its collectives ran on (like ``shardwise trace``'s axis table;
    a tag over several axes, e.g. ``loss`` over dp and pp, is one row "dp+pp"). From
    ``report_data.json``'s records when present, else from ``ledger.json``'s summary."""
    first = run["extra"].get("first_step") or {}
    recs = first.get("records")
    formula = first.get("formula")
    led = run["ledger"] or {}
    if recs is None:
        recs = led.get("collectives") or []
    if formula is None:
        formula = led.get("formula") or {}
    axes_of: dict[str, set] = {}
    for r in recs:
        axes_of.setdefault(r["tag"], set()).add(r["axis"])
    ledger: dict[str, float] = {}
    for r in recs:
        key = "+".join(sorted(axes_of[r["tag"]]))
        ledger[key] = ledger.get(key, 0.0) + r["wire_bytes"]
    want: dict[str, float] = {}
    for tag, v in (formula or {}).items():
        if tag != "total" and v:
            key = "+".join(sorted(axes_of.get(tag, {"(no record)"})))
            want[key] = want.get(key, 0.0) + v
    out = []
    for key in sorted(set(ledger) | set(want)):
        m, f = ledger.get(key, 0.0), want.get(key)
        out.append({"axis": key, "ledger": m, "formula": f,
                    "ratio": m / f if f else None})
    return out
