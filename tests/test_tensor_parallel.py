"""Tensor (+ sequence) parallelism against a single-process reference computed here, plus the
ledger against the formula, the dropout RNG policy, the conversion check and bad input.

One 4-rank world (tests/workers/tp_cases.py) runs tp ∈ {2, 4} × engine ∈ {explicit, torch} ×
SP on/off × tied/untied embeddings (``make test``: the half of it with every pair of factors'
values, W.is_slow; the other half under ``make test-slow``), each 3 AdamW steps with 2 micro-batches and clipping that
binds, on a GQA model (8 heads, 4 kv heads) with vocabulary 67, which neither tp divides."""

import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Ledger
from shardwise.data import DistributedSampler
from shardwise.errors import ShardwiseConfigError
from shardwise.precision import Precision
from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.tp import (TPOptions, apply as tp_apply, padded_vocab_size,
                                   parallelize_tensor, tp_step_bytes_formula, valid_tp_degrees,
                                   validate_tp)
from shardwise.parallel.sync import NoSync
from shardwise.parallel.model import ParallelModel
from shardwise.parity import ATOL, RTOL, assert_parity, reference_run
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import tp_cases as W  # noqa: E402

CASES = list(itertools.product(W.TPS, W.ENGINES, W.SPS, W.TIED))
# the parity cases as params, W.is_slow's marked slow (make test keeps a half with every pair)
CASE_PARAMS = [pytest.param(*c, marks=pytest.mark.slow if W.is_slow(*c) else ()) for c in CASES]


# the world of W.is_slow's parity cases: results_slow (``make test-slow``)
results, results_slow = split_worlds(W.__file__, "tp", fast="results")


def _results(request, tp, engine, sp, tied):
    """The folder of the world that ran this parity case."""
    return world_of(request, W.is_slow(tp, engine, sp, tied), fast="results")


def _reference(tied):
    """shardwise.parity's plain-PyTorch reference (AdamW, the whole global batch in one forward,
    F.cross_entropy mean over counted tokens, clip_grad_norm_), and the evaluation loss sum of
    rows 0..7 at the initialisation."""
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, tie_embeddings=tied, **W.MODEL)
    with torch.no_grad():
        (mb,) = work.batches(torch.arange(8), 8)
        eval_loss_sum = F.cross_entropy(model(mb["input_ids"]).reshape(-1, 67),
                                        mb["labels"].reshape(-1), ignore_index=-100,
                                        reduction="sum").item()
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(W.STEPS)]
    ref = reference_run(model, batches, lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM)
    ref["eval_loss_sum"] = eval_loss_sum
    return ref


@pytest.fixture(scope="module")
def references():
    return {tied: _reference(tied) for tied in W.TIED}


def _load(out, tp, engine, sp, tied):
    return [load_pt(out / f"{W.case_name(tp, engine, sp, tied)}_rank{r}.pt")
            for r in range(tp)]


@pytest.mark.parametrize("tp,engine,sp,tied", CASE_PARAMS)
def test_tp_matches_single_process(request, references, tp, engine, sp, tied):
    """The evaluation loss at the initialisation, then every step's loss, clipped norm,
    gradients and parameters by shardwise.parity's rule."""
    ref = references[tied]
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    results = _results(request, tp, engine, sp, tied)
    for rank, rec in enumerate(_load(results, tp, engine, sp, tied)):
        torch.testing.assert_close(torch.tensor(rec["eval_loss_sum"]),
                                   torch.tensor(ref["eval_loss_sum"]), rtol=RTOL, atol=ATOL)
        assert_parity(rec, ref, where=f"rank {rank}")


def test_reference_has_gqa_and_an_indivisible_vocabulary():
    cfg = build_model("tiny", vocab_size=67, **W.MODEL).config
    assert cfg.n_kv_heads < cfg.n_heads and all(67 % tp for tp in W.TPS)


