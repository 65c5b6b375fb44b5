"""bf16 mixed precision (``--dtype bf16``): bf16 compute under autocast, fp32 master weights,
fp32 gradients and AdamW state (``--reduce-dtype`` picks the dtype of the dp reduction only).

(a) single process, by hand: after a bf16 step every parameter, gradient and AdamW state tensor
is fp32, the gradient is the one an autocast forward/backward computes (and differs from the
fp32 gradient: bf16 really ran), and the update is AdamW's fp32 update of that gradient,
written out here from Loshchilov & Hutter 2019, Algorithm 2.
(b) per layout (``workers/precision_cases.py``): the loss after 20 steps of bf16 is within 2 %
of the same layout's fp32 run, and every tensor of model state is fp32 on every rank."""

import sys
from pathlib import Path

import pytest
import torch

from shardwise.config import TrainConfig
from shardwise.models import build_model, loss_sum_and_count
from shardwise.parallel.model import Local
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import precision_cases as W  # noqa: E402


@pytest.mark.timeout(60)
def test_fp32_master_invariant_one_step_by_hand():
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=W.V)
    engine = Local(model)
    cfg = TrainConfig(model="tiny", lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95)
    opt = build_optimizer(engine, cfg)
    mbs = W.local_microbatches(0, 1, 0)
    denom = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    # the gradient bf16 autocast computes, and the fp32 one, on copies of the same model
    def grads(autocast: bool):
        torch.manual_seed(0)
        m = build_model("tiny", vocab_size=W.V)
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                s, _ = loss_sum_and_count(m, mb)
            (s / denom).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    g_bf16, g_fp32 = grads(True), grads(False)

    train_step(engine, mbs, opt, max_norm=0.0, dtype="bf16", zero_grad=False)
    named = dict(model.named_parameters())
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    any_differs = False
    for n, p in named.items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32, n
        torch.testing.assert_close(p.grad, g_bf16[n], rtol=0, atol=0)  # what autocast computed
        any_differs |= not torch.equal(g_bf16[n], g_fp32[n])
        # AdamW, first step, in fp32 (Loshchilov & Hutter 2019, Alg. 2; PyTorch's AdamW):
        # m = (1−β1) g, v = (1−β2) g², θ ← θ(1 − lr·wd) − lr · m/(1−β1) / (sqrt(v/(1−β2)) + ε)
        grp = group_of[id(p)]
        lr, wd, (b1, b2), eps = grp["lr"], grp["weight_decay"], grp["betas"], grp["eps"]
        g = g_bf16[n]
        m, v = (1 - b1) * g, (1 - b2) * g * g
        want = p0[n] * (1 - lr * wd) - lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps)
        assert want.dtype == torch.float32
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert any_differs, "bf16 autocast gave exactly the fp32 gradients: it did not run in bf16"


# the world of W.SLOW's cases: results_slow (``make test-slow``)
results, results_slow = split_worlds(W.__file__, "precision", nproc=W.world_size(),
                                     fast="results")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, id=W.case_name(*c), marks=pytest.mark.slow
                                               if c in W.SLOW else ()) for c in W.CASES])
def test_bf16_loss_within_2_percent_of_fp32(request, case):
    from shardwise.parallel.layout import parse_layout

    results = world_of(request, case in W.SLOW, fast="results")

    world = parse_layout(case[0]).world
    for rank in range(world):
        rec = load_pt(results / f"{W.case_name(*case)}_rank{rank}.pt")
        fp32, bf16 = rec["fp32"][-1], rec["bf16"][-1]
        assert rec["fp32"][0] > 4.0 and fp32 < 0.6 * rec["fp32"][0], "the task was not learnt"
        assert abs(bf16 - fp32) <= 0.02 * fp32, (case, fp32, bf16)
        d = rec["dtypes"]
        assert d["params"] and set(d["params"].values()) == {torch.float32}, d["params"]
        assert d["grads"] and set(d["grads"].values()) == {torch.float32}, d["grads"]
        assert d["optimizer"] and {t for _, t in d["optimizer"]} == {torch.float32}
