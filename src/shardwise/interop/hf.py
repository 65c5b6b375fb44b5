"""Hugging Face folders in and out of shardwise's decoder: ``LlamaForCausalLM``, the families
that are the same decoder with a few config fields (``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``GPT2LMHeadModel``: below and :mod:`.gpt2`) and ``MixtralForCausalLM``
for its mixture of experts (:class:`~shardwise.models.MoELlama`).

Export (``shardwise export --checkpoint DIR --to hf OUT``, :func:`export_hf`) reads one of our
checkpoints (``checkpoints/step_N/``: DCP files with full-shape tensors under ``model.<FQN>``, and
``meta.json`` with the run's config) on one process, renames the tensors, and writes::

    OUT/config.json            LlamaConfig fields (architectures = ["LlamaForCausalLM"]; a MoE
                               model: MixtralConfig fields, ["MixtralForCausalLM"])
    OUT/model.safetensors      fp32 tensors under Hugging Face names
    OUT/tokenizer.json         the run's tokenizer as a `tokenizers` file (when it can be found)
    OUT/tokenizer_config.json  PreTrainedTokenizerFast, eos token, model_max_length
    OUT/generation_config.json eos/bos ids

Import (``shardwise train --init-from-hf DIR``, :func:`load_hf_weights`) reads such a folder
(``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``) into
the *plain* model before ``parallelize``, so any layout starts from it.

Name map (ours ↔ Hugging Face; ``{i}`` = layer index)::

    tok_embeddings.weight                    model.embed_tokens.weight         [V, d]
    layers.{i}.attention_norm.weight         model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.wq.weight           model.layers.{i}.self_attn.q_proj.weight [h·hd, d]
    layers.{i}.attention.wk.weight           model.layers.{i}.self_attn.k_proj.weight [k·hd, d]
    layers.{i}.attention.wv.weight           model.layers.{i}.self_attn.v_proj.weight [k·hd, d]
    layers.{i}.attention.wo.weight           model.layers.{i}.self_attn.o_proj.weight [d, h·hd]
    layers.{i}.ffn_norm.weight               model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1.weight        model.layers.{i}.mlp.gate_proj.weight    [f, d]
    layers.{i}.feed_forward.w3.weight        model.layers.{i}.mlp.up_proj.weight      [f, d]
    layers.{i}.feed_forward.w2.weight        model.layers.{i}.mlp.down_proj.weight    [d, f]
    norm.weight                              model.norm.weight
    output.weight                            lm_head.weight (absent when tied)  [V, d]

No tensor is permuted. Meta's original Llama code applies RoPE to *interleaved* pairs
(x[2j], x[2j+1]); Hugging Face's converter therefore permutes the rows of q_proj/k_proj so that
its "rotate-half" RoPE (pairs x[j], x[j + hd/2]) computes the same thing. Our
:func:`shardwise.models.llama.apply_rope` is rotate-half too, with the same frequencies
θ_j = theta^(−2j/hd) (Su et al. 2021, RoFormer, eq. 34), so the weights map 1:1 (tests/test_hf.py
checks the logits, which would differ if either side rotated other pairs). GQA: k/v projections
hold ``num_key_value_heads`` heads, query head ``q`` uses kv head ``q // (h/k)`` on both sides.
RMSNorm: ``rms_norm_eps`` ↔ ``norm_eps``; both normalise in fp32 and multiply by the weight.

**Mixtral** (Jiang et al. 2024; ``model_type = "mixtral"``) is our :class:`MoELlama` with every
block a MoE (``moe_every = 1``), no shared experts, renormalised top-k weights (``norm_topk``) and
no capacity (dropless): attention, norms and embeddings map as above, and per MoE block::

    layers.{i}.feed_forward.router.weight    model.layers.{i}.block_sparse_moe.gate.weight  [E, d]
    layers.{i}.feed_forward.experts.w1[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight
    layers.{i}.feed_forward.experts.w3[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight
    layers.{i}.feed_forward.experts.w2[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight

(w1, w3 [f, d], w2 [d, f] per expert j; f = ``intermediate_size`` = our ``d_expert``). That is the
file layout of the Hub's Mixtral-8x7B and what ``save_pretrained`` writes in transformers 4.x and
5.x alike; transformers 5 stacks the experts in memory (``model.layers.{i}.mlp.gate.weight``,
``mlp.experts.gate_up_proj`` [E, 2f, d] = cat(w1, w3) on dim 1, ``mlp.experts.down_proj``
[E, d, f] = w2: our own layout) and converts on load and save. Import accepts both namings.
Mixtral's router is ours: softmax over E in fp32, top-k, the k weights divided by their sum
(``MixtralTopKRouter``), so the logits are equal; only on an *exact* tie of two probabilities
could the two differ (``torch.topk`` promises no order among ties, we take the lower index).
What Mixtral cannot represent is refused on export (:func:`check_hf_exportable`): shared experts,
``moe_every`` > 1, a capacity factor (Mixtral never drops a token), unnormalised top-k weights.
The auxiliary losses do not change logits; their coefficients travel as ``router_aux_loss_coef``
(= our α; note that transformers' own balance loss, used only with ``output_router_logits``,
pools the batch and the layers and lets f sum to k, where ours is per sequence and per layer) and
``router_z_loss_coef`` (= β, a key Mixtral ignores; a folder without it imports with β = 0, as
Mixtral was trained without a z-loss). ``router_jitter_noise`` (training-time input noise in
transformers) is not read.

**The other dense families** are the same decoder with a few config fields
(:mod:`shardwise.models.llama`; ``family`` names the architecture export writes):

* **Mistral** (``model_type = "mistral"``, MistralForCausalLM): Llama's tensors and names under
  its own config class. ``sliding_window`` W (also Mixtral's): our attention is full causal
  attention, which is exactly the windowed one while a sequence has at most W tokens, so the
  window is kept in the config (and exported) and ``--seq-len`` > W is refused with that fix.
* **Llama 3.x** (``rope_scaling`` / ``rope_parameters`` of type ``llama3``): the scaled RoPE
  frequencies of :mod:`shardwise.models.rope`, kept in the config and written back on export;
  Llama 3.2's tied embeddings are ``tie_word_embeddings``.
* **Qwen2** (``"qwen2"``): Llama plus biases on q_proj, k_proj, v_proj (``qkv_bias``), names
  ``self_attn.{q,k,v}_proj.bias``; ``use_sliding_window`` must be off.
* **Qwen3** (``"qwen3"``): Llama plus an RMSNorm over each head's q and k before RoPE
  (``qk_norm``; ``self_attn.q_norm.weight``, ``k_norm.weight`` [hd]), ``head_dim`` given in
  config.json (our ``attn_head_dim``; it need not be hidden_size / heads), optional
  ``attention_bias`` (q, k, v, o).
* **GPT-2** (``"gpt2"``, GPT2LMHeadModel): learned positions, LayerNorm with bias, a GELU MLP,
  biases everywhere, tied embeddings, and a fused q‖k‖v ``c_attn`` stored as a transposed
  Conv1D, split at import and fused at export: :mod:`.gpt2`.

Errors: every bad folder or checkpoint raises :class:`~shardwise.errors.ShardwiseConfigError`
naming the file and the fix. Nothing here needs a process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from ..errors import ShardwiseConfigError
from ..models.rope import LLAMA3_KEYS, ROPE_TYPES

# (our FQN pattern, HF name pattern) for the per-layer tensors; {i} is the layer index.
_LAYER_MAP = [
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    # Qwen2's qkv biases (and any Llama-family bias), Qwen3's per-head q/k RMSNorm
    ("attention.wq.bias", "self_attn.q_proj.bias"),
    ("attention.wk.bias", "self_attn.k_proj.bias"),
    ("attention.wv.bias", "self_attn.v_proj.bias"),
    ("attention.wo.bias", "self_attn.o_proj.bias"),
    ("feed_forward.w1.bias", "mlp.gate_proj.bias"),
    ("feed_forward.w3.bias", "mlp.up_proj.bias"),
    ("feed_forward.w2.bias", "mlp.down_proj.bias"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
]
_TOP_MAP = [("tok_embeddings.weight", "model.embed_tokens.weight"),
            ("norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight")]
_OURS_TO_HF = {**dict(_TOP_MAP), **{f"layers.{{i}}.{a}": f"model.layers.{{i}}.{b}"
                                    for a, b in _LAYER_MAP}}
# Mixtral: ours → HF (the file layout; block i, expert j) and the HF names import accepts
_MOE_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123])")
_MOE_HF = re.compile(r"model\.layers\.(\d+)\.(?:"
                     r"(?:block_sparse_moe|mlp)\.(?P<gate>gate)\.weight|"
                     r"block_sparse_moe\.experts\.(?P<j>\d+)\.(?P<w>w[123])\.weight|"
                     r"mlp\.experts\.(?P<stacked>gate_up_proj|down_proj))")
_DENSE_FFN = re.compile(r"layers\.\d+\.feed_forward\.w[123]\.weight")
# tensors some HF checkpoints carry that are recomputed, not learned
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|"
                         r"model\.rotary_emb\.inv_freq")


def _rename(name: str, table: dict[str, str]) -> str | None:
    m = re.match(r"^(model\.)?layers\.(\d+)\.(.+)$", name)
    if m:
        i = m.group(2)
        for src, dst in table.items():
            if "{i}" in src and src.format(i=i) == name:
                return dst.format(i=i)
        return None
    return table.get(name)


def to_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool
                     ) -> dict[str, torch.Tensor]:
    """Our plain-model FQNs → Hugging Face names (same tensors, no copy, no permutation).

    ``output.weight`` is dropped when ``tie_embeddings`` (HF ties ``lm_head`` to the embedding).
    A MoE model's stacked experts [E, …] become Mixtral's E per-expert tensors (views ``t[j]``;
    module docstring). Raises ShardwiseConfigError for a name with no HF counterpart, or for a
    model that mixes dense and MoE blocks (a Mixtral's every block is a MoE)."""
    out, unknown = {}, []
    moe = any(_MOE_OURS.fullmatch(n) for n in state)
    for name, t in state.items():
        if name == "output.weight" and tie_embeddings:
            continue
        m = _MOE_OURS.fullmatch(name)
        if m:
            i, part = m.groups()
            if part == "router.weight":
                out[f"model.layers.{i}.block_sparse_moe.gate.weight"] = t
            else:
                for j in range(t.shape[0]):
                    out[f"model.layers.{i}.block_sparse_moe.experts.{j}.{part[-2:]}.weight"] = t[j]
            continue
        hf = None if moe and _DENSE_FFN.fullmatch(name) else _rename(name, _OURS_TO_HF)
        if hf is None:
            unknown.append(name)
        else:
            out[hf] = t
    if unknown:
        raise ShardwiseConfigError(
            f"no Hugging Face name for {unknown[:5]}: only the Llama models (--model "
            "tiny/small/base) and mixtures of experts with every block a MoE and no shared "
            "experts (Mixtral) export to HF")
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], tie_embeddings: bool, source: str = "HF"
                       ) -> dict[str, torch.Tensor]:
    """Hugging Face names → our FQNs (the inverse of :func:`to_hf_state_dict`).

    With ``tie_embeddings`` the embedding is also returned as ``output.weight`` (our tied
    model's state dict holds both names for one tensor) and any ``lm_head.weight`` is ignored.
    Mixtral's per-expert tensors are stacked in expert order (``torch.stack``: a copy); its
    transformers-5 names (``mlp.experts.gate_up_proj``, split into w1 and w3 as views) load too.
    Raises ShardwiseConfigError listing names we cannot place (biases, other architectures), an
    expert missing from a block, a tensor given twice, or experts of unequal shapes."""
    back = {v: k for k, v in _OURS_TO_HF.items()}
    out, unknown = {}, []
    experts: dict[str, dict[int, torch.Tensor]] = {}  # our stacked FQN → {expert j: tensor}

    def put(name: str, t: torch.Tensor) -> None:
        if name in out:
            raise ShardwiseConfigError(f"{source}: {name} is given twice (per-expert and "
                                       "stacked Mixtral tensors of one block?): keep one naming")
        out[name] = t

    for name, t in hf.items():
        if _HF_IGNORED.fullmatch(name) or (name == "lm_head.weight" and tie_embeddings):
            continue
        m = _MOE_HF.fullmatch(name)
        if m:
            ff = f"layers.{m.group(1)}.feed_forward"
            if m.group("gate"):
                put(f"{ff}.router.weight", t)
            elif m.group("w"):
                experts.setdefault(f"{ff}.experts.{m.group('w')}", {})[int(m.group("j"))] = t
            elif m.group("stacked") == "down_proj":
                put(f"{ff}.experts.w2", t)
            else:  # gate_up_proj [E, 2f, d] = cat(w1, w3) on dim 1
                f = t.shape[1] // 2
                put(f"{ff}.experts.w1", t[:, :f])
                put(f"{ff}.experts.w3", t[:, f:])
            continue
        ours = _rename(name, back)
        if ours is None:
            unknown.append(name)
        else:
            put(ours, t)
    if unknown:
        raise ShardwiseConfigError(
            f"{source}: tensors {unknown[:6]}{' …' if len(unknown) > 6 else ''} have no place in "
            "shardwise's Llama (no biases, RMSNorm, SwiGLU): only bias-free Llama checkpoints "
            "load; check model_type/attention_bias/mlp_bias in config.json")
    for name, parts in sorted(experts.items()):
        missing = sorted(set(range(max(parts) + 1)) - set(parts))
        if missing:
            raise ShardwiseConfigError(f"{source}: {name}: experts {missing[:6]} are missing "
                                       "(the per-expert tensors of a block must all be there): "
                                       "copy the whole model folder")
        try:
            put(name, torch.stack([parts[j] for j in range(len(parts))]))
        except RuntimeError as e:  # experts of unequal shapes
            raise ShardwiseConfigError(f"{source}: {name}: the experts' tensors differ in shape "
                                       f"({str(e).splitlines()[0]}): not a Mixtral "
                                       "checkpoint") from None
    if tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ---------------------------------------------------------------------------------- configs

