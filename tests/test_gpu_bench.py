"""``benchmarks/gpu.sh --cpu-dry-run``: the GPU benchmark's whole path on CPU (tiny model, fp32,
gloo; the gpu tests' CPU variants), so the script the device runs is proven runnable.
~70 s on this 2-core machine with inductor's cache warm, ~100 s when the cores are shared or
the cache is cold, because the path itself is one pytest (tests/test_gpu_path.py: two compiles
of the tiny block, 20 bf16 steps, a 3-step ``shardwise train``) and the bench's four runs (two
more compiles). So ``make test`` runs the bench's measuring part only (its driver with
``--skip-tests``: the four runs, their records and the table); the whole script, with the
``pytest -m gpu`` subset, is ``make test-slow``'s. The subset's compiled-vs-eager comparison
(loss and every gradient) runs in ``make test`` as tests/test_compile.py's
``test_compiled_blocks_give_the_eager_loss_and_every_gradient[selective]``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _check_runs_and_table(rep, tmp_path):
    assert rep["dry_run"] is True and rep["device"] == "cpu" and rep["backend"] == "gloo"
    assert rep["torch"] and rep["date"]
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


@pytest.mark.timeout(300)
def test_bench_driver_cpu_dry_run_measures_each_run_and_writes_the_table(tmp_path):
    """``make test``'s share: the driver benchmarks/gpu.sh execs (``python -m
    shardwise.tools.bench.gpu OUT --cpu-dry-run``) with ``--skip-tests``: every run of the plan
    (compile × ac), its record and the table, as in the whole dry run below."""
    p = subprocess.run([sys.executable, "-m", "shardwise.tools.bench.gpu", str(tmp_path),
                        "--cpu-dry-run", "--skip-tests"], env=_env(), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-5000:]
    rep = json.loads((tmp_path / "gpu.json").read_text())
    assert "tests" not in rep
    _check_runs_and_table(rep, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_sh_cpu_dry_run_writes_gpu_json_and_its_table(tmp_path):
    """The whole script, as the device runs it: the ``pytest -m gpu`` subset on CPU, then the
    bench's runs (make test-slow; make test runs the runs above and the subset's compiled-vs-
    eager comparison in tests/test_compile.py)."""
    p = subprocess.run([str(ROOT / "benchmarks/gpu.sh"), str(tmp_path), "--cpu-dry-run"],
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=560)
    assert p.returncode == 0, p.stdout[-5000:]
    rep = json.loads((tmp_path / "gpu.json").read_text())
    tests = rep["tests"]
    assert tests["failed"] == 0 and tests["passed"] == len(tests["cases"]) >= 6, tests["tail"]
    _check_runs_and_table(rep, tmp_path)
