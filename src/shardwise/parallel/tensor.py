"""Tensor parallelism (TP) with optional sequence parallelism (SP) and a vocab-parallel loss.

Math (Shoeybi et al. 2019, "Megatron-LM", arXiv 1909.08053, §3)
--------------------------------------------------------------
A linear layer Y = X A (A: [in, out]) can be split over n tp ranks in two ways:

* **column-parallel**: A = [A_1 … A_n] split by output columns. Rank i computes Y_i = X A_i from
  the *whole* X; the output features are sharded. No communication in forward.
* **row-parallel**: A = [A_1; …; A_n] split by input rows, X = [X_1 … X_n] split to match.
  Rank i computes the partial product X_i A_i; Y = Σ_i X_i A_i needs a SUM over ranks.

A column layer followed by a row layer therefore needs one all-reduce in forward (Megatron's
**g**, after the row layer) and one in backward (Megatron's **f**, the gradient of the
replicated input of the column layers), and nothing in between: the element-wise op between
them (SwiGLU's silu·mul, attention per head) works on the local shard. In a Llama block:

* attention: wq, wk, wv are column-parallel *by heads* (rank i owns query heads
  [i·h/n, (i+1)·h/n) and, for grouped-query attention, kv heads [i·k/n, (i+1)·k/n) — the same
  contiguous split keeps each query head next to the kv head it reads, so tp must divide both h
  and k); attention runs on the local heads; wo is row-parallel.
* SwiGLU MLP: w1 and w3 column-parallel (f/n hidden units each), silu(w1 x)·(w3 x) local, w2
  row-parallel.
* embedding (**VocabParallelEmbedding**): rows of the table split by vocabulary; a rank looks up
  the tokens it owns, writes zeros for the others, and g sums the rows.
* output head: column-parallel over the vocabulary, producing *local* logits [b, s, V/n].
  The **vocab-parallel cross-entropy** never gathers them (Megatron's
  ``vocab_parallel_cross_entropy``): with z the logits of one token and t its target,
  ``ℓ = log Σ_v exp(z_v − m) − (z_t − m)`` with ``m = max_v z_v``; m is an all-reduce(MAX) of
  the local maxima, Σ exp an all-reduce(SUM) of local sums, and z_t an all-reduce(SUM) in which
  only the rank owning t contributes. The gradient ``softmax(z) − onehot(t)`` is local.
* a vocabulary that n does not divide is padded with zero rows to a multiple of n; padded logits
  are masked to −∞ before the max / sum-exp, so they get probability 0, gradient 0, and stay 0
  under AdamW (zero gradient → zero moments → zero update; weight decay of 0 is 0). No token id
  reaches a padded embedding row. So padding changes neither the loss nor any gradient.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2)
-----------------------------------------------------------------------
Without SP, the activations between TP regions (norms, dropout, residual adds) are replicated:
every tp rank computes the same [b, s, d]. With SP they are split along the sequence instead,
[b, s/n, d], and the all-reduces at the region boundaries become their two halves: entering a
region is an all-gather along the sequence (backward: reduce-scatter), leaving it a
reduce-scatter (backward: all-gather). Same bytes, 1/n of the norm/dropout activations.
The norm weights stay replicated, but each rank now sees only its s/n positions, so their
gradients are partial sums: :meth:`TensorParallel.finish_gradient_sync` all-reduces them over tp.

Collectives per optimizer step (A = bytes of one [b, s, d] activation summed over the step's
micro-batches, L blocks, n = tp; see :func:`tp_step_bytes_formula`)
---------------------------------------------------------------------------------------------
=======================  ===================================  ===================================
where                    without SP                           with SP
=======================  ===================================  ===================================
embedding exit           all-reduce fwd                       reduce-scatter fwd / all-gather bwd
each block (×2: attn,    entry: all-reduce bwd (f);           entry: all-gather fwd / reduce-
MLP)                     exit: all-reduce fwd (g)             scatter bwd; exit: the converse
head entry               all-reduce bwd (f)                   all-gather fwd / reduce-scatter bwd
vocab-parallel CE        all-reduce MAX [N] + SUM [2, N] fp32 (N = tokens), forward only
norm-weight gradients    —                                    all-reduce of (2L+1)·d fp32
global grad norm         all-reduce of one fp64 scalar (sharded params' Σ g²)
=======================  ===================================  ===================================

Both columns total (1 + 2L) · 2(n−1)/n · A forward and the same backward (JAX scaling book ch. 5,
"How to Parallelize a Transformer for Training": per block 2 all-reduces forward, 2 backward).

Dropout RNG policy
------------------
Where an activation is *replicated* over tp (residual-branch dropout without SP), every tp rank
must drop the same elements, or the replicas diverge. Where it is *sharded* (attention dropout on
the local heads; residual dropout on sequence shards with SP), ranks must draw *different* masks,
or the shards get correlated masks. :class:`TPRNG` keeps two RNG states and forks the default
generator into one of them around each dropout (Megatron's ``CudaRNGStatesTracker``):
``"replicated"`` seeded ``seed + 1000·dp_index`` (equal on all tp ranks), ``"sharded"`` seeded
``seed + 2718 + tp_index + 1000·dp_index`` (different on each tp rank; 2718 as in Megatron's
``model_parallel_cuda_manual_seed``). The default generator is restored after each fork, so the
masks do not depend on what else consumes random numbers.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..comm.autograd import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from ..errors import ShardwiseConfigError
from ..models.llama import IGNORE_INDEX, Attention, FeedForward, Llama, apply_rope
from .engine import Engine
from .params import grads_or_zeros, mark_tp_shard, shard_of, sum_coalesced_, tp_sharded

AXIS = "tp"


# -- validation (no collectives: called by config.validate and before any conversion) -------------
def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def valid_tp_degrees(model_config, sp: bool = False, seq_len: int | None = None) -> list[int]:
    """The tp degrees this model accepts: divisors of gcd(n_heads, n_kv_heads, d_ff[, seq_len
    with SP]); with SP, 1 is excluded."""
    g = math.gcd(model_config.n_heads, model_config.n_kv_heads, model_config.d_ff)
    if sp and seq_len:
        g = math.gcd(g, seq_len)
    return [k for k in _divisors(g) if not (sp and k == 1)]


def validate_tp(model_config, tp: int, sp: bool = False, seq_len: int | None = None) -> None:
    """Raise :class:`ShardwiseConfigError` unless ``tp`` (and ``sp``) fit ``model_config``.

    Constraints: tp ≥ 1; ``--sp`` needs tp > 1; tp divides n_heads, n_kv_heads (heads are split
    whole, kv heads are not replicated) and d_ff; with SP, tp divides ``seq_len`` (sequence
    shards are equal). The vocabulary needs no constraint (it is padded). TP needs a Llama-style
    config (``n_heads`` …). Runs no collective. The message names the valid tp values."""
    if not isinstance(tp, int) or tp < 1:
        raise ShardwiseConfigError(f"--tp {tp} must be a positive integer")
    if tp == 1 and not sp:
        return
    llama = all(hasattr(model_config, a) for a in ("n_heads", "n_kv_heads", "d_ff"))
    valid = valid_tp_degrees(model_config, sp, seq_len) if llama else []
    choose = f"choose --tp from {{{', '.join(map(str, valid))}}}" if valid else \
        "no tp > 1 fits this model and sequence length" if llama else "choose --tp > 1"
    if sp and tp == 1:  # the one place this rule is written (Layout.check calls it)
        raise ShardwiseConfigError(
            f"--sp (sequence parallelism) needs --tp > 1: it shards the activations between TP "
            f"regions over the tp ranks; {choose}, or drop --sp")
    if not llama:
        what = (f"this model's config ({type(model_config).__name__}) has no attention heads"
                if model_config is not None else "this model has no config")
        raise ShardwiseConfigError(
            f"--tp {tp}{' --sp' if sp else ''}: tensor parallelism splits the Llama-style models "
            f"(--model tiny, small or base); {what}, so there is no TP plan: choose --model "
            "tiny, small or base, or --tp 1")
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(model_config, name)
        if value % tp:
            raise ShardwiseConfigError(
                f"--tp {tp} does not divide the model's {name}={value} (TP splits it evenly "
                f"over the tp ranks): {choose}")
    if sp and seq_len is not None and seq_len % tp:
        raise ShardwiseConfigError(
            f"--sp: --tp {tp} does not divide --seq-len {seq_len} (sequence parallelism splits "
            f"each sequence evenly over the tp ranks): {choose}, or change --seq-len to a "
            f"multiple of {tp}")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of ``tp`` ≥ ``vocab_size`` (Megatron pads to a multiple of 128·tp
    for kernel efficiency; a multiple of tp is all correctness needs)."""
    return -(-vocab_size // tp) * tp


# -- dropout RNG ----------------------------------------------------------------------------------
class TPRNG:
    """Two saved RNG states for dropout (see "Dropout RNG policy" in the module docstring).

    ``fork("replicated")`` / ``fork("sharded")`` swap the default generator of ``topo.device``
    to that state for the block, save the advanced state, and restore the default generator."""

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
def enter_tp_region(x: torch.Tensor, topo, sp: bool) -> torch.Tensor:
    """Replicated [b, s, d] (f: identity fwd, all-reduce bwd) or, with SP, sequence shard
    [b, s/n, d] → all-gather → [b, s, d] (reduce-scatter bwd)."""
    return gather_from_sp(x, topo, AXIS, dim=1) if sp else copy_to_tp(x, topo, AXIS)


def exit_tp_region(x: torch.Tensor, topo, sp: bool) -> torch.Tensor:
    """Partial sums [b, s, d] → all-reduce → replicated [b, s, d] (g), or, with SP,
    reduce-scatter → [b, s/n, d] (all-gather bwd)."""
    return reduce_scatter_to_sp(x, topo, AXIS, dim=1) if sp else reduce_from_tp(x, topo, AXIS)


# -- layers ---------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by output columns. ``weight``: [out/n, in] (nn.Linear layout: rows of
    Aᵀ), sharded on dim 0 over tp; rank i holds output features [i·out/n, (i+1)·out/n).

    forward: X [..., in], replicated over tp → Y_i [..., out/n]. **No collective**: the caller
    enters the TP region once (:func:`enter_tp_region`) for all column layers sharing an input
    (wq/wk/wv; w1/w3), which is one all-reduce in backward instead of one per layer."""

    def __init__(self, plain: nn.Linear, topo, padded_out: int | None = None,
                 weight: nn.Parameter | None = None):
        super().__init__()
        if plain.bias is not None:
            raise ShardwiseConfigError("ColumnParallelLinear: biases are not supported (the "
                                       "Llama models have none)")
        self.in_features, self.out_features = plain.in_features, plain.out_features
        if weight is None:
            weight = nn.Parameter(shard_of(plain.weight, 0, topo, padded_out))
        self.weight = mark_tp_shard(weight, 0, plain.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [..., out/n]


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i A_i with A split by input rows. ``weight``: [out, in/n], sharded on dim 1 over
    tp; rank i holds input features [i·in/n, (i+1)·in/n).

    forward: X_i [b, s, in/n] (this rank's features, the output of column layers) → local
    partial product → exit the TP region: all-reduce (g) → Y [b, s, out] replicated, or with SP
    reduce-scatter → [b, s/n, out]."""

    def __init__(self, plain: nn.Linear, topo, sp: bool):
        super().__init__()
        if plain.bias is not None:
            raise ShardwiseConfigError("RowParallelLinear: biases are not supported (the Llama "
                                       "models have none)")
        self.topo, self.sp = topo, sp
        self.in_features, self.out_features = plain.in_features, plain.out_features
        self.weight = mark_tp_shard(nn.Parameter(shard_of(plain.weight, 1, topo)), 1,
                                    plain.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp_region(F.linear(x, self.weight), self.topo, self.sp)


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding with its table split by vocabulary rows over tp.

    ``weight``: [V_pad/n, d], rank i holds token ids [i·V_pad/n, (i+1)·V_pad/n) (V_pad = V
    padded to a multiple of n; padded rows are zero and never looked up). forward: tokens [b, s]
    (same on every tp rank) → local lookup, zeros for ids this rank does not own → exit the TP
    region: all-reduce → [b, s, d], or with SP reduce-scatter → [b, s/n, d].

    A subclass of ``nn.Embedding`` so that code treating embeddings specially (AdamW groups: no
    weight decay on embeddings) treats the shard the same way."""

    def __init__(self, plain: nn.Embedding, topo, sp: bool):
        if plain.padding_idx is not None or plain.max_norm is not None:
            raise ShardwiseConfigError("VocabParallelEmbedding: padding_idx/max_norm are not "
                                       "supported")
        n = topo.size(AXIS)
        vocab, d = plain.weight.shape
        padded = padded_vocab_size(vocab, n)
        super().__init__(padded // n, d, _weight=shard_of(plain.weight, 0, topo, padded))
        mark_tp_shard(self.weight, 0, vocab)
        self.topo, self.sp = topo, sp
        self.vocab_size, self.vocab_start = vocab, topo.index(AXIS) * (padded // n)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start  # [b, s]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, d]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # not ours: contributes 0 (and no grad)
        return exit_tp_region(x, self.topo, self.sp)


class VocabParallelHead(ColumnParallelLinear):
    """The output head, column-parallel over the (padded) vocabulary. ``weight``: [V_pad/n, d]
    — with tied embeddings the *same* Parameter as :class:`VocabParallelEmbedding`'s shard.

    forward: hidden [b, s, d] replicated (or [b, s/n, d] with SP) → enter the TP region (f, or
    the SP all-gather) → local logits [b, s, V_pad/n] for vocabulary entries
    [vocab_start, vocab_start + V_pad/n). Feed them to :func:`vocab_parallel_cross_entropy`;
    full logits are never formed. With ``gather_output`` (inference only: sampling, eval
    through code that expects full logits) the logits are all-gathered and unpadded → [b, s, V]."""

    def __init__(self, plain: nn.Linear, topo, sp: bool, weight: nn.Parameter | None = None):
        n = topo.size(AXIS)
        padded = padded_vocab_size(plain.out_features, n)
        super().__init__(plain, topo, padded_out=padded, weight=weight)
        self.topo, self.sp, self.gather_output = topo, sp, False
        self.vocab_size, self.vocab_start = plain.out_features, topo.index(AXIS) * (padded // n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(enter_tp_region(x, self.topo, self.sp))  # [b, s, V_pad/n]
        if not self.gather_output:
            return logits
        if torch.is_grad_enabled():
            raise RuntimeError("VocabParallelHead.gather_output is for inference (no_grad) only")
        n = self.topo.size(AXIS)
        shard = logits.movedim(-1, 0).contiguous()  # [V_pad/n, b, s]
        full = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
        comm.all_gather(full, shard, self.topo, AXIS, tag="logits")
        return full[: self.vocab_size].movedim(0, -1)  # [b, s, V]


class TPDropout(nn.Module):
    """Dropout on the residual branch, drawn from the RNG region that matches the layout:
    ``"replicated"`` without SP (same mask on every tp rank), ``"sharded"`` with SP (each rank
    its own sequence shard, its own mask). x: any shape → same shape."""

    def __init__(self, p: float, rng: TPRNG, sp: bool):
        super().__init__()
        self.p, self.rng, self.sp = p, rng, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork("sharded" if self.sp else "replicated"):
            return F.dropout(x, self.p, training=True)


class TensorParallelAttention(nn.Module):
    """Causal GQA attention split by heads. wq: column [h/n·hd, d]; wk, wv: column [k/n·hd, d];
    wo: row [d, h/n·hd]. Rank i owns query heads [i·h/n, (i+1)·h/n) and kv heads
    [i·k/n, (i+1)·k/n): since query head j reads kv head ⌊j·k/h⌋, the contiguous split keeps
    every query head on the rank of its kv head. Attention dropout acts on local heads, so it
    draws from the ``"sharded"`` RNG region.

    forward: x [b, s, d] (SP: [b, s/n, d]) → enter → q [b, h/n, s, hd], k/v [b, k/n, s, hd] →
    attention → [b, s, h/n·hd] → wo (row: exit) → [b, s, d] (SP: [b, s/n, d])."""

    def __init__(self, plain: Attention, topo, sp: bool, rng: TPRNG):
        super().__init__()
        n = topo.size(AXIS)
        self.topo, self.sp, self.rng = topo, sp, rng
        self.head_dim, self.dropout = plain.head_dim, plain.dropout
        self.n_heads, self.n_kv_heads = plain.n_heads // n, plain.n_kv_heads // n  # local
        self.wq = ColumnParallelLinear(plain.wq, topo)
        self.wk = ColumnParallelLinear(plain.wk, topo)
        self.wv = ColumnParallelLinear(plain.wv, topo)
        self.wo = RowParallelLinear(plain.wo, topo, sp)

    def forward(self, x, cos, sin):
        x = enter_tp_region(x, self.topo, self.sp)  # [b, s, d], replicated over tp
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # [b, h/n, s, hd]
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [b, k/n, s, hd]
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # GQA: each local kv head serves h/k local q heads
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        with self.rng.fork("sharded") if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, d] or [b, s/n, d]


class TensorParallelSwiGLU(nn.Module):
    """SwiGLU w2(silu(w1 x) · w3 x) with w1, w3 column-parallel [f/n, d] and w2 row-parallel
    [d, f/n]: the gate product is element-wise on the local f/n hidden units, so there is no
    collective between the column and the row layers.

    forward: x [b, s, d] (SP: [b, s/n, d]) → enter → [b, s, f/n] → w2 (exit) → [b, s, d]
    (SP: [b, s/n, d])."""

    def __init__(self, plain: FeedForward, topo, sp: bool):
        super().__init__()
        self.topo, self.sp = topo, sp
        self.w1 = ColumnParallelLinear(plain.w1, topo)
        self.w3 = ColumnParallelLinear(plain.w3, topo)
        self.w2 = RowParallelLinear(plain.w2, topo, sp)

    def forward(self, x):
        x = enter_tp_region(x, self.topo, self.sp)  # [b, s, d]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [b, s, f/n] → exit


# -- the vocab-parallel cross-entropy -------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded over the vocabulary (Megatron-LM's
    ``_VocabParallelCrossEntropy``; math in the module docstring).

    forward(logits [N, V_pad/n] fp32, target [N]) → loss [N] (0 where target == IGNORE_INDEX).
    Collectives (tag ``"ce"``, forward only): all-reduce MAX of [N] (the row maxima), all-reduce
    SUM of [2, N] (Σ exp(z − m) and the target's shifted logit, which only its owner fills in).
    backward: ∂ℓ/∂z = softmax(z) − onehot(t) on the local columns; no collective."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, topo):
        n_local = logits.shape[-1]
        cols = vocab_start + torch.arange(n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # padding: probability 0
        m = logits.max(dim=-1).values  # [N]; −inf only if this whole shard is padding
        comm.all_reduce(m, topo, AXIS, op="max", tag="ce")
        z = logits - m.unsqueeze(-1)  # [N, V_pad/n], ≤ 0
        exp = z.exp()
        ignore = target == IGNORE_INDEX
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n_local) & ~ignore  # this rank owns the target
        local_t = local_t.clamp(0, n_local - 1)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)  # [N]
        stats = torch.stack([exp.sum(dim=-1), torch.where(mine, z_t, torch.zeros_like(z_t))])
        comm.all_reduce(stats, topo, AXIS, tag="ce")  # [2, N]: Σ exp, z_t − m
        sum_exp, z_t = stats[0], stats[1]
        loss = torch.where(ignore, torch.zeros_like(z_t), sum_exp.log() - z_t)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine, ignore)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignore = ctx.saved_tensors
        grad = softmax.clone()  # [N, V_pad/n]
        rows = mine.nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= 1.0
        scale = torch.where(ignore, torch.zeros_like(grad_loss), grad_loss)
        return grad * scale.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor,
                                 vocab_start: int, vocab_size: int, topo) -> torch.Tensor:
    """Per-token loss [b·s] (fp32; 0 where ``labels == IGNORE_INDEX``) from local logits
    [b, s, V_pad/n] (this rank's vocabulary entries from ``vocab_start``; entries ≥
    ``vocab_size`` are padding) and labels [b, s], identical on every tp rank. Every tp rank gets
    the same losses. Three fp32 values per token cross the wire (see
    :class:`_VocabParallelCrossEntropy`)."""
    return _VocabParallelCrossEntropy.apply(local_logits.flatten(0, 1).float(), labels.flatten(),
                                            vocab_start, vocab_size, topo)


# -- the engine -----------------------------------------------------------------------------------
class TensorParallel(Engine):
    """A Llama model converted by :func:`parallelize_tensor`, trained with tp ranks that all see
    the same batch.

    * ``forward_backward``: the model returns local logits; the loss is the vocab-parallel
      cross-entropy, so every tp rank holds the complete loss sum: the token count and the loss
      are all-reduced over dp only (``count_axes = reduce_loss_axes = ("dp",)``).
    * ``finish_gradient_sync``: with SP, one all-reduce over tp of the replicated parameters'
      (norm weights') partial gradients, tag ``"grad"``; without SP their gradients are already
      identical on every tp rank and nothing is sent.
    * ``clip_grad_norm_``: the base engine's (:func:`~.params.grad_norm_`): Σ g² of the shards
      plus (on tp index 0 only) the replicated params, one fp64 all-reduce over tp, tag
      ``"grad_norm"``.
    * ``named_full_parameters`` / ``named_full_gradients`` / ``full_optimizer_state``: the
      base engine's, which read each parameter's :class:`~.params.Placement` (shards
      all-gathered over tp, padding stripped; phase ``"gather"``, not part of the step).

    DP or ZeRO sits on top in :mod:`.compose` (dp × tp): the local shards are ordinary
    Parameters whose gradients are summed over dp."""

    count_axes = ("dp",)
    reduce_loss_axes = ("dp",)

    def __init__(self, module: Llama, topo, sp: bool, rng: TPRNG):
        super().__init__(module)
        self.topo, self.sp, self.rng = topo, sp, rng
        params = list(dict.fromkeys(module.parameters()))
        self.replicated = [p for p in params if not tp_sharded(p)]
        self.sharded = [p for p in params if tp_sharded(p)]

    @property
    def head(self) -> VocabParallelHead:
        return self.module.output

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-loss sum fp32 scalar, counted tokens) of ``batch`` via the vocab-parallel loss;
        the same on every tp rank. Usable for evaluation under ``torch.no_grad()``."""
        local_logits = self.module(batch["input_ids"])  # [b, s, V_pad/n]
        losses = vocab_parallel_cross_entropy(local_logits, batch["labels"],
                                              self.head.vocab_start, self.head.vocab_size,
                                              self.topo)
        return losses.sum(), (batch["labels"] != IGNORE_INDEX).sum()

    def loss_sum(self, batch: dict) -> torch.Tensor:
        return self.loss_sum_and_count(batch)[0]

    def finish_gradient_sync(self) -> None:
        """With SP: SUM the norm weights' partial gradients over tp (one flat all-reduce)."""
        if self.sp:
            self.reduce_replicated_grads(tag="sp_grad")

    def reduce_replicated_grads(self, tag: str = "sp_grad") -> None:
        """SUM the replicated parameters' (norm weights') gradients over tp: one flat
        all-reduce of (2L+1)·d fp32 (:func:`.params.sum_coalesced_`)."""
        sum_coalesced_(grads_or_zeros(self.replicated), self.topo, AXIS, tag=tag)

    def norm_axes(self) -> tuple[str, ...]:
        return (AXIS,)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """:func:`tp_step_bytes_formula` of this model (the per-tag part; micro_steps do not
        matter: every byte is linear in the batch)."""
        t = tp_step_bytes_formula(self.module.config, sequences, seq_len, self.topo.size(AXIS),
                                  self.sp, dp=self.topo.size("dp"), dtype=dtype)
        return {k: v for k, v in t.items() if k not in ("total", "loss")}

    def full_model(self):
        """The :class:`~.engine.Engine` hook for sampling: :meth:`gathered_logits`."""
        return self.gathered_logits()

    @contextlib.contextmanager
    def gathered_logits(self):
        """Inference helper: inside, the model returns full logits [b, s, V] (gathered over tp,
        unpadded) and SP is switched off (any sequence length works), so plain-model code
        (``generate``, ``loss_sum_and_count``) runs unchanged. Use under ``torch.no_grad()``."""
        mods = [m for m in self.module.modules() if hasattr(m, "sp")]
        saved = [m.sp for m in mods]
        for m in mods:
            m.sp = False
        self.head.gather_output = True
        try:
            yield self.module
        finally:
            self.head.gather_output = False
            for m, s in zip(mods, saved):
                m.sp = s


# -- the transform --------------------------------------------------------------------------------
def tp_plan(model: Llama) -> list[tuple[str, type, type]]:
    """(FQN, plain type expected, TP type it becomes) for every module TP converts."""
    plan = [("tok_embeddings", nn.Embedding, VocabParallelEmbedding)]
    for i in range(len(model.layers)):
        plan += [(f"layers.{i}.attention", Attention, TensorParallelAttention),
                 (f"layers.{i}.feed_forward", FeedForward, TensorParallelSwiGLU),
                 (f"layers.{i}.dropout", nn.Dropout, TPDropout)]
    plan.append(("output", nn.Linear, VocabParallelHead))
    return plan


_PLAIN_TYPES = (nn.Linear, nn.Embedding, nn.Dropout, Attention, FeedForward)


def _leftovers(model: nn.Module) -> list[str]:
    """Modules whose *exact* type is a plain one TP should have replaced (a subclass such as
    VocabParallelEmbedding is fine): each would silently run replicated."""
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if type(m) in _PLAIN_TYPES]


def _check_plan_covers(model: nn.Module, plan) -> None:
    """Before any collective: every planned module exists with its plain type, and every
    Linear/Embedding/Dropout of the model lies inside a planned module."""
    if not isinstance(model, Llama):
        raise ShardwiseConfigError(f"tensor parallelism supports the Llama-style models (--model "
                                   f"tiny, small, base), not {type(model).__name__}")
    modules = dict(model.named_modules())
    for fqn, plain_type, _ in plan:
        if not isinstance(modules.get(fqn), plain_type):
            raise ShardwiseConfigError(f"TP plan: expected a {plain_type.__name__} at {fqn!r}, "
                                       f"found {type(modules.get(fqn)).__name__}")
    roots = tuple(fqn for fqn, _, _ in plan)
    stray = [s for s in _leftovers(model)
             if not any(s.split(" ")[0] == r or s.startswith(r + ".") for r in roots)]
    if stray:
        raise ShardwiseConfigError(f"TP plan does not cover {', '.join(stray)}: they would run "
                                   "replicated and unsharded; add them to tp_plan() in "
                                   "parallel/tensor.py or remove them from the model")


def _check_converted(model: Llama, plan, topo) -> None:
    """After conversion: every planned module has its TP type, no plain Linear/Embedding/Dropout
    is left anywhere, shard shapes are as planned, and tied weights are still one Parameter.
    Raises RuntimeError (a bug in the conversion, not bad input)."""
    cfg, n = model.config, topo.size(AXIS)
    modules = dict(model.named_modules())
    problems = [f"{fqn} is {type(modules.get(fqn)).__name__}, not {tp_type.__name__}"
                for fqn, _, tp_type in plan if type(modules.get(fqn)) is not tp_type]
    problems += [f"{s} left unconverted" for s in _leftovers(model)]
    vpad = padded_vocab_size(cfg.vocab_size, n)
    expect = {"tok_embeddings.weight": (vpad // n, cfg.d_model),
              "output.weight": (vpad // n, cfg.d_model)}
    for i in range(cfg.n_layers):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        expect |= {f"{a}.wq.weight": (cfg.n_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wk.weight": (cfg.n_kv_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wv.weight": (cfg.n_kv_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wo.weight": (cfg.d_model, cfg.n_heads // n * cfg.head_dim),
                   f"{f}.w1.weight": (cfg.d_ff // n, cfg.d_model),
                   f"{f}.w3.weight": (cfg.d_ff // n, cfg.d_model),
                   f"{f}.w2.weight": (cfg.d_model, cfg.d_ff // n)}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, shape in expect.items():
        if name in params and tuple(params[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(params[name].shape)}, expected {shape}")
        if name in params and not tp_sharded(params[name]):
            problems.append(f"{name} is not marked as a tp shard")
    if cfg.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        problems.append("tied embeddings: output.weight is no longer tok_embeddings.weight")
    if problems:
        raise RuntimeError("tensor-parallel conversion incomplete: " + "; ".join(problems))


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


def parallelize_tensor(model: Llama, topo, sp: bool = False, *, seed: int = 0) -> TensorParallel:
    """Convert the plain Llama ``model`` in place for tensor parallelism over ``topo``'s "tp"
    axis (sequence parallelism with ``sp``) and return its :class:`TensorParallel` engine.

    Order: (1) :func:`validate_tp` and a check that the plan covers every Linear/Embedding/
    Dropout of the model — both raise :class:`ShardwiseConfigError` before any collective;
    (2) broadcast every parameter from tp index 0 (phase ``"init"``), so shards cut from
    different ranks' copies fit together even if the ranks were seeded differently; (3) replace
    the modules of :func:`tp_plan`, each rank keeping its shard; (4) check that every planned
    module was converted, nothing plain is left and tied weights are still tied — RuntimeError
    otherwise. ``seed`` seeds the dropout RNG regions (:class:`TPRNG`). The sequence length
    is checked against tp at the first SP forward (reduce-scatter raises ValueError); call
    ``validate_tp(cfg, tp, sp, seq_len)`` up front to get the configuration error instead."""
    cfg = getattr(model, "config", None)
    n = topo.size(AXIS)
    validate_tp(cfg, n, sp)
    plan = tp_plan(model) if isinstance(model, Llama) else []
    _check_plan_covers(model, plan)
    with topo.ledger.phase("init"):
        comm.broadcast_coalesced([p.data for p in model.parameters()], topo, AXIS, tag="init")
    rng = TPRNG(seed, topo)
    emb = VocabParallelEmbedding(model.tok_embeddings, topo, sp)
    head = VocabParallelHead(model.output, topo, sp,
                             weight=emb.weight if cfg.tie_embeddings else None)
    _set_submodule(model, "tok_embeddings", emb)
    for i, layer in enumerate(model.layers):
        layer.attention = TensorParallelAttention(layer.attention, topo, sp, rng)
        layer.feed_forward = TensorParallelSwiGLU(layer.feed_forward, topo, sp)
        layer.dropout = TPDropout(layer.dropout.p, rng, sp)
    _set_submodule(model, "output", head)
    _check_converted(model, plan, topo)
    return TensorParallel(model, topo, sp, rng)


# -- the formula ----------------------------------------------------------------------------------
def tp_step_bytes_formula(model_config, sequences: int, seq_len: int, tp: int, sp: bool = False,
                          dp: int = 1, dtype: str = "fp32") -> dict[str, float]:
    """Bytes one rank sends per optimizer step with explicit TP, by ledger tag, plus ``"total"``.

    ``sequences``: sequences this rank processes in the step (all micro-batches: every byte
    below is linear in the batch, so how it is cut into micro-batches does not matter);
    ``seq_len`` tokens each. n = tp, L = n_layers, d = d_model, N = sequences·seq_len tokens,
    r = 2(n−1)/n (ring all-reduce), h = (n−1)/n (all-gather / reduce-scatter); see
    :mod:`shardwise.comm.ledger` for the per-op counts.

    * ``tp_fwd``/``tp_bwd`` — activations, A_x = N·d·bytes(x): forward (1 + 2L)·r·A, backward
      (1 + 2L)·r·A, with or without SP (SP: the same total as (2 + 4L) collectives of h·A each).
      Counted per direction: forward = the embedding exit, 2 block exits and (SP) 2 block entries
      + the head entry; backward = 2 block entries and the head entry, and (SP) the 2 block exits
      and the embedding exit. ``dtype="bf16"`` (autocast): the 2L block exits (row-parallel
      outputs) and, with SP, their backward all-gathers carry bf16 (2 bytes); everything else
      (the embedding output, the residual stream, the gradients entering the regions) is fp32.
    * ``ce`` — the vocab-parallel cross-entropy: r·(N + 2N)·4 (MAX of [N], SUM of [2, N], fp32).
    * ``sp_grad`` — SP only: r·(2L + 1)·d·4, the norm weights' gradients (fp32).
    * ``grad_norm`` — r·8: the squared gradient norm (fp64 scalar) over tp.
    * ``loss`` — 2·(2(dp−1)/dp)·8: token count and loss sum over dp (0 at dp = 1).

    Init broadcasts, ``named_full_*`` gathers and evaluation are outside the step. Source:
    Megatron-LM §3 (f/g per block), Korthikanti et al. 2022 §4.2.2 (SP), JAX scaling book ch. 5."""
    n, L, d = tp, model_config.n_layers, model_config.d_model
    r, h = 2 * (n - 1) / n, (n - 1) / n
    tokens = sequences * seq_len
    wide = tokens * d * 4  # fp32 [.., d]
    exit_b = tokens * d * (2 if dtype == "bf16" else 4)  # row-parallel outputs under autocast
    if not sp:
        fwd = r * (wide + 2 * L * exit_b)  # embedding g + 2 g per block
        bwd = r * (2 * L * wide + wide)  # 2 f per block + head f
    else:
        fwd = h * (wide + 2 * L * wide + 2 * L * exit_b + wide)  # emb RS, AG+RS ×2L, head AG
        bwd = h * (wide + 2 * L * wide + 2 * L * exit_b + wide)  # head RS, RS+AG ×2L, emb AG
    out = {"tp_fwd": fwd, "tp_bwd": bwd, "ce": r * 3 * tokens * 4,
           "sp_grad": r * (2 * L + 1) * d * 4 if sp else 0.0, "grad_norm": r * 8,
           "loss": 2 * (2 * (dp - 1) / dp * 8)}
    out["total"] = sum(out.values())
    return out
