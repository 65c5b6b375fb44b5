"""Pipeline compositions (issue #6) against a single-process reference computed here, independently
of shardwise's training step and engines: pp=2 × tp=2 (1f1b with and without SP),
pp=2 × dp=2 ZeRO-1, pp=2 × dp=2 × tp=2 (1f1b, interleaved-1f1b, SP + ZeRO-1) with the explicit
engine, pp=2 × tp=2 and 3D (SP + ZeRO-1) with the torch engine, and the V schedules (zbv
pp=2 × tp=2 both engines, dualpipev 3D with SP + ZeRO-1); all in one 8-rank world
(tests/workers/pp_compose_cases.py). At each of 3 AdamW steps with binding clipping: the logged
loss and global grad norm, and every gradient of every stage gathered to full shape, equal the
reference's (fp32, rtol 1e-5, atol 1e-6), and so does the evaluation loss. Also: the ledger's
bytes per tag equal the engine's formula, and the main terms equal numbers worked out here by
hand; the full-shape optimizer state equals the reference AdamW's and survives a load round
trip."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.data import DistributedSampler
from shardwise.models import build_model
from shardwise.parity import ATOL, RTOL, assert_parity, reference_run, stages_together
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import pp_compose_cases as W  # noqa: E402

D = 32  # d_model of the tiny preset


# the world of W.SLOW's cases: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "pp_compose", nproc=8)


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case."""
    return world_of(request, request.node.callspec.params["case"] in W.SLOW)


def _params(cases):
    """``cases`` as params named by W.case_name, W.SLOW's marked slow."""
    return [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow if c in W.SLOW else ())
            for c in cases]


_REFS = {}


def reference(global_batch: int):
    """shardwise.parity's plain-PyTorch reference (AdamW with decay on matrices only, the whole
    global batch in one forward, mean cross-entropy over counted tokens, clip_grad_norm_), with
    AdamW's state, and the evaluation loss sum of the initial model."""
    if global_batch in _REFS:
        return _REFS[global_batch]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=W.V, n_layers=W.N_LAYERS, tie_embeddings=True)
    work = SyntheticLMWorkload(vocab_size=W.V, seq_len=W.SEQ, num_train=64, num_val=4, seed=0)
    (ev,) = work.batches(torch.arange(W.EVAL_ROWS), W.EVAL_ROWS)
    with torch.no_grad():  # evaluation loss sum of the initial model
        eval_sum = F.cross_entropy(model(ev["input_ids"]).reshape(-1, W.V),
                                   ev["labels"].reshape(-1), ignore_index=-100,
                                   reduction="sum").item()
    sampler = DistributedSampler(64, global_batch, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), global_batch)[0]
               for _ in range(W.STEPS)]
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM,
                        keep_state=True)
    ref["eval"] = eval_sum
    _REFS[global_batch] = ref
    return ref


def _load(out, case):
    pp, dp, tp = case[:3]
    return [load_pt(out / f"{W.case_name(*case)}_rank{r}.pt") for r in range(pp * dp * tp)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _params(W.CASES))
def test_composition_matches_single_process(results, case):
    pp, dp, tp, sp, zero, schedule, m, engine = case
    """Every step's loss, clipped norm, and each stage's gradients and parameters, by
    shardwise.parity's rule (the reference evaluated at the stages' parameters together)."""
    ref = reference(W.MICRO * m * dp)
    recs = _load(results, case)
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    whole = stages_together([rec["params"] for rec in recs])
    assert all(set(p) == set(ref["params"][0]) for p in whole), \
        "the stages together must hold every parameter"
    for rank, rec in enumerate(recs):
        # evaluation (loss_sum_and_count): the global loss sum on every rank
        torch.testing.assert_close(rec["eval"], ref["eval"], rtol=RTOL, atol=ATOL)
        assert all(rec["grads"]), f"rank {rank} holds no gradients"
        assert_parity({**rec, "params_full": whole}, ref, where=f"rank {rank}",
                      all_names=False)


EXPLICIT = [c for c in W.CASES if c[7] == "explicit"]


