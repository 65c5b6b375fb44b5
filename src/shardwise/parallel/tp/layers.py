"""The tensor-parallel layers: each takes the plain module it replaces and keeps this rank's shard.

Megatron-LM's split (Shoeybi et al. 2019, arXiv 1909.08053, §3; with sequence parallelism,
Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2): column-parallel layers run no collective, a
row-parallel one ends with a SUM over tp, and a block enters and leaves the TP region once per
column → row pair (the collectives: :mod:`.comms`). Shapes: ``b`` batch, ``s`` sequence, ``d``
d_model, ``h``/``k`` query/kv heads, ``hd`` head dim, ``f`` d_ff, ``V`` vocabulary, ``n`` = tp.
Derivation, vocabulary padding and the dropout RNG policy: docs/tensor-parallel.md §1, §4.
A layer whose forward depends on the layout keeps the layout's :class:`~.options.TPOptions` as
``self.options`` (:meth:`~.loss.VocabParallelLoss.gathered_logits` swaps it for one without SP).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ShardwiseConfigError
from ...models.llama import Attention, FeedForward, causal_attention, mlp_hidden, rms_norm
from ..numerics import linear_fn_of
from ..params import mark_tp_shard, shard_of
from .comms import AXIS, CopyToTP, GatherFromSP, ReduceFromTP, ReduceScatterToSP, along
from .options import TPOptions


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of ``tp`` ≥ ``vocab_size`` (Megatron pads to a multiple of 128·tp
    for kernel efficiency; a multiple of tp is all correctness needs)."""
    return -(-vocab_size // tp) * tp


class TPRNG:
    """Two saved RNG states for dropout (Megatron's ``CudaRNGStatesTracker``; the policy:
    docs/tensor-parallel.md §1): ``"replicated"`` (the same mask on every tp rank) seeded
    ``seed + 1000·dp_index``, ``"sharded"`` (a different mask per tp rank) seeded
    ``seed + 2718 + tp_index + 1000·dp_index`` (Megatron's ``model_parallel_cuda_manual_seed``).

    ``fork(region)`` runs its block with that state in ``topo.device``'s default generator, then
    saves the advanced state and restores the default one (``ValueError`` for another region)."""

    REGIONS = ("replicated", "sharded")

    def __init__(self, seed: int, topo):
        self.device = topo.device
        dp_i = topo.index("dp") if topo.size("dp") > 1 else 0
        seeds = {"replicated": seed + 1000 * dp_i,
                 "sharded": seed + 2718 + topo.index(AXIS) + 1000 * dp_i}
        self.states = {}
        for region, s in seeds.items():
            g = torch.Generator(device=self.device)
            g.manual_seed(s)
            self.states[region] = g.get_state()

    def _get(self):
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, region: str):
        if region not in self.REGIONS:
            raise ValueError(f"unknown RNG region {region!r}: {self.REGIONS}")
        saved = self._get()
        self._set(self.states[region])
        try:
            yield
        finally:
            self.states[region] = self._get()
            self._set(saved)


# -- entering and leaving the TP region -----------------------------------------------------------
def enter_tp_region(x: torch.Tensor, topo, options: TPOptions) -> torch.Tensor:
    """Replicated [b, s, d] (f: identity fwd, all-reduce bwd) or, with SP (``options.sp``),
    sequence shard [b, s/n, d] → all-gather → [b, s, d] (reduce-scatter bwd)."""
    if options.sp:
        return GatherFromSP.apply(x, topo, AXIS, 1)
    return CopyToTP.apply(x, topo, AXIS)


def exit_tp_region(x: torch.Tensor, topo, options: TPOptions) -> torch.Tensor:
    """Partial sums [b, s, d] → all-reduce → replicated [b, s, d] (g), or, with SP
    (``options.sp``), reduce-scatter → [b, s/n, d] (all-gather bwd)."""
    if options.sp:
        return ReduceScatterToSP.apply(x, topo, AXIS, 1)
    return ReduceFromTP.apply(x, topo, AXIS)


