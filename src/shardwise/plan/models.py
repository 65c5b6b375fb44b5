"""Model shapes the planner knows: Llama 3 8B/70B/405B, GPT-3 175B, Megatron's GPT runs, and any
:class:`~shardwise.models.LlamaConfig` (our own ``tiny``/``small``/``base``, and ``llama-1b``:
16 layers, d 2048, 32 heads, 8 kv heads, SwiGLU 8192, vocabulary 32,000, untied, s = 2048 —
1.10 B parameters, the one-GPU shape of ``benchmarks/gpu.sh``).

A :class:`ModelSpec` holds what the cost model needs: layers ``L``, width ``d``, heads ``h``, kv
heads ``k`` (head dim ``hd = d/h``, kv width ``kvd = k·hd``), SwiGLU/GeLU hidden size ``f``,
vocabulary ``V``, training sequence length ``s``, and the conventions that decide how many bytes
of activations a layer keeps for backward (``kernels``, ``flash_attention``, ``dropout``; see
:mod:`shardwise.plan.cost`).

Sources of the presets:

* Llama 3 8B / 70B / 405B — Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 3
  (layers 32/80/126, model dim 4096/8192/16384, FFN dim 14336/28672/53248, heads 32/64/128, 8 KV
  heads, vocabulary 128,000 → 128,256 in the released tokenizer, untied embeddings, RoPE,
  sequence 8,192 in pre-training (§3.4.1)).
* GPT-3 175B — Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (96 layers,
  d 12288, 96 heads, context 2048, f = 4d, learned positions, biases, LayerNorm, tied embeddings),
  with the vocabulary padded to 51,200 as Megatron-LM does (Korthikanti et al. 2022, §6: v = 51200).
* megatron-22b / mt-nlg-530b / megatron-1t — the GPT models of Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Table 3 (heads / hidden /
  layers: 64/6144/48, 128/20480/105, 160/25600/128; s = 2048, v = 51200).

Mixtures of experts (``n_experts`` E > 0): every ``moe_every``-th block (block i when
``i % moe_every == 0``, the rule of :class:`shardwise.models.MoEConfig` and Megatron's
``moe_layer_freq``) replaces its MLP by a router (d·E, no bias), E routed experts of hidden size
``d_expert`` (0: ``d_ff``) of which ``top_k`` k run per token, and ``n_shared_experts`` always-on
experts of the same size. Total parameters (:meth:`ModelSpec.num_params`, what memory holds)
count all E; active parameters (:meth:`ModelSpec.num_active_params`, what a token's FLOPs use)
count k + n_shared. Presets (dimensions as published; sources per preset below):

* mixtral-8x7b / mixtral-8x22b — Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088,
  Table 1 (8x7B: dim 4096, 32 layers, head_dim 128, hidden 14336, 32 heads, 8 kv heads, vocab
  32,000, 8 experts, top 2; "47B parameters … 13B active", Mistral AI's release: 46.7B / 12.9B);
  8x22B from Mistral AI's release ("141B parameters, 39B active") and its Hugging Face
  config.json (mistralai/Mixtral-8x22B-v0.1: hidden 6144, 56 layers, 48 heads, 8 kv heads,
  intermediate 16384, vocab 32,000, 8 experts, top 2). Untied embeddings, RoPE, RMSNorm.
* dbrx — Databricks, "Introducing DBRX" (2024-03-27: 132B total, 36B active, 16 experts choose
  4) and its config.json (databricks/dbrx-base: d_model 6144, 40 layers, 48 heads, 8 kv heads,
  ffn_hidden_size 10752, vocab 100,352). DBRX's LayerNorm has no bias: as many parameters as
  RMSNorm's weight, counted as ``rmsnorm``.
* llama4-scout / llama4-maverick — Meta's config.json of Llama-4-Scout-17B-16E and
  Llama-4-Maverick-17B-128E (text model: hidden 5120, 48 layers, 40 heads, 8 kv heads, head_dim
  128, expert intermediate 8192, dense intermediate_size_mlp 16384, vocab 202,048, one routed
  expert per token plus one shared expert; Scout 16 experts in every layer, Maverick 128 experts
  in every second layer, ``interleave_moe_layer_step`` 2); Meta's release: 17B active, 109B and
  400B total (with the vision encoder, which the text model here leaves out). Hugging Face puts
  Maverick's MoE layers at the odd indices, this spec at the even ones (the count, 24, is what
  the cost model uses). Its QK-norm has no weights; NoPE layers and chunked attention are not
  modelled (attention FLOPs over the full square, as for every model here).

Sequence length of the MoE presets: 4,096, the length of Megatron-Core's reference mappings for
Mixtral (the validation run of docs/planner.md §9); none of these models publishes its
pre-training length as Llama 3 does. Override it with ``--seq-len``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from ..errors import ShardwiseConfigError
from ..readers import read_toml


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (see the module docstring for the symbols).

    ``mlp``: "swiglu" (three d×f matrices) or "gelu" (two). ``norm``: "rmsnorm" (weight) or
    "layernorm" (weight + bias). ``bias``: linear layers have biases. ``learned_positions``: size of
    a learned position table (0 = RoPE, no parameters). ``kernels``: "fused" (production kernels:
    a norm keeps input and output, flash attention with native GQA, fused SwiGLU) or "eager"
    (shardwise's own Llama in PyTorch eager mode; see
    :func:`shardwise.plan.cost.layer_activation_bytes`).
    ``flash_attention``: the attention core keeps O(s) memory (False: the s×s probabilities are
    kept, as in Megatron-LM 2022). ``dropout``: dropout after attention and MLP (1-byte masks).

    Mixture of experts (the module docstring): ``n_experts`` E (0 = dense), ``top_k`` k,
    ``n_shared_experts``, ``d_expert`` (0: ``d_ff``), ``moe_every``. Refused: top_k outside
    1..E, MoE fields on a dense model, biases on an MoE model (their count is not modelled).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    bias: bool = False
    tie_embeddings: bool = False
    learned_positions: int = 0
    dropout: bool = False
    flash_attention: bool = True
    kernels: str = "fused"
    source: str = ""
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    d_expert: int = 0
    moe_every: int = 1

    def __post_init__(self):
        for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                    "seq_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShardwiseConfigError(f"model {self.name}: {key} = {v!r} must be a "
                                           "positive integer")
        if self.d_model % self.n_heads:
            raise ShardwiseConfigError(f"model {self.name}: n_heads = {self.n_heads} must "
                                       f"divide d_model = {self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ShardwiseConfigError(f"model {self.name}: n_kv_heads = {self.n_kv_heads} "
                                       f"must divide n_heads = {self.n_heads}")
        for key, allowed in (("mlp", ("swiglu", "gelu")), ("norm", ("rmsnorm", "layernorm")),
                             ("kernels", ("fused", "eager"))):
            if getattr(self, key) not in allowed:
                raise ShardwiseConfigError(f"model {self.name}: {key} = "
                                           f"{getattr(self, key)!r}: choose from {allowed}")
        for key in ("n_experts", "top_k", "n_shared_experts", "d_expert", "moe_every"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < (key == "moe_every"):
                raise ShardwiseConfigError(f"model {self.name}: {key} = {v!r} must be an "
                                           f"integer ≥ {int(key == 'moe_every')}")
        if self.n_experts == 0 and (self.top_k or self.n_shared_experts or self.d_expert):
            raise ShardwiseConfigError(
                f"model {self.name}: top_k / n_shared_experts / d_expert describe experts, but "
                "n_experts = 0 (a dense model): set n_experts, or drop them")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ShardwiseConfigError(
                f"model {self.name}: top_k = {self.top_k} must be between 1 and n_experts = "
                f"{self.n_experts}: a token cannot choose more experts than exist")
        if self.n_experts and self.bias:
            raise ShardwiseConfigError(f"model {self.name}: a mixture-of-experts model with "
                                       "biases is not modelled: set bias = false")

    # -- shapes ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """k·hd: width of K (and of V)."""
        return self.n_kv_heads * self.head_dim

    @property
    def n_mlp_mats(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    # -- mixture of experts ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_ff(self) -> int:
        """f_e: hidden size of one expert (``d_expert``, or ``d_ff`` when 0)."""
        return self.d_expert or self.d_ff

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) is a mixture of experts: ``i % moe_every == 0``."""
        return self.is_moe and i % self.moe_every == 0

    def moe_layers_in(self, start: int, count: int) -> int:
        """MoE blocks among blocks ``start … start + count − 1`` (a pipeline stage): the
        multiples of ``moe_every`` in the range, counted in closed form (the search asks this
        for every layout and stage)."""
        if not self.is_moe or count <= 0:
            return 0
        k = self.moe_every
        return (start + count - 1) // k - (start - 1) // k if start > 0 else \
            (count - 1) // k + 1

    @property
    def n_moe_layers(self) -> int:
        """L_m: the MoE blocks of the model."""
        return self.moe_layers_in(0, self.n_layers)

    def expert_params(self) -> int:
        """One expert: (2 or 3)·d·f_e (SwiGLU: w1, w3 [f_e, d], w2 [d, f_e])."""
        return self.n_mlp_mats * self.d_model * self.expert_ff

    def router_params(self) -> int:
        """The router of one MoE block: d·E (no bias)."""
        return self.d_model * self.n_experts

    def shared_params(self) -> int:
        """The shared experts of one MoE block: n_shared · one expert."""
        return self.n_shared_experts * self.expert_params()

    # -- parameters --------------------------------------------------------------------------
    def attention_matmul_params(self) -> int:
        """wq d·d, wk and wv d·kvd each, wo d·d."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim

    def layer_matmul_params(self, moe: bool = False) -> int:
        """Weights of the matmuls of one layer: attention (:meth:`attention_matmul_params`) and
        the MLP, (2 or 3)·d·f; an MoE layer (``moe``) has the router, the shared experts and all
        E experts instead (every parameter it holds)."""
        if moe:
            return (self.attention_matmul_params() + self.router_params() + self.shared_params()
                    + self.n_experts * self.expert_params())
        return self.attention_matmul_params() + self.n_mlp_mats * self.d_model * self.d_ff

    def layer_active_matmul_params(self, moe: bool = False) -> int:
        """The matmul weights one token passes through in one layer: a dense layer's all of
        them; an MoE layer's attention, router, shared experts and top_k of the E experts."""
        if moe:
            return (self.attention_matmul_params() + self.router_params() + self.shared_params()
                    + self.top_k * self.expert_params())
        return self.layer_matmul_params()

    def layer_small_params(self) -> int:
        """Norm weights (and biases) and linear biases of one layer (not sharded by TP in the
        cost model: replicated, as Megatron-LM replicates norms)."""
        d = self.d_model
        norms = 2 * d * (2 if self.norm == "layernorm" else 1)
        biases = 0
        if self.bias:  # q, k, v, o; MLP in (1 or 2 of width f) and out (d)
            biases = d + 2 * self.kv_dim + d + (self.n_mlp_mats - 1) * self.d_ff + d
        return norms + biases

    def layer_params(self, moe: bool = False) -> int:
        return self.layer_matmul_params(moe) + self.layer_small_params()

    def embedding_params(self) -> int:
        """Token embedding V·d plus a learned position table."""
        return self.vocab_size * self.d_model + self.learned_positions * self.d_model

    def head_params(self) -> int:
        """Final norm, plus the output projection V·d unless it is tied to the embedding."""
        final_norm = self.d_model * (2 if self.norm == "layernorm" else 1)
        return final_norm + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def num_params(self) -> int:
        """Ψ: every parameter once (a tied embedding counted once; every expert): what memory
        holds. Mixtral 8x7B: 46,702,792,704."""
        L, Lm = self.n_layers, self.n_moe_layers
        return ((L - Lm) * self.layer_params() + Lm * self.layer_params(moe=True)
                + self.embedding_params() + self.head_params())

    def num_active_params(self) -> int:
        """Parameters one token uses: :meth:`num_params` less the (E − k) experts it skips in
        every MoE block (Mixtral's "active parameters": 8x7B 12,879,925,248). = num_params for
        a dense model."""
        return (self.num_params()
                - self.n_moe_layers * (self.n_experts - self.top_k) * self.expert_params())

    def num_expert_params(self) -> int:
        """The routed experts' parameters, L_m·E·(2 or 3)·d·f_e: what expert parallelism
        shares out (router and shared experts stay with the dense parameters)."""
        return self.n_moe_layers * self.n_experts * self.expert_params()

    def layer_tensors(self, moe: bool = False) -> int:
        """Parameter tensors of one layer: wq wk wv wo, the MLP's (2 or 3), the norms (and
        biases); an MoE layer: the router, the experts stacked as (2 or 3) tensors [E, …] (as
        :class:`shardwise.models.moe.Experts` stores them) and the shared experts' (2 or 3)."""
        per = 4 + 2 * (2 if self.norm == "layernorm" else 1)
        if self.bias:
            per += 4 + self.n_mlp_mats - 1 + 1
        if moe:
            return per + 1 + self.n_mlp_mats + (self.n_mlp_mats if self.n_shared_experts else 0)
        return per + self.n_mlp_mats

    def top_tensors(self) -> int:
        """Parameter tensors outside the layers: embedding (and positions), final norm, and
        the output projection unless tied."""
        return (1 + (1 if self.learned_positions else 0) + (2 if self.norm == "layernorm" else 1)
                + (0 if self.tie_embeddings else 1))

    def num_tensors(self) -> int:
        """Number of parameter tensors (an optimizer keeps one step counter per tensor)."""
        L, Lm = self.n_layers, self.n_moe_layers
        return (L - Lm) * self.layer_tensors() + Lm * self.layer_tensors(True) + self.top_tensors()

    def matmul_params(self) -> int:
        """N of the 6N rule: the weights that take part in a matmul per token — every layer's
        active matmuls (:meth:`layer_active_matmul_params`: an MoE layer's top_k experts, not
        all E) plus the output projection V·d (computed even when tied); the input embedding
        is a lookup (0 FLOPs). Korthikanti et al. 2022 App. A / Narayanan et al. 2021 eq. 3;
        Megatron-LM's ``num_floating_point_operations`` counts an MoE layer the same way
        (top_k experts; it leaves out the router's d·E, 0.01 % of Mixtral's N)."""
        L, Lm = self.n_layers, self.n_moe_layers
        return ((L - Lm) * self.layer_active_matmul_params()
                + Lm * self.layer_active_matmul_params(moe=True)
                + self.vocab_size * self.d_model)

    def describe(self) -> str:
        moe = ""
        if self.is_moe:
            every = f" every {self.moe_every} layers" if self.moe_every > 1 else ""
            shared = f" + {self.n_shared_experts} shared" if self.n_shared_experts else ""
            moe = (f" ({self.num_active_params() / 1e9:,.2f} B active), {self.n_experts} "
                   f"experts{every}, top {self.top_k}{shared}, f_e={self.expert_ff}")
        return (f"{self.name}: {self.num_params() / 1e9:,.2f} B parameters{moe}, "
                f"L={self.n_layers}, d={self.d_model}, heads={self.n_heads}/{self.n_kv_heads} kv, "
                f"f={self.d_ff}, V={self.vocab_size:,}, s={self.seq_len}")


