"""bf16 parameter storage and ``--offload optimizer`` (issue 53) against one process with the
same storage, by the rules of docs/parity.md §7:

* dp = 2, one micro-batch per rank (DP, ZeRO-1/2/3; the torch engine's FSDP2 ZeRO-2/3 under
  the guide's recipe), both recipes and their offloaded twins:
  bitwise equal to :class:`~shardwise.parallel.model.Local` stepping the ranks' two
  micro-batches in rank order (losses, every gradient and bf16 parameter, every step);
* every layout (also HSDP, dp 4 ZeRO-3, tp 2, dp 2 × tp 2 ZeRO-1, pp 2 1F1B with and without
  dp 2 ZeRO-1/2/3 over its stages, pp 2 × dp 2 ZeRO-3 interleaved): the offloaded run bitwise
  equal to the same layout without offload (the same arithmetic, on the host), and the ledger's
  host ↔ device bytes equal to the formula (:func:`shardwise.parallel.storage.
  offload_bytes_formula`) every step;
* HSDP and dp 4 ZeRO-3 under Megatron's recipe: the first step's loss and fp32 main gradients
  within the fp32 rule (§2: the per-micro-batch bf16 gradients are the reference's bitwise,
  only the order of their fp32 sum differs); pp 2 × dp 2 with ZeRO-1/2/3 in the stages
  likewise, all but the tied embedding (§7, pp);
* the masters saved by ``full_optimizer_state`` resume bitwise; fp32 accumulation over
  micro-batches; the accuracy cost of the guide's recipe (an update below bf16's resolution
  lost), worked by hand; the refusals of what is not wired."""

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.errors import ShardwiseConfigError
from shardwise.models import count_items
from shardwise.parallel.apply import Layout
from shardwise.parallel.master import MasterAdamW
from shardwise.parallel.model import Local
from shardwise.parallel.storage import check_storage
from shardwise.parity import ATOL, RTOL
from shardwise.precision import Precision
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import storage_cases as W  # noqa: E402


# the worker runs W.FAST for a folder without "slow" in its name, the rest for storage_slow
fast_results, slow_results = split_worlds(W.__file__, "storage", fast="fast_results",
                                          slow="slow_results")


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case (``make test``: :data:`W.FAST`)."""
    case = request.node.callspec.params.get("case")
    case = case if case is None or isinstance(case, tuple) else None
    text = request.node.callspec.params.get("text")
    return _world(request, case if case else (text, "megatron"))


def _world(request, case):
    """The folder of the world that ran ``case`` (a case of :data:`W.CASES`)."""
    return world_of(request, case not in W.FAST, fast="fast_results", slow_name="slow_results")


def _params(cases):
    """``cases`` as pytest params, those outside :data:`W.FAST` marked slow."""
    return [pytest.param(c, id=W.case_name(*c), marks=() if c in W.FAST else pytest.mark.slow)
            for c in cases]


def _load(results, text, recipe):
    lay = W.layout_of(text)
    n = lay.pp * lay.dp * lay.tp
    return [load_pt(results / f"{W.case_name(text, recipe)}_rank{r}.pt") for r in range(n)]


_REFS: dict = {}


def reference(recipe: str, micro: int, n_layers: int = 2, fp32_masters: bool = False) -> dict:
    """One process with the same storage (``Local(model, precision, offload)``, the same
    optimizer built the same way), the global batch in micro-batches of ``micro`` in order.
    ``fp32_masters``: Megatron's recipe with its masters started at the fp32 init (FSDP2's
    form on the torch engine, §7) instead of the bf16 model's values; their values recorded."""
    key = (recipe, micro, n_layers, fp32_masters)
    if key not in _REFS:
        precision, offload = W.precision_of(recipe)
        ref = Local(W.make_model(n_layers), precision, offload)
        opt = build_optimizer(ref, W.config())
        named = dict(ref.module.named_parameters())
        if fp32_masters:  # MasterAdamW keeps a master it is given (its state, as on resume)
            for n, init in W.init_params(n_layers).items():
                opt.state[named[n]]["master"] = init
        work = W.workload()
        sampler = work.sampler(W.GLOBAL_BATCH, 1, 0, 0)
        rec = {k: [] for k in ("loss", "grad_norm", "params", "grads", "masters")}
        for _ in range(W.STEPS):
            res = train_step(ref, work.batches(sampler.next_global_batch(), micro), opt,
                             zero_grad=False)
            rec["loss"].append(res.loss)
            rec["grad_norm"].append(res.grad_norm)
            rec["grads"].append({n: g.clone() for n, g in ref.dp_gradients().items()})
            rec["params"].append({n: p.detach().clone()
                                  for n, p in ref.module.named_parameters()})
            rec["masters"].append({n: opt.state[p]["master"].clone() for n, p in named.items()
                                   if "master" in opt.state[p]})
        _REFS[key] = rec
    return _REFS[key]


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{what}: {n}"


