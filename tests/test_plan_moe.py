"""``shardwise plan`` for mixtures of experts: total vs active parameters, expert parallelism's
memory, all-to-all bytes and gradient groups, the search over ep, and a published MoE run.

Hand-worked numbers use either a published model (Mixtral 8x7B, Jiang et al. 2024, Table 1) or
``_spec()``, a small shape whose per-token bytes can be added up on paper. The all-to-all bytes
are also checked against the engine's own formula (:func:`shardwise.parallel.ep.ep_bytes_formula`,
which its ledger equals at 1.0000) fed a uniform routing.
"""

import json

import pytest

from shardwise.errors import ShardwiseConfigError
from shardwise.plan import comm as plan_comm
from shardwise.plan import memory as plan_memory
from shardwise.plan.cost import estimate
from shardwise.plan.layout import PRECISIONS, Assumptions, PlanLayout
from shardwise.plan.hardware import get_cluster
from shardwise.plan.models import ModelSpec, from_llama_config, get_model

H100 = get_cluster("h100-sxm")
GiB = 2**30


def _spec(**kw):
    """L 2, d 64, h 4 (hd 16), 2 kv heads (kvd 32), f = f_e = 128, V 256, s 64, E 4 experts,
    top 2; fused kernels, flash attention."""
    args = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                seq_len=64, n_experts=4, top_k=2)
    args.update(kw)
    return ModelSpec("moe-hand", **args)


def _wire(e, tag, axis=None):
    return sum(c.wire for c in e.comm if c.tag == tag and (axis is None or c.axis == axis))


# --------------------------------------------------------------------------------------------
# parameters: total (memory) vs active (FLOPs)


def test_mixtral_8x7b_total_and_active_parameters_by_hand():
    """Jiang et al. 2024, Table 1: L 32, d 4096, 32 heads of 128, 8 kv heads, f 14336, V 32,000,
    8 experts, top 2, untied. Per layer: attention 2d² + 2d·kvd, router d·E, E experts of
    3·d·f, two RMSNorm weights; plus 2·V·d and the final norm. Mistral AI publishes 46.7 B
    total and 12.9 B active: equal to ours at the one decimal they print (±0.05 B)."""
    m = get_model("mixtral-8x7b")
    L, d, kvd, f, E, k, V = 32, 4096, 8 * 128, 14336, 8, 2, 32000
    attn, expert, router = 2 * d * d + 2 * d * kvd, 3 * d * f, d * E
    total = L * (attn + E * expert + router + 2 * d) + 2 * V * d + d
    active = L * (attn + k * expert + router + 2 * d) + 2 * V * d + d
    assert (total, active) == (46_702_792_704, 12_879_925_248)
    assert m.num_params() == total and m.num_active_params() == active
    assert m.num_expert_params() == L * E * expert
    assert abs(total / 1e9 - 46.7) <= 0.05 and abs(active / 1e9 - 12.9) <= 0.05
    # N of 6N: the active matmul weights (the output projection, not the embedding lookup)
    assert m.matmul_params() == L * (attn + k * expert + router) + V * d


@pytest.mark.parametrize("name,total,active,digit", [
    ("mixtral-8x22b", 141, 39, 1.0),  # Mistral AI: "141B parameters, 39B active"
    ("dbrx", 132, 36, 1.0),  # Databricks: 132B total, 36B active
    ("llama4-scout", None, 17, 1.0),  # Meta: 17B active (109B total counts the vision encoder)
    ("llama4-maverick", 400, 17, 10.0),  # Meta: 400B total, 17B active; "400" has 2 digits
])
def test_other_presets_match_their_published_counts(name, total, active, digit):
    """Each published count agrees with ours to half a unit of its last printed digit."""
    m = get_model(name)
    if total is not None:
        assert abs(m.num_params() / 1e9 - total) <= digit / 2, m.num_params()
    assert abs(m.num_active_params() / 1e9 - active) <= 0.5, m.num_active_params()