def _llama3(name, L, d, h, f):
    return ModelSpec(name, n_layers=L, d_model=d, n_heads=h, n_kv_heads=8, d_ff=f,
                     vocab_size=128256, seq_len=8192,
                     source="Llama 3 Herd of Models, arXiv 2407.21783, Table 3")


def _megatron_gpt(name, L, d, h, source, vocab=51200):
    return ModelSpec(name, n_layers=L, d_model=d, n_heads=h, n_kv_heads=h, d_ff=4 * d,
                     vocab_size=vocab, seq_len=2048, mlp="gelu", norm="layernorm", bias=True,
                     tie_embeddings=True, learned_positions=2048, dropout=True,
                     flash_attention=False, source=source)


def _moe(name, L, d, h, kv, f, V, E, k, f_e=0, shared=0, every=1, source=""):
    return ModelSpec(name, n_layers=L, d_model=d, n_heads=h, n_kv_heads=kv, d_ff=f,
                     vocab_size=V, seq_len=4096, n_experts=E, top_k=k, d_expert=f_e,
                     n_shared_experts=shared, moe_every=every, source=source)


_KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Table 3"
_MIXTRAL = "Jiang et al. 2024, Mixtral of Experts, arXiv 2401.04088, Table 1"
_LLAMA4 = "Meta, Llama-4-{}-17B config.json (text model)"
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    "gpt3-175b": _megatron_gpt("gpt3-175b", 96, 12288, 96,
                               "Brown et al. 2020, Table 2.1; vocab padded to 51,200"),
    "megatron-22b": _megatron_gpt("megatron-22b", 48, 6144, 64, _KORTHIKANTI),
    "mt-nlg-530b": _megatron_gpt("mt-nlg-530b", 105, 20480, 128, _KORTHIKANTI),
    "megatron-1t": _megatron_gpt("megatron-1t", 128, 25600, 160, _KORTHIKANTI),
    # mixtures of experts: (L, d, h, kv, f, V, E, k, f_e, shared, every)
    "mixtral-8x7b": _moe("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 8, 2, source=_MIXTRAL),
    "mixtral-8x22b": _moe("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32000, 8, 2,
                          source="Mistral AI release; mistralai/Mixtral-8x22B-v0.1 config.json"),
    "dbrx": _moe("dbrx", 40, 6144, 48, 8, 10752, 100352, 16, 4,
                 source="Databricks, Introducing DBRX (2024); databricks/dbrx-base config.json"),
    "llama4-scout": _moe("llama4-scout", 48, 5120, 40, 8, 16384, 202048, 16, 1, 8192, 1,
                         source=_LLAMA4.format("Scout") + "-16E"),
    "llama4-maverick": _moe("llama4-maverick", 48, 5120, 40, 8, 16384, 202048, 128, 1, 8192,
                            1, every=2, source=_LLAMA4.format("Maverick") + "-128E"),
}


