"""Meta-device construction and the replayed init (shardwise.models.meta): a model built on
``meta`` and initialised one full tensor at a time equals the ordinary build bitwise, for every
preset and model family, and leaves the global RNG where the ordinary build leaves it."""

import math

import pytest
import torch
from torch import nn

from shardwise.models import build_model, model_names
from shardwise.models.meta import InitPlan, _Recorder, build_on_meta, materialize
from conftest import load_pt

# the families' switches (models/families.py builds these from HF configs)
FAMILIES = {
    "gpt2": dict(family="gpt2", norm="layer", mlp="gelu_tanh", pos="learned", qkv_bias=True,
                 o_bias=True, mlp_bias=True),
    "qwen2": dict(family="qwen2", qkv_bias=True),
    "qwen3": dict(family="qwen3", qk_norm=True, attn_head_dim=8),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
    "untied": dict(tie_embeddings=False),
}
CASES = [(n, {}) for n in model_names() if n != "llama-1b"] + \
        [("tiny", kw) for kw in FAMILIES.values()] + \
        [("moe-tiny", dict(tie_embeddings=False)), ("moe-tiny", dict(n_shared_experts=1))]


def _ids(case):
    name, kw = case
    return name + "".join(f"-{k}" for k in kw)


# ``base`` (23 M parameters, the largest preset here) under ``make test-slow``: the same Llama
# code as ``small`` and ``tiny``, which ``make test`` keeps
@pytest.mark.parametrize("case", [pytest.param(c, id=_ids(c), marks=pytest.mark.slow
                                               if c == ("base", {}) else ()) for c in CASES])
def test_meta_build_then_replayed_init_equals_the_ordinary_build_bitwise(case):
    name, kw = case
    torch.manual_seed(11)
    ref = build_model(name, 97, **kw)
    rng_ref = torch.random.get_rng_state()

    torch.manual_seed(11)
    model, plan = build_on_meta(name, 97, **kw)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, plan)
    assert torch.equal(torch.random.get_rng_state(), rng_ref)  # the same draws, no more

    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert list(got) == list(want)  # tied parameters stay tied (one name)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n
    bufs = dict(model.named_buffers())
    for n, b in ref.named_buffers():
        assert torch.equal(bufs[n], b), n
    if hasattr(ref, "output") and ref.config.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    # the two models compute the same logits (every buffer and statistic is real)
    x = torch.randint(0, 97, (2, 8)) if hasattr(ref, "tok_embeddings") else \
        torch.randn(2, ref.config.d_model)
    assert torch.equal(model(x), ref(x))


def test_meta_build_draws_nothing_and_allocates_nothing():
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    model, plan = build_on_meta("moe-tiny", 97)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # the record: construction's defaults (modules replaced after, too), then the model's init
    assert len(plan.log) > len(list(model.parameters()))


def test_a_parameter_no_init_wrote_is_refused():
    """A parameter whose value comes from its factory (``torch.ones`` at construction, no
    ``nn.init`` call) cannot be replayed: the plan says which one, rather than a wrong value."""
    class Ones(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.scale = nn.Parameter(torch.ones(2))

    rec = _Recorder()
    with torch.device("meta"), rec:
        m = Ones()
    with pytest.raises(ValueError, match="no recorded init wrote scale"):
        InitPlan(m, rec.log)


def test_an_init_on_a_view_is_refused():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 3))
            nn.init.normal_(self.w)
            with torch.no_grad():
                self.w[0].zero_()

    rec = _Recorder()
    with torch.device("meta"), rec:
        m = Partial()
    with pytest.raises(ValueError, match="on a view"):
        InitPlan(m, rec.log)


# -- the engines: each rank allocates and fills only what it holds -----------------------------

