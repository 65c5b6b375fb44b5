"""Model shapes the planner knows: Llama 3 8B/70B/405B, GPT-3 175B, Megatron's GPT runs, and any
:class:`~shardwise.models.LlamaConfig` (our own ``tiny``/``small``/``base``).

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
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

from ..errors import ShardwiseConfigError


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

    # -- parameters --------------------------------------------------------------------------
    def layer_matmul_params(self) -> int:
        """Weights of the matmuls of one layer: wq d·d, wk and wv d·kvd each, wo d·d, MLP
        (2 or 3)·d·f."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim + self.n_mlp_mats * d * self.d_ff

    def layer_small_params(self) -> int:
        """Norm weights (and biases) and linear biases of one layer (not sharded by TP in the
        cost model: replicated, as Megatron-LM replicates norms)."""
        d = self.d_model
        norms = 2 * d * (2 if self.norm == "layernorm" else 1)
        biases = 0
        if self.bias:  # q, k, v, o; MLP in (1 or 2 of width f) and out (d)
            biases = d + 2 * self.kv_dim + d + (self.n_mlp_mats - 1) * self.d_ff + d
        return norms + biases

    def layer_params(self) -> int:
        return self.layer_matmul_params() + self.layer_small_params()

    def embedding_params(self) -> int:
        """Token embedding V·d plus a learned position table."""
        return self.vocab_size * self.d_model + self.learned_positions * self.d_model

    def head_params(self) -> int:
        """Final norm, plus the output projection V·d unless it is tied to the embedding."""
        final_norm = self.d_model * (2 if self.norm == "layernorm" else 1)
        return final_norm + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def num_params(self) -> int:
        """Ψ: every parameter once (a tied embedding counted once)."""
        return self.n_layers * self.layer_params() + self.embedding_params() + self.head_params()

    def num_tensors(self) -> int:
        """Number of parameter tensors (an optimizer keeps one step counter per tensor)."""
        per_layer = 4 + self.n_mlp_mats + 2 * (2 if self.norm == "layernorm" else 1)
        if self.bias:
            per_layer += 4 + self.n_mlp_mats - 1 + 1
        top = 1 + (1 if self.learned_positions else 0) + (2 if self.norm == "layernorm" else 1)
        return self.n_layers * per_layer + top + (0 if self.tie_embeddings else 1)

    def matmul_params(self) -> int:
        """N of the 6N rule: the weights that take part in a matmul per token — every layer's
        matmuls plus the output projection V·d (computed even when tied); the input embedding
        is a lookup (0 FLOPs). Korthikanti et al. 2022 App. A / Narayanan et al. 2021 eq. 3."""
        return self.n_layers * self.layer_matmul_params() + self.vocab_size * self.d_model

    def describe(self) -> str:
        return (f"{self.name}: {self.num_params() / 1e9:,.2f} B parameters, L={self.n_layers}, "
                f"d={self.d_model}, heads={self.n_heads}/{self.n_kv_heads} kv, f={self.d_ff}, "
                f"V={self.vocab_size:,}, s={self.seq_len}")


def _llama3(name, L, d, h, f):
    return ModelSpec(name, n_layers=L, d_model=d, n_heads=h, n_kv_heads=8, d_ff=f,
                     vocab_size=128256, seq_len=8192,
                     source="Llama 3 Herd of Models, arXiv 2407.21783, Table 3")


def _megatron_gpt(name, L, d, h, source, vocab=51200):
    return ModelSpec(name, n_layers=L, d_model=d, n_heads=h, n_kv_heads=h, d_ff=4 * d,
                     vocab_size=vocab, seq_len=2048, mlp="gelu", norm="layernorm", bias=True,
                     tie_embeddings=True, learned_positions=2048, dropout=True,
                     flash_attention=False, source=source)


_KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Table 3"
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    "gpt3-175b": _megatron_gpt("gpt3-175b", 96, 12288, 96,
                               "Brown et al. 2020, Table 2.1; vocab padded to 51,200"),
    "megatron-22b": _megatron_gpt("megatron-22b", 48, 6144, 64, _KORTHIKANTI),
    "mt-nlg-530b": _megatron_gpt("mt-nlg-530b", 105, 20480, 128, _KORTHIKANTI),
    "megatron-1t": _megatron_gpt("megatron-1t", 128, 25600, 160, _KORTHIKANTI),
}


def from_llama_config(cfg, seq_len: int | None = None, name: str = "llama",
                      kernels: str = "eager") -> ModelSpec:
    """The :class:`ModelSpec` of a :class:`shardwise.models.LlamaConfig` (our own model: RMSNorm
    without biases, RoPE, SwiGLU, GQA, ``tie_embeddings`` as configured). ``kernels="eager"``
    counts activations the way our PyTorch-eager implementation keeps them."""
    return ModelSpec(name, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size,
                     seq_len=seq_len or cfg.max_seq_len, tie_embeddings=cfg.tie_embeddings,
                     dropout=cfg.dropout > 0, kernels=kernels,
                     source="shardwise.models.LlamaConfig")


def model_names() -> list[str]:
    from ..models import PRESETS as OURS

    return sorted(PRESETS) + sorted(OURS)


def get_model(name: str) -> ModelSpec:
    """A preset (:data:`PRESETS`, or shardwise's own tiny/small/base at vocab 4096, sequence
    128, eager kernels) or a TOML file of :class:`ModelSpec` fields. Raises ShardwiseConfigError."""
    from ..models import PRESETS as OURS
    from ..models import LlamaConfig

    if name in PRESETS:
        return PRESETS[name]
    if name in OURS:
        return from_llama_config(LlamaConfig(**OURS[name]), seq_len=128, name=name)
    if name.endswith(".toml"):
        return load_model(name)
    raise ShardwiseConfigError(f"--model {name!r} is not a preset: choose from {model_names()} "
                               "or give a FILE.toml with the ModelSpec fields")


def load_model(path: str) -> ModelSpec:
    """A :class:`ModelSpec` from TOML (keys = field names, e.g. ``n_layers = 32``)."""
    if not os.path.isfile(path):
        raise ShardwiseConfigError(f"--model {path}: no such file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ShardwiseConfigError(f"--model {path}: not valid TOML ({e})") from None
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