def _is_moe(cfg) -> bool:
    from ..models import MoEConfig

    return isinstance(cfg, MoEConfig)


def check_hf_exportable(cfg) -> str:
    """The Hugging Face architecture our config ``cfg`` exports to: ``"LlamaForCausalLM"`` for a
    :class:`~shardwise.models.LlamaConfig`, ``"MixtralForCausalLM"`` for a
    :class:`~shardwise.models.MoEConfig` that Mixtral can express. Raises ShardwiseConfigError
    naming what it cannot: shared experts, ``moe_every`` > 1, a capacity factor, unnormalised
    top-k weights (each would make transformers compute other logits)."""
    if not _is_moe(cfg):
        return _dense_architecture(cfg)
    why = []
    if cfg.n_shared_experts:
        why.append(f"n_shared_experts={cfg.n_shared_experts} (Mixtral has no shared experts)")
    if cfg.moe_every != 1:
        why.append(f"moe_every={cfg.moe_every} (every Mixtral block is a MoE; ours mixes in "
                   "dense blocks)")
    if cfg.capacity_factor is not None:
        why.append(f"capacity_factor={cfg.capacity_factor} (Mixtral is dropless: it never "
                   "drops a token)")
    if not cfg.norm_topk:
        why.append("norm_topk=False (Mixtral divides its top-k weights by their sum)")
    if why:
        raise ShardwiseConfigError(
            "export: a MixtralForCausalLM cannot represent this mixture of experts: "
            + "; ".join(why) + ": only MoE models with every block a MoE, no shared experts, "
            "no capacity factor and renormalised top-k weights export to HF")
    return "MixtralForCausalLM"


