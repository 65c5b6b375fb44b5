"""Pipeline parity against a single-process reference computed here, independently of shardwise's
training step: pp ∈ {2, 4} × every schedule × m ∈ {pp, 2·pp, odd} × engine ∈ {explicit, torch},
tied embeddings, 3 AdamW steps with clipping that binds; each stage's loss, gradients and
parameters match the reference's at every step by shardwise.parity's rule. The V schedules
(zbv, dualpipev) likewise at pp ∈ {2, 4} with several m, both engines, with dp = 2, untied and
on the MLP. Also: activation
memory per schedule (counted by the runtime), the ledger's point-to-point bytes against the
formula, and a timeline PNG + Chrome trace of a real pp=4 1F1B run."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.data import DistributedSampler
from shardwise.models import build_model
from shardwise.parallel.pp import build_schedule, peak_activations
from shardwise.config import TrainConfig
from shardwise.parity import ATOL, RTOL, assert_parity, reference_run, stages_together
from shardwise.train.workload import RegressionWorkload, SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import pp_cases as W  # noqa: E402

V, D = 67, 32  # vocab, d_model of the tiny preset
SEQ = 16
CASES = W.cases()


# the world of W.is_slow's cases: results_slow (``make test-slow``)
results, results_slow = split_worlds(W.__file__, "pp", fast="results")


_REFS = {}


def reference(global_batch: int, tie: bool = True, mlp: bool = False):
    """shardwise.parity's plain-PyTorch reference (AdamW, the whole global batch in one forward,
    loss = mean over counted tokens or over elements, clip_grad_norm_), and the evaluation loss
    sum of the initial model."""
    key = (global_batch, tie, mlp)
    if key in _REFS:
        return _REFS[key]
    torch.manual_seed(0)
    if mlp:
        model = build_model("mlp-tiny")
        work = RegressionWorkload(TrainConfig(model="mlp-tiny"), num_train=64, num_val=8)
    else:
        model = build_model("tiny", vocab_size=V, n_layers=W.N_LAYERS, tie_embeddings=tie)
        work = SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)
    (ev,) = work.batches(torch.arange(W.EVAL_ROWS), W.EVAL_ROWS)
    with torch.no_grad():  # evaluation loss sum of the initial model
        if mlp:
            eval_sum = F.mse_loss(model(ev["inputs"]), ev["targets"], reduction="sum").item()
        else:
            eval_sum = F.cross_entropy(model(ev["input_ids"]).reshape(-1, V),
                                       ev["labels"].reshape(-1), ignore_index=-100,
                                       reduction="sum").item()
    sampler = DistributedSampler(64, global_batch, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), global_batch)[0]
               for _ in range(W.STEPS)]
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM)
    ref["eval"] = eval_sum
    _REFS[key] = ref
    return ref


def _load(out, case):
    pp, dp, schedule, m, engine, overrides, lps = case
    name = W.case_name(pp, dp, schedule, m, engine, W._suffix(overrides, lps))
    return [load_pt(out / f"{name}_rank{r}.pt") for r in range(pp * dp)]


def _ids(case):
    pp, dp, schedule, m, engine, overrides, lps = case
    return W.case_name(pp, dp, schedule, m, engine, W._suffix(overrides, lps))


def _params(cases):
    """``cases`` as params named by _ids, W.is_slow's marked slow."""
    return [pytest.param(c, id=_ids(c), marks=pytest.mark.slow if W.is_slow(c) else ())
            for c in cases]


def _results(request, case):
    """The folder of the world that ran ``case``."""
    return world_of(request, W.is_slow(case), fast="results")


@pytest.mark.parametrize("case", _params(CASES))
def test_pipeline_matches_single_process(request, case):
    pp, dp, schedule, m, engine, overrides, lps = case
    results = _results(request, case)
    ref = reference(W.MICRO * m * dp, overrides.get("tie_embeddings", True),
                    overrides.get("model") == "mlp-tiny")
    recs = _load(results, case)
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    whole = stages_together([rec["params"] for rec in recs])  # every stage's, per step
    assert all(set(p) == set(ref["params"][0]) for p in whole), \
        "the stages together must hold every parameter"
    for rank, rec in enumerate(recs):
        # evaluation (loss_sum_and_count): the global loss sum on every rank
        torch.testing.assert_close(rec["eval"][0].item(), ref["eval"], rtol=RTOL, atol=ATOL)
        assert all(rec["grads"]), f"rank {rank} holds no gradients"
        # the logged loss and norm are global: identical on every rank; gradients and
        # parameters are this rank's stage's
        assert_parity({**rec, "params_full": whole}, ref, where=f"rank {rank}", all_names=False)


def test_tied_embedding_lives_on_first_and_last_stage(results):
    recs = _load(results, (4, 1, "1f1b", 4, "explicit", {}, None))
    holders = [r for r, rec in enumerate(recs) if "tok_embeddings.weight" in rec["params"][-1]]
    assert holders == [0, 3]
    assert all("output.weight" not in rec["params"][-1] for rec in recs)  # tied: one name