def write_hf_folder(folder, name="tiny", **overrides):
    """A tiny Llama (vocab 67; a Mixtral for ``moe-tiny``) as an HF folder: config.json and
    model.safetensors, our names mapped to HF's (random weights of another seed than the
    worker's init, so a load that did not happen shows)."""
    import json

    from safetensors.torch import save_file

    from shardwise.interop.hf import llama_to_hf_config, mixtral_to_hf_config, ours_to_hf

    torch.manual_seed(123)
    model = build_model(name, vocab_size=67, **overrides)
    folder.mkdir(parents=True, exist_ok=True)
    to_cfg = mixtral_to_hf_config if name.startswith("moe") else llama_to_hf_config
    (folder / "config.json").write_text(json.dumps(to_cfg(model.config)))
    state = {k: v.contiguous() for k, v in ours_to_hf(
        {n: p.detach() for n, p in model.named_parameters()}, model.config).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _world_of(tmp_path_factory, name):
    from conftest import ROOT, run_world

    out = tmp_path_factory.mktemp(name)
    write_hf_folder(out / "hf", n_heads=8, n_kv_heads=4)
    write_hf_folder(out / "hf_moe", "moe-tiny")
    run_world(ROOT / "tests" / "workers" / "meta_init_cases.py", out)
    return out


@pytest.fixture(scope="module")
def world_fast(tmp_path_factory):
    return _world_of(tmp_path_factory, "meta_init")


@pytest.fixture(scope="module")
def world_slow(tmp_path_factory):
    """The world of the worker's SLOW cases (``make test-slow``)."""
    return _world_of(tmp_path_factory, "meta_init_slow")


def _worker():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location(
        "meta_init_cases", ROOT / "tests" / "workers" / "meta_init_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SLOW = _worker().SLOW


@pytest.fixture
def world(request):
    """The folder of the world that ran this test's case (and its ``whole_case``)."""
    p = request.node.callspec.params
    slow = p["case"] in SLOW
    assert p.get("whole_case") not in SLOW  # the comparison's two cases: one world
    return request.getfixturevalue("world_slow" if slow else "world_fast")


def _case_names(names=None):
    """The worker's case names (or ``names``) as params, its SLOW ones marked slow."""
    return [pytest.param(c, marks=pytest.mark.slow if c in SLOW else ())
            for c in names or [c[0] for c in _worker().CASES]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _case_names())
def test_an_engine_built_from_a_meta_model_equals_the_whole_build_bitwise(world, case):
    """``parallelize(meta_model, ..., weights=plan.stream())`` against today's path (the model
    built whole, then parallelized), on every rank: the full parameters after parallelize, the
    global RNG state, two AdamW steps' losses and grad norms, the parameters after them."""
    for rank in range(4):
        r = load_pt(world / f"{case}_rank{rank}.pt")
        whole, meta = r["whole"], r["meta"]
        assert list(meta["init"]) == list(whole["init"])
        for n in whole["init"]:
            assert torch.equal(meta["init"][n], whole["init"][n]), (rank, n)
        assert torch.equal(meta["rng"], whole["rng"])
        assert meta["loss"] == whole["loss"] and meta["norm"] == whole["norm"], rank
        for n in whole["final"]:
            assert torch.equal(meta["final"][n], whole["final"][n]), (rank, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _case_names([
    "hf_dp4_z3", "hf_dp4_z3_torch", "hf_dp2_tp2", "hf_pp2_dp2", "hf_pp2_tp2_torch",
    "hf_moe_dp4_ep2_z3", "hf_hsdp2x2_z3", "hf_dp4_z1", "hf_tp4_sp"]))
def test_from_an_hf_folder_each_rank_reads_only_what_it_holds(world, case):
    """The elements the 4 ranks read of each HF tensor (``shardwise.lazy.counting`` around
    ``parallelize``), against what the layout gives each rank, worked by hand (a whole load
    reads every tensor on every rank: 4 × its elements):

    * ZeRO-3 over dp = 4: every element by one rank, once (the explicit engine's flat slices
      cut tensors anywhere: ``read_flat``; FSDP2's ``Shard(0)`` chunks); a Mixtral's experts
      under ep = 2 too (each ep rank's E/2 experts, ZeRO-3 over the 2 ranks that share them);
    * HSDP, 2 replicas × ZeRO-3 over 2: each element once per replica, 2 ×;
    * ZeRO-1 over dp = 4 (whole parameters on every rank): 4 ×;
    * dp = 2 × tp = 2: a matrix (tp-split) by each dp replica's two tp ranks, once each: 2 ×;
      a norm weight (replicated) by every rank: 4 ×; tp = 4 (± SP): 1 × and 4 ×;
    * pp = 2 × dp = 2: a tensor by the two ranks of the stage holding it (read whole: 0 or
      all of it per rank), 2 ×; the tied embedding is held by both stages: 4 ×;
    * pp = 2 × tp = 2 on torch's pipelining with DTensor TP: a matrix by its stage's two tp
      ranks, half each: 1 × (the tied embedding: both stages, 2 ×); a norm by its stage's two
      ranks: 2 ×."""
    from safetensors import safe_open

    folder = world / ("hf_moe" if case.startswith("hf_moe") else "hf")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    reads = [load_pt(world / f"{case}_rank{r}.pt")["reads"]
             for r in range(4)]
    for k, shape in shapes.items():
        numel = math.prod(shape)
        per_rank = [r.get(k, 0) for r in reads]
        total = sum(per_rank)
        if case in ("hf_dp4_z3", "hf_dp4_z3_torch", "hf_moe_dp4_ep2_z3"):
            assert total == numel, (k, per_rank)
        elif case == "hf_hsdp2x2_z3":
            assert total == 2 * numel, (k, per_rank)
        elif case == "hf_dp4_z1":
            assert total == 4 * numel, (k, per_rank)
        elif case == "hf_dp2_tp2":
            assert total == (2 if len(shape) == 2 else 4) * numel, (k, per_rank)
        elif case == "hf_tp4_sp":
            assert total == (1 if len(shape) == 2 else 4) * numel, (k, per_rank)
        elif case == "hf_pp2_dp2":
            assert set(per_rank) <= {0, numel}, (k, per_rank)
            assert total == (4 if k == "model.embed_tokens.weight" else 2) * numel, (k, per_rank)
        else:
            tied = k == "model.embed_tokens.weight"
            assert total == (2 if tied or len(shape) == 1 else 1) * numel, (k, per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case,whole_case,n", [("dp4_z3", "dp4", 4), ("hsdp2x2_z3", "dp4", 2),
                                               ("dp2_tp2_z3", "dp2_tp2_sp", 2)])
def test_zero3_from_a_meta_model_holds_only_its_slices(world, case, whole_case, n):
    """The parameter storage a rank's ZeRO-3 engine holds after a meta build: Ψ_local / n
    (Ψ_local: what the rank would hold without ZeRO-3, measured in ``whole_case``; n: the
    shard group) plus at most n − 1 padding elements per unit (3 units: the root, 2 blocks)."""
    for rank in range(4):
        got = load_pt(world / f"{case}_rank{rank}.pt")["meta_bytes"]
        base = load_pt(world / f"{whole_case}_rank{rank}.pt")["meta_bytes"]
        assert base / n <= got <= base / n + 3 * (n - 1) * 4, (rank, got, base)


@pytest.mark.parametrize("name,kw", [("tiny", {}), ("tiny", {**FAMILIES["gpt2"], "n_kv_heads": 4}),
                                     ("moe-tiny", dict(tie_embeddings=False))],
                         ids=["llama", "gpt2", "mixtral"])
def test_the_hf_stream_gives_what_the_whole_load_gives(tmp_path, name, kw):
    """``hf_weight_stream`` (lazy tensors, read whole here) against ``load_hf_weights`` (the
    whole folder into a whole model): every parameter, bitwise (GPT-2's fused c_attn split and
    transposed Conv1D weights, Mixtral's experts stacked); and any box of each lazy tensor reads
    exactly that box of the whole one."""
    import json

    from safetensors.torch import save_file

    from shardwise.interop.hf import hf_weight_stream, llama_to_hf_config, load_hf_weights
    from shardwise.interop.hf import mixtral_to_hf_config, ours_to_hf

    torch.manual_seed(5)
    src = build_model(name, vocab_size=67, **kw)
    to_cfg = mixtral_to_hf_config if name.startswith("moe") else llama_to_hf_config
    (tmp_path / "config.json").write_text(json.dumps(to_cfg(src.config)))
    state = ours_to_hf({n: p.detach() for n, p in src.named_parameters()}, src.config)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))

    whole = build_model(name, vocab_size=67, **kw)
    load_hf_weights(whole, tmp_path)
    meta, _ = build_on_meta(name, vocab_size=67, **kw)
    got = dict(hf_weight_stream(meta, tmp_path))
    for n, p in whole.named_parameters():
        assert torch.equal(got[n].read(), p), n
        lo = [s // 3 for s in p.shape]
        size = [max(1, s // 2) for s in p.shape]
        want = p[tuple(slice(a, a + k) for a, k in zip(lo, size))]
        assert torch.equal(got[n].box(lo, size).read(), want), n
        assert torch.equal(p, dict(src.named_parameters())[n]), n  # the round trip itself


def test_the_checkpoint_stream_reads_only_the_box_asked_for(tmp_path):
    """``checkpoint_weight_stream``: each parameter a lazy tensor; a box of it (one
    ``dcp.load`` into a destination that reports the full size and the box as its chunk)
    equals that box of what was saved, and only the box's elements are read."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint import checkpoint_weight_stream
    from shardwise.lazy import counting

    torch.manual_seed(3)
    saved = {n: p.detach().clone() for n, p in build_model("moe-tiny", vocab_size=67)
             .named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: one process"
        dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "meta.json").write_text("{}")
    meta, _ = build_on_meta("moe-tiny", vocab_size=67)
    with counting() as reads:
        got = dict(checkpoint_weight_stream(tmp_path, meta))
        assert list(got) == list(saved)
        for n, full in saved.items():
            lo = [s // 3 for s in full.shape]
            size = [max(1, s // 2) for s in full.shape]
            want = full[tuple(slice(a, a + k) for a, k in zip(lo, size))]
            assert torch.equal(got[n].box(lo, size).read(), want), n
            assert reads[n] == [math.prod(size)], n
        first = next(iter(saved))
        assert torch.equal(got[first].read(), saved[first])  # whole: the plain dcp.load


def test_read_flat_reads_exactly_the_flat_range():
    """``views.read_flat`` (a ZeRO-3 slice of a lazy tensor): for tensors of 1 to 4 dims and
    random ranges [lo, hi), the elements of the flattened tensor, and exactly hi − lo of them
    read (``shardwise.lazy.counting``)."""
    import random

    from shardwise.lazy import LazyTensor, counting
    from shardwise.parallel.views import read_flat

    rng = random.Random(0)
    for shape in [(5,), (4, 3), (3, 4, 5), (2, 3, 4, 5)]:
        w = torch.randn(shape)
        lazy = LazyTensor.source(shape, w.dtype, lambda o, s, w=w: w[tuple(
            slice(a, a + b) for a, b in zip(o, s))].clone(), "w")
        for _ in range(100):
            lo = rng.randrange(w.numel())
            hi = rng.randrange(lo + 1, w.numel() + 1)
            with counting() as reads:
                got = read_flat(lazy, lo, hi)
            assert torch.equal(got, w.reshape(-1)[lo:hi]), (shape, lo, hi)
            assert sum(reads["w"]) == hi - lo, (shape, lo, hi)


def test_stream_from_replays_the_init_from_a_state_and_puts_the_rng_back():
    """``InitPlan.stream_from(state)`` (DPO's reference: the initial policy a second time)
    gives the tensors ``stream()`` gave from that state, bitwise, and leaves the global RNG
    where it was before the replay (later draws are unaffected)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model, plan = build_on_meta("tiny", vocab_size=67)
    first = {n: t.clone() for n, t in plan.stream()}
    torch.manual_seed(99)
    here = torch.get_rng_state()
    again = dict(plan.stream_from(before))
    assert list(again) == list(first)
    for n in first:
        assert torch.equal(again[n], first[n]), n
    assert torch.equal(torch.get_rng_state(), here)
