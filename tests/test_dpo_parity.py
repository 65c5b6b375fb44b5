"""DPO parity (issue 21): the sigmoid DPO loss, every gradient and the reward metrics of a
parallel run equal a single-process reference, in dp, ZeRO-1/3, tp, dp × tp, pp (1f1b and
interleaved), pp × tp, pp × dp and the torch engine's DDP / FSDP2 — all in one 4-rank world
(tests/workers/dpo_cases.py; the layouts that a kept case composes again, W.SLOW, in a second
world under ``make test-slow``).

The reference is :func:`shardwise.parity.reference_run` with :func:`shardwise.parity.
reference_dpo_loss`: plain PyTorch, the whole global batch of pairs in one forward, each row's
log-prob by ``log_softmax`` + ``gather`` (not ``F.cross_entropy``, not shardwise's objective), the
reference log-probs from an untouched copy of the initial model. The comparison is
:func:`shardwise.parity.assert_parity` — per step the loss, the clipped norm and every gradient
within ``ATOL + RTOL·|ref|`` (1e-6 + 1e-5·|ref|) at the run's own parameters, and the
parameters within the AdamW bound; the derivation of those tolerances (summation order in fp32,
Higham §4.2) is in that module's docstring and holds here: the DPO weights β·σ(−z)/n that
multiply each row's cross-entropy gradient are smooth in z, and z is formed in fp64.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.models import build_model
from shardwise.parity import (ATOL, RTOL, assert_parity, reference_model_at, reference_run,
                              sequence_logps, stages_together)

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import dpo_cases as W  # noqa: E402


# the world of W.SLOW's cases: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "dpo", nproc=4)


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case."""
    return world_of(request, request.node.callspec.params["case"] in W.SLOW)


# the cases as params, W.SLOW's marked slow
CASES = [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow if c in W.SLOW else ())
         for c in W.CASES]


_REFS = {}


def reference(gb: int) -> dict:
    """The reference run for global batch ``gb`` rows, with each step's batch carrying the
    frozen initial model's log-probs."""
    if gb in _REFS:
        return _REFS[gb]
    work = W.make_work()
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=W.V, n_layers=W.N_LAYERS, tie_embeddings=True)
    frozen = build_model("tiny", vocab_size=W.V, n_layers=W.N_LAYERS, tie_embeddings=True)
    frozen.load_state_dict(model.state_dict())
    sampler = work.sampler(gb, 1, 0, seed=0)
    batches = []
    for _ in range(W.STEPS):
        (b,) = work.batches(sampler.next_global_batch(), gb)
        with torch.no_grad():
            b["ref_logps"] = sequence_logps(frozen, b["input_ids"], b["labels"])
        b["dpo_beta"] = W.BETA
        batches.append(b)
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM)
    ref["frozen"], ref["init"] = frozen, dict(frozen.named_parameters())
    _REFS[gb] = ref
    return ref


def _load(out, case):
    pp, dp, tp = case[:3]
    return [load_pt(out / f"{W.case_name(*case)}_rank{r}.pt") for r in range(pp * dp * tp)]


