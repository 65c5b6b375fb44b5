"""Tensor names between shardwise's plain models and Hugging Face folders: the Llama-family map
(:func:`to_hf_state_dict`, :func:`from_hf_state_dict`), Mixtral's experts, and the dispatch to
GPT-2's own map (:func:`hf_to_ours`, :func:`ours_to_hf`; :mod:`.gpt2`). Config fields:
:mod:`.hf_config`; reading and writing folders: :mod:`.hf_import`, :mod:`.hf_export`.

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

Errors: :class:`~shardwise.errors.ShardwiseConfigError` naming the tensors and the fix. Nothing
here needs a process group.
"""

from __future__ import annotations

import re

import torch

from ..errors import ShardwiseConfigError
from ..lazy import stack

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
    Mixtral's per-expert tensors are stacked in expert order (:func:`~shardwise.lazy.stack`: a
    copy, or lazy for lazy parts); its transformers-5 names (``mlp.experts.gate_up_proj``, split
    into w1 and w3 as views) load too.
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
            put(name, stack([parts[j] for j in range(len(parts))]))
        except RuntimeError as e:  # experts of unequal shapes
            raise ShardwiseConfigError(f"{source}: {name}: the experts' tensors differ in shape "
                                       f"({str(e).splitlines()[0]}): not a Mixtral "
                                       "checkpoint") from None
    if tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


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