@pytest.mark.parametrize("overrides", [{}, {"n_shared_experts": 1, "moe_every": 2}])
@pytest.mark.parametrize("name", ["moe-tiny", "moe-small"])
def test_moe_spec_counts_the_built_model(name, overrides):
    """Our own MoE Llama (shardwise.models.MoELlama): the spec's total equals the parameters
    the model allocates, its tensors the ones the optimizer steps, and its active count the
    config's num_active_params."""
    from shardwise.models import build_model

    model = build_model(name, **overrides)
    spec = from_llama_config(model.config, seq_len=32, name=name)
    assert spec.is_moe and spec.n_moe_layers == model.config.n_moe_layers
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    assert spec.num_tensors() == len(list(model.parameters()))
    assert spec.num_active_params() == model.config.num_active_params()


def test_model_flops_are_megatrons_count_of_an_moe_model():
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, MCore
    v0.8, the count behind the validation run's TFLOPS), per token:
    12·L·d²·((1 + g/h + s/d) + (f/d)·k·3/2 + V/(2·L·d)) — the top-k experts, not all E, and
    the full s × s attention. Ours adds the router, 6·d·E per MoE layer."""
    m = get_model("mixtral-8x7b")
    L, d, s, f, k, V, h, g = 32, 4096, 4096, 14336, 2, 32000, 32, 8
    megatron = 12 * L * d * d * ((1 + g / h + s / d) + f / d * k * 3 / 2 + V / (2 * L * d))
    e = estimate(m, H100, PlanLayout(dp=16, pp=4, ep=8, zero=1, schedule="interleaved-1f1b",
                                     virtual_stages=8), 256)
    assert e.flops["model_per_token"] == pytest.approx(megatron + 6 * L * d * 8, rel=1e-12)
    assert e.flops["model_per_token"] == 6 * m.matmul_params() + 12 * L * d * s


# --------------------------------------------------------------------------------------------
# expert parallelism: memory, bytes, groups, links


@pytest.mark.parametrize("zero", [0, 1, 3])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_state_divides_by_ep_and_zero_shards_it_over_edp(ep, zero):
    """Mixtral 8x7B on dp 8, one micro-batch, bf16 (P 2, G 4, K 12 bytes per parameter). With
    X the experts' parameters and D the rest: a rank holds D + X/ep; ZeRO shards D over dp = 8
    and its X/ep over the dp/ep ranks that hold the same experts — so with ZeRO-1 the optimizer
    state is (D + X)·12/8 whatever ep is, and with ZeRO-3 everything is (D + X)·18/8."""
    m = get_model("mixtral-8x7b")
    X = m.num_expert_params()
    D = m.num_params() - X
    st = estimate(m, H100, PlanLayout(dp=8, ep=ep, zero=zero), 8).memory["first"]
    steps = 4 * m.num_tensors()
    held = D + X / ep
    want = {0: (2 * held, 4 * held, 12 * held + steps),
            1: (2 * held, 4 * held, 12 * (D + X) / 8 + steps),
            3: (2 * (D + X) / 8, 4 * (D + X) / 8, 12 * (D + X) / 8 + steps)}[zero]
    got = (st["params"], st["grads"], st["optimizer"])
    assert got == pytest.approx(want, rel=1e-12)
    assert st["expert_params_count"] == pytest.approx(X / ep, rel=1e-12)


def test_moe_layer_activations_by_hand():
    """_spec(), a = 2, per token of one MoE layer: the norms 2·2·a·d = 512 B; Q, the attention
    output 2·a·d and K, V 2·a·kvd, with the flash lse 4·h: 400 B; the router's fp32
    probabilities 4·E = 16; the k = 2 dispatched copies a·k·d = 256; the experts' SwiGLU
    a·k·3·f_e = 1,536 and their outputs a·k·d = 256 → 2,976 B. TP 2 + SP: all ÷ 2 but the
    copies (gathered over tp) → 1,616; TP 2 without SP: the MoE feed-forward is whole on every
    tp rank, only attention ÷ 2 → 2,776."""
    m = _spec()
    assert plan_memory.layer_activation_bytes(m, 1, moe=True) == 2976
    assert plan_memory.layer_activation_bytes(m, 1, tp=2, sp=True, moe=True) == 1616
    assert plan_memory.layer_activation_bytes(m, 1, tp=2, sp=False, moe=True) == 2776
    assert plan_memory.layer_activation_bytes(m, 10, moe=True) == 10 * 2976
    assert plan_memory.layer_activation_bytes(m, 10, ckpt="full", moe=True) == 10 * 2 * 64


def test_all_to_all_bytes_by_hand():
    """_spec(), bf16, dp 4 = ep 4, b 2, 16 sequences: m = 2 micro-batches of T = 2·64 = 128
    tokens per rank. One all-to-all of the T·k = 256 copies (rows of d·a = 128 B) sends
    (ep−1)/ep of them: 3/4 · 256 · 128 = 24,576 B. Per MoE layer and micro-batch, the dispatch
    forward + backward and the combine forward + backward: 2 × 24,576 under each tag; the
    routing counts (3/4)·E·8 = 24 B forward. L_m = 2 layers, m = 2."""
    m = _spec()
    e = estimate(m, H100, PlanLayout(dp=4, ep=4, micro_batch=2, precision="bf16"), 16)
    assert e.microbatches == 2
    one = 3 / 4 * 128 * 2 * 64 * 2
    assert one == 24576
    assert _wire(e, "ep_dispatch") == _wire(e, "ep_combine") == 2 * 2 * 2 * one
    assert _wire(e, "ep_counts") == 2 * 2 * 24
    assert plan_comm.ep_layer_bytes(m, e.layout) == {"ep_dispatch": 2 * one, "ep_combine": 2 * one,
                                                     "ep_counts": 24}
    # full recomputation runs the forward's dispatch, combine and counts once more
    full = estimate(m, H100, PlanLayout(dp=4, ep=4, micro_batch=2, ckpt="full"), 16)
    assert _wire(full, "ep_dispatch") == 2 * 2 * 3 * one
    assert _wire(full, "ep_counts") == 2 * 2 * 2 * 24
    # ep 2: (ep−1)/ep = 1/2; with TP 2 + SP each tp rank dispatches its T/2 tokens; without SP
    # every tp rank routes all T (the engine's whole MoE feed-forward per tp rank)
    half = estimate(m, H100, PlanLayout(dp=4, ep=2, micro_batch=2), 16)
    assert _wire(half, "ep_dispatch") == 2 * 2 * 2 * (1 / 2 * 256 * 128)
    sp = estimate(m, H100, PlanLayout(dp=4, ep=4, tp=2, sp=True, micro_batch=2), 16)
    nosp = estimate(m, H100, PlanLayout(dp=4, ep=4, tp=2, micro_batch=2), 16)
    assert _wire(sp, "ep_dispatch") == _wire(e, "ep_dispatch") / 2
    assert _wire(nosp, "ep_dispatch") == _wire(e, "ep_dispatch")
    assert _wire(estimate(m, H100, PlanLayout(dp=4, micro_batch=2), 16), "ep_dispatch") == 0


def test_all_to_all_bytes_equal_the_engines_formula_under_uniform_routing():
    """The engine's formula (shardwise.parallel.ep.ep_bytes_formula: from the rows each rank
    sent and received, the ledger's number) fed the routing the planner assumes — every expert
    receives T·k/E of each rank's copies — gives the planner's bytes: moe-tiny (E 4, k 2,
    d 32), fp32 rows, ep 4, micro-batches of b = 3 sequences of 16 tokens, m = 2."""
    from torch import nn

    from shardwise.models import build_model, moe_layers
    from shardwise.parallel.ep import ep_bytes_formula

    model = build_model("moe-tiny")
    cfg = model.config
    ep, b, s, m = 4, 3, 16, 2
    copies = b * s * cfg.top_k  # T·k rows a rank routes per micro-batch

    class Topo:  # the two answers ep_bytes_formula reads
        def size(self, axis):
            return {"ep": ep}[axis]

        def index(self, axis):
            return {"ep": 1}[axis]

    class Recorded(nn.Module):  # a dispatcher that saw m uniform micro-batches
        records = [{"counts": [copies // cfg.n_experts] * cfg.n_experts,
                    "received": [copies // ep] * ep, "row_bytes": cfg.d_model * 4,
                    "combine_row_bytes": cfg.d_model * 4}] * m

    for layer in moe_layers(model):
        layer.dispatcher = Recorded()
    engine = ep_bytes_formula(model, Topo())
    spec = from_llama_config(cfg, seq_len=s)
    lay = PlanLayout(dp=ep, ep=ep, micro_batch=b, precision="fp32")
    per_layer = plan_comm.ep_layer_bytes(spec, lay)
    assert {k: spec.n_moe_layers * m * v for k, v in per_layer.items()} == \
        pytest.approx(engine, rel=1e-12)
    est = estimate(spec, H100, lay, ep * b * m)
    assert {k: _wire(est, k) for k in engine} == pytest.approx(engine, rel=1e-12)


def test_expert_gradients_reduce_over_edp_dense_over_dp():
    """The validation layout (Mixtral 8x7B, dp 16, ep 8, pp 4, ZeRO-1): a first-stage rank holds
    8 layers' attention and routers + the embedding (dense) and one expert per layer
    (8 · 3·d·f). Dense gradients reduce-scatter over the 16 dp ranks, (15/16)·4 B each; expert
    gradients over the 16/8 = 2 ranks holding the same experts, (1/2)·4 B each, on the link
    edp spans (stride ep = 8: one rank per node, one NIC)."""
    m = get_model("mixtral-8x7b")
    lay = PlanLayout(dp=16, pp=4, ep=8, zero=1, schedule="interleaved-1f1b", virtual_stages=8)
    e = estimate(m, H100, lay, 256)
    crit = e.details["critical_stage"]
    expert = e.details["expert_params_crit"]
    assert expert == e.stages[crit] * 3 * 4096 * 14336
    dense = e.details["params_crit"] - expert
    assert _wire(e, "grad", "dp") == pytest.approx(15 / 16 * 4 * dense, rel=1e-12)
    assert _wire(e, "grad", "edp") == pytest.approx(1 / 2 * 4 * expert, rel=1e-12)
    assert _wire(e, "param", "edp") == pytest.approx(1 / 2 * 2 * expert, rel=1e-12)
    edp = next(c for c in e.comm if c.axis == "edp")
    assert (edp.n, edp.link) == (2, "inter-node (1/node)")
    assert all(c.link == "intra-node" for c in e.comm if c.axis == "ep")
    # zero 0: one all-reduce each, and the experts' squares summed over ep for the norm
    z0 = estimate(m, H100, PlanLayout(dp=16, pp=4, ep=8, schedule="interleaved-1f1b",
                                      virtual_stages=8), 256)
    assert _wire(z0, "grad", "edp") == pytest.approx(2 * 1 / 2 * 4 * expert, rel=1e-12)
    assert _wire(z0, "grad_norm", "ep") == pytest.approx(2 * 7 / 8 * 8)


def test_ep_and_edp_links_follow_the_data_line():
    """EP takes consecutive ranks of the dp × cp line (stride tp), edp the rest (stride tp·ep),
    on 8-GPU nodes: tp 1 × ep 8 is one node; tp 2 × ep 8 spans two nodes with 4 ep ranks on
    each: min(450, 4·50) GB/s; tp 1, ep 4: edp ranks 4 apart, 2 per node: 100 GB/s."""
    c = H100
    assert plan_comm.axis_link(c, PlanLayout(dp=16, ep=8), "ep") == (450e9, 1e-6, "intra-node")
    assert plan_comm.axis_link(c, PlanLayout(dp=16, tp=2, ep=8), "ep")[:2] == (200e9, 5e-6)
    assert plan_comm.axis_link(c, PlanLayout(dp=16, ep=8), "edp")[:2] == (50e9, 5e-6)
    assert plan_comm.axis_link(c, PlanLayout(dp=16, ep=4), "edp")[:2] == (100e9, 5e-6)
    assert plan_comm.axis_link(c, PlanLayout(dp=4, cp=2, ep=8), "ep")[2] == "intra-node"


def test_expert_parallelism_is_what_lets_the_published_mixtral_layout_fit():
    """At Megatron-Core's mapping (tp 1, pp 4, dp 16), without ep every rank holds all 8
    experts of its 8 layers: 11.3 B parameters, which do not fit an 80 GB H100 under any
    recomputation; ep 8 leaves one expert per layer and fits without recomputation. The
    compute per token is the same (uniform routing) when the weight-gradient accumulation is
    fused into the GEMM as in Megatron-LM (unfused, adding each micro-batch's gradients costs
    HBM traffic in proportion to the parameters a rank holds, which ep divides); the
    all-to-alls cost ep its few %."""
    m = get_model("mixtral-8x7b")
    kw = dict(dp=16, pp=4, zero=1, schedule="interleaved-1f1b", virtual_stages=8)
    for ck in ("none", "selective", "full"):
        assert not estimate(m, H100, PlanLayout(ckpt=ck, **kw), 256).fits, ck
    fused = Assumptions(grad_accum_fused=True)
    one, eight = (estimate(m, H100, PlanLayout(ep=ep, **kw), 256, fused) for ep in (1, 8))
    assert eight.fits
    assert eight.times["compute"] == pytest.approx(one.times["compute"], rel=1e-12)
    unfused = [estimate(m, H100, PlanLayout(ep=ep, **kw), 256).times["compute"]
               for ep in (1, 8)]
    assert unfused[1] < unfused[0]
    assert 0 < eight.times["ep_exposed"] < 0.05 * eight.step_time_s


# --------------------------------------------------------------------------------------------
# search, validation, CLI, bad input


def test_search_enumerates_ep_for_moe_models_only():
    from shardwise.plan.search import Fixed, search

    fixed = Fixed(tp=1, pp=4, zero=1, schedule="interleaved-1f1b", virtual_stages=8,
                  micro_batch=1, ckpt="none")
    results = search(get_model("mixtral-8x7b"), H100, 64, 256, fixed)
    assert {e.layout.ep for e in results} == {1, 2, 4, 8}
    assert all((e.layout.dp * e.layout.cp) % e.layout.ep == 0 for e in results)
    best = results[0]
    assert best.fits and best.layout.ep > 1, best.layout.name()
    dense = search(get_model("llama3-8b"), H100, 8, 64, Fixed(tp=1, pp=1, zero=1))
    assert {e.layout.ep for e in dense} == {1}


def test_mixtral_8x7b_published_run():
    """Megatron-Core MoE README (MCore v0.9): Mixtral 8x7B, 64 H100, TP 1 EP 8 PP 4 VP 8, MBS 1,
    GBS 256, seq 4096, BF16, dropless: 468 TFLOPS = 47.3 % MFU (v0.8: 438, 44.3 %).

    The prediction is 54.2 %, +6.9 points: outside the ±5 points docs/planner.md claims for the
    dense runs, a reported miss (§9 explains it). What this test holds, and why: the
    uniform-routing estimate must not fall below the measured run (every MoE effect the model
    leaves out — the busiest expert rank setting the pace of each all-to-all, MCore v0.9's
    unfused permutation and router kernels, the dispatcher's host sync for dropless splits —
    makes a real step slower, never faster), and the miss stays under 10 points, the reading
    the docs report; a change to the cost model that moves it further must update §9."""
    from shardwise.plan.published import RUNS, predict

    run = next(r for r in RUNS if r.key == "mixtral-8x7b-64")
    e = predict(run)
    assert e.layout.name().startswith("dp=16,pp=4,ep=8,zero=1,interleaved-1f1b,v=8,b=1")
    assert e.fits and e.layout.world == 64 and e.microbatches == 16
    assert run.mfu == pytest.approx(468 / 989) and run.independent
    diff = 100 * (e.mfu - run.mfu)
    assert 0 < diff <= 10, diff
    assert run.tflops == 468 and e.cluster.gpu.bf16_flops == 989e12


def _plan(*argv):
    import argparse

    from shardwise.tools.plan import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *map(str, argv)])
    return args.func(args, list(argv))


def test_cli_plans_mixtral_with_ep_in_the_layout(capsys):
    argv = ("--model", "mixtral-8x7b", "--gpus", 64, "--global-batch-tokens", "1M", "--tp", 1,
            "--pp", 4, "--zero", 1, "--micro-batch", 1)
    assert _plan(*argv, "--json", "--top", 0) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    assert {x["ep"] for x in layouts} == {1, 2, 4, 8}
    assert layouts[0]["fits"] and layouts[0]["ep"] > 1
    assert _plan(*argv, "--top", 3, "--explain") == 0
    text = capsys.readouterr().out
    head = next(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "12.88 B active" in text and " ep " in head
    assert "ep_dispatch" in text and "EP over" in text and "edp" in text


def test_bad_moe_input_names_the_constraint(capsys):
    c = H100
    with pytest.raises(ShardwiseConfigError, match="needs a mixture-of-experts model"):
        estimate(get_model("llama3-8b"), c, PlanLayout(dp=2, ep=2), 2)
    with pytest.raises(ShardwiseConfigError, match="must divide n_experts = 8"):
        estimate(get_model("mixtral-8x7b"), c, PlanLayout(dp=6, ep=3), 6)
    with pytest.raises(ShardwiseConfigError, match="must divide dp × cp"):
        estimate(get_model("mixtral-8x7b"), c, PlanLayout(dp=2, ep=4), 2)
    with pytest.raises(ShardwiseConfigError, match="top_k = 9 must be between 1 and n_experts"):
        _spec(top_k=9)
    with pytest.raises(ShardwiseConfigError, match="n_experts = 0"):
        _spec(n_experts=0)
    with pytest.raises(ShardwiseConfigError, match="biases"):
        _spec(bias=True)
    from shardwise.tools.estimate import to_llama_config

    with pytest.raises(ShardwiseConfigError, match="estimator runs dense Llama models only"):
        to_llama_config(get_model("mixtral-8x7b"))
    from shardwise.tools.plan import main

    assert main(["--gpus", "8", "--model", "llama3-8b", "--ep", "2"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


def test_moe_model_from_toml(tmp_path):
    f = tmp_path / "moe.toml"
    f.write_text("n_layers = 2\nd_model = 64\nn_heads = 4\nn_kv_heads = 2\nd_ff = 128\n"
                 "vocab_size = 256\nseq_len = 64\nn_experts = 4\ntop_k = 2\n")
    from shardwise.plan.models import get_model as load

    assert load(str(f)).num_params() == _spec().num_params()


def test_precision_bytes_of_the_dispatched_rows():
    """The dispatched rows travel at the activation dtype: bf16 rows are half fp32's."""
    m = _spec()
    lay = dict(dp=4, ep=4, micro_batch=2)
    b16 = plan_comm.ep_layer_bytes(m, PlanLayout(precision="bf16", **lay))["ep_dispatch"]
    f32 = plan_comm.ep_layer_bytes(m, PlanLayout(precision="fp32", **lay))["ep_dispatch"]
    assert PRECISIONS["fp32"].act == 2 * PRECISIONS["bf16"].act and f32 == 2 * b16
