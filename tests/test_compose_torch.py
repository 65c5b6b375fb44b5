"""The torch engine for dp × tp (DTensor TP + FSDP2 ``fully_shard`` / ``replicate``) against a
single-process reference computed here, the ledger against the formula, reduce_dtype="bf16",
the layout-free optimizer state, and bad input.

One 4-rank world (tests/workers/compose_torch_cases.py) runs dp=2 × tp=2 with zero 0, 1, 2 (+SP),
3, each 3 AdamW steps with 2 micro-batches per rank and clipping that binds."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.precision import Precision
from shardwise.data import DistributedSampler
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parity import ATOL, RTOL, assert_parity, reference_at, reference_run

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world  # noqa: E402
import compose_torch_cases as W  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compose_torch")
    run_world(W.__file__, out, WORLD)
    return out


def _load(out, zero, sp, reduce_dtype="fp32"):
    return [load_pt(out / f"{W.case_name(zero, sp, reduce_dtype)}_rank{r}.pt")
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """shardwise.parity's plain-PyTorch reference (AdamW, the whole global batch in one forward,
    F.cross_entropy mean over counted tokens, clip_grad_norm_), 4 steps."""
    work = W.workload()
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **W.MODEL)
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(W.STEPS + 1)]
    return reference_run(model, batches, lrs=[W.LR] * (W.STEPS + 1), max_norm=W.MAX_NORM)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("zero,sp", W.CASES)
def test_2d_torch_matches_single_process(results, reference, zero, sp):
    """Every step's loss, clipped norm, gradients and parameters by shardwise.parity's rule."""
    assert all(n > W.MAX_NORM for n in reference["grad_norm"][:W.STEPS])  # clipping binds
    for rank, rec in enumerate(_load(results, zero, sp)):
        assert rec["engine"] == "ParallelModel"
        assert_parity(rec, reference, where=f"rank {rank}")


@pytest.mark.parametrize("zero,sp", W.CASES)
def test_ledger_bytes_equal_formula_per_tag(results, zero, sp):
    for rec in _load(results, zero, sp):
        for step in range(W.STEPS):
            got, f = rec["bytes"][step], rec["formula"][step]
            assert rec["total_bytes"][step] == pytest.approx(f["total"], rel=1e-12, abs=0)
            for tag in W.TAGS:
                assert got[tag] == pytest.approx(f.get(tag, 0.0), rel=1e-12, abs=0), tag
            # the dp traffic that defines each stage
            if zero == 0:
                assert got["param"] == 0 and got["grad"] > 0
            else:
                # fp64 [1] over dp, 2(n−1)/n = 1, and fp64 [1] over tp, 2(t−1)/t = 1
                assert got["param"] > 0 and got["grad_norm"] == 8 + 8


def test_formula_hand_worked(results):
    """dp=2, tp=2, zero 3 vs zero 2 vs zero 0 on rank 0 (tp index 0). Local tp shards of the
    tiny GQA model (d=32, 2 layers, head_dim 4, 8 heads, 4 kv heads, d_ff 64, vocab 67):
    per block wq 16×32, wk/wv 8×32, wo 32×16, w1/w3 32×32, w2 32×32, two norms 32 → 4672;
    root: embedding rows 34 of 67 (tp index 0) × 32 = 1088, final norm 32 → 1120. dp=2 pads
    each dim 0 to even (all already even): Ψ = 2·4672 + 1120 = 10464 elements."""
    blocks, psi = 2 * 4672, 2 * 4672 + 1120
    z3 = _load(results, 3, False)[0]["formula"][0]
    z2 = _load(results, 2, True)[0]["formula"][0]
    z0 = _load(results, 0, False)[0]["formula"][0]
    # 2 micro-steps; all-gather (n−1)/n = 1/2 of S
    assert z3["param"] == 2 * 0.5 * (psi + blocks) * 4
    assert z2["param"] == 2 * 0.5 * psi * 4
    assert z3["grad"] == z2["grad"] == 0.5 * psi * 4  # one reduce-scatter per step
    assert z0["grad"] == 2 * 0.5 * psi * 4 and z0["param"] == 0  # one all-reduce per step


def test_bf16_reduce_halves_the_gradient_bytes(results, reference):
    for zero in W.BF16_ZEROS:
        fp32 = _load(results, zero, False)
        for rank, rec in enumerate(_load(results, zero, False, "bf16")):
            assert rec["grad_dtypes"] == ["bfloat16"]
            assert rec["bytes"][0]["grad"] == pytest.approx(fp32[rank]["bytes"][0]["grad"] / 2,
                                                            rel=1e-12)
            assert rec["bytes"][0]["grad"] == pytest.approx(rec["formula"][0]["grad"],
                                                            rel=1e-12)
            assert rec["total_bytes"][0] == pytest.approx(rec["formula"][0]["total"], rel=1e-12)
            for tag in ("param", "tp_fwd", "tp_bwd"):  # nothing else changes
                assert rec["bytes"][0][tag] == fp32[rank]["bytes"][0][tag]
            # bf16 sums: 8 mantissa bits, so close to the reference but not within fp32 tolerance
            for name, g in reference["grads"][0].items():
                torch.testing.assert_close(rec["grads"][0][name], g, rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_bf16_reduce_in_the_1d_torch_engines(results, reference, zero):
    """DDP (bf16 compression hook through the ledger), ZeroRedundancyOptimizer over DDP and
    FSDP2 (MixedPrecisionPolicy) at dp=4: the gradient collective moves bf16, half the bytes,
    as the formula says; the gradients stay close to the reference."""
    for r in range(WORLD):
        rec = load_pt(results / f"dp4_z{zero}_reduce_rank{r}.pt")
        fp32, bf16 = rec["fp32"], rec["bf16"]
        assert fp32["grad_dtypes"] == ["float32"] and bf16["grad_dtypes"] == ["bfloat16"]
        assert bf16["bytes"][0]["grad"] == pytest.approx(fp32["bytes"][0]["grad"] / 2, rel=1e-12)
        for rec_ in (fp32, bf16):
            assert rec_["bytes"][0]["grad"] == pytest.approx(rec_["formula"][0]["grad"],
                                                             rel=1e-12)
        for name, g in reference["grads"][0].items():
            torch.testing.assert_close(fp32["grads"][0][name], g, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(bf16["grads"][0][name], g, rtol=2e-2, atol=2e-4)


def test_optimizer_state_round_trip_across_layouts(results, reference):
    """Full-shape AdamW state from torch dp=2,tp=2,zero=3 after 3 steps, loaded under torch
    dp=4,zero=3, dp=4,zero=1, tp=2 (ranks 0, 1) and into a plain model: the next step's loss
    equals the 2D engine's own next step and the single-process reference's step 4 (evaluated
    at the 2D run's parameters, shardwise.parity), and the state gathered after it agrees across
    all of them."""
    b1, b2 = 0.9, 0.95
    for rec in _load(results, 3, False):
        rt = rec["roundtrip"]
        assert rt["step"] == W.STEPS
        assert "tok_embeddings.weight" in rt["state_keys"] and len(rt["state_keys"]) == 2 + 9 * 2
        want = reference_at(reference, rt["params"], W.STEPS)["loss"]
        for key in ("own", "dp4_zero3", "dp4_zero1", "tp2", "plain"):
            torch.testing.assert_close(torch.tensor(rt[key]), torch.tensor(want),
                                       rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
        # after step 4 every layout's gathered state is the plain model's: all loaded the same
        # moments and took one step from the same parameters, so m and v differ only through
        # that step's gradient, which the parity rule bounds by e = ATOL + RTOL·|g|:
        # |δm| ≤ (1−β1)·e and |δv| ≤ (1−β2)·(2|g|·e + e²), plus RTOL of their own rounding
        plain = rt["state_after"]["plain"]
        for key in ("own", "dp4_zero3", "dp4_zero1", "tp2"):
            mine = rt["state_after"][key]
            assert mine.keys() == plain.keys(), key
            for name, st in plain.items():
                assert float(mine[name]["step"]) == float(st["step"]) == W.STEPS + 1
                g = rt["plain_grads"][name].abs()
                e = ATOL + RTOL * g
                tol = {"exp_avg": (1 - b1) * e + RTOL * st["exp_avg"].abs(),
                       "exp_avg_sq": (1 - b2) * (2 * g * e + e * e) + RTOL * st["exp_avg_sq"]}
                for k in ("exp_avg", "exp_avg_sq"):
                    bad = (mine[name][k] - st[k]).abs() > tol[k]
                    assert not bad.any(), (key, name, k, float((mine[name][k] - st[k]).abs()
                                                              .max()))


def _topo(dp, tp):
    return SimpleNamespace(size=lambda axis: {"dp": dp, "tp": tp, "pp": 1, "cp": 1}[axis],
                           describe=lambda: f"pp=1 × dp={dp} × tp={tp}")


def _check(model, topo, layout, reduce_dtype):
    """parallelize (dp × tp, torch) on a topology without groups: its checks (Layout.check)
    must raise before its first collective."""
    parallelize(model, topo, layout, engine="torch", precision=Precision.of(reduce=reduce_dtype))


def test_bad_input_refused_before_any_collective():
    llama = build_model("tiny", vocab_size=67, **W.MODEL)
    with pytest.raises(ShardwiseConfigError, match="no sequence dimension"):
        _check(build_model("mlp-tiny"), _topo(2, 2), Layout(dp=2, tp=2, sp=True), "fp32")
    with pytest.raises(ShardwiseConfigError, match="does not divide"):
        _check(llama, _topo(2, 3), Layout(dp=2, tp=3), "fp32")
    with pytest.raises(ShardwiseConfigError, match="fp32 or bf16"):
        _check(llama, _topo(2, 2), Layout(dp=2, tp=2), "fp16")
    with pytest.raises(ShardwiseConfigError, match="does not match"):
        _check(llama, _topo(4, 2), Layout(dp=2, tp=2), "fp32")
