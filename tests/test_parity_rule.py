"""The comparison rule of shardwise.parity: the AdamW parameter bound holds (torch's own AdamW
in float64, gradients perturbed on purpose), it is tight where it matters, and compare() fails a
run whose gradients or optimizer are wrong."""

import copy
import math

import pytest
import torch

from shardwise.parity import (ATOL, DRIFT_TERMS, RTOL, adamw_param_bound, adamw_state_bound,
                              compare, drift_bound, kl_divergence, reference_at, reference_run)


def _adamw(grads, lrs, betas=(0.9, 0.95), eps=1e-8, wd=0.1, state=False):
    """torch.optim.AdamW in float64 fed the given gradients: parameters after each step (and
    its final moments with ``state``)."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, grads[0].numel(), dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    out = []
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return (out, opt.state[p]) if state else out


def test_step_one_sign_flip_hand_worked():
    """g = +1e-10 in the reference, −1e-10 in the run: u = ±1e-10/(1e-10 + 1e-8) = ±0.0099, so
    |Δp| = lr·0.0198 = 5.94e-6 at lr 3e-4 (six times ATOL). The bound: |δm̂| = 2e-10,
    |δ√v̂| ≤ 2e-10, B = (2e-10 + 0.0099·2e-10)/(max(1e-10 − 2e-10, 0) + 1e-8) = 0.0202."""
    lr = 3e-4
    g = torch.tensor([1e-10], dtype=torch.float64)
    (pa,), (pb,) = _adamw([g], [lr]), _adamw([-g], [lr])
    got = float((pa - pb).abs())
    assert got == pytest.approx(lr * 2 * 1e-10 / (1e-10 + 1e-8), rel=1e-9)
    assert got > 5 * ATOL  # a fixed atol would call this a mismatch
    bound = float(adamw_param_bound([g], [2 * g], [lr])[0])
    u = 1e-10 / (1e-10 + 1e-8)
    assert bound == pytest.approx(lr * (2e-10 + u * 2e-10) / 1e-8, rel=1e-9)
    assert got <= bound <= 1.05 * got  # holds, and tight (within 5 %) here


@pytest.mark.parametrize("seed", range(4))
def test_bound_holds_for_random_perturbations_over_steps(seed):
    """Gradients spanning 1e-12 … 1 (around ε and far above), relative errors up to 1e-2 and
    absolute ones around ε, 5 steps with a changing lr: the real difference never exceeds the
    bound; and where |g| ≫ ε the bound is far below ATOL (the check stays strict)."""
    g = torch.Generator().manual_seed(seed)
    n, steps, lrs = 4000, 5, [1e-3, 3e-3, 2e-3, 1e-3, 5e-4]
    scale = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-12, 0, generator=g)
    ref = [scale * torch.randn(n, dtype=torch.float64, generator=g) for _ in range(steps)]
    err = [r * 1e-2 * torch.randn(n, dtype=torch.float64, generator=g)
           + 1e-9 * torch.randn(n, dtype=torch.float64, generator=g) for r in ref]
    mine = [r + e for r, e in zip(ref, err)]
    (pa, sa), (pb, sb) = _adamw(ref, lrs, state=True), _adamw(mine, lrs, state=True)
    bounds = adamw_param_bound(ref, [e.abs() for e in err], lrs)
    for t in range(steps):
        diff = (pa[t] - pb[t]).abs()
        assert bool((diff <= bounds[t] * (1 + 1e-9) + 1e-15).all()), t
    for key, tol in zip(("exp_avg", "exp_avg_sq"),
                        adamw_state_bound(ref, [e.abs() for e in err])):
        assert bool(((sa[key] - sb[key]).abs() <= tol).all()), key
    big = scale > 1e-3  # gradients ≫ ε, with round-off-sized errors (1e-7 relative)
    strict = adamw_param_bound(ref, [1e-7 * r.abs() for r in ref], lrs)[-1]
    assert float(strict[big].max()) < 1e-2 * ATOL


def _toy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(2))
    return model, [{"inputs": x[i], "targets": y[i]} for i in range(3)]


def _mine_from(ref, **changes):
    mine = {"loss": list(ref["loss"]), "grad_norm": list(ref["grad_norm"]),
            "grads": [{n: g.clone() for n, g in s.items()} for s in ref["grads"]],
            "params": [{n: p.clone() for n, p in s.items()} for s in ref["params"]]}
    mine.update(changes)
    return mine


def test_compare_passes_itself_and_fails_a_flipped_gradient_or_a_wrong_optimizer():
    model, batches = _toy()
    ref = reference_run(model, batches, lrs=[1e-2] * 3, max_norm=0.0)
    assert compare(_mine_from(ref), ref).ok
    # a gradient element off by 1e-4 (the control): reported at that step
    bad = _mine_from(ref)
    bad["grads"][1]["0.weight"][2, 1] += 1e-4
    rep = compare(bad, ref)
    assert not rep.ok and any("step 1 grad 0.weight" in f and "(2, 1)" in f for f in rep.failures)
    # the optimizer skipped weight decay once: every matrix element is off by lr·λ·|p|
    model2, _ = _toy()
    ref2 = reference_run(model2, batches, lrs=[1e-2] * 3, weight_decay=0.0)
    rep = compare(_mine_from(ref, params=ref2["params"]), ref)  # same gradients
    assert any("step 0 param 0.weight" in f for f in rep.failures), rep.failures
    assert not math.isnan(rep.param_bound_ratio) and rep.param_bound_ratio > 1


def test_compare_nan_and_shape_fail():
    model, batches = _toy()
    ref = reference_run(model, batches[:2], lrs=[1e-2] * 2)
    nan = _mine_from(ref, loss=[ref["loss"][0], float("nan")])
    assert any("step 1 loss" in f for f in compare(nan, ref).failures)
    shaped = _mine_from(ref)
    shaped["grads"][0]["2.bias"] = torch.zeros(5)
    assert any("shape" in f for f in compare(shaped, ref).failures)


def test_tolerances_are_the_stated_ones():
    assert (RTOL, ATOL) == (1e-5, 1e-6)
    assert RTOL / 2 ** -24 == pytest.approx(167.8, abs=0.1)  # 168 fp32 ulps


def test_later_steps_are_compared_at_the_runs_own_parameters():
    """A run whose step-0 update differs (lr 2e-2 instead of 1e-2): its step-1 and step-2
    gradients differ from the free-running reference's by far more than ATOL, but equal the
    reference evaluated at the run's own parameters, so only its parameters fail."""
    model, batches = _toy()
    ref = reference_run(model, batches, lrs=[1e-2] * 3)
    other, _ = _toy()
    run = reference_run(other, batches, lrs=[2e-2, 1e-2, 1e-2])
    assert max(float((run["grads"][1][n] - g).abs().max())
               for n, g in ref["grads"][1].items()) > 100 * ATOL
    rep = compare(_mine_from(run), ref)
    assert rep.failures and all(" param " in f for f in rep.failures), rep.failures
    with pytest.raises(ValueError, match="parameters after each step"):
        compare({**_mine_from(run), "params": run["params"][-1]}, ref)


