"""A mixture of experts in the explicit pipeline engine (issue #16: "composed with pp=2"), against
the single-process reference computed here: pp=2 × dp=2 with ep = 1 and 2, top-1 and top-2,
with and without a shared expert, 1f1b and gpipe, plus interleaved-1f1b, zb-h1, ZeRO-1 (ep = 1)
and a skewed routing, all in one 4-rank world (tests/workers/ep_pp_cases.py), one AdamW step
with binding clipping.

Checked: the logged loss (token cross-entropy *and* every stage's aux losses) and the clipped
global grad norm; every gradient of every stage gathered to full shape (experts over ep) and
the parameters after the step, by shardwise.parity's rule (torch.testing.assert_close with
RTOL/ATOL; the parameters with the AdamW bound); the ledger's bytes per tag equal
step_bytes_formula, and the routing-independent terms equal numbers counted here by hand.
Also the refusals: ZeRO-1 with ep > 1 in a pipeline, and the torch pipeline engine with an MoE
model."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.data import DistributedSampler
from shardwise.errors import ShardwiseConfigError
from shardwise.models import moe_aux_loss
from shardwise.parallel.layout import Layout
from shardwise.parity import ATOL, RTOL, assert_parity, reference_run
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, MIN_ROUTING_GAP, min_routing_gap, run_world  # noqa: E402
import ep_pp_cases as W  # noqa: E402

D, E = 32, 4  # d_model and n_experts of the moe-tiny preset


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_pp")
    run_world(W.__file__, out, nproc=W.PP * W.DP)
    return out


def _load(out, case):
    return [load_pt(out / f"{case.name}_rank{r}.pt") for r in range(W.PP * W.DP)]


def _global_batch() -> dict:
    """The step's whole global batch, as the dp ranks' samplers split it."""
    work = SyntheticLMWorkload(vocab_size=W.V, seq_len=W.SEQ, num_train=64, num_val=4, seed=0)
    rows = DistributedSampler(64, W.GLOBAL, 1, 0, seed=0).next_global_batch()
    return work.batches(rows, W.GLOBAL)[0]


@pytest.mark.parametrize("case", [c for c in W.CASES if not c.skew], ids=lambda c: c.name)
def test_no_routing_choice_is_near_a_tie(case):
    """Every layout routes as the reference does (conftest.min_routing_gap); the skewed cases
    tie exactly on purpose (zeroed routers) and the tie-break decides."""
    assert min_routing_gap(W.build(case), _global_batch()) > MIN_ROUTING_GAP


@pytest.mark.parametrize("case", W.CASES, ids=lambda c: c.name)
def test_matches_single_process(results, case):
    """Loss (incl. aux), norm, every gradient and the stepped parameters of every rank's stage
    equal the reference's (shardwise.parity.reference_run: the whole global batch in one
    forward, its aux losses added as token sums over the counted tokens, clip_grad_norm_,
    AdamW); the stages together hold every parameter."""
    batch = _global_batch()
    ref = reference_run(W.build(case), [batch], lrs=[W.LR], max_norm=W.MAX_NORM)
    assert ref["grad_norm"][0] > W.MAX_NORM  # clipping binds
    # the aux losses are visible at this tolerance: leaving out one stage's would fail
    plain = W.build(case)
    logits = plain(batch["input_ids"])
    ce = F.cross_entropy(logits.reshape(-1, W.V), batch["labels"].reshape(-1))
    aux = moe_aux_loss(plain) / (batch["labels"] != -100).sum()
    assert float(aux.detach()) > 100 * (ATOL + RTOL * ref["loss"][0])
    aux.backward()
    router = plain.layers[0].feed_forward.router.weight.grad  # a first-stage router
    assert float(router.abs().max()) > 100 * (ATOL + RTOL * float(
        ref["grads"][0]["layers.0.feed_forward.router.weight"].abs().max()))
    torch.testing.assert_close(float((ce + aux).detach()), ref["loss"][0], rtol=RTOL, atol=ATOL)

    recs = _load(results, case)
    held = set()
    for rank, rec in enumerate(recs):
        where = f"rank {rank} {rec['coords']}"
        torch.testing.assert_close(rec["loss"], ref["loss"][0], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{where} loss: {m}")
        torch.testing.assert_close(rec["grad_norm"], ref["grad_norm"][0], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{where} grad norm: {m}")
        assert rec["grads"], f"{where} holds no gradients"
        for name, g in rec["grads"].items():
            torch.testing.assert_close(g, ref["grads"][0][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} grad {name}: {m}")
        held |= set(rec["grads"])
        assert_parity({"loss": [rec["loss"]], "grad_norm": [rec["grad_norm"]],
                       "grads": [rec["grads"]], "params": rec["params"]}, ref, where=where,
                      all_names=False)
    assert held == set(ref["grads"][0]), "the stages together must hold every parameter"


@pytest.mark.parametrize("case", W.CASES, ids=lambda c: c.name)
def test_ledger_equals_formula(results, case):
    """Per tag, every rank: ledger == step_bytes_formula (the ep terms from the step's actual
    routing). By hand: the norm scalar over pp, ep (ep > 1) and dp (ZeRO-1); the routing counts'
    all-to-all, (ep−1)/ep·E·8 per MoE layer and microbatch; without ZeRO the dp all-reduce
    2(dp−1)/dp of the stage's dense gradients and of its experts over edp (dp/ep ranks: none
    here for ep = 2); the skewed routing: every copy this rank's ep group routes crosses from
    ep rank 1 to ep rank 0, so each rank sends (and receives) T_r·k rows of d·4 bytes per MoE
    layer, T_r its tokens, in dispatch and again in combine."""
    tokens = W.GLOBAL // W.DP * W.SEQ  # this rank's tokens per step, all microbatches
    for rec in _load(results, case):
        where = f"{rec['coords']}"
        led, f = rec["bytes"], rec["formula"]
        for tag in set(led) | set(f):
            if tag != "total":
                assert led.get(tag, 0.0) == pytest.approx(f.get(tag, 0.0), rel=1e-12), \
                    f"{where} {tag}"
        # ZeRO-1: dense slices over the data axis, expert slices over edp: the one scalar over
        # the data axis (= ep × edp) counts each once, no ep term
        norm = 2 * (W.PP - 1) / W.PP * 8 + (2 * (case.ep - 1) / case.ep * 8
                                              if case.ep > 1 and not case.zero else 0.0)
        norm += 2 * (W.DP - 1) / W.DP * 8 if case.zero else 0.0
        assert led["grad_norm"] == pytest.approx(norm), where
        n_moe = rec["moe_layers"]  # 0 on interleaved's pp rank 1 (blocks 1, 3: dense)
        if case.ep > 1 and n_moe:
            assert led["ep_counts"] == pytest.approx(case.m * n_moe * (case.ep - 1) / case.ep
                                                     * E * 8), where
            assert led["ep_dispatch"] > 0 and led["ep_combine"] > 0
        else:
            assert not any(t.startswith("ep_") for t in led), where
        if not case.zero:
            experts_over_edp = W.DP // case.ep
            dense = sum(t.numel() for n, t in rec["params"].items() if ".experts." not in n)
            experts = sum(t.numel() // case.ep for n, t in rec["params"].items()
                          if ".experts." in n)
            want = 2 * (W.DP - 1) / W.DP * dense * 4
            want += 2 * (experts_over_edp - 1) / experts_over_edp * experts * 4
            assert led["grad"] == pytest.approx(want), where
        if case.skew:
            rows = n_moe * tokens * case.top_k
            assert led["ep_dispatch"] == led["ep_combine"] == rows * D * 4, where


def test_pipeline_moe_refusals():
    """Before any collective: the torch pipeline engine with an MoE model (its schedule would
    drop the earlier stages' aux losses). ZeRO-1 with ep in a pipeline runs (a case above: the
    stage's expert shards are a second flat buffer over edp)."""
    Layout(pp=2, dp=2, ep=2, zero=1).check()
    cfg = W.build(W.CASES[0]).config
    with pytest.raises(ShardwiseConfigError, match="--engine torch --pp with a mixture"):
        Layout(pp=2, dp=2).check(model_cfg=cfg, engine="torch")
    Layout(pp=2, dp=2, zero=1).check(model_cfg=cfg)  # ZeRO-1 without ep runs (a case above)
    Layout(pp=2, dp=2, ep=2).check(model_cfg=cfg)
