"""``--compile`` (models/compile.py): compiled blocks give eager's loss and gradients, compose
with ZeRO-3's hooks across ranks, and layouts that cannot compile are refused up front; and the
AdamW implementations (train/optim.py) agree.

CPU inductor compiles with gcc; each compile here takes ~10-40 s on a shared 2-core machine
(inductor's on-disk cache makes repeats faster), so the compile tests are few.

Bounds (fp32, u = 2⁻²⁴). Inductor fuses the pointwise ops of a block and may reorder its
reductions (RMSNorm's mean over d, softmax's sums), while matmuls stay the same ATen calls.
Two orders of an n-term fp32 sum differ by at most 2·γ_n·Σ|x_i| ≈ 2n·u·Σ|x_i| (Higham 2002,
§4.2). The loss is a sum of b·s = 64 token losses of one sign: |Δ| ≤ 2·64·u·loss ≈ 7.6e-6
relative. A gradient element is a chain of such sums (≤ 32-wide reductions over d, 64-wide
over tokens, through 2 blocks × ~10 ops): ≈ 2·(64 + 32)·20·u ≈ 2.3e-4 of the tensor's scale in
the worst case; we allow 1e-4 of the tensor's largest element (the measured error is ~1e-7 of
it, and a wrong gradient — a hook that did not fire, a missing recompute — is off by O(1)).
"""

import json

import pytest
import torch

from conftest import run_cli
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, loss_sum_and_count, set_activation_checkpointing
from shardwise.models.compile import compile_blocks

U32 = 2.0 ** -24
LOSS_RTOL = 2 * 64 * U32
GRAD_REL = 1e-4


def _loss_and_grads(ac: str, compiled: bool):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64)
    set_activation_checkpointing(model, ac)
    if compiled:
        assert compile_blocks(model) == 2  # both blocks
        assert compile_blocks(model) == 0  # idempotent
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 64, (2, 32), generator=g),
             "labels": torch.randint(0, 64, (2, 32), generator=g)}
    loss, count = loss_sum_and_count(model, batch)
    (loss / count).backward()
    names = list(model.state_dict())
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, names


def test_compile_blocks_wraps_each_block_once_and_keeps_the_state_dict_names():
    """``compile_blocks`` wraps both blocks, a second call none (idempotent), and the state
    dict keeps eager's names (no ``_orig_mod.`` prefix: checkpoints are interchangeable).
    Nothing is compiled until a forward, so this is cheap; the compiled forward and backward
    are the test below (``make test``: --ac selective, AC's recompute inside the compiled
    block; ``make test-slow``: --ac none too, and the GPU bench's whole CPU dry run, whose
    tests/test_gpu_path.py::test_compiled_equals_eager makes the same comparison)."""
    torch.manual_seed(0)
    eager = build_model("tiny", vocab_size=64)
    model = build_model("tiny", vocab_size=64)
    assert compile_blocks(model) == 2  # both blocks
    assert compile_blocks(model) == 0  # idempotent
    assert list(model.state_dict()) == list(eager.state_dict())


# make test: --ac selective (the compiled block with AC's recompute; its loss and gradients);
# make test-slow: --ac none too (and tests/test_gpu_bench.py's whole dry run, which compares both)
@pytest.mark.parametrize("ac", [pytest.param("none", marks=pytest.mark.slow), "selective"])
def test_compiled_blocks_give_the_eager_loss_and_every_gradient(ac):
    le, ge, names_e = _loss_and_grads(ac, compiled=False)
    lc, gc, names_c = _loss_and_grads(ac, compiled=True)
    assert names_c == names_e  # no _orig_mod. prefix: checkpoints are interchangeable
    torch.testing.assert_close(lc, le, rtol=LOSS_RTOL, atol=0)
    assert gc.keys() == ge.keys()
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=0,
                                   atol=GRAD_REL * float(ge[n].abs().max()), msg=n)


