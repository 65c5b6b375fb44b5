"""Muon in one process (issue 41): our :class:`shardwise.parallel.muon.Muon` against the outside
reference ``torch.optim.Muon`` (bitwise, with its bf16 Newton–Schulz), the parity module's own
reference against torch's Newton–Schulz, the Muon/AdamW split of the parameters, one process
training with ``--optimizer muon`` against :func:`shardwise.parity_muon.reference_run_muon` by
the parity rule (and that rule failing on a wrong update), the layouts refused, and the
momentum buffers in the layout-free optimizer state."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from shardwise import parity_muon
from shardwise.config import TrainConfig, validate
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model
from shardwise.parallel.muon import NS_COEFFICIENTS, Muon, newton_schulz
from shardwise.parity import assert_parity, compare
from shardwise.tools.verify import build_case, reference_run, verify_workload
from shardwise.train.optim import muon_param_groups, optimizer_lines
from shardwise.train.step import train_step

SHAPES = [(48, 16), (16, 40), (32, 32)]  # tall, wide, square


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_equals_torch_optim_muon_bitwise(adjust, nesterov):
    """Same parameters, same gradients, 5 steps: every parameter and momentum buffer equal
    torch.optim.Muon's bit for bit when NS runs in bf16 as torch's does."""
    ours, theirs = _params(), _params()
    opt = Muon([{"params": ours, "muon": True}], lr=0.02, weight_decay=0.1, nesterov=nesterov,
               adjust_lr_fn=adjust, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, nesterov=nesterov,
                           adjust_lr_fn=adjust)
    for grads in _grads(5):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    assert float(opt.state[ours[0]]["step"]) == 5


def test_newton_schulz_equals_torch_and_batches_per_matrix():
    """Ours and parity_muon's (independent) NS are torch's bitwise in bf16; an [E, A, B] stack
    is E separate matrices (batched matmul vs one at a time: summation order only, within the
    parity rule's RTOL/ATOL of an O whose entries are ≤ ~1.2 in size)."""
    g = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        x = torch.randn(shape, generator=g)
        want = _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(newton_schulz(x, dtype=torch.bfloat16), want)
        assert torch.equal(parity_muon.newton_schulz(x, torch.bfloat16), want)
    stack = torch.randn(3, 16, 24, generator=g)
    each = torch.stack([newton_schulz(m) for m in stack])
    torch.testing.assert_close(newton_schulz(stack), each, rtol=1e-5, atol=1e-6)
    # and NS does what it is for: singular values pushed into ≈ [0.68, 1.21] (torch's docstring:
    # "S' ~ Uniform(0.5, 1.5)")
    s = torch.linalg.svdvals(newton_schulz(torch.randn(32, 64, generator=g)))
    assert 0.5 < float(s.min()) and float(s.max()) < 1.25


def test_adamw_groups_are_torch_adamw_bitwise():
    """The groups not marked muon are torch.optim.AdamW's own step, unchanged."""
    ours, theirs = _params(), _params()
    opt = Muon([{"params": ours[:1], "muon": True}, {"params": ours[1:]}], lr=1e-2,
               weight_decay=0.1, foreach=True)
    ref = torch.optim.AdamW(theirs[1:], lr=1e-2, weight_decay=0.1, foreach=True)
    for grads in _grads(4):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours[1:], theirs[1:]):
            assert torch.equal(p, q)
    assert set(opt.state[ours[1]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[ours[0]]) == {"step", "momentum_buffer"}


def test_muon_on_hidden_matrices_adamw_on_the_rest():
    """Muon: every matrix in a block; AdamW: embedding, output head (with decay), norms. The
    parity module's own split (written separately) agrees; the start-up line names both."""
    model = build_model("tiny", vocab_size=67, tie_embeddings=False)
    groups = muon_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert groups[0]["muon"] and muon == sorted(
        n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    assert len(muon) == 14  # 2 blocks × (wq, wk, wv, wo, w1, w2, w3)
    decay = [names[id(p)] for g in groups[1:] if g["weight_decay"] for p in g["params"]]
    assert decay == ["output.weight"]
    kinds = parity_muon.groups_of(model)
    assert sorted(n for n, k in kinds.items() if k == "muon") == muon
    lines = optimizer_lines(model, TrainConfig(optimizer="muon"))
    assert "Muon" in lines[0] and "14 hidden matrices" in lines[0] and "AdamW on 7" in lines[0]
    assert optimizer_lines(model, TrainConfig()) == []


def _one_process(cfg, steps=3):
    work = verify_workload("tiny", 0)
    ref = reference_run("tiny", work, cfg, 4, steps, {"n_layers": 2})
    model, engine, opt, sched = build_case("tiny", work, cfg, overrides={"n_layers": 2})
    sampler = work.sampler(4, 1, 0, cfg.seed)
    mine = {"loss": [], "grad_norm": [], "grads": [], "params": []}
    for _ in range(steps):
        res = train_step(engine, work.batches(sampler.next_local_batch(), 2), opt,
                         max_norm=cfg.grad_clip, scheduler=sched, zero_grad=False)
        mine["loss"].append(res.loss)
        mine["grad_norm"].append(res.grad_norm)
        mine["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        mine["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return mine, ref, engine, opt


CFG = dict(model="tiny", lr=3e-4, warmup_steps=1, steps=3, grad_clip=0.5, optimizer="muon")


def test_one_process_training_with_muon_matches_the_reference():
    """build_optimizer(--optimizer muon) + the training step, 3 steps with gradient
    accumulation and a clip that binds, against parity_muon's plain-PyTorch reference by the
    parity rule (parameters teacher-forced, docs/parity.md §Muon); and the rule fails when
    the run's update is scaled as Keller's "original" instead of AdamW-matched."""
    mine, ref, _, _ = _one_process(TrainConfig(**CFG))
    assert all(n > 0.5 for n in ref["grad_norm"])  # the clip binds
    rep = assert_parity(mine, ref)
    assert rep.max_param_diff < 1e-6
    moved = max(float((mine["params"][-1][n] - ref["init"][n]).abs().max())
                for n, k in ref["kinds"].items() if k == "muon")
    assert moved > 1e-4  # Muon moved the matrices, by far more than the tolerance
    cfg = TrainConfig(**CFG)
    work = verify_workload("tiny", 0)
    model, engine, opt, sched = build_case("tiny", work, cfg, overrides={"n_layers": 2})
    for g in opt.param_groups:
        g["adjust_lr_fn"] = "original"  # a wrong update scale
    sampler = work.sampler(4, 1, 0, cfg.seed)
    res = train_step(engine, work.batches(sampler.next_local_batch(), 2), opt,
                     max_norm=cfg.grad_clip, scheduler=sched, zero_grad=False)
    wrong = {"loss": [res.loss], "grads": [{n: p.grad.clone() for n, p in
                                             model.named_parameters()}],
             "params": [{n: p.detach().clone() for n, p in model.named_parameters()}]}
    rep = compare(wrong, ref)
    assert not rep.ok and any("param" in f for f in rep.failures), rep.failures


def test_optimizer_state_is_layout_free_and_round_trips_bitwise():
    """The full-shape optimizer state (what checkpoints hold) keeps Muon's momentum buffer for
    the hidden matrices and AdamW's moments for the rest, and loads back bit for bit."""
    mine, ref, engine, opt = _one_process(TrainConfig(**CFG), steps=2)
    state = engine.full_optimizer_state(opt)
    for n, k in ref["kinds"].items():
        want = {"step", "momentum_buffer"} if k == "muon" else {"step", "exp_avg", "exp_avg_sq"}
        assert set(state[n]) == want, n
    _, _, engine2, opt2 = _one_process(TrainConfig(**CFG, seed=1), steps=1)
    engine2.load_full_optimizer_state(opt2, state)
    again = engine2.full_optimizer_state(opt2)
    for n in state:
        for k, v in state[n].items():
            assert torch.equal(torch.as_tensor(again[n][k]), torch.as_tensor(v)), (n, k)


@pytest.mark.parametrize("flags,needle", [
    (dict(engine="torch", dp=2, tp=1, zero=1), "--engine explicit"),
    (dict(engine="torch", dp=1, tp=2, zero=0), "--engine explicit"),
    (dict(engine="torch", dp=2, tp=1, pp=2, zero=1), "--engine explicit"),
    (dict(engine="explicit", dp=2, tp=1, pp=2, zero=1), "--zero 0 with --pp"),
])
def test_layouts_without_muon_are_refused_before_any_collective(flags, needle):
    cfg = TrainConfig(**{"model": "tiny", "optimizer": "muon", "tp": 1, "pp": 1, "cp": 1,
                         "global_batch": 8, "micro_batch": 2, **flags})
    with pytest.raises(ShardwiseConfigError, match=needle):
        validate(cfg)
    validate(TrainConfig(**{**cfg.__dict__, "optimizer": "adamw"}))  # AdamW runs there


def test_newton_schulz_amplifies_a_perturbation_at_most_by_the_stated_lipschitz_bound():
    """docs/parity.md §6: ‖NS(X') − NS(X)‖_F ≤ L₁⁵·‖X' − X‖_F for normalised inputs, L₁ ≈ 3.96
    (L₁⁵ ≈ 979); measured in float64 on random and on nearly rank-deficient matrices (singular
    values near 0, where p′ = a is steepest), each with small random perturbations."""
    assert 950 < parity_muon.NS_LIPSCHITZ < 1000
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for k in range(20):
        m = torch.randn(64, 32, generator=g, dtype=torch.float64)
        if k % 2:  # singular values spread over 1e-4 … 1
            u, _, vh = torch.linalg.svd(m, full_matrices=False)
            m = u @ torch.diag(torch.logspace(-4, 0, 32, dtype=torch.float64)) @ vh
        d = 1e-7 * torch.randn(64, 32, generator=g, dtype=torch.float64)
        dx = ((m + d) / (m + d).norm() - m / m.norm()).norm()
        do = (parity_muon.newton_schulz(m + d, torch.float64)
              - parity_muon.newton_schulz(m, torch.float64)).norm()
        worst = max(worst, float(do / dx))
    assert 1.0 < worst <= parity_muon.NS_LIPSCHITZ, worst


def test_plan_prices_muon_from_the_models_own_matrices():
    """plan's Muon bill (shardwise.plan.muon) counts the hidden-matrix elements the built model
    has (moe-tiny: attention, router, experts over ep) and prices them: ZeRO's owner exchange
    over n (÷ t), TP's ring all_gather over t (the matrices this GPU owns, ÷ n under ZeRO), and
    Newton–Schulz's FLOPs as parallel.muon.ns_flops of each matrix this GPU orthogonalises."""
    from shardwise.parallel.muon import is_hidden_matrix, ns_flops
    from shardwise.plan.layout import PlanLayout
    from shardwise.plan.models import from_llama_config
    from shardwise.plan.muon import muon_cost

    for name in ("tiny", "moe-tiny"):
        model = build_model(name, vocab_size=67)
        spec = from_llama_config(model.config, name=name)
        mats = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
        psi = sum(p.numel() for p in mats)
        flops = sum(ns_flops(p.shape) for p in mats)
        c = muon_cost(spec, PlanLayout(dp=4, zero=1))
        assert c["matrix_elems"] == psi and c["tp"] == 0
        assert c["dp"] == pytest.approx(8 * 3 / 16 * psi) and c["ns_flops"] == pytest.approx(
            flops / 4)  # every matrix cut over the 4 slices: 3/4 of it there and back, ÷ 4 ranks
        c = muon_cost(spec, PlanLayout(tp=2, pp=2))
        assert c["dp"] == 0 and c["tp"] == pytest.approx(1 / 2 * 4 * psi / 2)
        assert muon_cost(spec, PlanLayout(dp=2))["dp"] == 0  # plain DP: whole matrices
    ep = muon_cost(spec, PlanLayout(dp=4, ep=2))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert ep["matrix_elems"] == pytest.approx(psi - experts / 2)


def test_the_cli_refuses_a_layout_without_muon_with_exit_2_and_verify_names_it(cache_dir,
                                                                              tmp_path):
    """`train` exits 2 with the one-line constraint and its fix before any worker starts;
    `verify` names the (layout, engine) cases it does not run for Muon instead of dropping
    them silently."""
    from conftest import run_cli

    p = run_cli(["train", "--model", "tiny", "--optimizer", "muon", "--engine", "torch", "--dp",
                 "2", "--zero", "1", "--out", tmp_path / "r"], cache_dir, timeout=120)
    assert p.returncode == 2, p.stdout
    assert "--optimizer muon --engine torch" in p.stdout and "--engine explicit" in p.stdout
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    p = run_cli(["verify", "--nproc", "2", "--optimizer", "muon", "--models", "tiny",
                 "--layouts", "dp=2", "dp=2,zero=1", "--steps", "1"], cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    assert "verify: dp=2,zero=1 torch: not run: --optimizer muon --engine torch" in p.stdout
    assert "3/3 passed" in p.stdout  # dp=2 on both engines, dp=2,zero=1 explicit


def test_resuming_with_the_other_optimizer_is_refused():
    """A checkpoint's Muon state loaded into AdamW (or AdamW's into Muon) would restart the
    moments silently: restore_training_state refuses it, naming the flag to resume with."""
    from shardwise.checkpoint import CheckpointError
    from shardwise.checkpoint.load import check_optimizer_kind

    _, _, engine, muon = _one_process(TrainConfig(**CFG), steps=1)
    _, _, engine2, adamw = _one_process(TrainConfig(**{**CFG, "optimizer": "adamw"}), steps=1)
    muon_state, adamw_state = (engine.full_optimizer_state(muon),
                               engine2.full_optimizer_state(adamw))
    check_optimizer_kind(muon_state, muon, "ckpt")  # same kind: fine
    check_optimizer_kind(adamw_state, adamw, "ckpt")
    with pytest.raises(CheckpointError, match="holds Muon's .* resume with --optimizer muon"):
        check_optimizer_kind(muon_state, adamw, "ckpt")
    with pytest.raises(CheckpointError, match="holds AdamW's .* resume with --optimizer adamw"):
        check_optimizer_kind(adamw_state, muon, "ckpt")
