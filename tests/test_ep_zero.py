"""Explicit ZeRO-1/2/3 composed with expert parallelism, against a single-process reference
computed here: the MoE Llama (moe-tiny, 4 experts, 2 MoE blocks) top-2, and top-1 with a shared
expert; zero ∈ {1, 2, 3} × ep ∈ {2, 4} at dp = 4 (edp = 2 and 1), dp = 2 with ep = 2 (edp = 1),
ZeRO-3 with two micro-steps and without reshard-after-forward; 2 AdamW steps with clipping
that binds, all in one 4-rank world (tests/workers/ep_zero_cases.py).

Checked: loss, clipped global grad norm (every element counted once over ep × edp), every full
gradient and parameter (shardwise.parity's rule and AdamW bound), the layout-free AdamW state
against the reference's and reloaded into a second engine, the ledger's bytes per tag against
``formulas.step_bytes_formula`` and, for ZeRO's tags, against sums written out here from the
reference's shapes, and model-state bytes against the ZeRO formula with an expert part."""

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.data import DistributedSampler
from shardwise.parity import assert_parity, reference_run
from shardwise.parallel.zero import (zero_ep_memory_formula, zero_ep_step_bytes_formula,
                                     zero_memory_formula, zero_step_bytes_formula)

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, MIN_ROUTING_GAP, min_routing_gap, split_worlds, world_of  # noqa: E402
import ep_zero_cases as W  # noqa: E402

# the cases as params, W.SLOW's marked slow
CASES = [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow if c in W.SLOW else ())
         for c in W.CASES]


# the world of W.SLOW's cases: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "ep_zero")


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case."""
    return world_of(request, request.node.callspec.params["case"] in W.SLOW)


def _reference(model_name):
    """shardwise.parity's plain-PyTorch reference (the whole global batch in one forward, the
    aux loss added, torch's clip_grad_norm_ and AdamW, moments kept) and the parameter shapes."""
    work = W.workload()
    model = W.make_model(model_name)
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(W.STEPS)]
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM,
                        keep_state=True)
    ref["shapes"] = {n: p.shape for n, p in model.named_parameters()}
    return ref


@pytest.fixture(scope="module")
def references():
    return {m: _reference(m) for m in W.MODELS}


def test_no_routing_choice_is_near_a_tie(references):
    """Every layout routes as the reference does (conftest.min_routing_gap): at both steps'
    parameters the k-th and (k+1)-th router probabilities of every token stay apart."""
    for m, ref in references.items():
        model = W.make_model(m)
        for step, batch in enumerate(ref["batches"]):
            if step:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(ref["params"][step - 1][n])
            assert min_routing_gap(model, batch) > MIN_ROUTING_GAP, (m, step)


def _load(results, case):
    return [load_pt(results / f"{W.case_name(*case)}_rank{r}.pt")
            for r in range(case[2] * case[4])]


