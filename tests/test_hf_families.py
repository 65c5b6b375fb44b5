"""Hugging Face interop for the model families beyond Llama: GPT-2, Qwen2, Qwen3, Mistral.

Every HF model is built by transformers from a tiny config (random weights, biases and norms
randomised so that a misplaced, transposed or mis-split tensor shows) and saved into tmp: no
downloads. For each family:

* HF → ours: transformers' folder loads into our decoder and the logits agree;
* ours → HF: our export (``shardwise export --to hf`` on a checkpoint written as training writes
  it) loads in ``AutoModelForCausalLM`` with equal logits, and the tokenizer comes along;
* HF → ours → HF returns every tensor bit for bit (renames, transposes, splits and concatenation
  do no arithmetic).

**Logit tolerance** (fp32): both sides compute the same function with the same fp32 operations
in other orders (SDPA against transformers' attention, LayerNorm/RMSNorm in fp32 on both), so
they differ by summation-order round-off only, which the project's parity rule bounds
(|Δ| ≤ ATOL + RTOL·|ref|, :mod:`shardwise.parity`; ATOL = 1e-5 is the issue's bound too); the
measured maxima are ~1e-6 on logits of order one.
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
    hf_model_overrides,
    hf_to_llama_config,
    hf_to_ours,
    load_hf_weights,
    ours_to_hf,
    read_hf_config,
    write_tokenizer_files,
)
from shardwise.models import Llama, LlamaConfig  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

V = 257  # the byte tokenizer's vocabulary
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def hf_config(family: str, **kw):
    """A tiny transformers config of ``family`` (vocab 257, 2 layers, d = 32, 4 heads)."""
    common = dict(vocab_size=V, bos_token_id=256, eos_token_id=256)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       layer_norm_epsilon=1e-5, **common, **kw)
    llama_like = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(**llama_like, **kw)
    if family == "qwen3":
        # head_dim 16 ≠ hidden / heads = 8, as in the real Qwen3 models (128 ≠ 1024 / 16)
        return transformers.Qwen3Config(**{"head_dim": 16, **llama_like, **kw})
    if family == "mistral":
        return transformers.MistralConfig(**{"sliding_window": None, **llama_like, **kw})
    raise ValueError(family)


FAMILIES = ["gpt2", "qwen2", "qwen3", "mistral"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 0.1, 1-D tensors (norm weights, biases) in [0.5, 1.5) or ±0.1 around 0
    (biases), so each tensor's place matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def hf_folder(tmp_path, family: str, **kw):
    """A random tiny transformers model of ``family`` saved into ``tmp_path/<family>`` with the
    byte tokenizer's files; returns (model, folder)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **kw)).eval()
    randomize(model, 1)
    folder = tmp_path / family
    model.save_pretrained(folder)
    write_tokenizer_files(ByteTokenizer(), folder, 64)
    return model, folder


def tokens(b=3, s=40, seed=0):
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(ours, ref):
    diff = (ours - ref).abs()
    bound = ATOL + RTOL * ref.abs()
    assert bool((diff <= bound).all()), f"max |Δ| {float(diff.max()):.3g}"
    return float(diff.max())


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_loads_into_ours_with_equal_logits_and_round_trips_bitwise(tmp_path, family):
    hf, folder = hf_folder(tmp_path, family)
    cfg = hf_to_llama_config(read_hf_config(folder))
    assert cfg.family == family
    over = hf_model_overrides(folder)
    ours = Llama(LlamaConfig(**over)).eval()
    load_hf_weights(ours, folder)
    x = tokens()
    with torch.no_grad():
        err = assert_logits_close(ours(x), hf(x).logits)
    print(f"{family}: HF → ours max |Δlogit| = {err:.3g}")
    # ours → HF names: exactly the tensors transformers holds (the tied head left out)
    back = ours_to_hf(dict(ours.named_parameters()), cfg)
    ref = {k: v for k, v in hf.state_dict().items()
           if not (cfg.tie_embeddings and k == "lm_head.weight")}
    assert set(back) == set(ref)
    for k in ref:
        assert back[k].shape == ref[k].shape and torch.equal(back[k], ref[k]), k
    again = hf_to_ours(back, cfg)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def _our_checkpoint(tmp_path, cfg: LlamaConfig, seed: int):
    """A checkpoint folder written the way train/checkpoint.py writes one (DCP "model" dict of
    full-shape tensors, meta.json with the model config), tokenizer: bytes."""
    import torch.distributed.checkpoint as dcp

    from shardwise.config import TrainConfig

    model = Llama(cfg).eval()
    randomize(model, seed)
    step = tmp_path / "run" / "checkpoints" / "step_2"
    dcp.save({"model": {k: v.detach() for k, v in model.named_parameters()}},
             checkpoint_id=str(step), no_dist=True)
    run = dataclasses.replace(TrainConfig(), model="small", tokenizer="bytes")
    (step / "meta.json").write_text(json.dumps({"step": 2, "config": dataclasses.asdict(run),
                                                "model_config": dataclasses.asdict(cfg)}))
    (step.parent / "latest").write_text("step_2\n")
    return model, tmp_path / "run"