# -- ledger vs formula ---------------------------------------------------------------------------
def test_formula_hand_worked():
    """d=32, L=2, 8 sequences × 16 tokens = 128 tokens; one [128, 32] fp32 activation is
    A = 16,384 bytes. tp=2: r = 2(n−1)/n = 1; tp=4: r = 1.5."""
    cfg = LlamaConfig(vocab_size=67, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=64)
    f = tp_step_bytes_formula(cfg, sequences=8, seq_len=16, tp=2, options=TPOptions(sp=False))
    assert f["tp_fwd"] == 5 * 16384 and f["tp_bwd"] == 5 * 16384  # (1 + 2L) all-reduces each
    assert f["ce"] == 3 * 128 * 4 and f["grad_norm"] == 8 and f["sp_grad"] == 0
    assert f["loss"] == 0
    assert f["total"] == 2 * 81920 + 1536 + 8
    g = tp_step_bytes_formula(cfg, sequences=8, seq_len=16, tp=4, options=TPOptions(sp=True))
    # 10 all-gathers/reduce-scatters each way of (3/4)·16384; 5 norm weights of 32 fp32
    assert g["tp_fwd"] == g["tp_bwd"] == 10 * 0.75 * 16384
    assert g["sp_grad"] == 1.5 * 5 * 32 * 4 and g["ce"] == 1.5 * 1536 and g["grad_norm"] == 12
    # bf16 autocast: the 2L row-parallel outputs travel in 2 bytes (forward g only, no SP)
    h = tp_step_bytes_formula(cfg, sequences=8, seq_len=16, tp=2, options=TPOptions(sp=False),
                              precision=Precision.of("bf16"))
    assert h["tp_fwd"] == 16384 + 4 * 8192 and h["tp_bwd"] == 5 * 16384


@pytest.mark.parametrize("tp,engine,sp,tied", CASE_PARAMS)
def test_ledger_bytes_equal_formula(request, tp, engine, sp, tied):
    cfg = build_model("tiny", vocab_size=67, **W.MODEL).config
    f = tp_step_bytes_formula(cfg, W.GLOBAL_BATCH, 16, tp, TPOptions(sp=sp))
    for rec in _load(_results(request, tp, engine, sp, tied), tp, engine, sp, tied):
        for step in range(W.STEPS):
            got = rec["bytes"][step]
            assert rec["total_bytes"][step] == pytest.approx(f["total"], rel=1e-12, abs=0)
            for tag in W.TAGS:  # per tag, both engines (one tag per kind of traffic)
                assert got[tag] == pytest.approx(f[tag], rel=1e-12, abs=0), (engine, tag)


@pytest.mark.parametrize("engine,sp", list(itertools.product(W.ENGINES, W.SPS)))
def test_ledger_bytes_equal_formula_under_bf16(results, engine, sp):
    """Row-parallel outputs travel in bf16 under autocast, everything else in fp32."""
    cfg = build_model("tiny", vocab_size=67, **W.MODEL).config
    f = tp_step_bytes_formula(cfg, 8, 16, 2, TPOptions(sp=sp), precision=Precision.of("bf16"))
    assert f["tp_fwd"] < tp_step_bytes_formula(cfg, 8, 16, 2, TPOptions(sp=sp))["tp_fwd"]
    for r in range(2):
        got = load_pt(results / f"bf16_{engine}_{'sp' if sp else 'nosp'}_rank{r}.pt")
        for tag in ("tp_fwd", "tp_bwd", "ce", "sp_grad"):
            assert got[tag] == pytest.approx(f[tag], rel=1e-12, abs=0), (engine, tag)


# -- dropout RNG policy --------------------------------------------------------------------------
def _dropout(results, sp):
    return [load_pt(results / f"dropout_{'sp' if sp else 'nosp'}_rank{r}.pt")
            for r in range(2)]


def test_dropout_masks_agree_where_activations_are_replicated(results):
    r0, r1 = _dropout(results, sp=False)
    assert len(r0["masks"]) == 4  # 2 blocks × (attention, MLP) residual dropout
    for m0, m1 in zip(r0["masks"], r1["masks"]):
        assert 0.3 < m0.float().mean() < 0.7  # p = 0.5: a real mask
        assert torch.equal(m0, m1)
    for b0, b1 in zip(r0["blocks"], r1["blocks"]):  # so the replicas stay identical
        torch.testing.assert_close(b0, b1, rtol=0, atol=0)


