"""ZeRO-1/2/3 against a single-process reference computed here, independently of shardwise's
training step and parallel code: zero ∈ {1, 2, 3} × dp ∈ {2, 4} × engine ∈ {explicit, torch}
on the tiny Llama (vocab 67, tied embeddings) and on mlp-tiny with d_ff 33 (block numel 1105,
which neither 2 nor 4 divides: padding), 3 AdamW steps with clipping that binds; plus gradient
accumulation, ZeRO-3 prefetch / reshard-after-forward variants, plain mlp-tiny.

Also: the clipped global norm, model-state bytes per rank against the ZeRO formula, the gathered
parameter peak of ZeRO-3, ledger bytes per step against hand-written formulas, and bad input."""

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.data import DistributedSampler
from shardwise.errors import ShardwiseConfigError
from shardwise.models.llama import generate
from shardwise.parity import ATOL, RTOL, assert_parity, reference_model_at, reference_run
from shardwise.parallel.zero import validate_zero, zero_memory_formula, zero_step_bytes_formula

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import zero_cases as W  # noqa: E402

def _params(cases):
    """``cases`` as params named by W.case_name, W.is_slow's marked slow."""
    return [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow if W.is_slow(c) else ())
            for c in cases]


# the world of W.is_slow's cases: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "zero")


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case (make test's world without one)."""
    params = getattr(request.node, "callspec", None)
    case = params.params.get("case") if params else None
    return world_of(request, case is not None and W.is_slow(case))


def _reference(model_name):
    """shardwise.parity's plain-PyTorch reference (torch.optim.AdamW with its own two groups, the
    whole global batch in one forward, torch's clip_grad_norm_), plus the evaluation output of
    the trained model and the unit sizes the docs define."""
    work = W.workload(model_name)
    model = W.make_model(model_name)
    max_norm = W.MODELS[model_name][2]
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(W.STEPS)]
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=max_norm)
    (batch,) = work.batches(torch.arange(4), 4, split="val")
    ref["eval_x"] = batch.get("input_ids", batch.get("inputs"))
    names = [n for n, _ in model.named_parameters()]
    ref["psi"] = sum(p.numel() for p in model.parameters())  # tied weight once
    ref["shapes"] = {n: p.shape for n, p in model.named_parameters()}
    # units as the docs define them: each layers.<i> block, the rest (the root) one unit
    units = {}
    for n in names:
        key = ".".join(n.split(".")[:2]) if n.startswith("layers.") else "root"
        units[key] = units.get(key, 0) + ref["shapes"][n].numel()
    ref["units"] = units
    ref["max_norm"] = max_norm
    return ref


@pytest.fixture(scope="module")
def references():
    return {m: _reference(m) for m in W.MODELS}


def _load(results, case):
    model, stage, dp, engine, accum, pf, raf, ovl = case
    name = W.case_name(model, stage, dp, engine, accum, pf, raf, ovl)
    return [load_pt(results / f"{name}_rank{r}.pt") for r in range(dp)]


def _close(a, b, what):
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


def test_padding_case_really_pads(references):
    for n in (2, 4):
        assert all(v % n for k, v in references["mlp33"]["units"].items())  # 1105 per block
    assert references["tiny"]["shapes"]["tok_embeddings.weight"][0] == 67  # FSDP2: uneven rows


@pytest.mark.parametrize("case", _params(W.CASES))
def test_zero_matches_single_process(results, references, case):
    """Every step: loss, clipped global grad norm, every (gathered) gradient and parameter, by
    shardwise.parity's rule; the tied weight appears once."""
    ref = references[case[0]]
    assert all(n > ref["max_norm"] for n in ref["grad_norm"])  # clipping binds
    for rank, rec in enumerate(_load(results, case)):
        assert_parity(rec, ref, where=f"rank {rank}")


@pytest.mark.parametrize("case", _params([c for c in W.CASES if c[3] == "explicit"]))
def test_evaluation_forward_after_training(results, references, case):
    """A no_grad forward of the wrapped model (evaluation) gives the reference model's outputs,
    and ZeRO-3 frees every gathered unit afterwards (no backward comes to free them); inside
    ``engine.full_model()`` (sampling) ZeRO-3 gathers each unit once for many forwards."""
    ref = references[case[0]]
    stage = case[1]
    for rec in _load(results, case):
        with torch.no_grad():  # the reference model where this run ended (shardwise.parity)
            want = reference_model_at(ref, rec["params"][-1])(ref["eval_x"])
        _close(rec["eval_out"], want, "eval output")
        assert rec["params_bytes_after_eval"] == rec["state_bytes"]["params"]
        for out in rec["full_model_out"]:  # engine.full_model(): two forwards, one gather
            _close(out, want, "full_model output")
        assert rec["full_model_gathers"] == (len(ref["units"]) if stage == 3 else 0)
        assert rec["params_bytes_after_full_model"] == rec["state_bytes"]["params"]
        if "sample_full" in rec:  # the seeded sample: one process's tokens, exactly
            want = generate(reference_model_at(ref, rec["params"][-1]), ref["eval_x"][:1, :3],
                            W.SAMPLE_TOKENS, generator=torch.Generator().manual_seed(0))
            assert torch.equal(rec["sample_full"], want)
            assert torch.equal(rec["sample_sharded"], want)
            # ZeRO-3 samples unit by unit: every unit gathered once per token, freed after
            assert rec["sample_sharded_gathers"] == (
                W.SAMPLE_TOKENS * len(ref["units"]) if stage == 3 else 0)
            assert rec["params_bytes_after_sample"] == rec["state_bytes"]["params"]


