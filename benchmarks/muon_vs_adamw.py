"""Muon vs AdamW per layout: step time and bytes per step (issue 41; benchmarks/README.md).

For each layout, ``shardwise train`` runs ``--steps`` steps with ``--optimizer adamw`` and then
with ``--optimizer muon`` (same model, data, seed), alternating the two ``--rounds`` times so
the machine's drift hits both alike; each run's median ``step_time_s`` (steps after the first
five) and its per-step ``comm_bytes`` (rank 0, constant from step 1) come from its
``metrics.jsonl``. Prints a Markdown table (the medians over rounds) and writes it as JSON.

    OMP_NUM_THREADS=1 python benchmarks/muon_vs_adamw.py --steps 20 --rounds 1 \\
        --layouts "--dp 2" "--dp 2 --zero 1" "--dp 2 --zero 3" "--tp 2" "--dp 2 --tp 2 --zero 1"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(flags: str, optimizer: str, steps: int, out: Path) -> tuple[float, float]:
    """(median step seconds after step 5, rank 0's comm bytes per step) of one train run."""
    cmd = [sys.executable, "-m", "shardwise", "train", "--steps", str(steps), "--optimizer",
           optimizer, "--eval-every", str(steps + 1), "--log-every", "1", "--out", str(out),
           *shlex.split(flags)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return (statistics.median(r["step_time_s"] for r in rows if r["step"] > 5),
            rows[-1]["comm_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", required=True, help='train flags, e.g. "--dp 2"')
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="benchmarks/results/muon_vs_adamw.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for flags in args.layouts:
            got: dict[str, list] = {"adamw": [], "muon": []}
            for r in range(args.rounds):
                for opt in ("adamw", "muon"):
                    got[opt].append(run(flags, opt, args.steps, Path(tmp) / f"{len(rows)}{opt}{r}"))
            a, m = ([statistics.median(x[i] for x in got[o]) for i in (0, 1)]
                    for o in ("adamw", "muon"))
            rows.append({"layout": flags, "adamw_step_s": a[0], "muon_step_s": m[0],
                         "adamw_bytes": a[1], "muon_bytes": m[1]})
            print(f"| `{flags}` | {a[0] * 1e3:,.0f} | {m[0] * 1e3:,.0f} | {m[0] / a[0]:.2f} | "
                  f"{a[1]:,.0f} | {m[1]:,.0f} | {m[1] - a[1]:+,.0f} |", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
