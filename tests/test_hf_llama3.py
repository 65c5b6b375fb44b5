"""Llama 3.x and Mistral's window in and out: ``rope_scaling`` of type ``llama3`` (Llama 3.1 and
later; Llama 3.2 also ties its embeddings) and Mistral's ``sliding_window``.

References are independent of our code: transformers' own RoPE initialiser
(``ROPE_INIT_FUNCTIONS["llama3"]``) for the frequencies, and transformers' models, built from tiny
random configs and saved into tmp (no downloads), for the logits. Tolerance: the parity rule
(|Δ| ≤ ATOL + RTOL·|ref|, :mod:`shardwise.parity`), as tests/test_hf_families.py.

The tiny config is chosen so that every branch of the llama3 rule is taken: head_dim 16, base
10⁴ gives wavelengths 2π·10^(j/2) = 6.3, 19.9, 62.8, 199, … tokens; with an original context of
64, low_freq_factor 1 and high_freq_factor 4 the thresholds are 64 and 16 tokens, so pair 0 is
kept, pairs 1–2 are interpolated and pairs 3–7 are divided by the factor.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.config import TrainConfig, validate  # noqa: E402
from shardwise.data import ByteTokenizer  # noqa: E402
from shardwise.errors import ShardwiseConfigError  # noqa: E402
from shardwise.interop.hf import (  # noqa: E402
    export_hf,
    hf_model_overrides,
    hf_to_llama_config,
    load_hf_weights,
    read_hf_config,
    write_tokenizer_files,
)
from shardwise.models import Llama, LlamaConfig  # noqa: E402
from shardwise.models.rope import inv_frequencies  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

V = 257
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama32_config(**kw):
    """A tiny Llama 3.2-style config: llama3 RoPE scaling, tied embeddings, GQA."""
    return transformers.LlamaConfig(**{
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_parameters": dict(LLAMA3),
        "bos_token_id": 256, "eos_token_id": 256, **kw})


def mistral_config(window=16):
    return transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=window, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if p.dim() == 1
                    else torch.randn(p.shape, generator=g) * 0.1)


def saved(tmp_path, config, name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, 1)
    folder = tmp_path / name
    model.save_pretrained(folder)
    write_tokenizer_files(ByteTokenizer(), folder, 64)
    return model, folder


def max_err(ours, ref):
    diff = (ours - ref).abs()
    assert bool((diff <= ATOL + RTOL * ref.abs()).all()), f"max |Δ| {float(diff.max()):.3g}"
    return float(diff.max())


def test_llama3_frequencies_equal_transformers_rope_initialiser():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = llama32_config()
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_frequencies(16, 10000.0, LLAMA3)
    plain = inv_frequencies(16, 10000.0)
    assert scale == 1.0
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    # every branch taken (module docstring): kept, interpolated, divided by the factor
    assert ours[0] == plain[0]
    assert all(plain[j] / 8 < ours[j] < plain[j] for j in (1, 2))
    torch.testing.assert_close(ours[3:], plain[3:] / 8)


def test_llama32_folder_imports_with_equal_logits_and_exports_back(tmp_path):
    hf, folder = saved(tmp_path, llama32_config(), "llama32")
    over = hf_model_overrides(folder)
    assert over["rope_scaling"]["rope_type"] == "llama3" and over["tie_embeddings"]
    ours = Llama(LlamaConfig(**over)).eval()
    load_hf_weights(ours, folder)
    x = torch.randint(0, V, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = max_err(ours(x), hf(x).logits)
    print(f"llama 3.2-style: HF → ours max |Δlogit| = {err:.3g}")
    # without the scaling the same weights give other logits beyond the original context
    plain = Llama(LlamaConfig(**{**over, "rope_scaling": None})).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(x) - hf(x).logits).abs().max() > 1e-3
    # export (as `shardwise export` from a checkpoint) → transformers: same logits
    import torch.distributed.checkpoint as dcp

    cfg = hf_to_llama_config(read_hf_config(folder))
    step = tmp_path / "run" / "checkpoints" / "step_1"
    dcp.save({"model": {k: v.detach() for k, v in ours.named_parameters()}},
             checkpoint_id=str(step), no_dist=True)
    run = dataclasses.replace(TrainConfig(), tokenizer="bytes")
    (step / "meta.json").write_text(json.dumps({"step": 1, "config": dataclasses.asdict(run),
                                                "model_config": dataclasses.asdict(cfg)}))
    (step.parent / "latest").write_text("step_1\n")
    out = export_hf(tmp_path / "run", tmp_path / "out")
    meta = json.loads((out / "config.json").read_text())
    assert meta["rope_parameters"]["rope_type"] == "llama3"
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        print(f"ours → HF max |Δlogit| = {max_err(ours(x), back(x).logits):.3g}")


def test_mistral_window_is_exact_up_to_the_window_and_longer_seq_len_is_refused(tmp_path):
    hf, folder = saved(tmp_path, mistral_config(window=16), "mistral")
    over = hf_model_overrides(folder)
    assert over["sliding_window"] == 16
    ours = Llama(LlamaConfig(**over)).eval()
    load_hf_weights(ours, folder)
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        max_err(ours(x), hf(x).logits)
        with pytest.raises(ValueError, match="sliding_window 16"):
            ours(torch.zeros(1, 17, dtype=torch.long))
    cfg = dataclasses.replace(TrainConfig(), init_from_hf=str(folder), tokenizer="bytes", dp=1,
                              tp=1, zero=0, seq_len=32, global_batch=2, micro_batch=1)
    with pytest.raises(ShardwiseConfigError, match=r"sliding_window 16.*--seq-len ≤ 16"):
        validate(cfg)
    validate(dataclasses.replace(cfg, seq_len=16))