def test_v_placement_puts_first_and_last_stage_on_rank_0(results):
    """zbv/dualpipev at pp=4 on 8 layers: rank r holds blocks r and 7−r; rank 0 the embedding
    and the head (one tied parameter, no swap), rank 3 the two middle blocks."""
    for schedule in ("zbv", "dualpipev"):
        recs = _load(results, (4, 1, schedule, 8, "explicit", {}, None))
        for r, rec in enumerate(recs):
            names = set(rec["params"][-1])
            blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
            assert blocks == [r, 7 - r]
            assert ("tok_embeddings.weight" in names) == ("norm.weight" in names) == (r == 0)
            assert "output.weight" not in names

@pytest.mark.parametrize("pp_m", [pytest.param(
    (pp, m), id=f"pp{pp}_m{m}",
    marks=pytest.mark.slow if W.is_slow((pp, 1, "1f1b", m, "explicit", {}, None)) else ())
    for pp in (2, 4) for m in (pp, 2 * pp, W.ODD_M[pp])])
def test_activation_memory_1f1b_at_most_p_gpipe_m(request, pp_m):
    pp, m = pp_m
    results = _results(request, (pp, 1, "1f1b", m, "explicit", {}, None))
    for rec in _load(results, (pp, 1, "1f1b", m, "explicit", {}, None)):
        i = rec["pp_index"]
        assert max(rec["peak_alive"]) == min(m, pp - i)  # warm-up p−1−i, plus one
        assert max(rec["peak_alive"]) <= pp
    for rec in _load(results, (pp, 1, "zb-h1", m, "explicit", {}, None)):
        assert max(rec["peak_alive"]) <= pp  # W pending counts as alive
    for rec in _load(results, (pp, 1, "gpipe", m, "explicit", {}, None)):
        assert max(rec["peak_alive"]) == m


@pytest.mark.parametrize("case", _params([c for c in CASES if c[2] in ("zbv", "dualpipev")
                                          and c[4] == "explicit"]))
def test_v_activation_memory_equals_the_schedules(request, case):
    """The runtime's count of chunks holding activations (F until B or W) is the order's
    (peak_activations): zbv 2p, dualpipev 2p+1 chunks once m ≥ 2p."""
    pp, dp, schedule, m = case[:4]
    want = peak_activations(build_schedule(schedule, pp, m))
    for rec in _load(_results(request, case), case):
        assert max(rec["peak_alive"]) == want[rec["pp_index"]]
        if m >= 2 * pp:
            assert want[rec["pp_index"]] == 2 * pp + (schedule == "dualpipev")


@pytest.mark.parametrize("case", _params([c for c in CASES if c[4] == "explicit"]))
def test_ledger_bytes_equal_formula(request, case):
    """Per step and rank r: activations m·v·A minus the last stage's, gradients m·v·A minus the
    first stage's (A = MICRO·SEQ·D·4 bytes); the tied embedding's gradient V·D·4 once each way
    between the first and the last rank; the norm scalar 2(p−1)/p·8; the dp gradient
    all-reduce; the loss/count scalars."""
    pp, dp, schedule, m, engine, overrides, lps = case
    v = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    act = W.MICRO * SEQ * D * 4
    tied = overrides.get("tie_embeddings", True) and "model" not in overrides
    if "model" in overrides:
        act = W.MICRO * 16 * 4  # mlp-tiny: [b, D=16]
    for rec in _load(_results(request, case), case):
        r = rec["pp_index"]
        stage_bytes = sum(p.numel() * 4 for p in rec["params"][-1].values())
        if schedule in ("zbv", "dualpipev"):
            # the V: rank 0 holds the first and the last stage (no tied swap), rank p−1 the
            # two middle ones (handed over in memory)
            n_fwd = n_bwd = 2 - (r == 0) - (r == pp - 1)
            tied_bytes = 0
        else:
            n_fwd, n_bwd = v - (r == pp - 1), v - (r == 0)
            tied_bytes = V * D * 4 if tied and r in (0, pp - 1) else 0
        for by_tag in rec["bytes"]:
            assert by_tag.get("pp_fwd", 0) == m * act * n_fwd
            assert by_tag.get("pp_bwd", 0) == m * act * n_bwd
            assert by_tag.get("tied", 0) == tied_bytes
            assert by_tag.get("grad_norm", 0) == pytest.approx(2 * (pp - 1) / pp * 8)
            assert by_tag.get("grad", 0) == pytest.approx(2 * (dp - 1) / dp * stage_bytes)
            # token count over dp; loss sum over pp and over dp
            assert by_tag.get("loss", 0) == pytest.approx(
                2 * (dp - 1) / dp * 8 * 2 + 2 * (pp - 1) / pp * 8)


def test_real_run_timeline_png_and_chrome_trace(results):
    info = load_pt(results / "trace_info.pt")
    png = Path(info["png"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(Path(info["trace"]).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        kinds = [e["cat"] for e in spans if e["tid"] == rank]
        assert kinds.count("F") == 8 and kinds.count("B") == 8
        assert kinds.count("SEND_F") == (8 if rank < 3 else 0)
        assert kinds.count("RECV_B") == (8 if rank < 3 else 0)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert 0.0 < info["bubble"] < 1.0
