"""ZeRO-2/3 and HSDP inside pipeline stages (issue 53) against a single-process reference
computed here (shardwise.parity's plain-PyTorch run), independently of the engines:
tests/workers/pp_zero_cases.py. 4 ranks: pp=2 × dp=2 with ZeRO-2 (1f1b,
interleaved-1f1b, zb-h1) and ZeRO-3 (1f1b with and without reshard_after_forward,
interleaved-1f1b) on the explicit engine, ZeRO-2/3 (1f1b, interleaved-1f1b) on the torch
engine (FSDP2 on each torch.distributed.pipelining stage); make test runs each stage and each
schedule of each engine, W.SLOW4 the rest (slow). 8 ranks (slow): HSDP pp=2 × dp=4
(dp_replicate 2) with ZeRO-1/2/3 and pp=2 × dp=2 × tp=2 with SP and ZeRO-3 (explicit), HSDP
with ZeRO-3 and ZeRO-1 (torch).

Each case evaluates once before training (what an evaluation leaves gathered must not change
the ledger), then at each of 3 AdamW steps with binding clipping: loss, norm, every gradient and
parameter of every stage by the fp32 parity rule (docs/parity.md); the ledger's bytes per tag
equal the engine's formula exactly, and equal the counts worked out here from the stage's
parameter shapes; the full-shape optimizer state by the rule, and its load round trip. The
refusals that remain are checked by Layout.check alone."""

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.data import DistributedSampler
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model
from shardwise.parallel.layout import Layout
from shardwise.parity import assert_parity, reference_run, stages_together
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world, split_worlds, world_of  # noqa: E402
import pp_zero_cases as W  # noqa: E402

FAST, SLOW = W.CASES[4], W.CASES[8]


# the 4-rank world of W.SLOW4's cases: results4_slow (``make test-slow``)
results4, results4_slow = split_worlds(W.__file__, "pp_zero4", fast="results4",
                                       slow="results4_slow")


@pytest.fixture(scope="module")
def results8(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_zero8")
    run_world(W.__file__, out, nproc=8)
    return out


_REFS = {}


def reference(global_batch: int) -> dict:
    """The plain model, the whole global batch per step, AdamW with the run's clipping."""
    if global_batch not in _REFS:
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=W.V, n_layers=W.N_LAYERS, tie_embeddings=True)
        work = SyntheticLMWorkload(vocab_size=W.V, seq_len=W.SEQ, num_train=64, num_val=4,
                                   seed=0)
        sampler = DistributedSampler(64, global_batch, 1, 0, seed=0)
        batches = [work.batches(sampler.next_global_batch(), global_batch)[0]
                   for _ in range(W.STEPS)]
        _REFS[global_batch] = reference_run(model, batches, lrs=[W.LR] * W.STEPS,
                                            max_norm=W.MAX_NORM, keep_state=True)
    return _REFS[global_batch]


def _engine(case) -> str:
    return case[9] if len(case) > 9 else "explicit"


def _load(out, case):
    pp, dp, tp = case[0], case[1], case[3]
    return [load_pt(out / f"{W.case_name(*case)}_rank{r}.pt") for r in range(pp * dp * tp)]


def _parity(out, case):
    pp, dp, rep, tp, sp, zero, schedule, m, raf = case[:9]
    ref = reference(W.MICRO * m * dp)
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    recs = _load(out, case)
    whole = stages_together([rec["params"] for rec in recs])
    assert all(set(p) == set(ref["params"][0]) for p in whole)
    for rank, rec in enumerate(recs):
        assert all(rec["grads"]), f"rank {rank} holds no gradients"
        assert set(rec["opt_state"]) == set(rec["params"][-1])
        assert_parity({**rec, "params_full": whole, "state": rec["opt_state"]}, ref,
                      where=f"rank {rank}", all_names=False)
        for name, st in rec["opt_state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(rec["opt_state_reloaded"][name][key], st[key],
                                           rtol=0, atol=0)


def _unit(name: str) -> str:
    """The unit a stage parameter belongs to: its block ``layers.<i>``, else its module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _padded(rec, n: int, engine: str, blocks: bool = False) -> int:
    """The elements the stage's dp collectives move: the explicit engine's flat units (the
    embedding, each block, the final norm, the head), each padded to a multiple of n; FSDP2's
    parameters, each padded on dim 0. ``blocks``: the blocks' parameters only."""
    shapes = {k: s for k, s in rec["shapes"].items() if not blocks or k.startswith("layers.")}
    if engine == "torch":
        return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes.values())
    units: dict[str, int] = {}
    for name, shape in shapes.items():
        units[_unit(name)] = units.get(_unit(name), 0) + math.prod(shape)
    return sum(math.ceil(k / n) * n for k in units.values())


