"""Step time with ``--check-collectives off | step | every``, alternating in one run (issue 18).

    OMP_NUM_THREADS=1 python -m shardwise.launch --nproc 2 benchmarks/check_overhead.py \\
        [--layout dp=2|tp=2|pp=2 ...] [--model small] [--steps 5] [--rounds 3]

The same measurement as ``shardwise bench --suite checks`` (src/shardwise/tools/bench/checks.py,
which has the method), on the layouts given (default dp=N, tp=N, pp=N).
"""

import argparse

from shardwise.tools.bench.checks import bench_checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", action="append", dest="check_layouts")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    bench_checks(ap.parse_args())


if __name__ == "__main__":
    main()