def from_llama_config(cfg, seq_len: int | None = None, name: str = "llama",
                      kernels: str = "eager") -> ModelSpec:
    """The :class:`ModelSpec` of a :class:`shardwise.models.LlamaConfig` (our own model: RMSNorm
    without biases, RoPE, SwiGLU, GQA, ``tie_embeddings`` as configured), or of a
    :class:`shardwise.models.MoEConfig` (its n_experts, top_k, n_shared_experts, d_expert,
    moe_every too). ``kernels="eager"`` counts activations the way our PyTorch-eager
    implementation keeps them (exact for the dense model; for the MoE blocks an estimate)."""
    moe = {}
    if getattr(cfg, "n_experts", None) is not None:
        moe = dict(n_experts=cfg.n_experts, top_k=cfg.top_k,
                   n_shared_experts=cfg.n_shared_experts, d_expert=cfg.d_expert,
                   moe_every=cfg.moe_every)
    return ModelSpec(name, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size,
                     seq_len=seq_len or cfg.max_seq_len, tie_embeddings=cfg.tie_embeddings,
                     dropout=cfg.dropout > 0, kernels=kernels,
                     source=f"shardwise.models.{type(cfg).__name__}", **moe)


@functools.lru_cache(maxsize=64)
def train_model_config(spec: ModelSpec):
    """The config ``shardwise train`` would build for ``spec`` (a
    :class:`~shardwise.models.LlamaConfig`, or a :class:`~shardwise.models.MoEConfig` for an
    MoE spec): the same shape (layers, width, heads, kv heads, d_ff, vocabulary, ``max_seq_len``
    = the training sequence), norm, MLP, positions, biases, tied embeddings and dropout
    (0.1 where the spec has dropout). What the planner hands to train's own layout check,
    :meth:`~shardwise.parallel.layout.Layout.check` (:func:`~.layout.check_train`). Cached: a
    frozen spec, an immutable use."""
    from ..models import LlamaConfig, MoEConfig

    kw = dict(vocab_size=spec.vocab_size, d_model=spec.d_model, n_layers=spec.n_layers,
              n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, d_ff=spec.d_ff,
              max_seq_len=max(spec.seq_len, spec.learned_positions),
              tie_embeddings=spec.tie_embeddings, dropout=0.1 if spec.dropout else 0.0,
              norm="layer" if spec.norm == "layernorm" else "rms", mlp=spec.mlp,
              pos="learned" if spec.learned_positions else "rope", qkv_bias=spec.bias,
              o_bias=spec.bias, mlp_bias=spec.bias)
    if not spec.is_moe:
        return LlamaConfig(**kw)
    return MoEConfig(**kw, n_experts=spec.n_experts, top_k=spec.top_k,
                     n_shared_experts=spec.n_shared_experts, d_expert=spec.d_expert,
                     moe_every=spec.moe_every)


