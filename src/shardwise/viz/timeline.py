"""Pipeline timelines: a PNG (ranks × time, one colour per action kind) and a Chrome trace.

Input: events with the attributes ``rank``, ``kind``, ``microbatch``, ``chunk``, ``start``,
``end`` (and optionally ``peer``) — e.g. :class:`shardwise.parallel.pp.Event` from the
simulator (abstract time units) or from a real run's timestamps
(:func:`shardwise.report.timeline.gather_timeline`, seconds; gathered and drawn by
:func:`shardwise.tools.trace.trace_pipeline`). Nothing here runs a collective.

The Chrome trace is the JSON "trace event" format (``{"traceEvents": [...]}``, complete events
``"ph": "X"`` with ``ts``/``dur`` in microseconds, one thread per rank) that ui.perfetto.dev and
chrome://tracing open directly.
"""

from __future__ import annotations

import json
from pathlib import Path

COLOURS = {
    "F": "#4C72B0",  # forward: blue
    "B": "#55A868",  # full backward: green
    "I": "#8FD19E",  # input-gradient backward: light green
    "W": "#DD8452",  # weight-gradient backward: orange
    "RECV_F": "#D0D0D0",  # waiting for an activation: light grey
    "RECV_B": "#A8A8A8",  # waiting for a gradient: grey
    "SEND_F": "#8172B3",  # posting a send: purple
    "SEND_B": "#937860",  # posting a send: brown
    "STEP": "#C44E52",  # a whole step (engines that do not expose their actions)
}
COMPUTE = ("F", "B", "I", "W", "STEP")


def bubble_of(events, p: int | None = None) -> float:
    """Measured bubble fraction 1 − Σ_r busy_r / (p · makespan): busy = time in compute
    actions (F, B, I, W), makespan = last end − first start over all ranks."""
    events = list(events)
    if not events:
        return 0.0
    p = p or (1 + max(e.rank for e in events))
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    busy = sum(e.end - e.start for e in events if e.kind in COMPUTE)
    return 1.0 - busy / (p * (t1 - t0)) if t1 > t0 else 0.0


def _label(e) -> str:
    return f"{e.microbatch}" + (f".{e.chunk}" if e.chunk else "")


def draw_timeline(events, path, title: str = "", unit: str = "time") -> Path:
    """Draw ``events`` as horizontal bars, one row per rank (rank 0 on top), and save a PNG at
    ``path``. Compute bars are labelled with their microbatch (``mb.chunk`` for chunks > 0);
    RECV bars show waiting. ``unit`` labels the x axis. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = list(events)
    p = 1 + max(e.rank for e in events) if events else 1
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=1.0) - t0 or 1.0
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(events) / p + 6)),
                                    1.0 + 0.6 * p))
    drawn = set()
    for e in events:
        dur = e.end - e.start
        if dur <= 0 and e.kind not in COMPUTE:
            continue  # an instantaneous send: nothing to draw
        drawn.add(e.kind)
        y = p - 1 - e.rank
        height = 0.8 if e.kind in COMPUTE else 0.35
        ax.barh(y, max(dur, span * 1e-4), left=e.start - t0, height=height,
                color=COLOURS.get(e.kind, "#333333"), edgecolor="white", linewidth=0.4)
        if e.kind in COMPUTE and dur > span / 60:
            ax.text(e.start - t0 + dur / 2, y, _label(e), ha="center", va="center",
                    fontsize=7, color="white")
    kinds = [k for k in COLOURS if k in drawn]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=len(kinds), fontsize=8, frameon=False)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
    ax.set_xlabel(unit)
    ax.set_xlim(0, span)
    bubble = bubble_of(events, p)
    ax.set_title(f"{title}  (bubble {bubble:.1%})" if title else f"bubble {bubble:.1%}",
                 fontsize=10)
    return save_figure(fig, path, dpi=110)


def save_figure(fig, path, dpi: int) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG; parent folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def chrome_trace(events, time_scale: float = 1e6) -> dict:
    """The trace-event JSON object for ``events``. ``time_scale``: microseconds per unit of the
    events' times (1e6 for seconds; for the simulator's abstract units any scale works, e.g.
    1000 draws one unit as one millisecond)."""
    events = list(events)
    t0 = min((e.start for e in events), default=0.0)
    out = []
    for r in sorted({e.rank for e in events}):
        out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r,
                    "args": {"name": f"pp rank {r}"}})
    for e in events:
        out.append({"name": f"{e.kind}{_label(e)}", "cat": e.kind, "ph": "X", "pid": 0,
                    "tid": e.rank, "ts": (e.start - t0) * time_scale,
                    "dur": (e.end - e.start) * time_scale,
                    "args": {"microbatch": e.microbatch, "chunk": e.chunk,
                             "peer": getattr(e, "peer", None)}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(events, path, time_scale: float = 1e6) -> Path:
    """Write :func:`chrome_trace` to ``path`` (load it in ui.perfetto.dev). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, time_scale)))
    return path