def _same_step(a: dict, b: dict, t: int) -> None:
    """Step ``t`` of two runs (an offloaded one and its twin): the same loss, every gradient
    and parameter bitwise."""
    assert a["loss"][t] == b["loss"][t], (t, a["loss"][t], b["loss"][t])
    _equal(a["grads"][t], b["grads"][t], f"step {t} gradients")
    _equal(a["params"][t], b["params"][t], f"step {t} parameters")


BITWISE = [c for c in W.CASES
           if c[0] in W.BITWISE or c[0] in W.TORCH and c[1] in ("guide", "fp32")]


@pytest.mark.parametrize("case", _params(BITWISE))
def test_dp2_bitwise_equal_to_one_process_with_the_same_storage(results, case):
    text, recipe = case
    ref = reference(recipe, W.GLOBAL_BATCH // 2)
    storage = torch.float32 if recipe.startswith("fp32") else torch.bfloat16
    for rank in _load(results, text, recipe):
        for t in range(W.STEPS):
            assert rank["loss"][t] == ref["loss"][t], (t, rank["loss"][t], ref["loss"][t])
            # §7: the reference's norm of bf16 gradients is torch's in bf16 (each tensor's
            # norm and the norm of norms rounded to bf16: ≤ 2 · 2⁻⁹ relative); else §2's rule
            rtol = 2 ** -8 if recipe.startswith("guide") else RTOL
            torch.testing.assert_close(torch.tensor(rank["grad_norm"][t]),
                                       torch.tensor(ref["grad_norm"][t]), rtol=rtol, atol=ATOL)
            _equal(rank["grads"][t], ref["grads"][t], f"step {t} gradients")
            _equal(rank["params"][t], ref["params"][t], f"step {t} parameters")
            assert all(p.dtype == storage for p in rank["params"][t].values())


TWINS = [(c[0], c[1]) for c in W.CASES if c[1].endswith("_off")]


@pytest.mark.parametrize("case", _params(TWINS))
def test_offload_bitwise_equal_to_no_offload_and_ledger_equals_formula(request, case):
    text, recipe = case
    twin = (text, recipe[:-len("_off")])  # maybe in the other world: each from its own
    on, off = (_load(_world(request, c), *c) for c in (case, twin))
    for a, b in zip(on, off):
        for t in range(W.STEPS):
            _same_step(a, b, t)
            assert a["ledger"][t] == a["formula"][t], (t, a["ledger"][t], a["formula"][t])
            for run in (a, b):  # every tag: the step's whole traffic against the formula
                led, formula = run["totals"][t]
                assert led == pytest.approx(formula, rel=1e-12), (t, led, formula)
            assert a["ledger"][t]["offload_d2h"] > 0 and a["ledger"][t]["offload_h2d"] > 0
            assert b["ledger"][t] == b["formula"][t] == {"offload_d2h": 0.0, "offload_h2d": 0.0}
        for n, st in a["state"].items():  # m and v the same; the host master is the parameter's
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], b["state"][n][k]), (n, k)
            assert st["master"].dtype == (torch.bfloat16 if recipe == "guide_off"
                                          else torch.float32)
            assert torch.equal(st["master"].to(a["params"][-1][n].dtype), a["params"][-1][n])


PARAMS_TWINS = [c for c in W.CASES if c[1] in W.PARAMS]


