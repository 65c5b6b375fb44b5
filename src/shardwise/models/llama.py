"""A plain Llama-style decoder that knows nothing of parallelism.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, RoPE; the
"rotate-half" layout that Hugging Face's LlamaForCausalLM uses, so weights map 1:1), SwiGLU MLP
(Shazeer 2020), grouped-query attention (Ainslie et al. 2023) through
``scaled_dot_product_attention``, optional tied input/output embeddings (Press & Wolf 2017).

The same decoder expresses the other families people fine-tune (:mod:`.families`; Hugging Face
folders: :mod:`shardwise.interop.hf`) through a few config fields, so the parallel plans, which
name the modules, see the same tree: ``norm`` ("rms" | "layer": LayerNorm with bias),
``mlp`` ("swiglu" | "gelu" | "gelu_tanh": a two-matmul GELU MLP w2(gelu(w1 x)), no w3), ``pos``
("rope" | "learned": a ``pos_embeddings`` table added to the token embedding, GPT-2), biases
(``qkv_bias``: Qwen2; ``o_bias``, ``mlp_bias``: GPT-2), ``qk_norm`` (an RMSNorm over each
head's q and k before RoPE: Qwen3), ``attn_head_dim`` (a head size other than d/h, Qwen3) and
``family`` (the Hugging Face architecture it exports to).

Shapes: ``b`` batch, ``s`` sequence, ``d`` d_model, ``h`` heads, ``k`` kv heads, ``hd`` head dim,
``f`` d_ff, ``V`` vocab. Module names follow Meta's Llama (``tok_embeddings``, ``layers.{i}.
attention.wq``, ``feed_forward.w1`` …) so parallel plans can name them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .ac import CheckpointedBlock
from .rope import check_rope_scaling, inv_frequencies
from .sdpa import SDPA_GQA


@dataclasses.dataclass
class LlamaConfig:
    """Dimensions of a Llama-style model. ``d_ff`` is the SwiGLU hidden size."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 688
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    # model families (module docstring; models/families.py): the defaults are Llama
    family: str = "llama"  # llama | mistral | qwen2 | qwen3 | gpt2: the HF architecture
    norm: str = "rms"  # rms (RMSNorm) | layer (LayerNorm with bias)
    mlp: str = "swiglu"  # swiglu | gelu | gelu_tanh (two-matmul GELU MLP, no w3)
    pos: str = "rope"  # rope | learned (pos_embeddings [max_seq_len, d])
    qkv_bias: bool = False  # biases on wq, wk, wv
    o_bias: bool = False  # bias on wo
    mlp_bias: bool = False  # biases on w1 (w3), w2
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before RoPE
    attn_head_dim: int = 0  # 0: d_model / n_heads
    # Llama 3 RoPE scaling ({"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}: models/rope.py), None = plain
    rope_scaling: dict | None = None
    # Mistral's sliding attention window (tokens; 0 = none). Our attention is full causal, which
    # equals the windowed one exactly while a sequence is at most this long: longer ones are
    # refused (config.validate before the run; Llama.forward here), never silently changed
    sliding_window: int = 0

    def __post_init__(self):
        if not self.attn_head_dim and self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError("head_dim = d_model / n_heads must be even for RoPE")
        check_rope_scaling(self.rope_scaling)
        for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("pos", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose from {allowed}")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    def num_params(self) -> int:
        """Parameter count Ψ (tied embeddings counted once)."""
        d, f, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norm = 2 * d if self.norm == "layer" else d
        mats = 3 if self.mlp == "swiglu" else 2
        block = 2 * d * q + 2 * d * kv + mats * d * f + 2 * norm
        block += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        block += ((mats - 1) * f + d) * self.mlp_bias + 2 * self.head_dim * self.qk_norm
        pos = self.max_seq_len * d if self.pos == "learned" else 0
        return V * d * (1 if self.tie_embeddings else 2) + L * block + norm + pos


NORMS, MLPS, POSITIONS = ("rms", "layer"), ("swiglu", "gelu", "gelu_tanh"), ("rope", "learned")


# Named presets. `tiny` is for tests (fast on one CPU thread); `small` is the embedded default
# (~4 M parameters at vocab 4096).
PRESETS = {
    "tiny": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688, max_seq_len=1024),
    "base": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1376, max_seq_len=2048),
    # ~1.1 B at vocab 32,000 (PRESET_VOCAB), untied: 16·60.8 M blocks + 2·65.5 M embeddings;
    # fp32 weights + grads + AdamW = 16 B/param ≈ 17.7 GB, one GPU (benchmarks/gpu.sh)
    "llama-1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                     max_seq_len=2048, tie_embeddings=False),
}
# The vocabulary a preset is meant for, where the data's tokenizer does not decide it (the
# planner's table and the GPU benchmark use it; training takes the tokenizer's vocabulary)
PRESET_VOCAB = {"llama-1b": 32000}


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight, computed in fp32. x: [..., d] → [..., d]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s function, with the weight given (TP passes it through a collective)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """y = (x − mean) / sqrt(var + eps) · weight + bias over the last dim, in fp32 (Ba et al.
    2016; GPT-2's ``ln_1``/``ln_2``/``ln_f``). x: [..., d] → [..., d]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(),
                         self.eps)
        return y.to(x.dtype)


def make_norm(cfg: LlamaConfig, dim: int | None = None) -> nn.Module:
    """The block/final norm of ``cfg`` (``cfg.norm``) over ``dim`` (default d_model)."""
    dim = cfg.d_model if dim is None else dim
    return LayerNorm(dim, cfg.norm_eps) if cfg.norm == "layer" else RMSNorm(dim, cfg.norm_eps)


def rope_cache(seq_len: int, head_dim: int, theta: float, scaling: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [seq_len, head_dim] for rotate-half RoPE (Su et al. 2021, eq. 34);
    ``scaling``: Llama 3's frequency scaling (:mod:`.rope`), None for plain RoPE."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)  # [hd/2]
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [s, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, hd] by position: x·cos + rotate_half(x)·sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class CoreAttention(nn.Module):
    """softmax(q·kᵀ/√hd + causal mask)·v per head, with GQA: q [b, h, s, hd], k and v
    [b, k, s, hd] (each kv head serves h/k query heads) → [b, h, s, hd], through
    ``scaled_dot_product_attention`` (native GQA, ``enable_gqa=True``, where this torch has
    it; else K/V repeated to h heads: :mod:`.sdpa`). No parameters: Megatron's "core
    attention", the part a sequence-parallel transform replaces (context parallelism: ring
    attention over cp)."""

    def forward(self, q, k, v, dropout_p: float = 0.0, mask=None):
        """``mask``: a packed row's :class:`DocumentMask` (or its boolean [b, 1, s, s] tensor,
        True = may attend) in place of the plain causal mask, or None."""
        if isinstance(mask, DocumentMask):
            mask = mask.dense
        causal = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
        if k.shape[1] != q.shape[1]:  # GQA: each kv head serves h/k query heads
            if SDPA_GQA:  # in the kernel: no repeated K/V [b, h, s, hd] (models/sdpa.py)
                return F.scaled_dot_product_attention(q, k, v, **causal,
                                                      dropout_p=dropout_p, enable_gqa=True)
            rep = q.shape[1] // k.shape[1]  # torch < 2.5: repeat K/V to h heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **causal, dropout_p=dropout_p)


def document_mask(documents: torch.Tensor | None) -> torch.Tensor | None:
    """The block-diagonal causal mask of a packed row: ``documents`` [b, s] (int64, the example
    each token belongs to) → bool [b, 1, s, s], True where query t may attend key u: u ≤ t and
    both in the same document. Each example then sees exactly what it would see alone (with
    its positions restarting at 0: the packed loss equals the unpacked one). None → None."""
    if documents is None:
        return None
    s = documents.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()  # [s, s]
    same = documents.unsqueeze(2) == documents.unsqueeze(1)  # [b, s, s]
    return (same & causal).unsqueeze(1)  # [b, 1, s, s]


class DocumentMask:
    """A packed row's attention mask as the model hands it to every layer's core attention:
    ``documents`` [b, s] (int64, the document of each token; see :func:`document_mask`) and,
    built on first use and then shared by every layer of the forward, ``dense``, the boolean
    [b, 1, s, s] mask. A core that attends in blocks (context parallelism's ring) reads
    ``documents`` instead and never builds ``dense``; :meth:`memo` keeps what a core derives
    from the documents once per forward (e.g. which blocks to skip), for every layer."""

    def __init__(self, documents: torch.Tensor):
        self.documents = documents
        self._memo: dict = {}

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        return document_mask(self.documents)

    def memo(self, key, make):
        """``make()`` on the first call with ``key``, the same object afterwards."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


def causal_attention(x: torch.Tensor, wq, wk, wv, head_dim: int, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, dropout_p: float = 0.0, core=None,
                     q_norm=None, k_norm=None, mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal GQA attention up to the output projection: x [b, s, d] → [b, s, h·hd].

    ``wq``/``wk``/``wv``: the projections (d → h·hd, d → k·hd, d → k·hd). Head counts come from
    their outputs, so a head-sharded (TP) copy runs this on its local heads unchanged. ``cos``,
    ``sin``: RoPE tables [s, hd] (or [b, 1, s, hd] for explicit positions), None for no RoPE
    (learned positions); ``core``: the :class:`CoreAttention` (or a replacement) that attends q
    to k, v after RoPE; ``q_norm``/``k_norm``: callables over [b, s, heads, hd] applied before
    RoPE (Qwen3's per-head RMSNorm), or None; ``mask``: a packed row's
    :class:`DocumentMask`, None for plain causal attention."""
    b, s, _ = x.shape
    q = wq(x).view(b, s, -1, head_dim)  # [b, s, h, hd]
    k = wk(x).view(b, s, -1, head_dim)  # [b, s, k, hd]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, h, s, hd], [b, k, s, hd]
    v = wv(x).view(b, s, -1, head_dim).transpose(1, 2)  # [b, k, s, hd]
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    core = core or CoreAttention()
    y = core(q, k, v, dropout_p) if mask is None else core(q, k, v, dropout_p, mask=mask)
    # y: [b, h, s, hd]
    return y.transpose(1, 2).reshape(b, s, -1)  # [b, s, h·hd]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, s: int,
                positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE rows for a sequence of ``s`` tokens: positions 0..s-1 ([s, hd] each), or the
    given ``positions`` [b, s] (int64; e.g. a context-parallel rank's chunks) → [b, 1, s, hd],
    which broadcasts over heads. Raises ``ValueError`` for a position past the tables
    (max_seq_len) on CPU; on an accelerator the check would sync the host every forward, so
    the index itself fails there (``shardwise train`` checks ``--seq-len`` before any of it)."""
    if positions is None:
        return cos[:s], sin[:s]
    if positions.device.type == "cpu" and positions.numel() and \
            int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"position {int(positions.max())} ≥ max_seq_len {cos.shape[0]}: the "
                         "whole sequence must fit the model's max_seq_len")
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


class Attention(nn.Module):
    """Causal GQA self-attention. wq: d → h·hd, wk/wv: d → k·hd, wo: h·hd → d (biases with
    ``qkv_bias`` / ``o_bias``); ``q_norm``/``k_norm``: RMSNorm over hd with ``qk_norm``, else
    None. ``rope``: whether RoPE rotates q and k (``pos == "rope"``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CoreAttention()
        self.dropout = cfg.dropout
        self.rope = cfg.pos == "rope"

    def forward(self, x, cos, sin, mask=None):
        if not self.rope:
            cos = sin = None
        y = causal_attention(x, self.wq, self.wk, self.wv, self.head_dim, cos, sin,
                             self.dropout if self.training else 0.0, self.core,
                             self.q_norm, self.k_norm, mask)  # [b, s, h·hd]
        return self.wo(y)  # [b, s, d]


def mlp_hidden(kind: str, w1, w3, x: torch.Tensor) -> torch.Tensor:
    """The MLP's hidden activation [..., f] of x [..., d]: SwiGLU silu(w1 x) · w3 x, or
    gelu(w1 x) (``"gelu_tanh"``: the tanh approximation, GPT-2's ``gelu_new``; Hendrycks &
    Gimpel 2016 §2). Column-sharded w1/w3 give the local f/n units (element-wise)."""
    if kind == "swiglu":
        return F.silu(w1(x)) * w3(x)
    return F.gelu(w1(x), approximate="tanh" if kind == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x), w1, w3: d → f; w2: f → d. With ``mlp`` "gelu" /
    "gelu_tanh": w2(gelu(w1 x)) and ``w3`` None. Biases with ``mlp_bias``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.kind = cfg.mlp
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias) \
            if cfg.mlp == "swiglu" else None
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.w2(mlp_hidden(self.kind, self.w1, self.w3, x))


class TransformerBlock(CheckpointedBlock, nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(·)). x [b, s, d] → [b, s, d].

    ``ac_mode`` ("none" | "selective" | "full", see :mod:`.ac`) checkpoints the body *inside*
    this forward, so hooks on the block fire once."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, mask=None):
        """``mask``: a packed row's :class:`DocumentMask`, or None."""
        if mask is None:
            return self.run(self._body, x, cos, sin)
        return self.run(self._body, x, cos, sin, mask)

    def _body(self, x, cos, sin, mask=None):
        attn = self.attention(self.attention_norm(x), cos, sin) if mask is None \
            else self.attention(self.attention_norm(x), cos, sin, mask)
        x = x + self.dropout(attn)
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    """tokens [b, s] int64 (and optional ``positions`` [b, s] int64, default 0..s-1, as Hugging
    Face's ``position_ids``; optional ``documents`` [b, s] for packed rows) → logits [b, s, V]. Loss is computed outside (see
    :func:`lm_loss`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # learned absolute positions (GPT-2), added to the token embedding; None with RoPE
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) \
            if cfg.pos == "learned" else None
        self.layers = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def make_block(self, cfg: LlamaConfig, i: int) -> nn.Module:
        """Block ``i`` (a variant model, e.g. :class:`~.moe.MoELlama`, returns its own)."""
        return TransformerBlock(cfg)

    @torch.no_grad()
    def reset_parameters(self):
        """N(0, init_std) for matrices; output projections (wo, w2) scaled by 1/sqrt(2·layers)
        (GPT-2, Radford et al. 2019 §2.3); norm weights to one, biases to zero."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute what construction computed rather than initialised, on the parameters'
        device: the RoPE tables (non-persistent buffers) and each MoE layer's statistics;
        after a build on the meta device (:mod:`.meta`)."""
        cfg, device = self.config, self.tok_embeddings.weight.device
        cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        for m in self.modules():
            if m is not self and callable(getattr(m, "reset_stats", None)):
                m.reset_stats()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents`` [b, s] int64: a packed row's example of each token (attention stays
        inside it: :class:`DocumentMask`; give the restarting ``positions`` with it)."""
        s = tokens.shape[1]
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} > max_seq_len {self.config.max_seq_len}")
        if self.config.sliding_window and s > self.config.sliding_window:
            raise ValueError(f"sequence length {s} > sliding_window {self.config.sliding_window}"
                             ": full causal attention would differ from the windowed one")
        cos, sin = rope_tables(self.rope_cos, self.rope_sin, s, positions)
        x = embed(self.tok_embeddings, self.pos_embeddings, tokens, positions)  # [b, s, d]
        mask = None if documents is None else DocumentMask(documents)  # None: plain causal
        for layer in self.layers:
            x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask)
        return self.output(self.norm(x))  # [b, s, V]


