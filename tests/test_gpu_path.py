"""The GPU correctness subset (``pytest -m gpu``; benchmarks/gpu.sh runs it on the device, and
its ``--cpu-dry-run`` on CPU). Deselected from ``make test`` by pyproject's ``-m "not gpu"``.

One worker process (tests/workers/gpu_cases.py) runs every case in a world of one rank on the
device — NCCL on CUDA, gloo on CPU — and each test checks one case against its bound.
``SHARDWISE_GPU_TEST_DEVICE`` picks the device (default: cuda where available, else cpu).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("SHARDWISE_GPU_TEST_DEVICE",
                        "cuda" if torch.cuda.is_available() else "cpu")
U32 = 2.0 ** -24  # fp32 unit roundoff


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_cases")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(ROOT / "tests/workers/gpu_cases.py"), DEVICE,
                        str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    print(p.stdout[-4000:])
    assert p.returncode == 0, p.stdout[-4000:]
    return json.loads((out / f"gpu_cases_{DEVICE}.json").read_text())


def test_process_group_of_one_rank(cases):
    """A world of one: NCCL on CUDA (gloo on CPU); an all-reduce over it returns its input."""
    pg = cases["process_group"]
    assert pg["backend"] == ("nccl" if DEVICE == "cuda" else "gloo")
    assert pg["value"] == [3.0] * 4


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_compiled_equals_eager(cases, ac):
    """Same loss and gradients within the fp32 bound of tests/test_compile.py (inductor fuses
    and reorders fp32 sums; cuBLAS/CPU matmuls are the same calls)."""
    c = cases["compile"][ac]
    assert math.isclose(c["loss_compiled"], c["loss_eager"], rel_tol=B_LOSS, abs_tol=0)
    for name, err in c["grad_max_abs_err"].items():
        assert err <= B_GRAD * c["grad_max_abs"][name], name


# tests/test_compile.py derives these: a sum of ≤ 128 token losses reordered (≤ n·u relative),
# gradients ≤ 1e-4 of their tensor's largest element
B_LOSS = 128 * U32
B_GRAD = 1e-4


def test_bf16_within_2_percent_of_fp32_after_20_steps(cases):
    """bf16 autocast (fp32 master weights) tracks fp32: the issue's 2 % on the loss after 20
    AdamW steps on learnable data (which falls by more than half, so both runs learn)."""
    fp32, bf16 = cases["bf16"]["fp32"], cases["bf16"]["bf16"]
    assert fp32[-1] < 0.6 * fp32[0]
    assert abs(bf16[-1] - fp32[-1]) <= 0.02 * fp32[-1]


def test_explicit_equals_torch_engine_at_dp1(cases):
    """dp = 1: our engine and PyTorch's run the same model; losses of 5 AdamW steps and the
    gradients agree within the parity rule's fp32 bound (docs/parity.md: rtol 1e-5 on values
    that are sums of O(100) fp32 terms in either summation order)."""
    from shardwise.parity import ATOL, RTOL

    e = cases["engines"]
    torch.testing.assert_close(torch.tensor(e["losses_torch"]),
                               torch.tensor(e["losses_explicit"]), rtol=RTOL, atol=ATOL)
    assert e["grad_max_abs_err"] <= ATOL + RTOL * e["grad_max_abs"]


def test_fused_equals_for_loop_adamw(cases):
    """Fused (one kernel per group) vs for-loop AdamW on the same fixed gradients: the update
    u = m̂/(√v̂ + ε), |u| ≲ 1, is computed in another fp32 order (a few ulps of u per step; 16
    allowed), so after T steps |Δp| ≤ T·lr·16·u + 4 ulps of |p| (the rounding of p itself)."""
    a = cases["adamw"]
    bound = a["steps"] * a["lr"] * 16 * U32 + 4 * U32 * a["max_abs_param"]
    assert a["max_abs_err"] <= bound


def test_train_loop_logs_device_memory_per_rank_per_step(tmp_path):
    """``shardwise train`` (one rank, 3 steps of the tiny model, eager) on DEVICE, with no
    ``--device`` flag where DEVICE is what ``--device auto``, the default, picks (the start-up
    line says so): on an accelerator every step's record has each rank's peak and reserved
    bytes (the peak above the model state the loop counted, reserved ≥ peak) next to the
    formula and the planner's activation estimate; on CPU none of these keys (nothing is
    measured there)."""
    for dep in ("matplotlib", "tensorboard"):  # loss.png and tb/ of the run folder
        pytest.importorskip(dep)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    auto = DEVICE == ("cuda" if torch.cuda.is_available() else "cpu")
    flag = [] if auto else ["--device", DEVICE]
    p = subprocess.run([sys.executable, "-m", "shardwise", "train", "--model", "tiny", "--dp",
                        "1", *flag, "--steps", "3", "--global-batch", "4",
                        "--seq-len", "64", "--tokenizer", "bytes",
                        "--eval-every", "100", "--eval-sequences", "4", "--sample-tokens", "0",
                        "--out", str(out)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
    assert "attention: scaled_dot_product_attention" in p.stdout
    why = ("auto: CUDA available" if DEVICE == "cuda" else "auto: no CUDA") if auto else \
        f"--device {DEVICE}"
    assert f"device {DEVICE}{':0' if DEVICE == 'cuda' else ''} ({why}), backend " \
        f"{'nccl' if DEVICE == 'cuda' else 'gloo'}" in p.stdout, p.stdout[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(steps) == 3
    for r in steps:
        if DEVICE == "cpu":
            assert not any(k.startswith("gpu_") for k in r)
            continue
        peak, reserved = r["gpu_max_allocated_bytes"], r["gpu_reserved_bytes"]
        assert len(peak) == len(reserved) == 1
        assert r["mem_bytes"] <= peak[0] <= reserved[0]
        assert r["mem_formula_bytes"] > 0 and r["act_estimate_bytes"] > 0