def _dense_architecture(cfg) -> str:
    """The HF architecture of dense config ``cfg`` (its ``family``), or ShardwiseConfigError
    naming the fields that family cannot represent."""
    family = getattr(cfg, "family", "llama")
    if family == "gpt2":
        from .gpt2 import gpt2_mismatch

        bad = gpt2_mismatch(cfg)
    elif family in _FAMILY_FIELDS:
        need = {**_LLAMA_LIKE, **_FAMILY_FIELDS[family]}
        if family in ("llama", "mistral"):
            need |= {"qkv_bias": False, "o_bias": False, "qk_norm": False}
        elif family == "qwen2":
            need |= {"qk_norm": False}
        else:  # qwen3: q, k, v, o biased together (attention_bias) or not at all
            need |= {"o_bias": cfg.qkv_bias}
        bad = [f"{k}={getattr(cfg, k)!r} ({family}: {v!r})" for k, v in need.items()
               if getattr(cfg, k) != v]
    else:
        bad = [f"family={family!r} (choose from gpt2, {', '.join(_FAMILY_FIELDS)})"]
    if bad:
        raise ShardwiseConfigError(f"export: a {family} model cannot represent this config: "
                                   + "; ".join(bad) + ": set the fields its family fixes")
    return SUPPORTED_MODEL_TYPES[family]


def llama_to_hf_config(cfg, eos_id: int | None = None) -> dict:
    """Our :class:`~shardwise.models.LlamaConfig` → a ``config.json`` dict for LlamaForCausalLM
    (a :class:`~shardwise.models.MoEConfig`: :func:`mixtral_to_hf_config`).

    Writes the RoPE base both as ``rope_theta`` (transformers 4.x) and ``rope_parameters``
    (5.x), so either version reads it."""
    if _is_moe(cfg):
        return mixtral_to_hf_config(cfg, eos_id)
    arch, family = _dense_architecture(cfg), getattr(cfg, "family", "llama")
    if family == "gpt2":
        from .gpt2 import gpt2_hf_config

        return gpt2_hf_config(cfg, eos_id)
    out = {"architectures": [arch], "model_type": family,
           **_decoder_config(cfg, cfg.d_ff, eos_id)}
    if family == "llama":
        out |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    elif family == "mistral":
        out |= {"sliding_window": cfg.sliding_window or None}
    else:  # qwen2, qwen3: full attention in every layer
        out |= {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layers,
                "layer_types": ["full_attention"] * cfg.n_layers}
        if family == "qwen3":
            out["attention_bias"] = bool(cfg.qkv_bias)
    return out


