"""Explicit dp × tp (TP inside, DP / ZeRO-1/2/3 over dp) against a single-process reference
computed here, the ledger against the formula, bf16 gradient reduction, layout-free optimizer
state (save under one layout, resume under another), the dropout RNG and bad input.

One 4-rank world (tests/workers/compose2d_cases.py) runs every case; dp=2 × tp=2 on a GQA model
(8 heads, 4 kv heads, d=32, 2 layers, d_ff=64) with vocabulary 67 (tp does not divide it), 3 AdamW
steps of 8 sequences, 2 micro-batches per dp rank, clipping that binds."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.data import DistributedSampler
from shardwise.models import build_model
from shardwise.parity import ATOL, RTOL, assert_parity, reference_model_at, reference_run
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import compose2d_cases as W  # noqa: E402

RANKS = range(4)
D, L, F_FF, H, K, HD, V = 32, 2, 64, 8, 4, 4, 67  # the model of W.MODEL, written out


# the world of W.PARITY_SLOW's cases: results_slow (``make test-slow``)
results, results_slow = split_worlds(W.__file__, "compose2d", fast="results")


def _results(request, zero, sp, tied):
    """The folder of the world that ran this parity case."""
    return world_of(request, (zero, sp, tied) in W.PARITY_SLOW, fast="results")


def _load(out, name, rank):
    return load_pt(out / f"{name}_rank{rank}.pt")


def _reference(tied, steps):
    """shardwise.parity's plain-PyTorch reference (torch AdamW with decay on matrices only, the
    whole global batch in one forward, F.cross_entropy mean over counted tokens,
    clip_grad_norm_), with AdamW's state after each step, and the validation rows."""
    work = SyntheticLMWorkload(vocab_size=V, seq_len=W.SEQ, num_train=64, num_val=4, seed=0)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, tie_embeddings=tied, **W.MODEL)
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(steps)]
    ref = reference_run(model, batches, lrs=[W.LR] * steps, max_norm=W.MAX_NORM,
                        keep_state=True)
    (ref["val"],) = work.batches(torch.arange(4), 4, split="val")
    return ref


@pytest.fixture(scope="module")
def references():
    return {tied: _reference(tied, W.RESUME_STEPS) for tied in (True, False)}


def _close(a, b, rtol=RTOL, atol=ATOL, what=""):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=what)


def _local_numel(tied, tp=2):
    """Ψ_tp of one rank's TP shard, from the model dimensions: vocabulary padded to a multiple
    of tp, attention split by heads, SwiGLU by d_ff, norm weights replicated."""
    vpad = -(-V // tp) * tp
    per_layer = (D * (H + 2 * K) * HD + H * HD * D + 3 * D * F_FF) // tp + 2 * D
    return vpad // tp * D * (1 if tied else 2) + L * per_layer + D


CASES = [W.case_name(*c) for c in W.PARITY]
PARITY = [pytest.param(*c, id=W.case_name(*c),  # W.PARITY_SLOW's marked slow
                       marks=pytest.mark.slow if c in W.PARITY_SLOW else ()) for c in W.PARITY]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero,sp,tied", PARITY)
def test_parity_with_single_process(request, references, zero, sp, tied):
    """Every step's loss, clipped norm, gradients and parameters by shardwise.parity's rule;
    the evaluation and sampling paths after training against the reference model holding this
    run's final parameters."""
    ref = references[tied]
    assert all(n > W.MAX_NORM for n in ref["grad_norm"][:W.STEPS])  # clipping binds
    results = _results(request, zero, sp, tied)
    for rank in RANKS:
        rec = _load(results, W.case_name(zero, sp, tied), rank)
        assert_parity(rec, ref, where=f"rank {rank}")
        with torch.no_grad():  # where this run ended: one forward's round-off only
            logits = reference_model_at(ref, rec["params"][-1])(ref["val"]["input_ids"])
        _close(rec["full_logits"], logits, what="full_model logits")
        ce = F.cross_entropy(logits.reshape(-1, V), ref["val"]["labels"].reshape(-1),
                             ignore_index=-100, reduction="sum")
        _close(torch.tensor(rec["eval_loss_sum"]), ce, what="eval loss sum")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero,sp,tied", PARITY + W.BF16,
                         ids=CASES + [W.case_name(*c, "bf16") for c in W.BF16])