def _units(ref, dp, ep):
    """The units the docs define, from the reference's shapes: (name, axis, n, Ψ_u) with the
    root (everything outside ``layers.``), each block's dense parameters over dp, and each
    block's experts (``experts.w1/w2/w3``, E/ep of them on a rank) over edp = dp/ep."""
    out = {}
    for name, shape in ref["shapes"].items():
        numel = math.prod(shape)
        if not name.startswith("layers."):
            key = ("root", "dp", dp)
        elif ".experts." in name:
            key = (".".join(name.split(".")[:2]) + ":experts", "edp", dp // ep)
            numel //= ep
        else:
            key = (".".join(name.split(".")[:2]), "dp", dp)
        out[key] = out.get(key, 0) + numel
    return [(name, axis, n, psi) for (name, axis, n), psi in out.items()]


@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(results, references, case):
    """Every step and rank: loss, clipped global grad norm, every full gradient and parameter
    (shardwise.parity: RTOL/ATOL, the AdamW bound); the full AdamW moments within
    adamw_state_bound; all in the plain model's full shapes."""
    ref = references[case[0]]
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    for rank, rec in enumerate(_load(results, case)):
        assert all(rec["grads"][-1][n].shape == s for n, s in ref["shapes"].items())
        assert_parity(rec, ref, where=f"rank {rank}")


@pytest.mark.parametrize("case", CASES)
def test_layout_free_optimizer_state_reloads(results, references, case):
    """full_optimizer_state gives full shapes and the step count; loaded into a second engine
    of the same layout (cut to its ep shards and edp/dp slices) it reads back bit for bit."""
    ref = references[case[0]]
    for rec in _load(results, case):
        assert set(rec["state"]) == set(ref["shapes"])
        for name, st in rec["state"].items():
            assert float(st["step"]) == W.STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                assert st[key].shape == ref["shapes"][name]
                assert torch.equal(rec["state_reloaded"][name][key], st[key]), (name, key)


@pytest.mark.parametrize("case", CASES)
def test_units_are_split_by_axis(results, references, case):
    """The engine's flat buffers are the units written out here: the dense ones over the data
    axis (n = dp), each block's experts over edp (n = dp/ep), in forward order, a block's
    experts right after its dense part."""
    _, _, dp, ep, *_ = case
    want = _units(references[case[0]], dp, ep)
    for rec in _load(results, case):
        got = [(name, "edp" if axis == "edp" else "dp", n, numel)
               for name, axis, n, numel, _ in rec["units"]]
        assert got == want


@pytest.mark.parametrize("case", CASES)
def test_ledger_bytes_equal_formula(results, references, case):
    """Per step and tag, the ledger equals ``formulas.step_bytes_formula`` (ratio 1.0000, no
    tag on one side only), and ZeRO's tags equal sums written out here (ZeRO paper §7.2,
    fp32, f(n) = (n−1)/n, P_u = ⌈Ψ_u/n_u⌉·n_u): grad Σ_u f(n_u)·4·P_u; param ZeRO-1/2 the same,
    ZeRO-3 M·Σ_u f(n_u)·4·P_u·(1 + [u a block, reshard after forward]); grad_norm 2·f(dp)·8;
    loss 2 · 2·f(dp)·8. Expert units over an edp of one rank move nothing."""
    model, stage, dp, ep, _, accum, raf = case
    f = lambda n: (n - 1) / n  # noqa: E731
    units = [(name, n, math.ceil(psi / n) * n) for name, _, n, psi in
             _units(references[model], dp, ep)]
    grad = sum(f(n) * 4 * p for _, n, p in units)
    if stage < 3:
        param = grad
    else:
        param = accum * sum(f(n) * 4 * p * (1 + (raf and name != "root")) for name, n, p in units)
    want = {"grad": grad, "param": param, "grad_norm": 2 * f(dp) * 8, "loss": 2 * 2 * f(dp) * 8}
    for rank, rec in enumerate(_load(results, case)):
        for step in range(W.STEPS):
            got, formula = rec["bytes"][step], dict(rec["formula"][step])
            total = formula.pop("total")
            assert set(got) == set(formula), (rank, step)
            for tag, value in formula.items():
                assert got[tag] == pytest.approx(value, rel=1e-12, abs=0), (rank, step, tag)
                assert value > 0, tag
            assert total == pytest.approx(sum(got.values()), rel=1e-12, abs=0)
            for tag, value in want.items():
                assert got[tag] == pytest.approx(value, rel=1e-12, abs=0), (rank, step, tag)


@pytest.mark.parametrize("case", CASES)
def test_model_state_bytes_match_formula(results, references, case):
    """ZeRO paper §5 with an expert part, fp32 AdamW, written out here: Ψ_d dense elements over
    n = dp, Ψ_e this rank's expert elements over n_e = dp/ep; params 4Ψ_d/n + 4Ψ_e/n_e at
    ZeRO-3 (else 4Ψ_d + 4Ψ_e), grads divided at ZeRO-2/3, optimizer 8Ψ_d/n + 8Ψ_e/n_e. No unit
    of this model needs padding, so the measured bytes equal it exactly, plus one fp32 AdamW
    step counter per optimizer piece."""
    _, stage, dp, ep, *_ = case
    units = _units(references[case[0]], dp, ep)
    assert all(psi % n == 0 for _, _, n, psi in units)  # no padding: the equalities are exact
    dense = sum(psi for _, axis, _, psi in units if axis == "dp")
    experts = sum(psi for _, axis, _, psi in units if axis == "edp")
    n, n_e = dp, dp // ep
    want = {"params": 4 * (dense / n + experts / n_e if stage == 3 else dense + experts),
            "grads": 4 * (dense / n + experts / n_e if stage >= 2 else dense + experts),
            "optimizer": 8 * (dense / n + experts / n_e)}
    want["total"] = sum(want.values())
    for rec in _load(results, case):
        assert rec["memory_formula"] == pytest.approx(want, rel=1e-12)
        got = rec["state_bytes"]
        assert got["params"] == want["params"]
        assert got["grads"] == want["grads"]
        assert got["optimizer"] == want["optimizer"] + 4 * rec["n_pieces"]


def test_ep_formulas_by_hand():
    # without experts: ZeRO's own formula
    for stage in (1, 2, 3):
        assert zero_ep_step_bytes_formula(stage, 1000, 4, 0, 1) == \
            zero_step_bytes_formula(stage, 1000, 4)
        assert zero_ep_memory_formula(stage, 1000, 4, 0, 1) == zero_memory_formula(stage, 1000, 4)
    # Ψ_d = 1000 over n = 4 (f = 0.75), Ψ_e = 400 over n_e = 2 (f = 0.5), fp32:
    # ZeRO-1/2 grad 3000 + 800, param the same, norm 12; ZeRO-3 param 6000 + 1600, with
    # regathered 800 dense and 0 experts: 3000 + 2400 + 800; n_e = 1 moves nothing
    z1 = zero_ep_step_bytes_formula(1, 1000, 4, 400, 2)
    assert z1 == {"grad": 3800, "param": 3800, "grad_norm": 12, "total": 7612}
    assert zero_ep_step_bytes_formula(3, 1000, 4, 400, 2)["param"] == 7600
    assert zero_ep_step_bytes_formula(3, 1000, 4, 400, 2, regathered=800,
                                      regathered_experts=0)["param"] == 6200
    assert zero_ep_step_bytes_formula(3, 1000, 4, 400, 1)["grad"] == 3000
    # memory ZeRO-3: 16·1000/4 + 16·400/2 = 4000 + 3200; ZeRO-1 with n_e = 1: 8000 + 2000 + 6400
    assert zero_ep_memory_formula(3, 1000, 4, 400, 2)["total"] == 7200
    assert zero_ep_memory_formula(1, 1000, 4, 400, 1)["total"] == 8 * 1000 + 2000 + 16 * 400