def _decoder_config(cfg, intermediate: int, eos_id: int | None) -> dict:
    """The ``config.json`` keys Llama and Mixtral folders share (``intermediate_size``: the
    dense SwiGLU's, or one expert's)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": intermediate,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            **(getattr(cfg, "rope_scaling", None) or {})},
        **({"rope_scaling": cfg.rope_scaling} if getattr(cfg, "rope_scaling", None) else {}),
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def mixtral_to_hf_config(cfg, eos_id: int | None = None) -> dict:
    """Our :class:`~shardwise.models.MoEConfig` → a ``config.json`` dict for MixtralForCausalLM
    (``intermediate_size`` = ``d_expert``; the auxiliary-loss coefficients as in the module
    docstring; ``sliding_window`` null: full causal attention). Raises ShardwiseConfigError as
    :func:`check_hf_exportable`."""
    check_hf_exportable(cfg)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            **_decoder_config(cfg, cfg.d_expert, eos_id),
            "sliding_window": cfg.sliding_window or None,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "output_router_logits": False, "router_aux_loss_coef": cfg.aux_loss_coef,
            "router_z_loss_coef": cfg.z_loss_coef, "router_jitter_noise": 0.0}


def read_hf_config(folder: str | os.PathLike) -> dict:
    """``folder/config.json`` as a dict. Raises ShardwiseConfigError if the folder or the file
    is missing or is not JSON."""
    folder = Path(folder)
    if not folder.is_dir():
        from .hub import looks_like_hub_name, model_recipe

        if looks_like_hub_name(str(folder)):
            raise ShardwiseConfigError(f"--init-from-hf {folder}: no such folder; "
                                       + model_recipe(str(folder)))
        raise ShardwiseConfigError(f"--init-from-hf {folder}: no such folder: give a local "
                                   "Hugging Face model folder (config.json + model.safetensors)")
    path = folder / "config.json"
    if not path.is_file():
        raise ShardwiseConfigError(f"--init-from-hf {folder}: no config.json there: give the "
                                   "folder that save_pretrained wrote")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardwiseConfigError(f"{path}: not valid JSON ({e}): re-save the model with "
                                   "save_pretrained") from None
    if not isinstance(data, dict):
        raise ShardwiseConfigError(f"{path}: expected a JSON object of config fields")
    return data


def hf_to_llama_config(hf: dict, source: str = "config.json"):
    """A Hugging Face config dict → our LlamaConfig (``model_type`` "llama") or MoEConfig
    ("mixtral"), or ShardwiseConfigError saying why the architecture cannot be expressed
    (GPT-2, biases, RoPE scaling, another activation, a sliding attention window …)."""
    from ..models import LlamaConfig, MoEConfig

    mt = hf.get("model_type")
    if mt == "gpt2":
        from .gpt2 import gpt2_config

        return gpt2_config(hf, source)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ShardwiseConfigError(
            f"{source}: model_type {mt!r} is not supported: shardwise loads "
            + ", ".join(f"{a} ('{t}')" for t, a in SUPPORTED_MODEL_TYPES.items())
            + " folders")
    biased = ("mlp_bias",) if mt == "qwen3" else ("attention_bias", "mlp_bias")
    for key in biased:
        if hf.get(key, False):
            raise ShardwiseConfigError(f"{source}: {key} = {hf[key]} but shardwise's {mt} has "
                                       "no biases there: only checkpoints without it load")
    if hf.get("use_sliding_window") and mt in ("qwen2", "qwen3"):
        raise ShardwiseConfigError(f"{source}: use_sliding_window = true: shardwise's attention "
                                   "is full causal attention: use a checkpoint without it")
    if hf.get("hidden_act", "silu") != "silu":
        raise ShardwiseConfigError(f"{source}: hidden_act {hf['hidden_act']!r}: shardwise's "
                                   "SwiGLU uses silu; only silu Llama checkpoints load")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
        else "default"
    if rope_type not in ROPE_TYPES:
        raise ShardwiseConfigError(
            f"{source}: RoPE scaling {rope_type!r} is not implemented (shardwise has plain RoPE "
            "and Llama 3's 'llama3' scaling: models/rope.py): use a checkpoint without that "
            "rope_scaling")
    scaling = None
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in rope]
        if missing:
            raise ShardwiseConfigError(f"{source}: rope_scaling of type 'llama3' lacks {missing}: "
                                       "re-save the model with save_pretrained")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_KEYS}}
    # transformers' defaults where a field is absent: LlamaConfig's, or MixtralConfig's
    mixtral = mt == "mixtral"
    theta0, eps0, pos0 = {"mixtral": (1e6, 1e-5, 4096 * 32), "mistral": (1e4, 1e-6, 4096 * 32),
                          "qwen2": (1e4, 1e-6, 32768), "qwen3": (1e4, 1e-6, 32768)
                          }.get(mt, (10000.0, 1e-6, 2048))
    try:
        d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kw = dict(
            vocab_size=int(hf["vocab_size"]), d_model=d,
            n_layers=int(hf["num_hidden_layers"]), n_heads=h,
            n_kv_heads=int(hf.get("num_key_value_heads") or h),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", pos0)),
            rope_theta=float(hf.get("rope_theta") or (rope or {}).get("rope_theta") or theta0),
            norm_eps=float(hf.get("rms_norm_eps", eps0)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)), family=mt, rope_scaling=scaling)
        if mt == "qwen2":
            kw["qkv_bias"] = True
        if mt == "qwen3":
            bias = bool(hf.get("attention_bias", False))
            kw.update(qk_norm=True, qkv_bias=bias, o_bias=bias,
                      attn_head_dim=int(hf.get("head_dim") or 128))
        elif hf.get("head_dim") not in (None, d // h):
            kw["attn_head_dim"] = int(hf["head_dim"])
        window = hf.get("sliding_window")
        window = None if window is None else int(window)
        if mixtral:
            kw["family"] = "llama"  # a MoEConfig: its family is decided by the MoE fields
            kw.update(n_experts=int(hf.get("num_local_experts", 8)),
                      top_k=int(hf.get("num_experts_per_tok", 2)), d_expert=kw["d_ff"],
                      moe_every=1, n_shared_experts=0, capacity_factor=None, norm_topk=True,
                      aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                      z_loss_coef=float(hf.get("router_z_loss_coef", 0.0)))
    except KeyError as e:
        raise ShardwiseConfigError(f"{source}: missing field {e.args[0]!r}: re-save the model "
                                   "with save_pretrained") from None
    except (TypeError, ValueError) as e:  # a field that is not a number
        raise ShardwiseConfigError(f"{source}: {e}") from None
    if (mixtral or mt == "mistral") and window is not None and window < kw["max_seq_len"]:
        kw["sliding_window"] = window  # exact up to --seq-len ≤ window; longer: refused
    try:
        cfg = MoEConfig(**kw) if mixtral else LlamaConfig(**kw)
    except ValueError as e:  # our configs' own checks: heads divide d_model, top_k ≤ E, …
        raise ShardwiseConfigError(f"{source}: {e}") from None
    if mixtral and hf.get("head_dim") not in (None, cfg.head_dim):
        raise ShardwiseConfigError(
            f"{source}: head_dim {hf['head_dim']} ≠ hidden_size / num_attention_heads = "
            f"{cfg.head_dim}: shardwise derives head_dim for Mixtral; such checkpoints do not "
            "load")
    return cfg


# model_type → the architecture; the dense families are our Llama with other config fields
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                         "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM"}
# what each Llama-like family fixes (besides the shape): checked on export
_FAMILY_FIELDS = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True, "o_bias": False},
                  "qwen3": {"qk_norm": True}}
_LLAMA_LIKE = dict(norm="rms", mlp="swiglu", pos="rope", mlp_bias=False)


ARCH_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
               "rope_theta", "norm_eps", "tie_embeddings", "family", "norm", "mlp", "pos",
               "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "attn_head_dim", "rope_scaling",
               "sliding_window")
# the MoEConfig fields a Mixtral folder also decides (its loss coefficients reach the run's
# --aux-loss-coef / --z-loss-coef unless flags give them: config.from_args)
MOE_ARCH_FIELDS = ("n_experts", "top_k", "d_expert", "moe_every", "n_shared_experts",
                   "capacity_factor", "norm_topk")


def hf_model_kind(folder: str | os.PathLike) -> str:
    """``"moe"`` for a MixtralForCausalLM folder (build a MoE preset), ``"llama"`` for a
    LlamaForCausalLM one. Raises as :func:`hf_to_llama_config`."""
    cfg = hf_to_llama_config(read_hf_config(folder), source=f"{folder}/config.json")
    return "moe" if _is_moe(cfg) else "llama"


def hf_model_overrides(folder: str | os.PathLike) -> dict:
    """The config fields (:data:`ARCH_FIELDS` + ``vocab_size``, and for a Mixtral folder
    :data:`MOE_ARCH_FIELDS`) of the HF folder, for ``build_model(preset, **overrides)`` (a MoE
    preset for a Mixtral folder: :func:`hf_model_kind`). Raises as :func:`hf_to_llama_config`."""
    cfg = hf_to_llama_config(read_hf_config(folder), source=f"{folder}/config.json")
    fields = (*ARCH_FIELDS, "vocab_size", *(MOE_ARCH_FIELDS if _is_moe(cfg) else ()))
    return {k: getattr(cfg, k) for k in fields}


def describe_source(run_cfg) -> str:
    """What the start-up line calls the model of a run (``run_cfg``: the TrainConfig): the
    preset name, or for ``--init-from-hf DIR`` the architecture and where its values came from
    (the folder's config.json; flags for ``--n-layers`` and MoE coefficients that differ from
    the folder's)."""
    if not run_cfg.init_from_hf:
        return run_cfg.model
    folder = run_cfg.init_from_hf
    hf = read_hf_config(folder)
    cfg = hf_to_llama_config(hf, source=f"{folder}/config.json")
    arch = SUPPORTED_MODEL_TYPES.get(hf.get("model_type"), "?")
    extras = []
    if getattr(cfg, "rope_scaling", None):
        extras.append(f"rope {cfg.rope_scaling['rope_type']} ×{cfg.rope_scaling['factor']:g}")
    if getattr(cfg, "sliding_window", 0):
        extras.append(f"sliding window {cfg.sliding_window}")
    parts = [f"shape{', ' + ', '.join(extras) if extras else ''} from {folder}/config.json"]
    if run_cfg.n_layers and run_cfg.n_layers != cfg.n_layers:
        parts.append(f"n_layers {run_cfg.n_layers} from --n-layers")
    if _is_moe(cfg):
        for name, key in (("aux_loss_coef", "router_aux_loss_coef"),
                          ("z_loss_coef", "router_z_loss_coef")):
            mine, theirs = getattr(run_cfg, name), getattr(cfg, name)
            where = (f"config.json's {key}" if key in hf else "transformers' default, absent "
                     "from config.json") if mine == theirs else f"--{name.replace('_', '-')}"
            parts.append(f"{name} {mine:g} from {where}")
    return f"{arch} ({'; '.join(parts)})"


# ---------------------------------------------------------------------------------- weights

def read_hf_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder as fp32 CPU tensors: ``model.safetensors``, the shards listed
    in ``model.safetensors.index.json``, or ``pytorch_model.bin`` (loaded weights_only)."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        if not f.is_file():
            raise ShardwiseConfigError(f"{f}: listed in the index but missing: copy the whole "
                                       "model folder")
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except ImportError:
            raise ShardwiseConfigError("reading .safetensors needs the safetensors package: "
                                       "pip install 'shardwise[hf]'") from None
        except Exception as e:  # truncated or corrupt file: the libraries raise various types
            raise ShardwiseConfigError(f"{f}: cannot be read ({type(e).__name__}: {e}): the file "
                                       "is corrupt or truncated; copy it again") from None
        out.update({k: v.float() for k, v in part.items()})
    return out


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of a HF folder (see :func:`read_hf_weights`); ShardwiseConfigError when
    there are none. Cheap: reads at most the index."""
    folder = Path(folder)
    single, index, pt = (folder / "model.safetensors", folder / "model.safetensors.index.json",
                         folder / "pytorch_model.bin")
    files: list[Path]
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ShardwiseConfigError(f"{index}: not a safetensors index ({e}): re-save the "
                                       "model with save_pretrained") from None
        files = [folder / s for s in shards]
    elif pt.is_file():
        files = [pt]
    else:
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: no weights (model.safetensors, model.safetensors.index.json "
            "or pytorch_model.bin): save the model with save_pretrained into that folder")
    return files


def check_weight_files(folder: str | os.PathLike, cfg=None) -> None:
    """Cheap pre-flight (headers only) for ``--init-from-hf``, run by ``config.validate`` before
    any collective: the weight files exist, every ``.safetensors`` header covers its file (a
    truncated copy fails here, on every rank, instead of after the process group exists), and,
    given our LlamaConfig or MoEConfig ``cfg``, the tensor names and shapes fit it."""
    shapes: dict[str, tuple] = {}
    for f in weight_files(folder):
        if not f.is_file():
            raise ShardwiseConfigError(f"{f}: listed in the index but missing: copy the whole "
                                       "model folder")
        if f.suffix != ".safetensors":
            continue
        try:
            from safetensors import safe_open
        except ImportError:
            raise ShardwiseConfigError("reading .safetensors needs the safetensors package: "
                                       "pip install 'shardwise[hf]'") from None
        try:
            with safe_open(str(f), "pt") as handle:
                shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except Exception as e:  # SafetensorError: truncated or not a safetensors file
            raise ShardwiseConfigError(f"{f}: cannot be read ({e}): the file is corrupt or "
                                       "truncated; copy it again") from None
    if cfg is None or not shapes:
        return
    # the names and shapes as the weights would load: meta tensors through the same renaming
    # (and Mixtral's expert stacking) that load_hf_weights applies
    got = {k: tuple(v.shape) for k, v in hf_to_ours(
        {k: torch.empty(v, device="meta") for k, v in shapes.items()}, cfg,
        source=str(folder)).items()}
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_for(cfg).state_dict().items()}
    bad = [f"{k}: file {got.get(k, 'missing')} vs config.json {expected.get(k, 'absent')}"
           for k in sorted(set(expected) | set(got)) if got.get(k) != expected.get(k)]
    if bad:
        raise ShardwiseConfigError(f"{folder}: the weights do not fit its config.json "
                                   f"({len(bad)} mismatched: {bad[:4]}): config.json and the "
                                   "weights must come from the same save_pretrained")


def model_for(cfg):
    """Our plain model of config ``cfg``: :class:`~shardwise.models.MoELlama` for a MoEConfig,
    else :class:`~shardwise.models.Llama` (on the current default device)."""
    from ..models import Llama, MoELlama

    return MoELlama(cfg) if _is_moe(cfg) else Llama(cfg)


@torch.no_grad()
def load_hf_weights(model, folder: str | os.PathLike) -> None:
    """Copy the HF Llama or Mixtral folder's weights into our plain ``model`` (in place, before
    ``parallelize``). The architecture must match (build the model with
    :func:`hf_model_overrides`; a MoE preset for a Mixtral folder); raises ShardwiseConfigError
    when the model is of the other kind, or listing missing/unexpected names and shape
    mismatches."""
    from ..models import MoELlama

    cfg = hf_to_llama_config(read_hf_config(folder), source=f"{folder}/config.json")
    if _is_moe(cfg) != isinstance(model, MoELlama):
        arch, have, need = (("MixtralForCausalLM", "a dense Llama", "a MoE") if _is_moe(cfg)
                            else ("LlamaForCausalLM", "a MoELlama", "a dense"))
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: its config.json is a {arch} but the model built is "
            f"{have}: build {need} model from the folder's overrides (hf_model_kind, "
            "hf_model_overrides)")
    if getattr(model, "config", cfg).family != cfg.family:
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: its config.json is a {cfg.family} model but the model "
            f"built is a {model.config.family} one: build the model from the folder's "
            "overrides (hf_model_overrides)")
    ours = hf_to_ours(read_hf_weights(folder), cfg, source=str(folder))
    _copy_into(model, ours, str(folder))


def hf_to_ours(hf: dict[str, torch.Tensor], cfg, source: str = "HF") -> dict[str, torch.Tensor]:
    """HF tensors → our FQNs for model config ``cfg``: GPT-2's own map (:mod:`.gpt2`) or the
    Llama-family one (:func:`from_hf_state_dict`)."""
    if getattr(cfg, "family", "llama") == "gpt2":
        from .gpt2 import gpt2_from_hf_state_dict

        return gpt2_from_hf_state_dict(hf, cfg, source)
    return from_hf_state_dict(hf, cfg.tie_embeddings, source=source)


def ours_to_hf(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Our full-shape tensors → HF names for ``cfg`` (the inverse of :func:`hf_to_ours`)."""
    if getattr(cfg, "family", "llama") == "gpt2":
        from .gpt2 import gpt2_to_hf_state_dict

        return gpt2_to_hf_state_dict(state)
    return to_hf_state_dict(state, cfg.tie_embeddings)