def _padded_units(ref, n):
    return {k: math.ceil(v / n) * n for k, v in ref["units"].items()}


def _fsdp_padded(ref, n):
    return sum(math.ceil(s[0] / n) * n * (s.numel() // s[0]) for s in ref["shapes"].values())


@pytest.mark.parametrize("case", _params(W.CASES))
def test_ledger_bytes_equal_formula(results, references, case):
    """Bytes sent per rank per step, by tag, written out here by hand (ZeRO paper §7):
    f = (n−1)/n, fp32, Ψp = elements that travel (padding included).
    grad: ZeRO reduce_scatter f·4Ψp (torch ZeRO-1: DDP's all_reduce 2f·4Ψ);
    param: explicit ZeRO-1/2 one all_gather f·4Ψp after the step; ZeRO-3 and FSDP2 per micro-step
    M·f·4·(Ψp + regathered), where blocks are gathered again for backward (not the root, which
    stays gathered) unless reshard_after_forward is off (torch ZeRO-2);
    grad_norm: one fp64 scalar all_reduce 2f·8;
    loss: token count + loss sum, 2 × 2f·8."""
    model, stage, n, engine, accum, pf, raf, _ = case
    ref = references[model]
    f = (n - 1) / n
    units = _padded_units(ref, n)
    if engine == "explicit":
        psi = sum(units.values())
        blocks = sum(v for k, v in units.items() if k != "root")
    else:
        psi = _fsdp_padded(ref, n)
        blocks = psi - _fsdp_padded({"shapes": {k: s for k, s in ref["shapes"].items()
                                                if not k.startswith("layers.")}}, n)
    if engine == "torch" and stage == 1:  # DDP all_reduce; ZeroRedundancyOptimizer's broadcasts
        want = {"grad": 2 * f * 4 * ref["psi"], "param": 0.0, "grad_norm": 0.0}  # bypass it
    else:
        if engine == "explicit" and stage < 3:
            param = f * 4 * psi
        else:  # explicit ZeRO-3, or FSDP2 (torch ZeRO-2 = FSDP2 without reshard-after-forward)
            again = blocks if (raf if engine == "explicit" else stage == 3) else 0
            param = accum * f * 4 * (psi + again)
        want = {"grad": f * 4 * psi, "param": param, "grad_norm": 2 * f * 8}
    want["loss"] = 2 * 2 * f * 8
    for rec in _load(results, case):
        for step in range(W.STEPS):
            got = rec["bytes"][step]
            for tag, value in want.items():
                assert got[tag] == pytest.approx(value, rel=1e-12, abs=0), (tag, step)
            assert got[None] == pytest.approx(sum(want.values()), rel=1e-12, abs=0)
            formula = rec["formula"][step]  # the engine's own formula, as trace/verify use it
            for tag in ("grad", "param", "grad_norm"):
                assert formula[tag] == pytest.approx(want[tag], rel=1e-12, abs=0), tag


def test_zero3_regathers_the_blocks_for_backward(results, references):
    """The paper's 3Ψ vs 2Ψ (§7.2): on tiny4 at dp=2 ZeRO-3 sends Ψp + Ψp_blocks more parameter
    bytes per step than ZeRO-3 without reshard-after-forward, which moves ZeRO-2's 2Ψ."""
    z3 = _load(results, ("tiny4", 3, 2, "explicit", 1, True, True, True))[0]["bytes"][0]
    z3_keep = _load(results, ("tiny4", 3, 2, "explicit", 1, True, False, True))[0]["bytes"][0]
    units = _padded_units(references["tiny4"], 2)
    blocks = sum(v for k, v in units.items() if k != "root")
    assert z3["param"] - z3_keep["param"] == pytest.approx(0.5 * 4 * blocks)
    assert (z3_keep["grad"] + z3_keep["param"]) == pytest.approx(2 * 0.5 * 4 * sum(units.values()))


@pytest.mark.parametrize("case", _params([c for c in W.CASES
                                          if c[3] == "explicit" and c[4] == 1]))
def test_explicit_model_state_bytes_match_formula(results, references, case):
    """Exact bytes per rank, by kind, against ZeRO paper Figure 1 with fp32 AdamW (4Ψ + 4Ψ + 8Ψ,
    each divided by n once sharded): ratio in [1, 1.02] (padding and AdamW's step counters)."""
    model, stage, n, *_ = case
    ref = references[model]
    psi = ref["psi"]
    padded = sum(_padded_units(ref, n).values())
    want = {"params": 4 * psi / (n if stage == 3 else 1),
            "grads": 4 * psi / (n if stage >= 2 else 1), "optimizer": 8 * psi / n}
    want["total"] = sum(want.values())
    recs = _load(results, case)
    for rec in recs:  # per rank: the last ranks own the padding, so they may hold a bit less
        got = rec["state_bytes"]
        assert got["total"] / want["total"] <= 1.02, (got, want)
        assert got["params"] == 4 * padded // (n if stage == 3 else 1)  # exact
        assert got["grads"] == 4 * padded // (n if stage >= 2 else 1)
        assert rec["memory_formula"] == pytest.approx(want)
    # optimizer state: exactly two fp32 moments per real element over all ranks, plus one fp32
    # step counter per piece (slice ∩ parameter); nothing replicated
    total_opt = sum(rec["state_bytes"]["optimizer"] for rec in recs)
    assert total_opt == 8 * psi + 4 * sum(rec["n_pieces"] for rec in recs)


@pytest.mark.parametrize("case", _params([c for c in W.CASES
                                          if c[3] == "torch" and c[4] == 1]))
def test_torch_model_state_bytes(results, references, case):
    """FSDP2 (stages 2 and 3) keeps parameters, gradients and AdamW state sharded between steps.
    Parameters and gradients: FSDP2's padded local storage, exactly 4·Ψp/n with each parameter's
    dim 0 padded to a multiple of n; AdamW state: over all ranks exactly 8Ψ plus one fp32 step
    counter per parameter per rank. Against ZeRO-3's 16Ψ/n: within 2% on the tiny Llama; FSDP2
    pads every parameter's rows, so mlp33 at dp=4 (rows of 33 → 36) is 5% over — the reason the
    explicit engine pads whole units instead (at most n − 1 elements per unit).
    Stage 1 (ZeroRedundancyOptimizer over DDP): full parameters and gradients (4Ψ each, bucket
    views); optimizer state partitioned by whole parameters, over all ranks exactly 8Ψ plus one
    step counter per parameter (per rank uneven)."""
    model, stage, n, *_ = case
    ref = references[model]
    psi, n_params = ref["psi"], len(ref["shapes"])
    recs = _load(results, case)
    opt_total = sum(r["state_bytes"]["optimizer"] for r in recs)
    if stage == 1:
        for rec in recs:
            assert rec["state_bytes"]["params"] == 4 * psi
            assert rec["state_bytes"]["grads"] == 4 * psi
        assert opt_total == 8 * psi + 4 * n_params
        return
    for rec in recs:
        assert rec["state_bytes"]["params"] == 4 * _fsdp_padded(ref, n) // n
        assert rec["state_bytes"]["grads"] == 4 * _fsdp_padded(ref, n) // n
        if model == "tiny":
            assert rec["state_bytes"]["total"] / (16 * psi / n) <= 1.02, rec["state_bytes"]
    assert opt_total == 8 * psi + 4 * n_params * n


def test_zero3_gathered_peak_is_root_plus_two_units(results, references):
    """With prefetch the gathered parameters never exceed the root unit (embeddings + head, kept
    like FSDP2's root) + the unit computing + the one prefetched; without prefetch root + one;
    without reshard-after-forward everything. tiny4: root 2176, blocks 9280 elements."""
    units = _padded_units(references["tiny4"], 2)
    root, block = units["root"], units["layers.0"]
    expect = {(True, True): root + 2 * block, (False, True): root + block,
              (True, False): sum(units.values())}
    for (pf, raf), elems in expect.items():
        for rec in _load(results, ("tiny4", 3, 2, "explicit", 1, pf, raf, True)):
            assert rec["state_bytes"]["gathered_params_peak"] == 4 * elems
    # no root: the MLP's peak is two blocks
    mlp = _padded_units(references["mlp33"], 4)
    for rec in _load(results, ("mlp33", 3, 4, "explicit", 1, True, True, True)):
        assert rec["state_bytes"]["gathered_params_peak"] == 4 * 2 * mlp["layers.0"]


def test_zero3_reduce_inputs_peak_is_one_unit(results, references):
    """Each unit's full-size flat gradient [P_u] lives from its reduce_scatter's launch until the
    next unit's launch waits for it, before packing its own: one unit at a time (the largest;
    reduce order: the blocks backward, then the root), never the whole model's 4Ψ. tiny4: a
    block (9280 > root 2176); the MLP (no root): a block. Prefetch and reshard-after-forward
    change nothing here."""
    units = _padded_units(references["tiny4"], 2)
    for pf, raf in ((True, True), (False, True), (True, False)):
        for rec in _load(results, ("tiny4", 3, 2, "explicit", 1, pf, raf, True)):
            assert rec["state_bytes"]["reduce_inputs_peak"] == 4 * units["layers.0"]
    mlp = _padded_units(references["mlp33"], 4)
    for rec in _load(results, ("mlp33", 3, 4, "explicit", 1, True, True, True)):
        assert rec["state_bytes"]["reduce_inputs_peak"] == 4 * mlp["layers.0"]


@pytest.mark.parametrize("dp", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_padding_never_reaches_the_math(request, dp):
    # mlp33 at dp=2: W.is_slow's world
    results = world_of(request, W.is_slow(("mlp33", 1, dp, "explicit", 1, True, True, True)))
    for stage in (1, 2, 3):
        for rec in _load(results, ("mlp33", stage, dp, "explicit", 1, True, True, True)):
            assert rec["padded_numel"] > rec["numel"]
            assert rec["pad"] == [0.0] * W.STEPS


def test_bad_input_errors_name_the_fix(results):
    msgs = load_pt(results / "errors_rank0.pt")
    assert "dp=1" in msgs["explicit_dp1"] and "--dp 2" in msgs["explicit_dp1"]
    assert "dp=1" in msgs["torch_dp1"] and "--zero 0" in msgs["torch_dp1"]
    assert "tok_embeddings.weight" in msgs["split_tied"] and "one unit" in msgs["split_tied"]
    assert "layers.9" in msgs["bad_unit"] and "submodule" in msgs["bad_unit"]
    assert "nest" in msgs["nested"]
    assert "Adafactor" in msgs["optimizer"] and "adamw" in msgs["optimizer"]
    rank1 = load_pt(results / "errors_rank1.pt")  # the other member failed alike
    assert rank1["split_tied"] == msgs["split_tied"]


def test_validate_zero():
    validate_zero(0, 1)  # plain DP: anything goes
    validate_zero(3, 2, optimizer=torch.optim.AdamW, engine="torch")
    for bad, needle in (((1, 1), "--dp 2"), ((4, 2), "choose 0"),
                        ((2, 4, "lamb"), "adamw"), ((3, 2, torch.optim.LBFGS), "element-wise")):
        args, kw = bad[:2], ({"optimizer": bad[2]} if len(bad) > 2 else {})
        with pytest.raises(ShardwiseConfigError, match=needle):
            validate_zero(*args, **kw)


def test_memory_formula_by_hand():
    # Ψ = 1000, n = 4, fp32 AdamW: ZeRO-1 4000 + 4000 + 2000; ZeRO-2 4000 + 1000 + 2000;
    # ZeRO-3 1000 + 1000 + 2000; mixed precision (2, 2, 12) ZeRO-3: (2+2+12)·1000/4 = 4000
    assert zero_memory_formula(1, 1000, 4)["total"] == 10000
    assert zero_memory_formula(2, 1000, 4)["total"] == 7000
    assert zero_memory_formula(3, 1000, 4)["total"] == 4000
    assert zero_memory_formula(0, 1000, 4)["total"] == 16000
    assert zero_memory_formula(3, 1000, 4, 2, 2, 12)["total"] == 4000
    assert zero_memory_formula(1, 1000, 4, 2, 2, 12)["optimizer"] == 3000


def test_step_bytes_formula_by_hand():
    # Ψ = 1000 fp32 over n = 4: f = 0.75; DP all_reduce 6000; ZeRO-1/2 3000 + 3000 + 12 (norm);
    # ZeRO-3 3000 + 6000 + 12; two micro-steps: params twice; root of 200 kept: 3000 + 5400
    assert zero_step_bytes_formula(0, 1000, 4)["total"] == 6000
    for stage in (1, 2):
        assert zero_step_bytes_formula(stage, 1000, 4) == {"grad": 3000, "param": 3000,
                                                           "grad_norm": 12, "total": 6012}
    assert zero_step_bytes_formula(3, 1000, 4)["param"] == 6000
    assert zero_step_bytes_formula(3, 1000, 4, micro_steps=2)["param"] == 12000
    assert zero_step_bytes_formula(3, 1000, 4, regathered=800)["param"] == 5400
    assert zero_step_bytes_formula(3, 1000, 4, regathered=0)["param"] == 3000
