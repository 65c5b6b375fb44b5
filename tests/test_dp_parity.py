"""DP parity against a single-process reference computed here, independently of shardwise's
training step: dp ∈ {1, 2, 4} × engine ∈ {explicit, torch} × gradient accumulation ∈ {1, 2},
3 AdamW steps with clipping that binds, on sequences with very different numbers of counted
tokens. Also: the ledger's bytes per step against the formula, and the sampler's disjointness."""

import itertools
import sys
from pathlib import Path

import pytest
import torch

from shardwise.data import DistributedSampler
from shardwise.models import build_model
from shardwise.parity import assert_parity, reference_run
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world  # noqa: E402
import dp_cases as W  # noqa: E402

CASES = list(itertools.product((1, 2, 4), ("explicit", "torch"), (1, 2)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    run_world(W.__file__, out)
    return out


@pytest.fixture(scope="module")
def reference():
    """shardwise.parity's plain-PyTorch reference (the whole global batch in one forward, loss =
    mean over counted tokens, AdamW, clip_grad_norm_) on the same global batches."""
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    indices = [sampler.next_global_batch() for _ in range(W.STEPS)]
    batches = [work.batches(idx, W.GLOBAL_BATCH)[0] for idx in indices]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, tie_embeddings=True)
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM)
    ref["indices"] = indices
    ref["counts"] = [(b["labels"] != -100).sum(1) for b in batches]
    ref["num_params"] = sum(p.numel() for p in model.parameters())
    return ref


def _load(out, dp, engine, accum):
    return [load_pt(out / f"dp{dp}_{engine}_acc{accum}_rank{r}.pt") for r in range(dp)]


def test_reference_batches_have_very_different_token_counts(reference):
    counts = torch.cat(reference["counts"])
    assert counts.min() <= 3 and counts.max() >= 14, counts  # seq_len 16: uneven on purpose


@pytest.mark.parametrize("dp,engine,accum", CASES)
def test_dp_matches_single_process(results, reference, dp, engine, accum):
    """Every step: loss, clipped global norm, every gradient and parameter (shardwise.parity's
    rule: the stated rtol/atol, and the AdamW bound for parameters)."""
    assert all(n > W.MAX_NORM for n in reference["grad_norm"])  # clipping binds
    for rank, rec in enumerate(_load(results, dp, engine, accum)):
        assert_parity(rec, reference, where=f"rank {rank}")


@pytest.mark.parametrize("dp,engine,accum", CASES)
def test_ledger_bytes_equal_formula(results, reference, dp, engine, accum):
    """Per step each rank sends 2(n−1)/n × 4Ψ bytes of fp32 gradients, plus two fp64 scalars
    (the token count before the forward, the loss sum after the step) of 2(n−1)/n × 8 each."""
    n, psi = dp, reference["num_params"]
    grad = 2 * (n - 1) / n * 4 * psi
    scalars = 2 * (2 * (n - 1) / n * 8)
    for rec in _load(results, dp, engine, accum):
        for step in range(W.STEPS):
            assert rec["grad_bytes"][step] == pytest.approx(grad, rel=1e-12, abs=0)
            assert rec["total_bytes"][step] == pytest.approx(grad + scalars, rel=1e-12, abs=0)
        if engine == "explicit" and dp > 1:
            assert rec["n_buckets"] > 1  # bucket_mb=0.01: gradients travel in several buckets


@pytest.mark.parametrize("dp", (2, 4))
def test_ranks_see_disjoint_slices_whose_union_is_the_global_batch(results, reference, dp):
    recs = _load(results, dp, "explicit", 1)
    for step in range(W.STEPS):
        parts = [rec["indices"][step] for rec in recs]
        union = torch.cat(parts)
        assert len(set(union.tolist())) == len(union)  # disjoint
        assert torch.equal(union, reference["indices"][step])  # same global batch, same order


def test_bucket_all_reduces_launch_during_backward_only_with_overlap(results):
    for rank in range(2):
        launched = load_pt(results / f"overlap_rank{rank}.pt")["launched"]
        in_flight, n_buckets = launched[True, False]
        assert n_buckets > 1 and in_flight == n_buckets  # all launched from backward hooks
        assert launched[False, False] == (0, n_buckets)  # none until finish_gradient_sync


def test_unused_parameter_gets_zero_gradient_and_the_rest_still_sync(results):
    per_rank = [load_pt(results / f"overlap_rank{r}.pt")["grads"] for r in range(2)]
    for grads in per_rank:
        torch.testing.assert_close(grads[True, True]["unused"], torch.zeros(5), rtol=0, atol=0)
        for name, g in grads[True, False].items():
            torch.testing.assert_close(grads[True, True][name], g, rtol=0, atol=0)
            torch.testing.assert_close(grads[False, False][name], g, rtol=0, atol=0)
    for name, g in per_rank[0][True, False].items():  # replicas agree after the sync
        torch.testing.assert_close(per_rank[1][True, False][name], g, rtol=0, atol=0)
