#!/usr/bin/env bash
# benchmarks/gpu.sh OUTDIR [--cpu-dry-run]
#
# One prepared call on one GPU (an H200; ≤ 8 minutes): the `pytest -m gpu` correctness subset,
# tokens/s and MFU of `small` and `llama-1b` at seq 2048 in bf16, eager and --compile, with
# --ac none and selective, peak memory against the formula and the planner, and the planner's
# prediction for each run. Writes OUTDIR/gpu.json and OUTDIR/gpu.md (the table). The driver is
# src/shardwise/tools/bench/gpu.py (its docstring says what is measured and how).
#
# The device machine has torch and Python preinstalled and no network, so shardwise is
# installed from this checkout with `pip install --no-deps -e .` (no build isolation, which
# would download setuptools); where that cannot be done the source tree is used in place
# (PYTHONPATH=src: the package is pure Python).
#
# --cpu-dry-run: the same code path on CPU (tiny model, fp32, two timed steps, gloo), to show
# the script runs; it installs nothing (SHARDWISE_GPU_INSTALL=1 to install anyway).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: benchmarks/gpu.sh OUTDIR [--cpu-dry-run]" >&2
  exit 2
fi
out=$1
shift
dry=0
for a in "$@"; do
  case $a in
    --cpu-dry-run) dry=1 ;;
    *) echo "gpu.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
install=${SHARDWISE_GPU_INSTALL:-$((1 - dry))}
if [ "$install" = 1 ]; then
  if ! (cd "$root" && "$py" -m pip install --quiet --no-deps --no-build-isolation -e .) \
      > "$out/pip.log" 2>&1; then
    echo "gpu.sh: pip install --no-deps -e . failed (see $out/pip.log): using $root/src in place"
  fi
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$dry" = 1 ] && echo 1 || echo 8)}
args=("$out")
[ "$dry" = 1 ] && args+=(--cpu-dry-run)
cd "$root"
exec "$py" -m shardwise.tools.bench.gpu "${args[@]}"