def _copy_into(model, state: dict[str, torch.Tensor], source: str) -> None:
    target = model.state_dict()
    missing = sorted(set(target) - set(state))
    extra = sorted(set(state) - set(target))
    shapes = [f"{k}: {tuple(state[k].shape)} vs model {tuple(target[k].shape)}"
              for k in target if k in state and state[k].shape != target[k].shape]
    if missing or extra or shapes:
        parts = ([f"missing {missing[:6]}"] if missing else []) + \
                ([f"unexpected {extra[:6]}"] if extra else []) + \
                ([f"shape mismatch {shapes[:6]}"] if shapes else [])
        raise ShardwiseConfigError(f"{source}: weights do not fit the model ({'; '.join(parts)}): "
                                   "the model config and the weights must come from the same "
                                   "checkpoint")
    for k, t in target.items():
        t.copy_(state[k].to(t.dtype))


# ------------------------------------------------------------------------------ checkpoints

def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder, its ``checkpoints/`` folder (→ the one ``latest`` names), or a
    ``step_N`` folder → the ``step_N`` folder. Raises ShardwiseConfigError saying what is
    there."""
    p = Path(path)
    if not p.exists():
        raise ShardwiseConfigError(f"--checkpoint {p}: no such folder: give a run folder, its "
                                   "checkpoints/ folder or a checkpoints/step_N folder")
    for base in (p, p / "checkpoints"):
        latest = base / "latest"
        if latest.is_file():
            name = latest.read_text().strip()
            if not (base / name).is_dir():
                raise ShardwiseConfigError(f"{latest} names {name!r}, which does not exist: "
                                           "pass a complete checkpoints/step_N folder")
            return base / name
    if (p / "meta.json").exists() or (p / ".metadata").exists():
        return p
    raise ShardwiseConfigError(f"--checkpoint {p}: no checkpoint there (no meta.json/.metadata, "
                               "no checkpoints/latest): pass a run folder or a checkpoints/step_N "
                               "folder")


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, Path]:
    """The model tensors (our FQN → full-shape fp32 tensor), ``meta.json`` and the step folder
    of a checkpoint, read on this one process (``dcp.load(no_dist=True)``; the optimizer state is
    not read). Raises ShardwiseConfigError naming the file when something is missing or corrupt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    step = resolve_checkpoint(path)
    meta_path = step / "meta.json"
    if not meta_path.is_file():
        raise ShardwiseConfigError(f"{meta_path}: missing: the checkpoint is incomplete (its "
                                   "save did not finish): use an earlier checkpoints/step_N")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardwiseConfigError(f"{meta_path}: not valid JSON ({e}): the checkpoint is "
                                   "corrupt: use an earlier checkpoints/step_N") from None
    _check_marker(step, meta)
    try:
        md = FileSystemReader(str(step)).read_metadata()
    except Exception as e:  # missing or corrupt .metadata
        raise ShardwiseConfigError(f"{step / '.metadata'}: cannot be read ({type(e).__name__}): "
                                   "the checkpoint is corrupt or incomplete: use an earlier "
                                   "checkpoints/step_N") from None
    state = {}
    for key, tmd in md.state_dict_metadata.items():
        for prefix in ("model.", "model/"):
            if key.startswith(prefix) and hasattr(tmd, "size"):
                state[key] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    if not state:
        raise ShardwiseConfigError(f"{step}: no model tensors in the checkpoint (keys "
                                   f"{sorted(md.state_dict_metadata)[:4]}): not a shardwise "
                                   "checkpoint")
    _check_storage_files(step, md)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(step), no_dist=True)
    except (Exception, CheckpointException) as e:  # corrupt .distcp: assorted errors, which
        # DCP wraps in CheckpointException (a BaseException whose text holds a traceback)
        inner = next(iter(getattr(e, "failures", {}).values()), e)
        inner = getattr(inner, "exc", inner)
        raise ShardwiseConfigError(f"{step}: the tensor files cannot be read "
                                   f"({type(inner).__name__}: {str(inner).splitlines()[0][:160]}):"
                                   " the checkpoint is corrupt: use an earlier "
                                   "checkpoints/step_N") from None
    model = {k.split(".", 1)[1] if k.startswith("model.") else k.split("/", 1)[1]: v.float()
             for k, v in state.items()}
    return model, meta, step