@pytest.mark.parametrize("family", FAMILIES)
def test_our_export_loads_in_transformers_with_equal_logits_and_its_tokenizer(tmp_path, family):
    cfg = hf_to_llama_config(hf_config(family).to_dict())
    model, run = _our_checkpoint(tmp_path, cfg, seed=2)
    out = export_hf(run, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    assert meta["model_type"] == family
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == meta["architectures"][0]
    x = tokens(seed=4)
    with torch.no_grad():
        err = assert_logits_close(model(x), hf(x).logits)
    print(f"{family}: ours → HF max |Δlogit| = {err:.3g}")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    s = "café — naïve\n\tx = 1"
    assert tok(s)["input_ids"] == ByteTokenizer().encode(s)
    assert tok.eos_token_id == ByteTokenizer().eos_id == meta["eos_token_id"]


def test_gpt2_fused_qkv_is_split_by_columns_in_q_k_v_order(tmp_path):
    """c_attn's Conv1D weight [d, 3d] is x @ W: columns [0, d) make q, [d, 2d) k, [2d, 3d) v,
    so our wq.weight is W[:, :d]ᵀ (a row split of the stored tensor would mix q and k)."""
    hf, folder = hf_folder(tmp_path, "gpt2")
    cfg = hf_to_llama_config(read_hf_config(folder))
    ours = hf_to_ours(hf.state_dict(), cfg)
    w = hf.state_dict()["transformer.h.0.attn.c_attn.weight"]  # [d, 3d]
    d = cfg.d_model
    assert w.shape == (d, 3 * d)
    for j, x in enumerate("qkv"):
        assert torch.equal(ours[f"layers.0.attention.w{x}.weight"], w[:, j * d:(j + 1) * d].t())
    h = torch.randn(5, d)
    ref = hf.transformer.h[0].attn.c_attn(h)  # [5, 3d]
    got = torch.cat([h @ ours[f"layers.0.attention.w{x}.weight"].t()
                     + ours[f"layers.0.attention.w{x}.bias"] for x in "qkv"], -1)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(ShardwiseConfigError, match="model_type 'bert' is not supported: "
                       "shardwise loads LlamaForCausalLM.*GPT2LMHeadModel"):
        hf_model_overrides(folder)


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_weights_that_do_not_fit_config_json_are_refused_before_loading(tmp_path, family):
    """config.json from one model, weights from another (another MLP width, another head_dim):
    the header check names the tensors, before any weight is read."""
    _, folder = hf_folder(tmp_path, family)
    other_shape = {"gpt2": dict(n_inner=96), "qwen3": dict(head_dim=8)}[family]
    _, other = hf_folder(tmp_path / "other", family, **other_shape)
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    cfg = hf_to_llama_config(read_hf_config(folder))
    with pytest.raises(ShardwiseConfigError, match="the weights do not fit its config.json"):
        check_weight_files(folder, cfg)


def test_what_a_family_cannot_represent_is_refused_on_export(tmp_path):
    cfg = hf_to_llama_config(hf_config("qwen2").to_dict())
    bad = dataclasses.replace(cfg, qk_norm=True)
    _, run = _our_checkpoint(tmp_path, bad, seed=0)
    with pytest.raises(ShardwiseConfigError, match=r"a qwen2 model cannot represent this "
                       r"config: qk_norm=True \(qwen2: False\)"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_folder_with_only_gpt2_slow_tokenizer_files_is_refused_not_retokenized(tmp_path):
    """vocab.json + merges.txt without tokenizer.json: training a new BPE would silently give
    the model's ids other meanings, so the run is refused with the conversion command."""
    from shardwise.train.workload import tokenizer_spec

    _, folder = hf_folder(tmp_path, "gpt2")
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ShardwiseConfigError, match="vocab.json \\+ merges.txt but no "
                       "tokenizer.json.*save_pretrained"):
        tokenizer_spec("bpe", str(folder))
    assert tokenizer_spec("bytes", str(folder)) == "bytes"