def model_names() -> list[str]:
    from ..models import MOE_PRESETS
    from ..models import PRESETS as OURS

    return sorted(PRESETS) + sorted(OURS) + sorted(MOE_PRESETS)


def get_model(name: str) -> ModelSpec:
    """A preset (:data:`PRESETS`, or shardwise's own tiny/small/base and moe-tiny/moe-small at
    vocab 4096, sequence 128, eager kernels; ``llama-1b`` at its vocabulary 32,000
    (:data:`shardwise.models.llama.PRESET_VOCAB`), sequence 2048, untied) or a TOML file of
    :class:`ModelSpec` fields. Raises ShardwiseConfigError."""
    from ..models import MOE_PRESETS, preset_config
    from ..models import PRESETS as OURS
    from ..models.llama import PRESET_VOCAB

    if name in PRESETS:
        return PRESETS[name]
    if name in PRESET_VOCAB:  # a preset meant for one shape (llama-1b: V 32,000, s 2048)
        cfg = preset_config(name, PRESET_VOCAB[name])
        return from_llama_config(cfg, seq_len=cfg.max_seq_len, name=name)
    if name in OURS or name in MOE_PRESETS:
        return from_llama_config(preset_config(name), seq_len=128, name=name)
    if name.endswith(".toml"):
        return load_model(name)
    raise ShardwiseConfigError(f"--model {name!r} is not a preset: choose from {model_names()} "
                               "or give a FILE.toml with the ModelSpec fields")


def load_model(path: str) -> ModelSpec:
    """A :class:`ModelSpec` from TOML (keys = field names, e.g. ``n_layers = 32``)."""
    data = read_toml(path, "--model")
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    bad = set(data) - fields
    if bad:
        raise ShardwiseConfigError(f"--model {path}: unknown key(s) {sorted(bad)}; valid: "
                                   f"{sorted(fields)}")
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    required = {"n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "seq_len"} - set(data)
    if required:
        raise ShardwiseConfigError(f"--model {path}: missing key(s) {sorted(required)}")
    data.setdefault("n_kv_heads", data["n_heads"])
    return ModelSpec(**data)