def test_dropout_masks_differ_on_sequence_shards(results):
    r0, r1 = _dropout(results, sp=True)
    for m0, m1 in zip(r0["masks"], r1["masks"]):
        assert m0.shape[1] == 8 and not torch.equal(m0, m1)  # [b, s/2, d]: own shard, own mask


def test_rng_regions(results):
    for sp in (False, True):
        r0, r1 = _dropout(results, sp)
        assert torch.equal(r0["replicated_draw"], r1["replicated_draw"])
        assert not torch.equal(r0["sharded_draw"], r1["sharded_draw"])
        assert r0["default_rng_untouched"] and r1["default_rng_untouched"]


# -- bad input, conversion check (in process: nothing here may reach a collective) ----------------
class NoCommTopo:
    """A topology whose tp axis has ``tp`` ranks but which fails on any communication."""

    def __init__(self, tp):
        self.tp, self.ledger, self.device = tp, Ledger(), torch.device("cpu")

    def size(self, axis):
        return self.tp if axis == "tp" else 1

    def index(self, axis):
        return 0

    def group(self, axis):
        raise AssertionError("a collective was attempted before validation failed")

    global_rank = group


def tiny_config(**kw):
    return build_model("tiny", vocab_size=67, **{**W.MODEL, **kw}).config


@pytest.mark.parametrize("tp,sp,seq,what,valid", [
    (3, False, None, "n_heads=8", "{1, 2, 4}"),
    (8, False, None, "n_kv_heads=4", "{1, 2, 4}"),
    (2, True, 15, "--seq-len 15", "no tp > 1"),
    (4, True, 18, "--seq-len 18", "{2}"),
    (1, True, 16, "--sp (sequence parallelism) needs --tp > 1", "{2, 4}"),
])
def test_bad_tp_names_the_constraint_and_valid_values(tp, sp, seq, what, valid):
    with pytest.raises(ShardwiseConfigError) as e:
        validate_tp(tiny_config(), tp, TPOptions(sp=sp), seq)
    assert what in str(e.value) and valid in str(e.value)


def test_tp_not_dividing_d_ff():
    cfg = tiny_config(n_heads=4, n_kv_heads=4, d_ff=66)  # gcd(4, 4, 66) = 2
    assert valid_tp_degrees(cfg) == [1, 2]
    with pytest.raises(ShardwiseConfigError, match=r"d_ff=66.*\{1, 2\}"):
        validate_tp(cfg, 4)


def test_valid_configs_pass():
    for tp, sp in ((1, False), (2, False), (4, True), (2, True)):
        validate_tp(tiny_config(), tp, TPOptions(sp=sp), 16)