# make test: --ac selective, whose per-rank block graph (micro-batch 2 × 32) is the one the
# in-process test above compiles, so inductor's on-disk cache serves this run's training graph
# (measured cold: 56 s → 43 s); make test-slow: --ac full too
@pytest.mark.parametrize("ac", ["selective", pytest.param("full", marks=pytest.mark.slow)])
def test_compile_with_zero3_over_two_ranks_gives_the_eager_run(cache_dir, tmp_path, ac):
    """dp = 2, ZeRO-3 (pre-forward all-gathers, post-forward frees, the pre-backward re-gather,
    post-accumulate-grad reduce-scatters) with activation checkpointing: the compiled run logs
    the eager run's losses and gradient norms, step by step, within the layouts' end-to-end
    bound (tests/test_cli.py: rel 1e-5, abs 1e-6 — fp32 round-off carried through 3 AdamW
    steps)."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        p = run_cli(["train", "--model", "tiny", "--dp", "2", "--zero", "3", "--ac", ac,
                     "--steps", "3", "--global-batch", "4", "--seq-len", "32",
                     "--tokenizer", "bytes", "--eval-every", "100", "--eval-sequences", "4",
                     "--sample-tokens", "0", "--out", out, *extra], cache_dir, timeout=400)
        assert p.returncode == 0, p.stdout
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        if extra:
            assert "--compile: torch.compile on 2 blocks" in p.stdout
    for key in ("loss", "grad_norm", "val_loss"):
        eager = [r[key] for r in runs["eager"] if key in r]
        compiled = [r[key] for r in runs["compiled"] if key in r]
        assert len(eager) == len(compiled) >= 2, key
        assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6), key
    assert not any(k.startswith("gpu_") for r in runs["compiled"] for k in r)  # CPU: absent


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "2"], "--tp 2"),
    (["--dp", "1", "--cp", "2"], "--cp 2"),
    (["--model", "moe-tiny", "--dp", "1"], "mixture-of-experts"),
    (["--pp", "2", "--schedule", "zb-h1"], "zb-h1"),
    (["--pp", "2", "--schedule", "zbv", "--n-layers", "4"], "--schedule zbv"),
    (["--pp", "2", "--schedule", "dualpipev", "--n-layers", "4", "--microbatches", "4"],
     "--schedule dualpipev"),
])
def test_compile_refuses_layouts_whose_blocks_communicate(flags, needle):
    """Refused by validate (every rank, before any collective), naming the cause and the fix."""
    import argparse

    from shardwise.config import add_config_flags, from_args, validate

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = from_args(parser.parse_args([*flags, "--compile", "--global-batch", "8"]))
    with pytest.raises(ShardwiseConfigError, match="--compile") as e:
        validate(cfg)
    assert needle in str(e.value) and "drop --compile" in str(e.value)


def test_foreach_adamw_equals_the_for_loop():
    """The CPU default (foreach: torch._foreach_* multi-tensor ops) against the for-loop
    AdamW that the parity reference uses (shardwise.parity), 10 steps on the tiny Llama's real
    gradients and its two parameter groups. Bound: 0 (bitwise). On CPU each _foreach_ op runs
    the same ATen kernel per tensor as the for-loop's op, in the same order per element, with
    the same Python-float step sizes, so nothing is rounded differently; any difference is a
    changed formula, not arithmetic (the fused kernel, by contrast, differs by ulps:
    tests/test_gpu_path.py)."""
    from shardwise.train.optim import adamw_kwargs, param_groups

    finals = {}
    for impl in ("for-loop", "foreach"):
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=64)
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                **adamw_kwargs(impl))
        g = torch.Generator().manual_seed(1)
        for _ in range(10):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            loss, count = loss_sum_and_count(model, {"input_ids": ids, "labels": ids})
            opt.zero_grad()
            (loss / count).backward()
            opt.step()
        finals[impl] = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert opt.defaults["foreach"] is (impl == "foreach")
    for n, p in finals["for-loop"].items():
        torch.testing.assert_close(finals["foreach"][n], p, rtol=0, atol=0, msg=n)


def test_adamw_implementation_follows_the_device():
    from shardwise.train.optim import adamw_impl, adamw_kwargs

    assert adamw_impl("cpu") == "foreach"
    assert adamw_impl(torch.device("cuda", 0)) == "fused"
    assert adamw_kwargs("fused") == {"fused": True}
    with pytest.raises(ValueError, match="choose from"):
        adamw_kwargs("apex")