@pytest.mark.parametrize("case", _params(PARAMS_TWINS))
def test_params_offload_bitwise_equal_to_no_offload_and_ledger_equals_formula(request, case):
    """``--offload params`` (ZeRO-3's shards on the host; :mod:`shardwise.parallel.zero.
    offload`; also inside pp 2's stages, 1F1B and interleaved) against the same layout without
    offload: the same arithmetic, so losses, every
    gradient, parameter and optimizer state bitwise equal every step. The copies, each step:
    the ledger equals the formula, and, derived apart from it from the ring costs, each
    all_gather of a unit's [k] slices ((S−1)·k·b on the wire, S the shard group) follows one
    host → device copy of k·b, and each reduce_scatter ((S−1)·k·b_r) one copy down of k·b_r:
    h2d = param / (S−1), d2h = grad / (S−1). By the formula, the parameter and gradient shards
    leave the device for the host."""
    text, recipe = case
    twin = (text, recipe[:-len("_offp")])  # maybe in the other world: each from its own
    on, off = (_load(_world(request, c), *c) for c in (case, twin))
    lay = W.layout_of(text)
    s = lay.dp // lay.dp_replicate
    for a, b in zip(on, off):
        assert a["offloaded"] and all(a["offloaded"]) and not any(b["offloaded"])
        for t in range(W.STEPS):
            _same_step(a, b, t)
            assert a["ledger"][t] == a["formula"][t], (t, a["ledger"][t], a["formula"][t])
            assert a["ledger"][t]["offload_h2d"] == a["tags"][t]["param"] / (s - 1) > 0
            assert a["ledger"][t]["offload_d2h"] == a["tags"][t]["grad"] / (s - 1) > 0
            assert a["tags"][t] == b["tags"][t]  # the collectives unchanged
            for run in (a, b):
                led, formula = run["totals"][t]
                assert led == pytest.approx(formula, rel=1e-12), (t, led, formula)
        assert a["state"].keys() == b["state"].keys()
        for n, st in a["state"].items():
            _equal(st, b["state"][n], f"optimizer state of {n}")
        if a["memory"] is None:  # a pipeline stage: no closed form of its state
            continue
        # the start-up formula: model state all on the host, Ψ/S elements of each at the
        # recipe's bytes (parameter P, gradient G, master + m + v K), where without offload
        # it is all on the device
        dev, host, twin = a["memory"]["device"], a["memory"]["host"], b["memory"]["device"]
        psi = sum(p.numel() for p in dict.fromkeys(W.make_model().parameters())) / s
        prec = W.precision_of(recipe)[0]
        want = {"params": prec.param * psi, "grads": prec.grad * psi, "optimizer": prec.optim * psi}
        assert dev["total"] == 0.0 and twin["total"] == host["total"] == sum(want.values())
        assert {k: host[k] for k in want} == want and {k: twin[k] for k in want} == want



TORCH_BITWISE = [(lay, "megatron") for lay in W.TORCH]


@pytest.mark.parametrize("case", _params(TORCH_BITWISE))
def test_torch_megatron_dp2_bitwise_equal_to_one_process_from_the_fp32_init(results, case):
    """§7, Megatron's recipe in FSDP2's form (an fp32 model under ``MixedPrecisionPolicy(
    param_dtype=bf16, reduce_dtype=fp32)``) at dp 2, one micro-batch per rank: bitwise equal to
    one process with Megatron's recipe whose fp32 masters start at the fp32 init — the losses,
    the fp32 gradients (each micro-batch's bf16 gradient in fp32, two summed), the fp32
    parameters = the reference's masters and their bf16 rounding = its bf16 parameters."""
    text, recipe = case
    ref = reference(recipe, W.GLOBAL_BATCH // 2, fp32_masters=True)
    for rank in _load(results, text, recipe):
        for t in range(W.STEPS):
            assert rank["loss"][t] == ref["loss"][t], (t, rank["loss"][t], ref["loss"][t])
            torch.testing.assert_close(torch.tensor(rank["grad_norm"][t]),
                                       torch.tensor(ref["grad_norm"][t]), rtol=RTOL, atol=ATOL)
            _equal(rank["grads"][t], ref["grads"][t], f"step {t} gradients")
            _equal(rank["params"][t], ref["masters"][t], f"step {t} parameters = masters")
            _equal({n: p.to(torch.bfloat16) for n, p in rank["params"][t].items()},
                   ref["params"][t], f"step {t} bf16 parameters")
        for st in rank["state"].values():  # the fp32 parameter is the master: none beside it
            assert "master" not in st and st["exp_avg"].dtype == torch.float32


TORCH_PARAMS_TWINS = [c for c in W.CASES if c[1].endswith("_params")]


@pytest.mark.parametrize("case", _params(TORCH_PARAMS_TWINS))
def test_torch_offload_params_bitwise_equal_to_no_offload(results, case):
    """``--offload params`` on the torch engine (FSDP2's ``CPUOffloadPolicy``) on a CPU-only gloo
    world (host = device: the same arithmetic) against the same layout without it, every layout
    where FSDP2 is the sync: losses, gradients, parameters and AdamW state equal every step;
    the ledger = formula every step, with no offload copies booked (FSDP2's own ``.to()``
    copies: formula only, docs/precision-memory-mfu.md)."""
    text, recipe = case
    on, off = _load(results, text, recipe), _load(results, text, recipe[:-len("_params")])
    for a, b in zip(on, off):
        for t in range(W.STEPS):
            _same_step(a, b, t)
            for run in (a, b):
                assert run["ledger"][t] == run["formula"][t] == {"offload_d2h": 0.0,
                                                                 "offload_h2d": 0.0}
                led, formula = run["totals"][t]
                assert led == pytest.approx(formula, rel=1e-12), (t, led, formula)
        for n, st in a["state"].items():
            assert st.keys() == b["state"][n].keys() and "master" not in st
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], b["state"][n][k]), (n, k)