def _biased_run(scale: float, steps: int) -> tuple[dict, dict]:
    """(the reference, a run of the same model and batches whose loss is multiplied by
    ``scale`` — a systematic bias such as a normaliser off by one part in a million): plain
    PyTorch, AdamW with the reference's groups and hyperparameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    g = torch.Generator().manual_seed(3)
    batches = [{"inputs": torch.randn(16, 4, generator=g), "targets": torch.randn(16, 4, generator=g)}
               for _ in range(steps)]
    biased = copy.deepcopy(model)
    ref = reference_run(model, batches, lrs=[1e-2] * steps)
    decay = [p for p in biased.parameters() if p.dim() >= 2]
    rest = [p for p in biased.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    mine = {"loss": [], "grad_norm": [], "grads": [], "params": []}
    for b in batches:
        loss = torch.nn.functional.mse_loss(biased(b["inputs"]), b["targets"]) * scale
        loss.backward()
        mine["loss"].append(float(loss.detach()))
        mine["grad_norm"].append(float(torch.cat([p.grad.reshape(-1) for p in
                                                  biased.parameters()]).norm()))
        mine["grads"].append({n: p.grad.clone() for n, p in biased.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        mine["params"].append({n: p.detach().clone() for n, p in biased.named_parameters()})
    return ref, mine


def test_drift_check_fails_a_planted_bias_that_every_pointwise_check_passes():
    """A loss scaled by 1 + 1e-6 over 8 steps: every step's loss, norm and gradient is within
    ATOL + RTOL·|ref| (the bias is 1e-6 relative, RTOL 1e-5), yet all on one side. The drift
    bound over T = 8 steps is 3·mean(τ)/(2·√(84·8)) ≈ 0.058·τ ≈ 0.64e-6 at a loss near 1, while the
    mean signed difference is the planted (s − 1)·loss, s = 1 + 1e-6 as fp32 holds it
    (1 + 8·2⁻²³ = 1 + 9.54e-7): it fails. The unbiased run (scale 1) passes, and so does a run
    whose differences of the same size alternate in sign (round-off's signature)."""
    ref, mine = _biased_run(1 + 1e-6, 8)
    rep = compare(mine, ref)
    assert [f for f in rep.failures if "drift" not in f] == []  # every pointwise check passes
    assert any("loss drift" in f for f in rep.failures), rep.failures
    assert rep.drift_ratio > 1
    # what compare measured: each step against the reference at the run's own parameters, where
    # the two forwards are the same fp32 operations, so the difference is the planted scale up
    # to the rounding of loss·s (½ ulp of the loss); the free-running reference would add the
    # trajectories' divergence, which depends on the CPU path (−5 % under
    # ATEN_CPU_CAPABILITY=default against +1 % here, with 1e-6 written as decimal)
    forced = [ref["loss"][0]] + [float(reference_at(ref, mine["params"][t - 1], t)["loss"])
                                 for t in range(1, 8)]
    mean_bias = sum(m - r for m, r in zip(mine["loss"], forced)) / 8
    s = float(torch.tensor(1 + 1e-6, dtype=torch.float32))
    half_ulp = max(torch.finfo(torch.float32).eps / 2 * 2.0 ** math.floor(math.log2(abs(x)))
                   for x in forced)
    assert abs(mean_bias - (s - 1) * sum(forced) / 8) <= half_ulp, (mean_bias, s)
    assert abs(mean_bias) > drift_bound(forced)
    ref0, same = _biased_run(1.0, 8)
    assert compare(same, ref0).ok
    alternating = _mine_from(ref0, loss=[x * (1 + (-1) ** t * 1e-6)
                                         for t, x in enumerate(ref0["loss"])])
    rep = compare(alternating, ref0)
    assert rep.ok and rep.drift_ratio < 0.5, (rep.failures, rep.drift_ratio)


def test_drift_bound_is_the_stated_formula():
    """λ·mean(ATOL + RTOL·|ref|)/(2·√(n·T)) with n = RTOL/(2u) ≈ 83.9 and λ = 3: hand-worked for
    losses 4 and 6 over T = 2: τ̄ = 1e-6 + 1e-5·5 = 5.1e-5, √(83.886·2) = 12.953."""
    assert DRIFT_TERMS == pytest.approx(83.886, abs=1e-3)
    assert drift_bound([4.0, 6.0]) == pytest.approx(3 * 5.1e-5 / (2 * 12.9527), rel=1e-4)
    with pytest.raises(ValueError):
        drift_bound([])


def test_kl_divergence_is_the_stated_formula():
    """Hand-worked: p = (½, ½) from logits (0, 0), q = (¼, ¾) from (0, ln 3): KL(p ‖ q) =
    ½·ln(½/¼) + ½·ln(½/¾) = ½·ln(4/3); the mean over positions; 0 for equal logits, also after a
    shift (softmax ignores it); torch's F.kl_div(batchmean) on random logits; and second order
    in δ (KL ≈ ½·Var_p(δ))."""
    p = torch.zeros(2, dtype=torch.float64)
    q = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)  # ln 3 exact to fp64
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    assert kl_divergence(torch.stack([p, p]), torch.stack([q, p])) == pytest.approx(
        0.25 * math.log(4 / 3), rel=1e-12)
    x = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    y = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1))
    assert kl_divergence(x, x) == 0.0 and abs(kl_divergence(x, x + 2.5)) < 1e-14
    ref = torch.nn.functional.kl_div(y.double().log_softmax(-1).reshape(21, 50),
                                     x.double().log_softmax(-1).reshape(21, 50),
                                     log_target=True, reduction="batchmean")
    assert kl_divergence(x, y) == pytest.approx(float(ref), rel=1e-12)
    d = 1e-4 * torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(2))
    pr = x.double().softmax(-1)
    var = (pr * d.double() ** 2).sum(-1) - (pr * d.double()).sum(-1) ** 2
    assert kl_divergence(x, x + d) == pytest.approx(float(0.5 * var.mean()), rel=1e-2)
    with pytest.raises(ValueError, match="shapes"):
        kl_divergence(x, y[:, :3])


