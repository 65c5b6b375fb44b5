"""Hugging Face ``config.json`` ↔ our :class:`~shardwise.models.LlamaConfig` /
:class:`~shardwise.models.MoEConfig`: reading a folder's config (:func:`read_hf_config`,
:func:`hf_to_llama_config`, :func:`hf_model_kind`, :func:`hf_model_overrides`), writing one
(:func:`llama_to_hf_config`, :func:`mixtral_to_hf_config`), what export can represent
(:func:`check_hf_exportable`), RoPE scaling, the router coefficients (Mixtral: :mod:`.hf_names`)
and the start-up line's :func:`describe_source`.

**The other dense families** are the same decoder with a few config fields
(:mod:`shardwise.models.llama`; ``family`` names the architecture export writes):

* **Mistral** (``model_type = "mistral"``, MistralForCausalLM): Llama's tensors and names under
  its own config class. ``sliding_window`` W (also Mixtral's): our attention is full causal
  attention, which is exactly the windowed one while a sequence has at most W tokens, so the
  window is kept in the config (and exported) and ``--seq-len`` > W is refused with that fix.
* **Llama 3.x** (``rope_scaling`` / ``rope_parameters`` of type ``llama3``): the scaled RoPE
  frequencies of :mod:`shardwise.models.rope`, kept in the config and written back on export;
  Llama 3.2's tied embeddings are ``tie_word_embeddings``. The RoPE keys are read by
  transformers 5's rule (:func:`hf_rope`: a non-empty ``rope_scaling`` replaces
  ``rope_parameters``; θ inside the dict wins over the top-level ``rope_theta``).
* **Qwen2** (``"qwen2"``): Llama plus biases on q_proj, k_proj, v_proj (``qkv_bias``), names
  ``self_attn.{q,k,v}_proj.bias``; ``use_sliding_window`` must be off.
* **Qwen3** (``"qwen3"``): Llama plus an RMSNorm over each head's q and k before RoPE
  (``qk_norm``; ``self_attn.q_norm.weight``, ``k_norm.weight`` [hd]), ``head_dim`` given in
  config.json (our ``attn_head_dim``; it need not be hidden_size / heads), optional
  ``attention_bias`` (q, k, v, o).
* **GPT-2** (``"gpt2"``, GPT2LMHeadModel): learned positions, LayerNorm with bias, a GELU MLP,
  biases everywhere, tied embeddings, and a fused q‖k‖v ``c_attn`` stored as a transposed
  Conv1D, split at import and fused at export: :mod:`.gpt2`.

Errors: every bad config raises :class:`~shardwise.errors.ShardwiseConfigError` naming the file
and the fix. Nothing here needs a process group.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..errors import ShardwiseConfigError
from ..models.rope import LLAMA3_KEYS, ROPE_TYPES
from ..readers import read_json

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
    data = read_json(path, "--init-from-hf", "re-save the model with save_pretrained")
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
    # transformers' defaults where a field is absent: LlamaConfig's, or MixtralConfig's
    mixtral = mt == "mixtral"
    theta0, eps0, pos0 = {"mixtral": (1e6, 1e-5, 4096 * 32), "mistral": (1e4, 1e-6, 4096 * 32),
                          "qwen2": (1e4, 1e-6, 32768), "qwen3": (1e4, 1e-6, 32768)
                          }.get(mt, (10000.0, 1e-6, 2048))
    try:
        max_pos = int(hf.get("max_position_embeddings", pos0))
    except (TypeError, ValueError) as e:
        raise ShardwiseConfigError(f"{source}: max_position_embeddings: {e}") from None
    theta, scaling = hf_rope(hf, source, theta0, max_pos)
    try:
        d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kw = dict(
            vocab_size=int(hf["vocab_size"]), d_model=d,
            n_layers=int(hf["num_hidden_layers"]), n_heads=h,
            n_kv_heads=int(hf.get("num_key_value_heads") or h),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=max_pos, rope_theta=theta,
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


def hf_rope(hf: dict, source: str = "config.json", default_theta: float = 10000.0,
            max_positions: int = 2048) -> tuple[float, dict | None]:
    """(RoPE base θ, our ``rope_scaling`` or None) of the config dict ``hf``, read as
    transformers 5 reads ``config.json`` (``RotaryEmbeddingConfigMixin`` in
    modeling_rope_utils.py: ``convert_rope_params_to_dict``, then ``standardize_rope_params``),
    so the model we build turns by the angles transformers' does:

    1. ``rope_scaling`` (transformers 4's key), when present and not empty, *replaces*
       ``rope_parameters`` (5's) whole: the two dicts are never merged;
    2. θ is the chosen dict's ``rope_theta``, else the top-level ``rope_theta``, else the
       family's default (10⁴; Mixtral 10⁶);
    3. the type is the dict's ``rope_type``, else its legacy ``type``, else ``"default"``;
    4. a ``llama3`` dict without ``original_max_position_embeddings`` takes
       ``max_position_embeddings``.

    tests/test_hf_refusals.py checks this against transformers' own config objects. Raises
    ShardwiseConfigError, naming the key and the file, for a type other than ``default`` and
    ``llama3`` (yarn, linear, dynamic, longrope …: :mod:`shardwise.models.rope` has no other), a
    dict per layer type, a θ that is not a positive number, a llama3 dict that lacks a factor
    or rotates only part of each head (``partial_rotary_factor`` ≠ 1)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ShardwiseConfigError(f"{source}: {key} = {rope!r}: expected a JSON object such as "
                                   '{"rope_type": "default", "rope_theta": 10000.0}: re-save the '
                                   "model with save_pretrained")
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:
        raise ShardwiseConfigError(f"{source}: {key} gives RoPE per layer type ({nested}): "
                                   "shardwise uses one RoPE in every layer: use a checkpoint with "
                                   "one flat rope_parameters")
    theta = rope["rope_theta"] if "rope_theta" in rope else hf.get("rope_theta", default_theta)
    where = f"{key}.rope_theta" if "rope_theta" in rope else "rope_theta"
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ShardwiseConfigError(f"{source}: {where} = {theta!r}: the RoPE base must be a "
                                   "positive number (Llama: 10000.0 or 500000.0): re-save the "
                                   "model with save_pretrained")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ShardwiseConfigError(
            f"{source}: {key}: RoPE scaling {rope_type!r} is not implemented (shardwise has "
            "plain RoPE and Llama 3's 'llama3' scaling: models/rope.py): use a checkpoint "
            f"without that {key}")
    if rope_type == "default":
        return float(theta), None
    rope = {"original_max_position_embeddings": max_positions, **rope}
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise ShardwiseConfigError(f"{source}: {key} of type 'llama3' lacks {missing}: re-save "
                                   "the model with save_pretrained")
    bad = [f"{k} = {rope[k]!r}" for k in LLAMA3_KEYS
           if isinstance(rope[k], bool) or not isinstance(rope[k], (int, float))]
    if bad:
        raise ShardwiseConfigError(f"{source}: {key}: {', '.join(bad)}: the llama3 factors must "
                                   "be numbers: re-save the model with save_pretrained")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ShardwiseConfigError(f"{source}: partial_rotary_factor = {partial!r}: shardwise's "
                                   "RoPE turns every pair of each head: only checkpoints without "
                                   "it (or 1.0) load")
    return float(theta), {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_KEYS}}


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