def expected_metrics(ref: dict, params: dict, batch: dict) -> tuple[dict, torch.Tensor]:
    """The DPO metrics of ``batch`` (whole global batch) at ``params``, by hand, and the
    per-pair margins."""
    model = reference_model_at(ref, params)
    with torch.no_grad():
        pi = sequence_logps(model, batch["input_ids"], batch["labels"])
    r = batch["ref_logps"]
    rc, rr, pc, pr = r[0::2], r[1::2], pi[0::2], pi[1::2]
    margin = W.BETA * ((pc - rc) - (pr - rr))
    return {"dpo_reward_margin": float(margin.mean()),
            "dpo_reward_accuracy": float((margin > 0).double().mean()),
            "dpo_reward_chosen": float(W.BETA * (pc - rc).mean()),
            "dpo_reward_rejected": float(W.BETA * (pr - rr).mean()),
            "dpo_logps_chosen": float(pc.mean()), "dpo_logps_rejected": float(pr.mean()),
            "dpo_pairs": len(pc)}, margin


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES)
def test_dpo_matches_single_process(results, case):
    """Loss, clipped norm, every gradient, the parameters after each AdamW step (the parity
    rule), on every rank; and the clipping binds, and the policy moved off the reference (so
    steps 2 and 3 test z ≠ 0: at step 1 policy = reference and z = 0 exactly)."""
    ref = reference(W.global_batch(case))
    recs = _load(results, case)
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])
    assert ref["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(ref["loss"][-1] - math.log(2)) > 1e-3
    whole = stages_together([rec["params"] for rec in recs])
    assert all(set(p) == set(ref["params"][0]) for p in whole)
    for rank, rec in enumerate(recs):
        assert rec["grads"][0], f"rank {rank} holds no gradients"
        assert_parity({**rec, "params_full": whole}, ref, where=f"rank {rank}", all_names=False)


@pytest.mark.parametrize("case", CASES)
def test_dpo_metrics_match_by_hand(results, case):
    """The step metrics (mean reward margin, accuracy, rewards and log-probs of chosen and
    rejected over the global batch, from the step's own forward) equal those computed by hand
    at the parameters the step started from, identically on every rank. Tolerance: a row's
    log-prob sums ≤ 16 fp32 terms of size ≤ ~10, each off by a few ulps between summation
    orders (2⁻²³ ≈ 1.2e-7): ≤ 16·10·4·1.2e-7 ≈ 8e-5; so atol 2e-4 on log-probs and on the
    β-scaled rewards. Accuracy is compared only where no reference margin is within 1e-3 of 0
    (a round-off could flip such a pair; at step 1 every margin is exactly 0 on both sides)."""
    ref = reference(W.global_batch(case))
    recs = _load(results, case)
    whole = stages_together([rec["params"] for rec in recs])
    for t in range(W.STEPS):
        params = ref["init"] if t == 0 else whole[t - 1]
        want, margin = expected_metrics(ref, params, ref["batches"][t])
        for rank, rec in enumerate(recs):
            got = rec["metrics"][t]
            assert got["dpo_pairs"] == want["dpo_pairs"]
            for k in ("dpo_reward_margin", "dpo_reward_chosen", "dpo_reward_rejected",
                      "dpo_logps_chosen", "dpo_logps_rejected"):
                assert got[k] == pytest.approx(want[k], abs=2e-4), (rank, t, k)
            if t == 0:
                assert got["dpo_reward_margin"] == 0.0 and got["dpo_reward_accuracy"] == 0.0
            elif bool((margin.abs() > 1e-3).all()):
                assert got["dpo_reward_accuracy"] == want["dpo_reward_accuracy"], (rank, t)
            assert got["mem_reference_bytes"] == rec["ref_bytes"]["params"]


@pytest.mark.parametrize("case", CASES)
def test_reference_is_frozen_and_sharded_like_the_policy(results, case):
    """The reference has no trainable parameter and no gradient after 3 steps; its parameter
    bytes on each rank are the policy's (the same shards: 1/dp of them under ZeRO-3, a
    pipeline stage, tp shards); validation at the initial model gives log 2 over exactly the
    held-out pairs (3 pairs: one dp rank runs a padding forward whose sums are not added)."""
    pp, dp, tp, zero, schedule, m, micro, engine = case
    for rec in _load(results, case):
        assert not rec["ref_requires_grad"] and rec["ref_grads"] == 0
        assert rec["ref_bytes"]["grads"] == 0 and rec["ref_bytes"]["optimizer"] == 0
        policy = sum(t.numel() for t in rec["params"][-1].values())  # full shapes of the stage
        if zero == 3:  # ZeRO-3 / FSDP2: about 1/dp of the stage's elements
            assert rec["ref_bytes"]["params"] <= 4 * (policy / dp + 64 * dp)
        elif tp == 1:  # replicated over dp: exactly the stage's parameters
            assert rec["ref_bytes"]["params"] == 4 * policy
        assert rec["val_metrics"]["val_dpo_pairs"] == W.VAL_PAIRS
        assert rec["val_loss"] == pytest.approx(math.log(2), rel=RTOL, abs=ATOL)