# Test files that use the rule's tolerances without comparing a parallel layout with one process:
# `make test-cpu-paths` need not run them (docs/parity.md §5). Each with the reason.
NOT_A_LAYOUT = {
    "test_chat_pack.py": "one process: packed rows against unpacked ones (test_pack_layouts: "
                         "the layouts)",
    "test_compile.py": "one process: compiled against eager, with its own bound (LOSS_RTOL)",
    "test_export_tokenizer.py": "one process: an HF folder's logits against its import → "
                                "export round trip's (KL and the pointwise rule)",
    "test_gpu_path.py": "a GPU's run (skipped on CPU)",
    "test_hf_families.py": "one process: our logits against transformers'",
    "test_hf_llama3.py": "one process: our logits against transformers'",
    "test_hf_mixtral.py": "one process: our logits against transformers'",
    "test_moe_model.py": "one process: batch splits and attach mode against plain mode",
    "test_report.py": "reads RTOL/ATOL for the report's table; runs no model",
}


def test_the_cpu_paths_target_lists_every_parity_test():
    """Every test file that imports the parity rule is in the Makefile's PARITY_TESTS (run by
    `make test-cpu-paths` under five CPU math paths), or in NOT_A_LAYOUT with its reason; so a new
    parity test cannot be left out of the other paths (issue 34), and every listed one exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    make = (root / "Makefile").read_text()
    block = re.search(r"^PARITY_TESTS :=(.*?)(?<!\\)\n", make, re.S | re.M).group(1)
    listed = block.replace("\\\n", " ").split()
    files = {item.split("::")[0].removeprefix("tests/") for item in listed}
    for item in listed:
        path, *names = item.split("::")
        assert (root / path).exists(), item
        for name in names:
            assert re.search(rf"^def {name}\(", (root / path).read_text(), re.M), item
    uses = {p.name for p in (root / "tests").glob("test_*.py")
            if re.search(r"shardwise\.parity\b|from shardwise import parity", p.read_text())}
    assert uses - files - set(NOT_A_LAYOUT) == set(), "add them to PARITY_TESTS or NOT_A_LAYOUT"
    assert set(NOT_A_LAYOUT) <= uses and not set(NOT_A_LAYOUT) & files