def test_ledger_equals_formula(request, zero, sp, tied):
    results = _results(request, zero, sp, tied)
    for reduce_dtype in (("fp32", "bf16") if (zero, sp, tied) in W.BF16 else ("fp32",)):
        sp_slices = []
        for rank in RANKS:
            rec = _load(results, W.case_name(zero, sp, tied, reduce_dtype), rank)
            for step in range(W.STEPS):
                # formulas.step_bytes_formula = the engine's bytes_formula + the loss scalars
                measured, formula = rec["bytes"][step], rec["formula"][step]
                engine_formula = rec["engine_formula"][step]
                assert {t: v for t, v in formula.items() if t not in ("loss", "total")} == \
                    {t: v for t, v in engine_formula.items() if t != "total"}
                for tag in set(measured) | set(formula):
                    if tag in ("total", "checkpoint"):
                        continue
                    m, f = measured.get(tag, 0.0), formula.get(tag, 0.0)
                    assert m == pytest.approx(f, rel=1e-12, abs=1e-9), (rank, step, tag, m, f)
                total = rec["formula"][step]["total"]  # formulas.step_bytes_formula
                assert measured["total"] == pytest.approx(total, rel=1e-12)
                assert measured["checkpoint"] == 0  # state gathers are outside the step
            # independent numbers: Ψ_tp from the dimensions; DP's ring all-reduce of it
            assert rec["local_numel"] == _local_numel(tied)
            b = 2 if reduce_dtype == "bf16" else 4
            if zero == 0:
                assert rec["bytes"][0]["grad"] == 2 * (2 - 1) / 2 * _local_numel(tied) * b
                assert rec["bytes"][0]["sp_grad"] == (2 * (2 - 1) / 2 * (2 * L + 1) * D * 4
                                                      if sp else 0)
            else:
                sp_slices.append(rec["sp_slice_numel"])
            assert rec["bytes"][0]["tp_fwd"] > 0 and rec["bytes"][0]["loss"] == 2 * 8.0
        if zero and sp:  # ranks (dp 0, tp j), (dp 1, tp j) own disjoint halves of the norms
            assert sp_slices[0] + sp_slices[2] == (2 * L + 1) * D
            assert sp_slices[0] == sp_slices[1] and sp_slices[2] == sp_slices[3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero,sp,tied", W.BF16, ids=[W.case_name(*c) for c in W.BF16])
def test_bf16_reduction_halves_dp_bytes(results, references, zero, sp, tied):
    ref = references[tied]
    for rank in RANKS:
        fp32 = _load(results, W.case_name(zero, sp, tied), rank)
        bf16 = _load(results, W.case_name(zero, sp, tied, "bf16"), rank)
        diffs = []
        for step in range(W.STEPS):
            assert fp32["grad_dtypes"][step] == ["float32"]
            assert bf16["grad_dtypes"][step] == ["bfloat16"]
            assert bf16["bytes"][step]["grad"] == fp32["bytes"][step]["grad"] / 2
            for tag in ("tp_fwd", "tp_bwd", "ce", "param", "sp_grad", "grad_norm", "loss"):
                assert bf16["bytes"][step][tag] == fp32["bytes"][step][tag], tag
            # bf16 keeps 8 mantissa bits: the loss stays close, gradients within ~1 %
            assert bf16["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-4)
            for name, g in bf16["grads"][step].items():
                r = ref["grads"][step][name]
                assert (g - r).norm() <= 1e-2 * r.norm() + 1e-7, (step, name)
                diffs.append(float((g - fp32["grads"][step][name]).abs().max()))
        assert max(diffs) > 0  # the reduction really was rounded to bf16


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", W.PLAIN_ZERO)
def test_plain_dp_bf16_reduction(results, references, zero):
    """Without TP: DataParallel's bf16 buckets / ZeroSync's bf16 reduce_scatter book half
    the gradient bytes, the formula follows, and the loss stays close to the reference's."""
    ref = references[True]
    for rank in RANKS:
        fp32 = _load(results, f"plain_z{zero}_fp32", rank)
        bf16 = _load(results, f"plain_z{zero}_bf16", rank)
        for step in range(2):
            assert (fp32["grad_dtypes"][step], bf16["grad_dtypes"][step]) == (["float32"],
                                                                              ["bfloat16"])
            assert bf16["bytes"][step]["grad"] == fp32["bytes"][step]["grad"] / 2 > 0
            for rec in (fp32, bf16):
                assert rec["bytes"][step]["total"] == pytest.approx(
                    rec["formula"][step]["total"], rel=1e-12)
                assert rec["bytes"][step]["grad"] == pytest.approx(
                    rec["formula"][step]["grad"], rel=1e-12)
            assert fp32["loss"][step] == pytest.approx(ref["loss"][step], rel=RTOL)
            assert bf16["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero,sp,tied", PARITY)
def test_full_optimizer_state_matches_reference(request, references, zero, sp, tied):
    """The layout-free AdamW state against the reference's, within the bound that the measured
    gradient errors give (shardwise.parity.adamw_state_bound); memory against the formula."""
    ref = references[tied]
    results = _results(request, zero, sp, tied)
    for rank in RANKS:
        rec = _load(results, W.case_name(zero, sp, tied), rank)
        state = rec["opt_state"]
        assert state.keys() == ref["state"][W.STEPS - 1].keys()
        assert all(float(st["step"]) == W.STEPS for st in state.values())
        assert_parity({**rec, "state": state}, ref, where=f"rank {rank}")
        mem, formula = rec["state_bytes"], rec["memory_formula"]
        for key in ("params", "grads"):
            assert mem[key] == pytest.approx(formula[key], rel=0.02), key
        # the optimizer also holds AdamW's fp32 step counter per tensor (piece)
        assert formula["optimizer"] <= mem["optimizer"] <= 1.02 * formula["optimizer"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", W.RESUME_TARGETS)
def test_resume_under_another_layout(results, references, target):
    """Saved after step 2 of dp=2,tp=2,zero=3,sp; steps 3 and 4 under ``target`` continue the
    run: its trajectory (the source's first 2 steps, then the target's) matches one process by
    shardwise.parity's rule, moments included; with fresh optimizer state (the negative control)
    they must not."""
    ref = references[True]
    src = _load(results, "resume_source", 0)
    assert_parity(src, ref, where="source")  # the source itself follows the reference
    head = {k: src[k][:W.SAVE_AFTER] for k in ("loss", "grads", "params")}
    assert all(float(st["step"]) == W.SAVE_AFTER for st in src["saved_state"].values())
    assert_parity({**head, "state": src["saved_state"]}, ref, where="saved state")
    ranks = range(2) if target == "tp2" else RANKS
    for rank in ranks:
        rec = _load(results, f"resume_{target}", rank)
        if target != "fresh_state":  # the round trip full → shards → full is exact
            for name, st in src["saved_state"].items():
                for k, v in st.items():
                    assert torch.equal(rec["loaded_state"][name][k], v), (name, k)
        losses = rec["loss"]
        params = rec["params"]
        if target == "fresh_state":
            assert losses[0] == pytest.approx(src["loss"][W.SAVE_AFTER], rel=1e-12)  # same params
            assert abs(losses[1] - src["loss"][W.SAVE_AFTER + 1]) > 1e-5  # moments matter
            worst = max(float((params[0][n] - src["params"][W.SAVE_AFTER][n]).abs().max())
                        for n in params[0])
            assert worst > 1e-4
            continue
        resumed = {k: head[k] + rec[k] for k in ("loss", "grads", "params")}
        assert_parity({**resumed, "state": rec["final_state"]}, ref,
                      where=f"{target} rank {rank}")


@pytest.mark.timeout(300)
def test_dropout_rng_per_dp_replica(results):
    """Residual dropout without SP acts on tp-replicated activations: the same mask on both tp
    ranks of a dp row; the two dp rows (different data in training) draw different masks."""
    recs = {(r["dp"], r["tp"]): r["masks"] for r in (_load(results, "dropout", k) for k in RANKS)}
    assert len(recs[(0, 0)]) == 2 * L  # attention and MLP branch of each block
    for a, b in zip(recs[(0, 0)], recs[(0, 1)]):
        assert torch.equal(a, b)
    for a, b in zip(recs[(1, 0)], recs[(1, 1)]):
        assert torch.equal(a, b)
    for a, b in zip(recs[(0, 0)], recs[(1, 0)]):
        assert not torch.equal(a, b)
        assert 0.3 < a.float().mean() < 0.7  # about half dropped


@pytest.mark.timeout(300)
def test_bad_input_raises_config_error(results):
    expect = {"mlp": "no sequence dimension", "reduce_dtype": "fp32 or bf16", "tp_heads": "n_kv_heads",
              "wrong_topology": "Topology", "dp_reduce_dtype": "fp32 or bf16",
              "zero_reduce_dtype": "fp32 or bf16"}
    msgs = _load(results, "errors", 0)
    assert msgs.keys() == expect.keys()
    for key, needle in expect.items():
        assert "WRONG ERROR TYPE" not in msgs[key] and msgs[key] != "NO ERROR", msgs[key]
        assert needle in msgs[key], (key, msgs[key])
