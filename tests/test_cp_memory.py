"""benchmarks/cp_memory.py on a tiny config: the activation bytes each cp rank saves for
backward equal the hand-derived formula exactly (cp = 1 and cp = 2, ring and all-gather), every
rank saves the same, and the saved-bytes budget refuses cp = 1 at a length that cp = 2 trains.

The benchmark forks its cp worlds, so it runs in a fresh interpreter (pytest's worker has
threads); about 10 s."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_cp_saved_bytes_equal_formula_and_budget(tmp_path):
    out = tmp_path / "cp_memory.json"
    # tiny, vocab 256: per token 6,084 B at cp = 1, 5,892 B at cp = 2 (ring); at 1 MiB, cp = 1
    # fits 128 tokens and not 256, cp = 2 fits 256
    cmd = [sys.executable, str(ROOT / "benchmarks/cp_memory.py"), "--model", "tiny",
           "--vocab", "256", "--seq-lens", "64", "--cps", "1", "2", "--budget-mib", "1",
           "--budget-seq", "256", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=110)
    assert p.returncode == 0, p.stdout
    res = json.loads(out.read_text())
    rows = {(r["cp"], r["method"]): r for r in res["rows"]}
    assert set(rows) == {(1, "-"), (2, "ring"), (2, "allgather")}
    for r in rows.values():
        assert r["saved_bytes"] == r["formula_bytes"], r  # exact, not just within 5 %
        assert r["ranks_equal"], r
    assert abs(rows[2, "ring"]["loss"] - rows[1, "-"]["loss"]) < 1e-5
    budget = {(b["seq"], b["cp"], b["method"]): b for b in res["budget"]}
    assert not budget[256, 1, "-"]["ok"] and "budget" in budget[256, 1, "-"]["why"]
    assert budget[256, 2, "ring"]["ok"] and budget[256, 2, "ring"]["all_ranks_ok"] == [True] * 2
    assert budget[128, 1, "-"]["ok"]  # the budget is one that cp = 1 fits at s / 2
