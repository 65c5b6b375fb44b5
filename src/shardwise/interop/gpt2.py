"""Hugging Face ``GPT2LMHeadModel`` folders in and out of our decoder (``family = "gpt2"``).

GPT-2 (Radford et al. 2019) is our :class:`~shardwise.models.Llama` with ``norm = "layer"``
(LayerNorm with bias), ``mlp = "gelu_tanh"`` (``activation_function = "gelu_new"``; ``"gelu"``
is the exact erf GELU), ``pos = "learned"`` (``wpe``), biases on every projection, tied
embeddings, as many kv heads as query heads, and no RoPE. The attention scale is 1/√hd on both
sides (``scale_attn_weights``; ``scale_attn_by_inverse_layer_idx`` is refused).

GPT-2 stores its projections as ``Conv1D``: ``y = x @ W + b`` with W [in, out], the transpose
of ``nn.Linear``'s [out, in]. Its ``c_attn`` fuses q‖k‖v on the output dim: W [d, 3d], b [3d].
Import splits it into our ``wq``/``wk``/``wv`` (each [d, d] after the transpose); export fuses
them back from the *full* tensors of a checkpoint. The fused tensor never exists inside a
layout: under TP each of wq, wk, wv is column-sharded on its own, so every rank keeps whole
heads of q, k and v (a contiguous 1/tp of the fused [3d, d] would hand rank 0 all of q and part
of k instead). Name map (``{i}`` = layer; ``transformer.`` is also accepted missing, as in the
Hub's original ``gpt2`` files)::

    tok_embeddings.weight          transformer.wte.weight            [V, d]
    pos_embeddings.weight          transformer.wpe.weight            [P, d]
    layers.{i}.attention_norm.*    transformer.h.{i}.ln_1.{weight,bias}
    layers.{i}.attention.w{q,k,v}  transformer.h.{i}.attn.c_attn.{weight [d, 3d], bias [3d]}
    layers.{i}.attention.wo        transformer.h.{i}.attn.c_proj      (Conv1D: transposed)
    layers.{i}.ffn_norm.*          transformer.h.{i}.ln_2.{weight,bias}
    layers.{i}.feed_forward.w1     transformer.h.{i}.mlp.c_fc         (Conv1D: transposed)
    layers.{i}.feed_forward.w2     transformer.h.{i}.mlp.c_proj       (Conv1D: transposed)
    norm.*                         transformer.ln_f.{weight,bias}
    output.weight                  lm_head.weight (tied: absent or equal to wte)

Transposes, slices and concatenation move values without arithmetic, so HF → ours → HF is
bitwise. Errors: :class:`~shardwise.errors.ShardwiseConfigError` naming the field or tensor.
"""

from __future__ import annotations

import re

import torch

from ..errors import ShardwiseConfigError
from ..lazy import cat

# the fixed fields of the family (the rest comes from config.json)
GPT2_FIELDS = dict(family="gpt2", norm="layer", pos="learned", qkv_bias=True, o_bias=True,
                   mlp_bias=True, qk_norm=False, attn_head_dim=0, tie_embeddings=True)
_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# tensors GPT-2 files may carry that are buffers, not weights (the causal mask)
_IGNORED = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


def gpt2_config(hf: dict, source: str = "config.json"):
    """A GPT-2 ``config.json`` dict → our LlamaConfig (``family = "gpt2"``), or
    ShardwiseConfigError for what our decoder cannot express (another activation, layer-index
    attention scaling, cross-attention, untied embeddings)."""
    from ..models import LlamaConfig

    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTS:
        raise ShardwiseConfigError(f"{source}: activation_function {act!r}: GPT-2 folders load "
                                   f"with one of {sorted(_ACTS)}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if bool(hf.get(key, ok)) != ok:
            raise ShardwiseConfigError(f"{source}: {key} = {hf[key]}: shardwise's GPT-2 needs "
                                       f"{key} = {ok} (it computes other logits otherwise)")
    try:
        d, h = int(hf["n_embd"]), int(hf["n_head"])
        kw = dict(vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["n_layer"]),
                  n_heads=h, n_kv_heads=h, d_ff=int(hf.get("n_inner") or 4 * d),
                  max_seq_len=int(hf.get("n_positions", 1024)),
                  norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                  init_std=float(hf.get("initializer_range", 0.02)), mlp=_ACTS[act],
                  **GPT2_FIELDS)
    except KeyError as e:
        raise ShardwiseConfigError(f"{source}: missing field {e.args[0]!r}: re-save the model "
                                   "with save_pretrained") from None
    except (TypeError, ValueError) as e:
        raise ShardwiseConfigError(f"{source}: {e}") from None
    try:
        return LlamaConfig(**kw)
    except ValueError as e:
        raise ShardwiseConfigError(f"{source}: {e}") from None


