"""Every pipeline schedule side by side, on paper: the simulator's timeline, bubble and peak
activations of each of the six schedules at the same p and m, against the closed form.

    python -m shardwise.viz.schedules --pp 4 --microbatches 8 --out schedules.png

prints one line per schedule (bubble simulated and by formula, peak chunks held per rank) and
draws one panel per schedule on a common time axis (unit: T_F, one rank's whole forward of one
microbatch; T_F = T_B = T_W, free communication). Nothing here runs a model or a collective;
the real runs' bubbles are ``shardwise bench --suite pp`` (docs/pipeline-parallel.md §3, §9).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..parallel.pp import SCHEDULES, Costs, bubble_formula, build_schedule, simulate
from ..parallel.pp.schedules import default_chunks
from .timeline import COLOURS, COMPUTE, _label, save_figure


def compare(p: int, m: int, costs: Costs = Costs()) -> list[dict]:
    """For each schedule of :data:`~shardwise.parallel.pp.SCHEDULES` at ``p`` ranks and ``m``
    microbatches (its default v): ``{"schedule", "v", "placement", "bubble", "formula",
    "peak", "events"}`` — simulated bubble fraction, the closed form (None where the
    schedule has none at these costs), peak (microbatch, chunk) pairs alive per rank, the
    simulator's events. Raises :class:`~shardwise.errors.ShardwiseConfigError` if a schedule
    refuses (p, m)."""
    rows = []
    for name in SCHEDULES:
        v = default_chunks(name)
        s = build_schedule(name, p, m, v)
        r = simulate(s, costs)
        try:
            formula = bubble_formula(name, p, m, v, costs)
        except ValueError:
            formula = None
        rows.append({"schedule": name, "v": v, "placement": s.placement,
                     "bubble": r.bubble_fraction, "formula": formula, "peak": r.peak_alive,
                     "events": r.events})
    return rows


def draw_schedules(rows: list[dict], path, title: str = "") -> Path:
    """One panel per row of :func:`compare` (ranks × time, rank 0 on top, F blue, B green,
    I light green, W orange; labels ``mb`` or ``mb.chunk``), all on the same time axis, each
    titled with its simulated bubble. Saves a PNG at ``path`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = 1 + max(e.rank for row in rows for e in row["events"])
    span = max(e.end for row in rows for e in row["events"])
    fig, axes = plt.subplots(len(rows), 1, figsize=(16, 0.9 + len(rows) * (0.45 * p + 0.6)),
                             sharex=True)
    for ax, row in zip(axes, rows):
        for e in row["events"]:
            if e.kind not in COMPUTE:
                continue
            y = p - 1 - e.rank
            ax.barh(y, e.end - e.start, left=e.start, height=0.8, color=COLOURS[e.kind],
                    edgecolor="white", linewidth=0.4)
            ax.text(e.start + (e.end - e.start) / 2, y, _label(e), ha="center", va="center",
                    fontsize=6, color="white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))], fontsize=7)
        formula = "" if row["formula"] is None else f", formula {row['formula']:.1%}"
        ax.set_title(f"{row['schedule']} (v={row['v']}, {row['placement']} placement): bubble "
                     f"{row['bubble']:.1%}{formula}, peak chunks alive {max(row['peak'])}",
                     fontsize=9, loc="left")
        ax.set_xlim(0, span)
    axes[-1].set_xlabel("time (T_F = one rank's forward of one microbatch; T_B = T_W = T_F)")
    fig.legend(handles=[Patch(color=COLOURS[k], label=k) for k in "FBIW"], loc="lower right",
               ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.viz.schedules",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches m")
    ap.add_argument("--out", default="schedules.png", help="the PNG to write")
    args = ap.parse_args(argv)
    rows = compare(args.pp, args.microbatches)
    print(f"p={args.pp}, m={args.microbatches}, T_F = T_B = T_W, free communication")
    print(f"{'schedule':<18}{'v':>2}  {'bubble (sim)':>12}  {'formula':>8}  peak chunks alive "
          f"per rank")
    for r in rows:
        formula = "-" if r["formula"] is None else f"{r['formula']:.4f}"
        print(f"{r['schedule']:<18}{r['v']:>2}  {r['bubble']:>12.4f}  {formula:>8}  {r['peak']}")
    path = draw_schedules(rows, args.out, title=f"the six schedules, p={args.pp}, "
                                                f"m={args.microbatches} (simulated)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