@pytest.mark.parametrize("case", _params(EXPLICIT))
def test_ledger_bytes_equal_formula_and_hand_count(results, case):
    """Per tag, every step, every rank: ledger == the engine's formula exactly. And by hand
    (A = one microbatch's hidden state, MICRO·SEQ·D·4 bytes, /tp with SP): activations
    m·v·A minus the last stage's, gradients m·v·A minus the first stage's; the tied embedding
    shard ⌈V/tp⌉·D·4 between the first and the last stage; ZeRO-1's reduce-scatter and
    all-gather of the padded stage, (dp−1)/dp·P·4 each; the norm scalar over tp, dp (ZeRO-1)
    and pp; TP per stage (no SP): forward 2(tp−1)/tp·W·(E + 2·L_s), W = MICRO·m·SEQ·D·4."""
    pp, dp, tp, sp, zero, schedule, m, engine = case
    v = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    is_v = schedule in ("zbv", "dualpipev")  # rank 0 holds the first and the last stage
    act = W.MICRO * W.SEQ * D * 4 // (tp if sp else 1)
    for rec in _load(results, case):
        r = rec["coords"]["pp"]
        first, last = r == 0, r == (0 if is_v else pp - 1)  # holds the embedding / the head
        # messages: the V's rank p−1 hands stage p−1 to p in memory; loop: v − [first/last]
        n_fwd = 2 - (r == 0) - (r == pp - 1) if is_v else v - last
        n_bwd = 2 - (r == 0) - (r == pp - 1) if is_v else v - first
        local_numel = None
        for by_tag, formula in zip(rec["bytes"], rec["formula"]):
            for tag in set(by_tag) | set(formula):
                if tag == "total":
                    continue
                assert by_tag.get(tag, 0.0) == pytest.approx(formula.get(tag, 0.0), rel=1e-12), tag
            assert by_tag.get("pp_fwd", 0) == m * act * n_fwd
            assert by_tag.get("pp_bwd", 0) == m * act * n_bwd
            swap = (first or last) and not (first and last)  # both on one rank: no swap
            assert by_tag.get("tied", 0) == (math.ceil(W.V / tp) * D * 4 if swap else 0)
            norm = 2 * (pp - 1) / pp * 8 + (2 * (tp - 1) / tp * 8 if tp > 1 else 0)
            norm += 2 * (dp - 1) / dp * 8 if zero else 0
            assert by_tag.get("grad_norm", 0) == pytest.approx(norm)
            if zero and tp == 1:  # full stage shapes = local shapes
                local_numel = sum(p.numel() for p in rec["params"][-1].values())
                padded = math.ceil(local_numel / dp) * dp
                assert by_tag.get("param", 0) == pytest.approx((dp - 1) / dp * padded * 4)
                assert by_tag.get("grad", 0) == pytest.approx((dp - 1) / dp * padded * 4)
            if tp > 1 and not sp:
                blocks = W.N_LAYERS // pp  # balanced split, all chunks of this rank
                wide = W.MICRO * m * W.SEQ * D * 4
                assert by_tag.get("tp_fwd", 0) == pytest.approx(
                    2 * (tp - 1) / tp * wide * (first + 2 * blocks))
                assert by_tag.get("tp_bwd", 0) == pytest.approx(
                    2 * (tp - 1) / tp * wide * (2 * blocks + last))


@pytest.mark.parametrize("case", _params([c for c in W.CASES if c[7] == "torch"]))
def test_torch_engine_ledger_total_equals_formula(results, case):
    """torch engine: what is booked (DTensor's TP collectives, our tied swap, dp all-reduce,
    norm, loss scalars; PyTorch's own p2p is not booked) equals the formula's total."""
    for rec in _load(results, case):
        for by_tag, formula in zip(rec["bytes"], rec["formula"]):
            assert sum(by_tag.values()) == pytest.approx(formula["total"], rel=1e-12)
            assert "pp_fwd" not in by_tag and "pp_bwd" not in by_tag


@pytest.mark.parametrize("case", _params([c for c in W.CASES
                                          if not (c[7] == "torch" and c[4])]))
def test_full_optimizer_state_equals_reference(results, case):
    """full_optimizer_state: AdamW's moments in full parameter shape (gathered over the dp
    slices of ZeRO-1 and the tp shards), equal to the reference optimizer's within the bound
    the measured gradient errors give (shardwise.parity.adamw_state_bound), on every rank, for
    every parameter of its stage; loading them back and reading again gives the same."""
    pp, dp, tp, sp, zero, schedule, m, engine = case
    ref = reference(W.MICRO * m * dp)
    recs = _load(results, case)
    whole = stages_together([rec["params"] for rec in recs])
    for rank, rec in enumerate(recs):
        assert set(rec["opt_state"]) == set(rec["params"][-1])
        assert all(float(st["step"]) == W.STEPS for st in rec["opt_state"].values())
        assert_parity({**rec, "params_full": whole, "state": rec["opt_state"]}, ref,
                      where=f"rank {rank}", all_names=False)
        for name, st in rec["opt_state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(rec["opt_state_reloaded"][name][key], st[key],
                                           rtol=0, atol=0)


@pytest.mark.parametrize("case", W.BF16_CASES, ids=lambda c: W.case_name(*c))
def test_bf16_gradient_reduction(results_fast, case):
    """``reduce_dtype="bf16"``: the dp gradient reduction is booked in bf16 at half the fp32
    bytes (ledger == formula per tag; by hand: all-reduce 2(dp−1)/dp·Ψ_s·2, ZeRO-1 reduce-scatter
    (dp−1)/dp·P_s·2), and the reduced gradients agree with the fp32 reference to bf16 precision
    (per tensor, in norm: elements where the dp partials cancel have large relative errors)."""
    results = results_fast  # the BF16_CASES run in make test's world
    pp, dp, tp, sp, zero, schedule, m, engine = case
    ref = reference(W.MICRO * m * dp)
    for rank in range(pp * dp * tp):
        rec = load_pt(results / f"bf16_{W.case_name(*case)}_rank{rank}.pt")
        assert rec["grad_dtypes"] == ["bfloat16"]
        for tag in set(rec["bytes"]) | set(rec["formula"]):
            if tag != "total":
                assert rec["bytes"].get(tag, 0.0) == pytest.approx(rec["formula"].get(tag, 0.0),
                                                                   rel=1e-12), tag
        numel = sum(g.numel() for g in rec["grads"].values())
        padded = math.ceil(numel / dp) * dp
        want = (dp - 1) / dp * padded * 2 if zero else 2 * (dp - 1) / dp * numel * 2
        assert rec["bytes"]["grad"] == pytest.approx(want)
        for name, g in rec["grads"].items():
            want_g = ref["grads"][0][name]
            # each dp partial and their sum rounded to bf16 (2⁻⁹ relative): a per-tensor
            # relative error of a few 1e-3; a missing or doubled dp term would be ~50 %
            err = float((g - want_g).norm() / want_g.norm())
            assert err < 1e-2, f"rank {rank} {name}: relative error {err:.2e}"
