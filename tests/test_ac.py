"""Activation checkpointing (``--ac``): gradients identical to no checkpointing, single process
and under distributed layouts; the step's ledger bytes unchanged, a recompute's TP collectives
booked apart (phase "recompute") and equal to a hand count; saved activation bytes lower for
selective and lower still for full."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, loss_sum_and_count, set_activation_checkpointing
from shardwise.train.workload import SyntheticLMWorkload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import ac_cases as W  # noqa: E402


def _grads(model_name, mode, dtype=None, **kw):
    """Gradients of one forward+backward of a fixed batch under ``mode`` (dropout on for the
    Llama, so the RNG replay of the recompute is exercised)."""
    torch.manual_seed(0)
    model = build_model(model_name, **kw)
    assert set_activation_checkpointing(model, mode) == model.config.n_layers
    if "input_ids" in _BATCH[model_name]:
        model.train()
    torch.manual_seed(1)  # dropout masks drawn from here
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
           else torch.autocast("cpu", enabled=False))
    with ctx:
        loss, _ = loss_sum_and_count(model, _BATCH[model_name])
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


_WORK = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=8, num_val=2, seed=0)
_BATCH = {"tiny": _WORK.batches(torch.arange(4), 4)[0],
          "mlp-tiny": {"inputs": torch.randn(6, 16, generator=torch.Generator().manual_seed(0)),
                       "targets": torch.randn(6, 16, generator=torch.Generator().manual_seed(1))}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("model_name,kw,dtype", [
    ("tiny", dict(vocab_size=67, dropout=0.2), None),
    ("tiny", dict(vocab_size=67), "bf16"),  # autocast state replayed in the recompute
    ("mlp-tiny", {}, None)])
def test_single_process_gradients_bitwise(model_name, kw, dtype, mode):
    ref = _grads(model_name, "none", dtype, **kw)
    got = _grads(model_name, mode, dtype, **kw)
    assert ref.keys() == got.keys()
    for n in ref:  # the same ops in the same order: bitwise
        assert torch.equal(got[n], ref[n]), f"{mode}: gradient of {n} differs"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("schedule", ("zb-h1", "zbv", "dualpipev"))
def test_selective_with_zero_bubble_is_refused(schedule):
    from shardwise.config import TrainConfig, validate

    with pytest.raises(ShardwiseConfigError, match=f"--ac selective with --schedule {schedule}"):
        validate(TrainConfig(model="tiny", dp=1, tp=1, zero=0, pp=2, schedule=schedule,
                             n_layers=4, global_batch=8, micro_batch=2, ac="selective"))


@pytest.mark.timeout(30)
def test_bad_mode_is_a_config_error():
    with pytest.raises(ShardwiseConfigError, match="--ac 'partial'"):
        set_activation_checkpointing(build_model("tiny", vocab_size=67), "partial")


# the world of W.SLOW's layouts: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "ac", nproc=2)


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's layout."""
    return world_of(request, request.node.callspec.params["layout"] in W.SLOW)


def _layout_modes(modes=None):
    """(layout, mode) params, those of W.SLOW's layouts marked slow."""
    return [pytest.param(lay, m, marks=pytest.mark.slow if lay in W.SLOW else ())
            for lay, lay_modes in W.MODES_OF.items() for m in lay_modes
            if m != "none" and (modes is None or m in modes)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,mode", _layout_modes())
def test_distributed_gradients_and_ledger(results, layout, mode):
    for rank in (0, 1):
        ref = load_pt(results / f"{layout}_none_rank{rank}.pt")
        got = load_pt(results / f"{layout}_{mode}_rank{rank}.pt")
        for step in range(W.STEPS):
            assert got["loss"][step] == ref["loss"][step]
            assert got["grads"][step].keys() == ref["grads"][step].keys()
            for n, g in ref["grads"][step].items():
                torch.testing.assert_close(got["grads"][step][n], g, rtol=0, atol=0)  # bitwise
            # the step's bytes (what the step formula predicts) do not change with --ac
            assert got["step_bytes"][step] == ref["step_bytes"][step]
            assert ref["recompute"][step] == []  # nothing is recomputed without --ac


# what a recompute re-sends per micro-batch and block (test_recompute_bytes_by_hand), in units of
# S = b·s·d·4 bytes
RECOMPUTE_S = {"tp2_explicit": 2 * (1 / 2), "tp2_torch": 2 * (1 / 2),
               "tp2_sp_explicit": 3 * (1 / 2), "dp2_zero3_explicit": 0.0, "dp2_zero3_torch": 0.0, "pp2_1f1b_explicit": 0.0,
               "pp2_zbh1_explicit": 0.0, "pp2_zbv_explicit": 0.0}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,mode", _layout_modes(("selective", "full")))
def test_recompute_bytes_by_hand(results, layout, mode):
    """Hand count of what a recompute re-sends, per micro-batch and block (b=2, s=16, d=32,
    fp32: S = 2·16·32·4 = 4096 bytes), n = 2. PyTorch's early stop ends the recompute once the
    last saved tensor is back (the w2 matmul), so the block's last exit collective is not redone:
    * TP: attention's exit all-reduce (g): 2(n−1)/n · S = 4096 B;
    * TP+SP: all-gather in, reduce-scatter out of attention, all-gather into the FFN:
      3 · (n−1)/n · S = 6144 B;
    * ZeRO-3 and PP: the block body holds no collective (ZeRO-3 gathers in the block's hooks,
      outside the checkpoint): 0 B.
    (zb-h1, zbv run none/full only: selective is refused there, tested above.)"""
    S = W.MICRO * W.SEQ * 32 * 4
    bytes_per = RECOMPUTE_S[layout] * S
    n_blocks = W.N_LAYERS.get(layout, 2)
    for rank in (0, 1):
        got = load_pt(results / f"{layout}_{mode}_rank{rank}.pt")
        blocks_here = n_blocks // 2 if layout.startswith("pp2") else n_blocks
        for step in range(W.STEPS):
            total = sum(b for *_, b in got["recompute"][step])
            assert total == W.N_MICRO * blocks_here * bytes_per, (layout, got["recompute"])


def _load_bench():
    spec = importlib.util.spec_from_file_location("ac_memory", ROOT / "benchmarks/ac_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_saved_activation_bytes_ordering():
    """The benchmark's measurement on a small config: full < selective < none, gradients
    bitwise equal; full keeps about the block inputs only."""
    bench = _load_bench()
    rows = {r["mode"]: r for r in bench.run("tiny", batch=2, seq_len=32, vocab=67, repeats=1)}
    none, sel, full = (rows[m]["saved_bytes"] for m in ("none", "selective", "full"))
    assert full < sel < none, rows
    assert all(r["grads_bitwise_equal_to_none"] for r in rows.values())
