"""Hugging Face interop for the mixture of experts: our MoELlama (every block a MoE, no shared
experts, renormalised top-k, dropless) exports to a MixtralForCausalLM folder that transformers
loads with equal logits, a transformers-made Mixtral loads into ours with equal logits, the round
trip returns every parameter bit for bit, and what Mixtral cannot represent is refused.

Every HF model here is built by transformers itself or loaded by it from a folder we wrote (no
downloads), fp32 throughout. **Logit tolerance**: the two forwards compute the same function with
the same fp32 operations in other orders (transformers' SDPA/eager attention against ours, its
expert loop and ``index_add_`` against our sorted dispatch), so they differ by summation-order
round-off only, which the project's parity rule bounds (|Δ| ≤ ATOL + RTOL·|ref|,
:mod:`shardwise.parity` derives it for models of this size). That holds only while both sides
route every token alike (a near-tie of two router probabilities could flip under round-off), so
each comparison first checks that every token chose the same experts in every layer on both
sides (transformers' ``router_logits`` against ours).
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.data import ByteTokenizer  # noqa: E402
from shardwise.errors import ShardwiseConfigError  # noqa: E402
from shardwise.interop.hf import (  # noqa: E402
    check_weight_files,
    export_hf,
    hf_model_kind,
    hf_model_overrides,
    hf_to_llama_config,
    load_hf_weights,
    read_hf_config,
    to_hf_state_dict,
    write_tokenizer_files,
)
from shardwise.models import Llama, LlamaConfig, MoEConfig, MoELlama  # noqa: E402
from shardwise.models.moe import moe_layers  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

V = 257  # the byte tokenizer's vocabulary
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cfg(**kw) -> MoEConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                d_expert=24, max_seq_len=64, n_experts=4, top_k=2, rope_theta=50000.0,
                norm_eps=1e-6, tie_embeddings=False, aux_loss_coef=0.02, z_loss_coef=0.003)
    return MoEConfig(**{**base, **kw})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 0.1 (logits of order one), norms off one, routers of order 0.5 (wide
    gaps between the router's probabilities): a transposed or misplaced tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                std = 0.5 if n.endswith(("router.weight", "gate.weight")) else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _ours(cfg: MoEConfig, seed: int = 0) -> MoELlama:
    model = MoELlama(cfg).eval()
    _randomize(model, seed)
    return model


def _our_routes(model: MoELlama, x: torch.Tensor) -> list[torch.Tensor]:
    """The experts each token chose in each MoE layer of our forward of ``x``: [b·s, k] each,
    sorted (a set per token)."""
    routes, hooks = [], []
    for m in moe_layers(model):
        def hook(mod, inp, out, k=m.top_k):
            routes.append(out.float().softmax(-1).topk(k, -1).indices.flatten(0, 1).sort(-1)[0])
        hooks.append(m.router.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return routes


def _assert_same_logits(ours, hf, x):
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        got = ours(x)
    # the same routing on both sides (else the comparison below would not be of round-off)
    k = hf.config.num_experts_per_tok
    theirs = [r.topk(k, -1).indices.sort(-1)[0] for r in out.router_logits]
    assert all(torch.equal(a, b) for a, b in zip(_our_routes(ours, x), theirs, strict=True))
    assert out.logits.abs().max() > 0.3  # logits of order one: the tolerance is relative
    torch.testing.assert_close(got, out.logits, atol=ATOL, rtol=RTOL)


def _checkpoint(tmp_path, model: MoELlama):
    """A checkpoint written the way train/checkpoint.py writes it: DCP files of the model's
    parameters under "model", meta.json with the run config and the model config."""
    import torch.distributed.checkpoint as dcp

    from shardwise.config import TrainConfig

    step = tmp_path / "run" / "checkpoints" / "step_2"
    dcp.save({"model": {k: v.detach() for k, v in model.named_parameters()}},
             checkpoint_id=str(step), no_dist=True)
    run = dataclasses.replace(TrainConfig(), model="moe-tiny", tokenizer="bytes",
                              tie_embeddings=model.config.tie_embeddings)
    (step / "meta.json").write_text(json.dumps({
        "step": 2, "config": dataclasses.asdict(run),
        "model_config": dataclasses.asdict(model.config)}))
    (step.parent / "latest").write_text("step_2\n")
    return tmp_path / "run"


_X = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(3))


# --------------------------------------------------------------------------------- export

@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie,k", [(False, 2), (True, 1)], ids=["untied-top2", "tied-top1"])
def test_our_moe_exports_to_a_mixtral_folder_with_equal_logits_and_round_trips(tmp_path, tie, k):
    cfg = _cfg(tie_embeddings=tie, top_k=k)
    ours = _ours(cfg)
    out = export_hf(_checkpoint(tmp_path, ours), tmp_path / "hf")
    hc = json.loads((out / "config.json").read_text())
    assert hc["architectures"] == ["MixtralForCausalLM"] and hc["model_type"] == "mixtral"
    assert (hc["num_local_experts"], hc["num_experts_per_tok"], hc["intermediate_size"]) == \
        (4, k, 24)
    assert hc["sliding_window"] is None and hc["output_router_logits"] is False
    assert (hc["router_aux_loss_coef"], hc["router_z_loss_coef"]) == (0.02, 0.003)

    hf = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings is tie
    # transformers 5 holds the experts stacked: gate_up_proj = cat(w1, w3) on dim 1
    for i, layer in enumerate(hf.model.layers):
        ff = ours.layers[i].feed_forward
        assert torch.equal(layer.mlp.gate.weight, ff.router.weight)
        assert torch.equal(layer.mlp.experts.gate_up_proj,
                           torch.cat([ff.experts.w1, ff.experts.w3], 1))
        assert torch.equal(layer.mlp.experts.down_proj, ff.experts.w2)
    _assert_same_logits(ours, hf, _X)

    # back: the folder's config is ours (d_ff, unused when every block is a MoE, is d_expert)
    back_cfg = hf_to_llama_config(read_hf_config(out))
    assert back_cfg == dataclasses.replace(cfg, d_ff=cfg.d_expert)
    again = MoELlama(back_cfg)
    load_hf_weights(again, out)
    for n, p in ours.state_dict().items():
        assert torch.equal(again.state_dict()[n], p), n


@pytest.mark.parametrize("kw,why", [
    (dict(n_shared_experts=1), "n_shared_experts=1 (Mixtral has no shared experts)"),
    (dict(moe_every=2), "moe_every=2 (every Mixtral block is a MoE"),
    (dict(capacity_factor=1.25), "capacity_factor=1.25 (Mixtral is dropless"),
    (dict(norm_topk=False), "norm_topk=False (Mixtral divides its top-k weights"),
])
def test_what_mixtral_cannot_represent_is_refused_before_anything_is_written(tmp_path, kw, why):
    run = _checkpoint(tmp_path, _ours(_cfg(**kw)))
    with pytest.raises(ShardwiseConfigError, match="a MixtralForCausalLM cannot represent") as e:
        export_hf(run, tmp_path / "hf")
    assert why in str(e.value)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


# --------------------------------------------------------------------------------- import

def _hf_mixtral(tmp_path, tie=False):
    """A random tiny MixtralForCausalLM saved by transformers into ``tmp_path/hf``."""
    torch.manual_seed(1)
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        bos_token_id=256, eos_token_id=256)
    model = transformers.MixtralForCausalLM(cfg).eval()
    _randomize(model, 7)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    write_tokenizer_files(ByteTokenizer(), folder, 64)
    return model, folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_transformers_mixtral_loads_into_ours_with_equal_logits(tmp_path, tie):
    hf, folder = _hf_mixtral(tmp_path, tie)
    assert hf_model_kind(folder) == "moe"
    over = hf_model_overrides(folder)
    assert {k: over[k] for k in ("n_experts", "top_k", "d_expert", "moe_every",
                                 "n_shared_experts", "capacity_factor", "norm_topk")} == \
        dict(n_experts=4, top_k=2, d_expert=24, moe_every=1, n_shared_experts=0,
             capacity_factor=None, norm_topk=True)
    assert over["rope_theta"] == 1000.0 and over["norm_eps"] == 1e-6
    cfg = MoEConfig(**over)
    check_weight_files(folder, hf_to_llama_config(read_hf_config(folder)))
    ours = MoELlama(cfg).eval()
    load_hf_weights(ours, folder)
    _assert_same_logits(ours, hf, _X)

    # ours → HF names gives exactly the tensors save_pretrained wrote (the per-expert layout)
    from safetensors.torch import load_file, save_file

    written = load_file(str(folder / "model.safetensors"))
    back = to_hf_state_dict(dict(ours.named_parameters()), tie_embeddings=tie)
    assert set(back) == set(written) - ({"lm_head.weight"} if tie else set())
    assert all(torch.equal(back[n], written[n]) for n in back)

    # transformers 5's in-memory names (stacked gate_up_proj/down_proj, mlp.gate) load too
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (tie and k == "lm_head.weight")}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    check_weight_files(stacked, cfg)
    other = MoELlama(cfg)
    load_hf_weights(other, stacked)
    for n, p in ours.state_dict().items():
        assert torch.equal(other.state_dict()[n], p), n


def test_a_bad_mixtral_folder_is_refused_with_the_reason(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _hf_mixtral(tmp_path)
    hc = read_hf_config(folder)
    cfg = hf_to_llama_config(hc)

    # a window shorter than the context is kept: runs with --seq-len ≤ 16 are exact, longer ones
    # are refused by config.validate (tests/test_hf_llama3.py, for Mistral's)
    assert hf_to_llama_config({**hc, "sliding_window": 16}).sliding_window == 16
    assert isinstance(hf_to_llama_config({**hc, "sliding_window": 64}), MoEConfig)
    with pytest.raises(ShardwiseConfigError, match="top_k=5 must be between 1 and n_experts=4"):
        hf_to_llama_config({**hc, "num_experts_per_tok": 5})

    # config.json and the weights disagree on the number of experts
    (folder / "config.json").write_text(json.dumps({**hc, "num_local_experts": 8}))
    with pytest.raises(ShardwiseConfigError, match="the weights do not fit its config.json"):
        check_weight_files(folder, hf_to_llama_config(read_hf_config(folder)))
    (folder / "config.json").write_text(json.dumps(hc))

    # an expert's tensors missing from the file
    sd = load_file(str(folder / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if ".experts.1." not in k}
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ShardwiseConfigError, match=r"experts \[1\] are missing"):
        check_weight_files(folder, cfg)

    # a Mixtral folder into a dense model
    with pytest.raises(ShardwiseConfigError, match="is a MixtralForCausalLM but the model built "
                       "is a dense Llama"):
        load_hf_weights(Llama(LlamaConfig(**{k: getattr(cfg, k) for k in (
            "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
            "max_seq_len")})), folder)
