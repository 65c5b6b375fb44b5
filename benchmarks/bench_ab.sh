#!/usr/bin/env bash
# A refactor's speed check: `shardwise bench --layouts LAYOUT...` on two trees, alternating
# OLD NEW OLD NEW… for ROUNDS rounds in one sitting, so a slower machine shows in both.
# Usage: benchmarks/bench_ab.sh OLD_TREE NEW_TREE ROUNDS OUT_DIR LAYOUT...
#   e.g. benchmarks/bench_ab.sh ../old . 2 /tmp/ab dp=2 dp=2,zero=3 tp=2 pp=2,1f1b,m=4
# Each tree runs from its own src/ with this tree's .venv; OUT_DIR/{old,new}_R.txt hold the tables
# (compare the explicit engine's median step; the spread between one tree's rounds is the noise).
set -uo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3; out=$4; shift 4
py=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  for t in old new; do
    tree=$old; [[ $t == new ]] && tree=$new
    (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH="$tree/src" "$py" -m shardwise bench \
      --layouts "$@" --steps 10 --rounds 1 --out "$out/results_$t" > "$out/${t}_$i.txt" 2>&1)
    echo "$t round $i: exit $? at $(date +%T), load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
