"""Per-round medians and their spread for ``shardwise bench --layouts`` reports: the noise a
before/after comparison of step times must be read against.

    python benchmarks/bench_spread.py benchmarks/baselines/bench_before.json bench_after.json

For each report, layout and engine it prints the median step time, the median of each round's
``steps`` timed steps (rank 0's times, in ms) and the spread, (max − min) / median over the
rounds, plus the report's explicit / torch ratio (all steps and paired by round).
"""

from __future__ import annotations

import json
import statistics
import sys


def round_medians(times: list[float], steps: int) -> list[float]:
    """The median of each consecutive group of ``steps`` step times (s), in ms."""
    return [statistics.median(times[i * steps:(i + 1) * steps]) * 1e3
            for i in range(len(times) // steps)]


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        steps = report["config"]["steps"]
        print(path)
        for row in report["rows"]:
            for engine in ("explicit", "torch"):
                r = row[engine]
                rounds = round_medians(r["step_times_s_rank0"], steps)
                spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
                print(f"  {row['layout']:16s} {engine:8s} median {r['median_step_s'] * 1e3:7.1f} ms"
                      f"  rounds {[round(x, 1) for x in rounds]}  spread {100 * spread:5.1f}%")
            print(f"  {'':16s} explicit/torch {row['explicit_over_torch']:.3f} "
                  f"paired {row['explicit_over_torch_paired']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