def embed(tok_embeddings, pos_embeddings, tokens: torch.Tensor,
          positions: torch.Tensor | None) -> torch.Tensor:
    """tokens [b, s] → tok_embeddings(tokens) [b, s, d], plus ``pos_embeddings`` of the
    positions (default 0..s-1, [1, s]) when the model learns them (None: RoPE, nothing added).
    Under TP with SP both modules return this tp rank's sequence shard [b, s/n, d]."""
    x = tok_embeddings(tokens)
    if pos_embeddings is None:
        return x
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return x + pos_embeddings(positions)


IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies and the number of counted tokens.

    logits [b, s, V], labels [b, s] (``IGNORE_INDEX`` = not counted). Returns (loss_sum scalar,
    count scalar int64). Dividing by the *global* count gives the token-weighted mean.
    """
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()


@torch.no_grad()
def generate(model: Llama, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 50, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample ``max_new_tokens`` after ``prompt`` [1, s] (no KV cache: it is a demo)."""
    was_training = model.training
    model.eval()
    out = prompt
    for _ in range(max_new_tokens):
        ctx = out[:, -model.config.max_seq_len:]
        logits = model(ctx)[:, -1, :].float() / max(temperature, 1e-5)
        if top_k:
            v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < v[:, [-1]]] = -float("inf")
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        out = torch.cat([out, nxt], dim=1)
    model.train(was_training)
    return out