@pytest.mark.parametrize("case", _params([("dp=2,zero=3@torch", r) for r in (
    "megatron", "megatron_params", "fp32_params")]))
def test_torch_fsdp2_memory_and_copies_formulas_by_hand(results, case):
    """The model state FSDP2's form keeps per rank (:func:`~shardwise.parallel.storage.
    storage_memory_formula`): 4 + 4 + 8 B per element of its fp32 shard, Ψ/2 each at dp 2 — on
    the device, or with ``--offload params`` all on the host. And FSDP2's host ↔ device copies
    under ``CPUOffloadPolicy`` (formula only, not booked:
    :func:`~shardwise.parallel.storage.fsdp2_offload_bytes_formula`) against a count by hand
    from the tiny Llama's shapes at dp 2 ZeRO-3, one micro-batch: each parameter's dim 0 padded
    to even (FSDP2's chunks), each rank's half of it; the blocks gathered twice (forward, and
    again for backward), the root once, each copied to the device as fp32 shards (the masters,
    or fp32 storage); each reduced fp32 gradient shard copied back once."""
    shapes = {n: p.shape for n, p in W.make_model().named_parameters()}
    half = {n: -(-s[0] // 2) * 2 * math.prod(s[1:]) // 2 for n, s in shapes.items()}
    blocks = sum(v for n, v in half.items() if n.startswith("layers."))
    root = sum(half.values()) - blocks
    psi = sum(math.prod(s) for s in shapes.values())
    state = {"params": 4 * psi / 2, "grads": 4 * psi / 2, "optimizer": 8 * psi / 2,
             "total": 16 * psi / 2}
    zero = dict.fromkeys(state, 0.0)
    offloaded = case[1].endswith("_params")
    for rank in _load(results, *case):
        assert rank["memory"] == ({"device": zero, "host": state} if offloaded else
                                  {"device": state, "host": zero})
        assert rank["fsdp2_copies"] == ({"fsdp2_h2d": 4.0 * (root + 2 * blocks),
                                         "fsdp2_d2h": 4.0 * (root + blocks)} if offloaded else {})


def test_explicit_checkpoint_resumed_by_fsdp2_form_from_its_masters(fast_results):
    """A checkpoint of Megatron's recipe saved by the explicit engine (bf16 parameters, fp32
    masters in the state) resumed on the torch engine (dp 2 ZeRO-3): its fp32 parameters are
    the saved masters bit for bit (:func:`~shardwise.parallel.storage.load_masters_`), no
    ``master`` stays in its state, and its next step is the explicit engine's: the same loss,
    its parameters the explicit engine's masters (§7: both bitwise to one process)."""
    for r in range(2):
        rec = load_pt(fast_results / f"explicit_to_torch_rank{r}.pt")
        _equal(rec["loaded"], rec["saved_masters"], "loaded parameters = saved masters")
        assert all("master" not in keys for keys in rec["torch_state_keys"].values())
        loss_a, loss_t, masters, params = rec["next"]
        assert loss_a == loss_t
        _equal(params, masters, "next step: parameters = the explicit engine's masters")



@pytest.mark.parametrize("text", ["dp=4,dp_replicate=2,zero=3",
                                  pytest.param("dp=4,zero=3", marks=pytest.mark.slow),
                                  pytest.param("dp=4,dp_replicate=2,zero=3@torch",
                                               marks=pytest.mark.slow)])
def test_hsdp_and_dp4_first_step_within_the_fp32_rule(results, text):
    ref = reference("megatron", W.GLOBAL_BATCH // 4)
    for rank in _load(results, text, "megatron"):
        torch.testing.assert_close(torch.tensor(rank["loss"][0]), torch.tensor(ref["loss"][0]),
                                   rtol=RTOL, atol=ATOL)
        for n, g in ref["grads"][0].items():
            assert rank["grads"][0][n].dtype == torch.float32
            torch.testing.assert_close(rank["grads"][0][n], g, rtol=RTOL, atol=ATOL)


PIPELINES = [(lay, "megatron") for lay in ["pp=2,dp=2,zero=1,microbatches=2", *W.PP_ZERO,
                                          *[t for t in W.TORCH_OTHERS if "pp" in t]]]


@pytest.mark.parametrize("case", _params(PIPELINES))
def test_pipeline_first_step_within_the_fp32_rule_but_the_tied_embedding(results, case):
    """§7, pp > 1 (ZeRO-1/2/3 in the stages, 1F1B and interleaved): each stage's micro-batch
    gradients are the reference's bitwise and the fp32 main gradients sum the 4 micro-batches in
    another order (§2's rule at step 1) — all but the tied embedding, whose two copies are
    folded into fp32 apart (TiedSwap) where the reference adds its two uses in bf16."""
    text, recipe = case
    lay = W.layout_of(text)
    ref = reference(recipe, W.GLOBAL_BATCH // (lay.dp * lay.microbatches), W.n_layers_of(lay))
    for rank in _load(results, text, recipe):
        torch.testing.assert_close(torch.tensor(rank["loss"][0]), torch.tensor(ref["loss"][0]),
                                   rtol=RTOL, atol=ATOL)
        grads = {n: g for n, g in rank["grads"][0].items() if n != "tok_embeddings.weight"}
        assert grads and all(g.dtype == torch.float32 for g in grads.values())
        for n, g in grads.items():
            torch.testing.assert_close(g, ref["grads"][0][n], rtol=RTOL, atol=ATOL)


MEGATRON = [c for c in W.CASES if c[1] in ("megatron", "megatron_off", "megatron_offp",
                                               "megatron_params")]


@pytest.mark.parametrize("case", _params(MEGATRON))
def test_masters_saved_and_resumed_bitwise(results, case):
    torch_form = W.engine_of(case[0]) == "torch"  # FSDP2's: the fp32 parameter is the master
    for rank in _load(results, *case):
        last = rank["params"][-1]
        for n, st in rank["state"].items():  # the fp32 master, the bf16 parameter its rounding
            if torch_form:
                assert "master" not in st and last[n].dtype == torch.float32
                continue
            assert st["master"].dtype == torch.float32 and st["master"].shape == last[n].shape
            assert torch.equal(st["master"].to(torch.bfloat16), last[n])
        a, b, pa, pb = rank["resume"]
        assert a == b
        _equal(pa, pb, "resumed parameters")


def test_fp32_accumulation_over_micro_batches():
    """Megatron's recipe sums each micro-batch's bf16 gradient in fp32 (the main gradient):
    exactly fp32(g₀) + fp32(g₁) of the two micro-batches run alone; the guide's accumulates in
    bf16 (rounded after each addition), which differs."""
    work = W.workload()
    batch = work.batches(torch.arange(4), 2)

    def grads(recipe, mbs):
        precision, offload = W.precision_of(recipe)
        ref = Local(W.make_model(), precision, offload)
        train_step(ref, mbs, build_optimizer(ref, W.config()), zero_grad=False)
        return ref.dp_gradients()

    both = grads("megatron", batch)
    # the same step's gradient, micro-batch by micro-batch (the same global token count)
    denom = float(sum(count_items(mb) for mb in batch))
    parts = []
    for mb in batch:
        ref = Local(W.make_model(), *W.precision_of("megatron"))
        ref.forward_backward([mb], denom, "bf16")
        parts.append(ref.dp_gradients())
    for n in both:
        assert torch.equal(both[n], parts[0][n] + parts[1][n]), n
    guide = grads("guide", batch)
    assert any(not torch.equal(guide[n].float(), both[n]) for n in both)


def test_update_below_bf16_resolution_lost_without_a_master():
    """docs/precision-memory-mfu.md's worked case: w = 1 in bf16 (spacing 2⁻⁸ below 1), AdamW
    lr 1e-3, no decay: each step moves the weight by lr (m̂/√v̂ = 1 for a constant gradient).
    Without a master the step 1 − 1e-3 rounds back to 1 every time; with an fp32 master the
    master reaches 1 − 3e-3 after 3 steps and the bf16 weight 1 − 2⁻⁸."""
    def run(master: bool):
        w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        opt = (MasterAdamW([w], lr=1e-3, weight_decay=0.0) if master else
               torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0))
        for _ in range(3):
            w.grad = torch.ones(1, dtype=torch.bfloat16)
            opt.step()
        return w, opt

    w, _ = run(False)
    assert float(w) == 1.0
    w, opt = run(True)
    master = opt.state[w]["master"]
    assert abs(float(master) - (1 - 3e-3)) < 1e-6
    assert float(w) == 1 - 2 ** -8


def test_refusals_name_the_fix():
    bf16, guide = Precision.stored("bf16", "fp32"), Precision.stored("bf16", "none")
    for layout, precision, offload, engine, match in [
            (Layout(dp=2, zero=2), Precision(), "params", "explicit", "--zero 3"),
            (Layout(dp=2, tp=2, zero=3), bf16, "params", "explicit", "without tp only"),
            (Layout(dp=2, zero=1), bf16, "none", "torch", "--zero 2 or 3"),  # DDP + ZeRO-1's
            (Layout(dp=2), bf16, "params", "torch", "--zero 2 or 3"),  # DDP
            (Layout(dp=2, tp=2), bf16, "none", "torch", "--zero 2 or 3"),  # replicate
            (Layout(tp=2), Precision(), "params", "torch", "--zero 2 or 3"),  # no dp sync
            (Layout(dp=2, zero=1), guide, "none", "torch", "--zero 2 or 3"),
            (Layout(dp=4, dp_replicate=2, zero=3), guide, "none", "torch", "only over dp"),
            (Layout(dp=2, zero=3), Precision(), "optimizer", "torch", "use --offload params"),
            (Layout(dp=2, zero=3), Precision.stored("bf16", "fp32", reduce="bf16"), "none",
             "torch", "--reduce-dtype fp32"),
            (Layout(dp=2, zero=3, cp=2), bf16, "none", "torch", "ZeroRedundancyOptimizer, cp"),
            (Layout(dp=2), Precision(), "disk", "explicit", "choose none"),
            (Layout(dp=2, cp=2), bf16, "none", "explicit", "cp or ep")]:
        with pytest.raises(ShardwiseConfigError, match=match):
            check_storage(layout, precision, offload, engine)
    for layout in (Layout(dp=2, zero=3), Layout(pp=2, dp=2, zero=1), Layout(dp=2, tp=2),
                   Layout(pp=2, dp=2, zero=3), Layout(pp=2, dp=4, dp_replicate=2, zero=3)):
        check_storage(layout, bf16, "optimizer", "explicit")  # wired
    for layout in (Layout(dp=2, zero=3), Layout(dp=4, dp_replicate=2, zero=3),
                   Layout(pp=2, dp=2, zero=3)):
        check_storage(layout, bf16, "params", "explicit")  # wired
    check_storage(Layout(dp=2, zero=3), guide, "none", "torch")
    for layout in (Layout(dp=2, zero=2), Layout(dp=4, dp_replicate=2, zero=3),
                   Layout(dp=2, tp=2, zero=1), Layout(pp=2, dp=2, zero=3)):  # FSDP2 the sync
        for precision, offload in ((bf16, "none"), (bf16, "params"), (Precision(), "params")):
            check_storage(layout, precision, offload, "torch")


@pytest.mark.parametrize("offload", [False, True])
def test_the_host_step_one_parameter_at_a_time_is_torchs_adamw_bitwise(offload, monkeypatch):
    """On the host MasterAdamW steps one parameter at a time (one gradient copy and one √v
    temporary alive, not the group's): each AdamW call gets one tensor, and three steps on fp32
    parameters with a master copy (or none) equal torch.optim.AdamW(foreach=True) over the
    whole group, bitwise."""
    import shardwise.parallel.master as master
    from shardwise.parallel.master import MasterAdamW

    sizes, torch_adamw = [], master.adamw
    monkeypatch.setattr(master, "adamw", lambda params, *a, **k: (
        sizes.append(len(params)), torch_adamw(params, *a, **k)))

    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = MasterAdamW(ours, **kw, foreach=True, offload=offload)
    ref_opt = torch.optim.AdamW(ref, **kw, foreach=True)
    for _ in range(3):
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a.detach(), b.detach())
    assert sizes == [1] * (3 * len(shapes))
