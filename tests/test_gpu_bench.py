"""``benchmarks/gpu.sh --cpu-dry-run``: the GPU benchmark's whole path on CPU (tiny model, fp32,
gloo; the gpu tests' CPU variants), so the script the device runs is proven runnable.
~70 s on this 2-core machine with inductor's cache warm, ~100 s when the cores are shared or
the cache is cold: over the 60 s we aimed for, because the path itself is one pytest, a
3-step ``shardwise train`` and four compiles of the tiny block."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_gpu_sh_cpu_dry_run_writes_gpu_json_and_its_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([str(ROOT / "benchmarks/gpu.sh"), str(tmp_path), "--cpu-dry-run"],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=560)
    assert p.returncode == 0, p.stdout[-5000:]
    rep = json.loads((tmp_path / "gpu.json").read_text())
    assert rep["dry_run"] is True and rep["device"] == "cpu" and rep["backend"] == "gloo"
    assert rep["torch"] and rep["date"]
    tests = rep["tests"]
    assert tests["failed"] == 0 and tests["passed"] == len(tests["cases"]) >= 6, tests["tail"]
    runs = rep["runs"]
    assert {(r["compile"], r["ac"]) for r in runs} == {(c, a) for c in (False, True)
                                                       for a in ("none", "selective")}
    for r in runs:
        assert r["status"] == "ok", r.get("traceback")
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert len(r["step_times_s"]) == r["timed_steps"] == rep["plan"]["steps"]
        # CPU: no device memory is measured, so nothing is written for it
        assert r["peak_allocated_bytes"] is None and r["reserved_bytes"] is None
        assert "peak_vs_planner" not in r
        # the formula and the planner agree on the model state (16 B per parameter), the
        # gradient buckets (4 B per parameter) and the activations; the planner adds AdamW's
        # fp32 step counter per tensor (4 B each, < 64 tensors here)
        assert r["model_state_formula_bytes"] == 16 * r["params"]
        assert r["gradient_bucket_bytes"] == 4 * r["params"]
        pl = r["planner"]
        assert 0 <= pl["mem_bytes_per_gpu"] - r["formula_peak_bytes"] <= 4 * 64
        assert pl["tokens_per_s"] > 0 and 0 < pl["mfu"] < 1
        assert "attention:" in r["attention"] and r["adamw"] == "foreach"
    table = (tmp_path / "gpu.md").read_text()
    assert "| model | compile | ac | tokens/s | MFU |" in table
    assert "not a measurement of a GPU" in table
