"""The explicit pipeline engine on micro-batches of unequal sizes (issue 13, item 1).

Micro-batches of (3, 3, 2) and (2, 3, 3) rows, pp=2, every explicit schedule (a 2-rank world),
then pp=2 × tp=2 (± SP) and pp=2 × dp=2 with a different split on each dp rank (a 4-rank
world): the loss, the gradient norm and every gradient of 2 AdamW steps match one process
running the plain model on the concatenated batch (token-weighted mean), by shardwise.parity's
rule, and the ledger's bytes per tag equal the formula's and a hand count of the point-to-point
activations (Σ rows · S · d · 4 per chunk boundary)."""

import sys
from pathlib import Path

import pytest
import torch

from shardwise.models import build_model
from shardwise.parity import assert_parity, reference_run, stages_together

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world  # noqa: E402
import pp_unequal_cases as W  # noqa: E402

D = 32  # d_model of the tiny preset
CASES2, CASES4 = W.cases(2), W.cases(4)


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_unequal2")
    run_world(W.__file__, out, nproc=2)
    return out


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_unequal4")
    run_world(W.__file__, out, nproc=4)
    return out


_REFS = {}


def reference(dp: int) -> dict:
    """shardwise.parity's plain-PyTorch reference: the seed-0 model, each step's whole global
    batch (8·dp rows) in one forward, cross-entropy averaged over its counted tokens."""
    if dp not in _REFS:
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=W.V, n_layers=W.N_LAYERS)
        work = W.make_work()
        batches = [work.batches(W.global_rows(t, dp), 8 * dp)[0] for t in range(W.STEPS)]
        _REFS[dp] = reference_run(model, batches, lrs=[W.LR] * W.STEPS, weight_decay=0.1)
    return _REFS[dp]


def _load(out, case):
    pp, dp, tp = case[:3]
    return [load_pt(out / f"{W.case_name(*case)}_rank{r}.pt") for r in range(pp * dp * tp)]


def _ids(case):
    return W.case_name(*case)


def _check_parity(out, case):
    recs = _load(out, case)
    ref = reference(case[1])
    whole = stages_together([rec["params"] for rec in recs])
    assert all(set(p) == set(ref["params"][0]) for p in whole), \
        "the stages together must hold every parameter"
    for rank, rec in enumerate(recs):
        assert rec["grads"] and all(rec["grads"]), f"rank {rank} holds no gradients"
        assert_parity({**rec, "params_full": whole}, ref, where=f"rank {rank}", all_names=False)


def _check_bytes(out, case):
    """Ledger == formula per tag; by hand: every stage boundary carries each micro-batch's
    [b, s, d] (SP: [b, s/tp, d]) fp32 once forward (pp_fwd) and once backward (pp_bwd), so rank
    r sends Σ_b b·s·d·4 · (v − [r = p−1]) activations and · (v − [r = 0]) gradients."""
    pp, dp, tp, sp, schedule, sizes = case
    v = 2 if schedule == "interleaved-1f1b" else 1
    for rec in _load(out, case):
        r = rec["coords"]["pp"]
        rows = sum(sizes[rec["coords"]["dp"]])
        act = rows * (W.SEQ // (tp if sp else 1)) * D * 4
        for by_tag, formula in zip(rec["bytes"], rec["formula"]):
            assert by_tag.get("pp_fwd", 0) == act * (v - (r == pp - 1))
            assert by_tag.get("pp_bwd", 0) == act * (v - (r == 0))
            for tag in (set(by_tag) | set(formula)) - {"total"}:
                assert by_tag.get(tag, 0.0) == pytest.approx(formula.get(tag, 0.0),
                                                             rel=1e-12), tag


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES2, ids=_ids)
def test_unequal_microbatches_match_single_process(results2, case):
    _check_parity(results2, case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES2, ids=_ids)
def test_unequal_microbatches_ledger_equals_formula(results2, case):
    _check_bytes(results2, case)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES4, ids=_ids)
def test_unequal_microbatches_with_tp_or_dp_match_single_process(results4, case):
    _check_parity(results4, case)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES4, ids=_ids)
def test_unequal_microbatches_with_tp_or_dp_ledger_equals_formula(results4, case):
    _check_bytes(results4, case)


def test_activation_shape_from_each_microbatch_or_its_targets():
    """A rank sizes each receive from that micro-batch's own rows, read from the inputs or, when
    it holds only the targets, from them: [b, s, d] (SP over 2: [b, s/2, d]); MLP [b, D]."""
    from shardwise.parallel.pp.split import activation_shape

    cfg = build_model("tiny", vocab_size=W.V, n_layers=2).config
    ids = torch.zeros(3, W.SEQ, dtype=torch.long)
    assert activation_shape({"input_ids": ids, "labels": ids}, cfg) == (3, W.SEQ, D)
    assert activation_shape({"labels": ids[:2]}, cfg, seq_shards=2) == (2, W.SEQ // 2, D)
    assert activation_shape({"targets": torch.zeros(5, 16)}, None) == (5, 16)