def _check_marker(step: Path, meta: dict) -> None:
    """Checkpoints written with a completion marker (``COMPLETE``: the files and their sizes,
    train/checkpoint.py, meta ``format`` ≥ 2) must have it, and every file must have the size it
    had when written."""
    marker = step / "COMPLETE"
    if not marker.is_file():
        if meta.get("format", 1) >= 2:
            raise ShardwiseConfigError(f"checkpoint {step} has no completion marker (COMPLETE): its "
                                       "save did not finish: use an earlier checkpoints/step_N")
        return
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise ShardwiseConfigError(f"{marker}: unreadable completion marker ({e}): use an "
                                   "earlier checkpoints/step_N") from None
    for rel, want in files.items():
        f = step / rel
        if not f.is_file() or f.stat().st_size != want.get("bytes", f.stat().st_size):
            have = f.stat().st_size if f.is_file() else "missing"
            raise ShardwiseConfigError(f"{f}: {have} bytes but {want.get('bytes')} were written: "
                                       "the checkpoint is corrupt: use an earlier "
                                       "checkpoints/step_N")


def _check_storage_files(step: Path, md) -> None:
    """Every byte range the DCP metadata promises must exist: names a missing or truncated
    ``.distcp`` file (a crash mid-copy, a full disk) instead of a deep unpickling error."""
    need: dict[str, int] = {}
    for info in getattr(md, "storage_data", {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            need[path] = max(need.get(path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = step / rel
        if not f.is_file():
            raise ShardwiseConfigError(f"{f}: missing (listed in {step / '.metadata'}): the "
                                       "checkpoint is incomplete: use an earlier "
                                       "checkpoints/step_N")
        if f.stat().st_size < size:
            raise ShardwiseConfigError(f"{f}: truncated ({f.stat().st_size} of {size} bytes): the "
                                       "checkpoint is corrupt: use an earlier checkpoints/step_N")


def checkpoint_model_config(state: dict[str, torch.Tensor], meta: dict):
    """The LlamaConfig (a MoEConfig for a mixture of experts) a checkpoint was trained with:
    ``meta["model_config"]`` when the run recorded it, else the run config's preset +
    ``n_layers`` + ``tie_embeddings`` (+ the ``--init-from-hf`` folder's architecture), with the
    vocabulary read off the embedding. Raises ShardwiseConfigError for a model that is not
    Llama-style, or when the tensors do not fit that config (listing them)."""
    from ..models import MOE_PRESETS, PRESETS, LlamaConfig, MoEConfig, preset_config

    run = meta.get("config", {})
    if "model_config" in meta:
        mc = meta["model_config"] or {}
        try:
            cfg = (MoEConfig if "n_experts" in mc else LlamaConfig)(**mc)
        except TypeError as e:  # e.g. the regression MLP's config
            raise ShardwiseConfigError(f"the checkpoint's model ({e}) is not a Llama-style "
                                       "model: only the Llama and MoE models export to "
                                       "HF") from None
    else:
        name = run.get("model", "")
        if name not in PRESETS and name not in MOE_PRESETS:
            raise ShardwiseConfigError(f"the checkpoint's model {name!r} is not a Llama preset: "
                                       "only the Llama models (tiny/small/base) and the MoE "
                                       "ones export to HF")
        if "tok_embeddings.weight" not in state:
            raise ShardwiseConfigError("the checkpoint has no tok_embeddings.weight (a pipeline "
                                       "checkpoint missing a stage?): cannot export")
        over = {"vocab_size": state["tok_embeddings.weight"].shape[0],
                "tie_embeddings": run.get("tie_embeddings", True)}
        if run.get("n_layers"):
            over["n_layers"] = run["n_layers"]
        if run.get("init_from_hf") and Path(run["init_from_hf"]).is_dir():
            over.update({k: v for k, v in hf_model_overrides(run["init_from_hf"]).items()
                         if k != "vocab_size"})
        cfg = preset_config(name, **over)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_for(cfg).named_parameters()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    bad = [f"{k}: checkpoint {got.get(k, 'missing')} vs config {expected.get(k, 'absent')}"
           for k in sorted(set(expected) | set(got)) if got.get(k) != expected.get(k)]
    if bad:
        raise ShardwiseConfigError(f"the checkpoint's tensors do not fit its model config "
                                   f"({len(bad)} mismatched: {bad[:6]}): was it written by another "
                                   "version or edited?")
    return cfg


# ------------------------------------------------------------------------------- tokenizers

def byte_tokenizer_json():
    """Our :class:`~shardwise.data.ByteTokenizer` (ids 0..255 = UTF-8 bytes, 256 = EOS) as a
    ``tokenizers.Tokenizer``: a byte-level BPE with no merges whose vocabulary puts byte ``b``
    at id ``b`` (GPT-2's byte→unicode alphabet), then ``<|endoftext|>`` at 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's reversible byte → printable-unicode map (Radford et al. 2019, encoder.py)
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _tokenizer_from_run(run: dict, step: Path):
    """Our tokenizer of a run, or None: a ``tokenizer.json`` saved beside the checkpoint, else
    rebuilt from the run config (bytes, a tokenizer file, or the cached BPE of its data)."""
    from ..data.tokenizer import ByteTokenizer, load_tokenizer

    for cand in (step / "tokenizer.json", step.parent.parent / "tokenizer.json"):
        if cand.is_file():
            return load_tokenizer(str(cand), None, 0, Path("."))
    spec = run.get("tokenizer", "bpe")
    hf_tok = Path(run.get("init_from_hf") or "") / "tokenizer.json"
    if spec == "bpe" and run.get("init_from_hf") and hf_tok.is_file():
        spec = str(hf_tok)  # what train/workload.py's tokenizer_spec resolved it to
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json"):
        return load_tokenizer(spec, None, 0, Path("."))
    if run.get("task") == "sft":
        from ..data.sft import prepare_sft_data

        return prepare_sft_data(run["data"], spec, run.get("vocab_size", 4096),
                                run.get("seq_len", 128)).tokenizer
    from ..data import prepare_lm_data

    return prepare_lm_data(run.get("data") or None, spec, run.get("vocab_size", 4096),
                           run.get("seq_len", 128)).tokenizer


def write_tokenizer_files(tok, out: Path, max_len: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (PreTrainedTokenizerFast) for ``tok``."""
    from ..data.tokenizer import ByteTokenizer

    text = byte_tokenizer_json().to_str() if isinstance(tok, ByteTokenizer) else tok.to_str()
    (out / "tokenizer.json").write_text(text)
    eos = json.loads(text)
    eos_tok = next((a["content"] for a in eos.get("added_tokens", [])
                    if a.get("id") == tok.eos_id), "<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_tok, "bos_token": eos_tok,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False}, indent=2))


# ----------------------------------------------------------------------------------- export

def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike,
              tokenizer: str | None = None) -> Path:
    """Write a LlamaForCausalLM folder ``out`` from one of our checkpoints (see module doc); a
    MixtralForCausalLM folder when the checkpoint's model is a mixture of experts.

    ``tokenizer``: a tokenizer ``.json`` to ship instead of the run's own. The folder is written
    as ``out.tmp`` and renamed when complete. Returns ``out``. Raises ShardwiseConfigError for
    an existing non-empty ``out``, a missing/corrupt checkpoint, or a non-Llama model."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardwiseConfigError(f"export: {out} already exists and is not empty: choose a "
                                   "new output folder or remove it")
    state, meta, step = read_checkpoint(checkpoint)
    cfg = checkpoint_model_config(state, meta)
    check_hf_exportable(cfg)  # before anything is written
    run = meta.get("config", {})
    try:
        if tokenizer:
            from ..data.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer, None, 0, Path("."))
        else:
            tok = _tokenizer_from_run(run, step)
    except ShardwiseConfigError as e:
        raise ShardwiseConfigError(f"export: could not rebuild the run's tokenizer ({e}): pass "
                                   "--tokenizer FILE.json") from None
    if tok.vocab_size > cfg.vocab_size:
        raise ShardwiseConfigError(f"export: the tokenizer has {tok.vocab_size} ids but the model "
                                   f"only {cfg.vocab_size} embeddings: pass the run's own "
                                   "--tokenizer")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ShardwiseConfigError("export --to hf needs safetensors: pip install "
                                   "'shardwise[hf]'") from None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ShardwiseConfigError(f"export: cannot create {tmp} ({e.strerror}): choose a "
                                   "writable output folder") from None
    hf = {k: v.contiguous() for k, v in ours_to_hf(state, cfg).items()}
    save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(llama_to_hf_config(cfg, tok.eos_id), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id}, indent=2))
    write_tokenizer_files(tok, tmp, cfg.max_seq_len)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out