def gpt2_hf_config(cfg, eos_id: int | None = None) -> dict:
    """Our GPT-2-family LlamaConfig → a ``config.json`` dict for GPT2LMHeadModel (dropouts 0)."""
    act = {v: k for k, v in _ACTS.items() if k != "gelu_pytorch_tanh"}[cfg.mlp]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
            "activation_function": act, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": eos_id, "eos_token_id": eos_id,
            "torch_dtype": "float32", "use_cache": True}


def gpt2_mismatch(cfg) -> list[str]:
    """What keeps our config ``cfg`` from being a GPT-2 (empty when it is one)."""
    need = {**GPT2_FIELDS, "n_kv_heads": cfg.n_heads}
    bad = [f"{k}={getattr(cfg, k)!r} (GPT-2: {v!r})" for k, v in need.items()
           if getattr(cfg, k) != v]
    if cfg.mlp not in ("gelu", "gelu_tanh"):
        bad.append(f"mlp={cfg.mlp!r} (GPT-2: a GELU MLP)")
    return bad


def gpt2_to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full-shape tensors (plain-model FQNs) → GPT2LMHeadModel names: Conv1D weights
    transposed, q‖k‖v fused into ``c_attn`` (module docstring); ``output.weight`` (tied) left
    out. New tensors (``contiguous`` copies), or lazy ones for lazy ``state``
    (:mod:`shardwise.lazy`: export reads one at a time). Raises ShardwiseConfigError for a name
    GPT-2 has no place for."""
    out, unknown, done = {}, [], set()
    top = {"tok_embeddings.weight": "transformer.wte.weight",
           "pos_embeddings.weight": "transformer.wpe.weight",
           "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    per = {"attention_norm": "ln_1", "ffn_norm": "ln_2", "attention.wo": "attn.c_proj",
           "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}
    for name, t in state.items():
        if name == "output.weight" or name in done:
            continue
        if name in top:
            out[top[name]] = t.contiguous()
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if not m:
            unknown.append(name)
            continue
        i, mod, kind = m.groups()
        if mod in ("attention.wq", "attention.wk", "attention.wv"):
            parts = [f"layers.{i}.attention.w{x}.{kind}" for x in "qkv"]
            if any(p not in state for p in parts):
                raise ShardwiseConfigError(f"GPT-2 export: layer {i} lacks one of {parts}")
            ts = [state[p] for p in parts]
            fused = cat([x.t() for x in ts], 1) if kind == "weight" else cat(ts)
            out[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.contiguous()
            done.update(parts)
        elif mod in per:
            conv = kind == "weight" and "norm" not in mod
            out[f"transformer.h.{i}.{per[mod]}.{kind}"] = (t.t() if conv else t).contiguous()
        else:
            unknown.append(name)
    if unknown:
        raise ShardwiseConfigError(f"GPT-2 export: no GPT2LMHeadModel name for {unknown[:5]}")
    return out


def gpt2_from_hf_state_dict(hf: dict[str, torch.Tensor], cfg, source: str = "HF"
                            ) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel names → our FQNs (the inverse of :func:`gpt2_to_hf_state_dict`):
    ``c_attn`` [d, 3d] split into wq, wk, wv of d output features each (views), Conv1D weights
    transposed (views), the embedding also as ``output.weight`` (tied). Raises
    ShardwiseConfigError for names it cannot place or a ``c_attn`` whose width is not 3d."""
    d = cfg.d_model
    out, unknown = {}, []
    top = {"wte.weight": "tok_embeddings.weight", "wpe.weight": "pos_embeddings.weight",
           "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}
    per = {"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.c_proj": "attention.wo",
           "mlp.c_fc": "feed_forward.w1", "mlp.c_proj": "feed_forward.w2"}
    for name, t in hf.items():
        if _IGNORED.fullmatch(name) or name == "lm_head.weight":
            continue
        base = name.removeprefix("transformer.")
        if base in top:
            out[top[base]] = t
            continue
        m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", base)
        if not m:
            unknown.append(name)
            continue
        i, mod, kind = m.groups()
        if mod == "attn.c_attn":
            width = t.shape[-1] if kind == "weight" else t.shape[0]
            if width != 3 * d:
                raise ShardwiseConfigError(f"{source}: {name} has shape {tuple(t.shape)}: "
                                           f"c_attn fuses q, k, v of n_embd={d} each, so its "
                                           f"last dim must be {3 * d}")
            for j, x in enumerate("qkv"):
                part = t[:, j * d:(j + 1) * d].t() if kind == "weight" else t[j * d:(j + 1) * d]
                out[f"layers.{i}.attention.w{x}.{kind}"] = part
        elif mod in per:
            conv = kind == "weight" and not mod.startswith("ln")
            out[f"layers.{i}.{per[mod]}.{kind}"] = t.t() if conv else t
        else:
            unknown.append(name)
    if unknown:
        raise ShardwiseConfigError(f"{source}: tensors with no place in shardwise's GPT-2: "
                                   f"{unknown[:6]}: is this a GPT2LMHeadModel folder?")
    if "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