def _ledger(out, case):
    """Ledger == formula per tag; by hand for tp = 1, n = the shard group (dp / dp_replicate),
    P = :func:`_padded`: grad (n−1)/n·P·4 on the shard axis; HSDP grad_replicate
    2(R−1)/R·P·4/n on dp_replicate; param ZeRO-1/2 (n−1)/n·P·4 once; ZeRO-3 explicit 2m× that
    (reshard_after_forward: every F and every B) or once (held for the step); ZeRO-3 torch,
    1F1B: the chunk's own unit once, each block m + 1 times (FSDP2 frees it after each forward,
    not after a backward, so the first F, the warm-up Fs that follow an F, and every B that
    follows an F gather it: 1 + w + (m − w)); the norm's scalar over pp and the shard group (and
    tp)."""
    pp, dp, rep, tp, sp, zero, schedule, m, raf = case[:9]
    engine = _engine(case)
    n = dp // rep
    shard_axis = "dp_shard" if rep > 1 else "dp"
    for rec in _load(out, case):
        padded = _padded(rec, n, engine)
        for by_tag, by_axis, formula in zip(rec["bytes"], rec["by_axis"], rec["formula"]):
            for tag in set(by_tag) | set(formula):
                if tag != "total":
                    assert by_tag.get(tag, 0.0) == pytest.approx(formula.get(tag, 0.0),
                                                                 rel=1e-12), tag
            norm = 2 * (pp - 1) / pp * 8 + 2 * (n - 1) / n * 8
            norm += 2 * (tp - 1) / tp * 8 if tp > 1 else 0
            assert by_tag["grad_norm"] == pytest.approx(norm)
            if tp > 1:
                continue
            once = (n - 1) / n * padded * 4
            assert by_axis[("grad", shard_axis)] == pytest.approx(once)
            if engine == "explicit":
                gathers = (2 * m if raf else 1) if zero == 3 else 1
                assert by_axis[("param", shard_axis)] == pytest.approx(gathers * once)
            elif zero < 3:  # FSDP2 without reshard after forward (ZeRO-1 under HSDP: ZeRO-2)
                assert by_axis[("param", shard_axis)] == pytest.approx(once)
            elif schedule == "1f1b":
                blocks = (n - 1) / n * _padded(rec, n, engine, blocks=True) * 4
                assert by_axis[("param", shard_axis)] == pytest.approx(once + m * blocks)
            if rep > 1:
                assert by_axis[("grad_replicate", "dp_replicate")] == pytest.approx(
                    2 * (rep - 1) / rep * padded * 4 / n)
            else:
                assert "grad_replicate" not in by_tag


def _params4():
    """The 4-rank cases, W.SLOW4's marked slow."""
    return [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow if c in W.SLOW4 else ())
            for c in FAST]


def _results4(request, case):
    return world_of(request, case in W.SLOW4, fast="results4", slow_name="results4_slow")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _params4())
def test_stage_zero_matches_single_process(request, case):
    _parity(_results4(request, case), case)


@pytest.mark.parametrize("case", _params4())
def test_stage_zero_ledger_equals_formula_and_hand_count(request, case):
    _ledger(_results4(request, case), case)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", SLOW, ids=lambda c: W.case_name(*c))
def test_hsdp_and_tp_in_pipeline_match_single_process(results8, case):
    _parity(results8, case)
    _ledger(results8, case)


@pytest.mark.parametrize("layout, engine, needle", [
    (Layout(pp=2, dp=2, zero=3, schedule="zb-h1"), "explicit", "split-backward"),
    (Layout(pp=2, dp=2, zero=3, schedule="zbv"), "explicit", "split-backward"),
    (Layout(pp=2, dp=2, ep=2, zero=2), "explicit", "not wired"),
    (Layout(pp=2, dp=2, zero=2, schedule="zb-h1"), "torch", "tp 1 and gpipe"),
    (Layout(pp=2, dp=2, tp=2, zero=3), "torch", "tp 1 and gpipe"),
])
def test_remaining_refusals(layout, engine, needle):
    with pytest.raises(ShardwiseConfigError, match=needle):
        layout.check(engine=engine)


@pytest.mark.parametrize("layout", [
    Layout(pp=2, dp=2, zero=2, schedule="zb-h1"), Layout(pp=2, dp=2, zero=3),
    Layout(pp=2, dp=2, zero=3, schedule="interleaved-1f1b"),
    Layout(pp=2, dp=4, dp_replicate=2, zero=3), Layout(pp=2, dp=4, dp_replicate=2, zero=1)])
def test_explicit_engine_accepts(layout):
    layout.check(engine="explicit")


@pytest.mark.parametrize("layout", [Layout(pp=2, dp=2, zero=2), Layout(pp=2, dp=2, zero=3),
                                    Layout(pp=2, dp=2, zero=3, schedule="interleaved-1f1b"),
                                    Layout(pp=2, dp=4, dp_replicate=2, zero=1)])
def test_torch_engine_accepts(layout):
    layout.check(engine="torch")