def test_tp_takes_one_options_argument():
    """Issue 52: SP reaches every function and class of ``parallel/tp/`` as the one
    ``TPOptions`` argument, never as its own ``sp`` parameter (a later option, async TP, joins
    the record instead of every signature); the layout builds it, and it cannot change."""
    import ast
    import dataclasses

    from shardwise.parallel.layout import Layout

    tp_dir = Path(tp_apply.__file__).parent
    bools = [f"{f.name}:{n.lineno} {n.name}" for f in sorted(tp_dir.glob("*.py"))
             for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and "sp" in [a.arg for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs]]
    assert bools == [], bools
    assert [f.name for f in dataclasses.fields(TPOptions)] == ["sp"]
    assert TPOptions() == TPOptions(sp=False) == Layout(tp=2).tp_options
    assert Layout(tp=2, sp=True).tp_options == TPOptions(sp=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TPOptions().sp = True


def test_mlp_tp_rules():
    """The stacked MLP splits d_ff: tp must divide it; no SP (no sequence); no TP in stages."""
    cfg = build_model("mlp-tiny").config  # d_ff 32
    validate_tp(cfg, 4)
    with pytest.raises(ShardwiseConfigError, match=r"d_ff=32.*\{1, 2, 4, 8, 16, 32\}"):
        validate_tp(cfg, 3)
    with pytest.raises(ShardwiseConfigError, match="no sequence dimension"):
        validate_tp(cfg, 2, TPOptions(sp=True))
    with pytest.raises(ShardwiseConfigError, match="not tensor-parallel"):
        validate_tp(cfg, 2, pp=2)
    with pytest.raises(ShardwiseConfigError, match="Llama-style"):
        validate_tp(None, 2)


@pytest.mark.parametrize("tp,sp", [(3, False), (1, True)])
def test_parallelize_rejects_bad_tp_before_any_collective(tp, sp):
    model = build_model("tiny", vocab_size=67, **W.MODEL)
    with pytest.raises(ShardwiseConfigError):
        parallelize_tensor(model, NoCommTopo(tp), options=TPOptions(sp=sp))
    assert type(model.output) is nn.Linear  # untouched


def test_unplanned_module_is_rejected_before_any_collective():
    model = build_model("tiny", vocab_size=67, **W.MODEL)
    model.layers[1].extra = nn.Linear(32, 32, bias=False)  # would silently stay replicated
    with pytest.raises(ShardwiseConfigError, match=r"layers\.1\.extra \(Linear\)"):
        parallelize_tensor(model, NoCommTopo(2))


class _SoloTopo(NoCommTopo):
    """tp = 1: comm ops on a group of one issue no call (they only book 0 bytes)."""

    def __init__(self):
        super().__init__(1)

    def global_rank(self, axis, index):
        return 0


def test_conversion_that_skips_a_module_fails_loudly(monkeypatch):
    """The picotron failure: the output head left unparallelised. tp=1 runs without a group."""
    real = tp_apply._set_submodule
    monkeypatch.setattr(tp_apply, "_set_submodule",
                        lambda m, fqn, new: None if fqn == "output" else real(m, fqn, new))
    model = build_model("tiny", vocab_size=67, tie_embeddings=False, **W.MODEL)
    with pytest.raises(RuntimeError, match=r"output is Linear, not VocabParallelHead"):
        parallelize_tensor(model, _SoloTopo())


def test_tp1_conversion_is_the_plain_model():
    """At tp = 1 every shard is the whole tensor: same loss and gradients as the plain model."""
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=8, num_val=1, seed=0)
    (mb,) = work.batches(torch.arange(4), 4)
    torch.manual_seed(0)
    plain = build_model("tiny", vocab_size=67, **W.MODEL)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **W.MODEL)
    topo = _SoloTopo()
    loss_fn = parallelize_tensor(model, topo)
    engine = ParallelModel(model, topo, loss_fn=loss_fn, grad_sync=NoSync(model, topo))
    s_ref = F.cross_entropy(plain(mb["input_ids"]).flatten(0, 1), mb["labels"].flatten(),
                            ignore_index=-100, reduction="sum")
    s_ref.backward()
    s, _ = loss_fn.loss_sum_and_count(mb)  # with grad (the engine's evaluation is no_grad)
    s.backward()
    torch.testing.assert_close(s, s_ref, rtol=RTOL, atol=ATOL)
    grads = engine.named_full_gradients()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=ATOL)
    with torch.no_grad(), engine.full_model() as m:
        torch.testing.assert_close(m(mb["input_ids"]), plain(mb["input_ids"]),
                                   rtol=RTOL, atol=ATOL)


def test_padded_vocab_size():
    assert padded_vocab_size(67, 2) == 68 and padded_vocab_size(67, 4) == 68
    assert padded_vocab_size(64, 4) == 64


@pytest.mark.parametrize("tp,engine,sp,tied", [p for p in CASE_PARAMS
                                                 if p.values[1] == "explicit"])
def test_vocab_padding_rows_stay_zero(request, tp, engine, sp, tied):
    """V = 67 → 68 rows: the last tp rank holds one padded row of the embedding and the head;
    after 3 AdamW steps (weight decay on the untied head) it is still exactly zero."""
    recs = _load(_results(request, tp, engine, sp, tied), tp, engine, sp, tied)
    assert [r["padded_rows"] for r in recs[:-1]] == [0] * (tp - 1)
    assert recs[-1]["padded_rows"] == 1 and recs[-1]["padded_max_abs"] == 0.0