# -- layers ---------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by output columns. ``weight``: [out/n, in] (nn.Linear layout:
    rows of Aᵀ), sharded on dim 0 over tp; rank i holds output features [i·out/n, (i+1)·out/n),
    and ``bias`` (None when the plain layer has none) the same features [out/n] (Megatron §3:
    the bias is split with the output dim). forward: X [..., in], replicated over tp → Y_i
    [..., out/n], **no collective**: the caller enters the TP region once
    (:func:`enter_tp_region`) for all column layers sharing an input."""

    def __init__(self, plain: nn.Linear, topo, padded_out: int | None = None,
                 weight: nn.Parameter | None = None):
        super().__init__()
        if weight is None:
            weight = nn.Parameter(shard_of(plain.weight, 0, topo, padded_out))
        self.weight = mark_tp_shard(weight, 0, plain.out_features)
        self.bias = None
        if plain.bias is not None:
            self.bias = mark_tp_shard(nn.Parameter(shard_of(plain.bias, 0, topo, padded_out)),
                                      0, plain.out_features)
        self.linear_fn = linear_fn_of(plain)  # F.linear, or a numerics transform's op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)  # [..., out/n]


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i A_i + b with A split by input rows. ``weight``: [out, in/n], sharded on dim 1
    over tp; rank i holds input features [i·in/n, (i+1)·in/n). ``bias`` [out] (None when the
    plain layer has none) is replicated and added once, after the sum (adding it on every rank
    before the reduce would count it n times; Megatron §3). forward: X_i [b, s, in/n] (the
    column layers' output) → local partial product → exit the TP region: all-reduce (g) → Y
    [b, s, out] replicated, or with SP reduce-scatter → [b, s/n, out] → + b. Under SP the bias
    sees only this rank's s/n positions, so its gradient is a partial sum over tp, completed
    with the norm weights' (``sp_grad``: every tp-replicated parameter)."""

    def __init__(self, plain: nn.Linear, topo, options: TPOptions):
        super().__init__()
        self.topo, self.options = topo, options
        self.weight = mark_tp_shard(nn.Parameter(shard_of(plain.weight, 1, topo)), 1,
                                    plain.in_features)
        self.bias = None if plain.bias is None else nn.Parameter(plain.bias.detach().clone())
        self.linear_fn = linear_fn_of(plain)  # F.linear, or a numerics transform's op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exit_tp_region(self.linear_fn(x, self.weight, None), self.topo, self.options)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding, its table split by vocabulary rows over tp (an ``nn.Embedding``, so
    that AdamW's no-decay group for embeddings finds it). ``weight``: [V_pad/n, d], rank i holds
    token ids [i·V_pad/n, (i+1)·V_pad/n) (V_pad = V padded to a multiple of n; padded rows are
    zero and never looked up). forward: tokens [b, s] (same on every tp rank) → local lookup,
    zeros for ids this rank does not own → exit the TP region: all-reduce (g sums the rows) →
    [b, s, d], or with SP reduce-scatter → [b, s/n, d]."""

    def __init__(self, plain: nn.Embedding, topo, options: TPOptions):
        if plain.padding_idx is not None or plain.max_norm is not None:
            raise ShardwiseConfigError("VocabParallelEmbedding: padding_idx/max_norm are not "
                                       "supported")
        n = topo.size(AXIS)
        vocab, d = plain.weight.shape
        padded = padded_vocab_size(vocab, n)
        super().__init__(padded // n, d, _weight=shard_of(plain.weight, 0, topo, padded))
        mark_tp_shard(self.weight, 0, vocab)
        self.topo, self.options = topo, options
        self.vocab_size, self.vocab_start = vocab, topo.index(AXIS) * (padded // n)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start  # [b, s]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, d]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # not ours: contributes 0 (and no grad)
        return exit_tp_region(x, self.topo, self.options)


class VocabParallelHead(ColumnParallelLinear):
    """The output head, column-parallel over the (padded) vocabulary. ``weight``: [V_pad/n, d]
    — with tied embeddings the *same* Parameter as :class:`VocabParallelEmbedding`'s shard.
    forward: hidden [b, s, d] (SP: [b, s/n, d]) → enter the TP region → local logits
    [b, s, V_pad/n] for entries [vocab_start, vocab_start + V_pad/n), never gathered (feed them to
    :func:`.loss.vocab_parallel_cross_entropy`). With ``gather_output`` (inference only, else
    RuntimeError) the logits are all-gathered over tp and unpadded → [b, s, V]."""

    def __init__(self, plain: nn.Linear, topo, options: TPOptions,
                 weight: nn.Parameter | None = None):
        n = topo.size(AXIS)
        padded = padded_vocab_size(plain.out_features, n)
        super().__init__(plain, topo, padded_out=padded, weight=weight)
        self.topo, self.options, self.gather_output = topo, options, False
        self.vocab_size, self.vocab_start = plain.out_features, topo.index(AXIS) * (padded // n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(enter_tp_region(x, self.topo, self.options))  # [b, s, V_pad/n]
        if not self.gather_output:
            return logits
        if torch.is_grad_enabled():
            raise RuntimeError("VocabParallelHead.gather_output is for inference (no_grad) only")
        full = along(logits, self.topo, AXIS, -1, "logits", gather=True)  # [b, s, V_pad]
        return full[..., : self.vocab_size]  # [b, s, V]


class TPPositionEmbedding(nn.Embedding):
    """Learned absolute positions (GPT-2's ``wpe``) under TP: the table [P, d] is replicated
    (it is small, and the sum with the token embedding happens where the activation is
    replicated or sequence-sharded); an ``nn.Embedding``, so that AdamW's no-decay group for
    embeddings finds it. forward: positions [b or 1, s] int64 → [.., s, d], or
    with SP this tp rank's sequence shard [.., s/n, d] (the same rows
    :class:`VocabParallelEmbedding`'s reduce-scatter hands it). No collective; under SP the
    table's gradient covers only this rank's positions: summed over tp with the other
    replicated parameters (``sp_grad``), or, with ``grad_sum`` (the DTensor engine, whose SP
    finisher sums only DTensor ``Partial`` gradients), by f on the weight (:class:`.comms.
    CopyToTP`: all-reduce of its gradient in backward, tag ``tp_bwd``)."""

    def __init__(self, plain: nn.Embedding, topo, options: TPOptions, grad_sum: bool = False):
        super().__init__(*plain.weight.shape, _weight=plain.weight.detach())
        self.weight = plain.weight  # the same Parameter (replicated: nothing to cut)
        self.topo, self.options, self.grad_sum = topo, options, grad_sum

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.options.sp:
            n, i = self.topo.size(AXIS), self.topo.index(AXIS)
            s = positions.shape[1]
            if s % n:
                raise ValueError(f"sequence parallelism: tp={n} does not divide the sequence "
                                 f"length {s}")
            positions = positions[:, i * s // n:(i + 1) * s // n]
        w = CopyToTP.apply(self.weight, self.topo, AXIS) if self.grad_sum else self.weight
        return F.embedding(positions, w)


class TPSummedNorm(nn.Module):
    """Qwen3's per-head q/k RMSNorm on this rank's heads, without SP: the weight [hd] is
    replicated but each tp rank's heads reach only their share of its gradient, so the weight
    enters through f (:class:`.comms.CopyToTP`: identity forward, all-reduce of its gradient
    backward, tag ``tp_bwd``). With SP the block already holds the whole sequence here, and the
    partial gradient is summed with the other replicated parameters (``sp_grad``) instead."""

    def __init__(self, plain, topo):
        super().__init__()
        self.weight, self.eps, self.topo = plain.weight, plain.eps, topo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, CopyToTP.apply(self.weight, self.topo, AXIS), self.eps)


class TPDropout(nn.Module):
    """Dropout on the residual branch, drawn from the RNG region that matches the layout:
    ``"replicated"`` without SP (same mask on every tp rank), ``"sharded"`` with SP (each rank
    its own sequence shard, its own mask). x: any shape → same shape."""

    def __init__(self, p: float, rng: TPRNG, options: TPOptions):
        super().__init__()
        self.p, self.rng, self.options = p, rng, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork("sharded" if self.options.sp else "replicated"):
            return F.dropout(x, self.p, training=True)


class TensorParallelAttention(nn.Module):
    """Causal GQA attention split by heads. wq: column [h/n·hd, d]; wk, wv: column [k/n·hd, d];
    wo: row [d, h/n·hd]. Rank i owns query heads [i·h/n, (i+1)·h/n) and kv heads
    [i·k/n, (i+1)·k/n), which keeps query head j with its kv head ⌊j·k/h⌋ (so tp divides h and
    k). Attention dropout acts on local heads: RNG region ``"sharded"``. forward: x [b, s, d]
    (SP: [b, s/n, d]) → enter → the plain model's :func:`~shardwise.models.llama.causal_attention`
    on the local heads → [b, s, h/n·hd] → wo (row: exit) → [b, s, d] (SP: [b, s/n, d])."""

    def __init__(self, plain: Attention, topo, options: TPOptions, rng: TPRNG):
        super().__init__()
        self.topo, self.options, self.rng = topo, options, rng
        self.head_dim, self.dropout = plain.head_dim, plain.dropout
        self.wq = ColumnParallelLinear(plain.wq, topo)
        self.wk = ColumnParallelLinear(plain.wk, topo)
        self.wv = ColumnParallelLinear(plain.wv, topo)
        self.wo = RowParallelLinear(plain.wo, topo, options)
        self.core = plain.core  # plain, or context parallelism's (on the local heads)
        self.rope = plain.rope
        self.q_norm, self.k_norm = plain.q_norm, plain.k_norm  # replicated [hd] (Qwen3)
        if plain.q_norm is not None and not options.sp:
            self.q_norm, self.k_norm = (TPSummedNorm(plain.q_norm, topo),
                                        TPSummedNorm(plain.k_norm, topo))

    def forward(self, x, cos, sin, mask=None):  # mask: a packed row's document mask
        x = enter_tp_region(x, self.topo, self.options)  # [b, s, d], replicated over tp
        p = self.dropout if self.training else 0.0
        if not self.rope:
            cos = sin = None
        with self.rng.fork("sharded") if p > 0 else contextlib.nullcontext():
            y = causal_attention(x, self.wq, self.wk, self.wv, self.head_dim, cos, sin, p,
                                 self.core, self.q_norm, self.k_norm, mask)
        return self.wo(y)  # [b, s, h/n·hd] → [b, s, d] or [b, s/n, d]


class TensorParallelSwiGLU(nn.Module):
    """SwiGLU w2(silu(w1 x) · w3 x) with w1, w3 column-parallel [f/n, d] and w2 row-parallel
    [d, f/n]: the gate product is element-wise on the local f/n hidden units, so no collective
    runs between them. A GELU MLP (GPT-2: w2(gelu(w1 x)), no w3) is split the same way (the
    GELU is element-wise too). forward: x [b, s, d] (SP: [b, s/n, d]) → enter → [b, s, f/n] →
    w2 (exit) → [b, s, d] (SP: [b, s/n, d])."""

    def __init__(self, plain: FeedForward, topo, options: TPOptions):
        super().__init__()
        self.topo, self.options, self.kind = topo, options, plain.kind
        self.w1 = ColumnParallelLinear(plain.w1, topo)
        self.w3 = None if plain.w3 is None else ColumnParallelLinear(plain.w3, topo)
        self.w2 = RowParallelLinear(plain.w2, topo, options)

    def forward(self, x):
        x = enter_tp_region(x, self.topo, self.options)  # [b, s, d]
        return self.w2(mlp_hidden(self.kind, self.w1, self.w3, x))  # [b, s, f/n] → exit
