"""Context parallelism (CP): each sequence split over the cp ranks, attention by ring or
all-gather.

Reading order: :mod:`.split` (the load-balanced causal split, the checks), :mod:`.attention`
(ring attention and all-gather attention as autograd functions over the "cp" axis, and their
bytes), then this module (:func:`parallelize_context`: swap every block's core attention).

What the transform does, and what the rest of the step does for it:

* the model: every block's :class:`~shardwise.models.llama.CoreAttention` becomes a
  :class:`~.attention.ContextParallelAttention` on the "cp" axis; nothing else changes — the
  projections, MLP, norms and the loss are per token, so they run on the local tokens as they are;
* the batch: ``train_step`` and evaluation cut each micro-batch to this rank's chunks with
  :func:`~.split.shard_sequence` (``position_ids`` added, so RoPE follows the chunks; a packed
  batch keeps its per-document positions, and its ``document_ids`` become where each token's
  document starts, which the core attention masks by);
* the loss: each rank's token-loss sum covers its chunks, so the token count and the loss sum
  are all-reduced over dp × cp (the engines' ``count_axes`` / ``reduce_loss_axes`` are the
  topology's ``data_axis``, "dp_cp");
* the gradients: parameters are replicated over cp, so every dp strategy (DP, ZeRO-1/2/3) runs
  over "dp_cp" (torchtitan's ``dp_shard_cp``); the global norm counts each element once as
  before.

docs/context-parallel.md has the math, the collectives and the pitfalls.

From learn/ (no script yet: the nearest ideas of three scripts, and docs/context-parallel.md):

* ``learn/dp.py``'s ``x.chunk(n)[rank]`` splits the batch; CP splits each sequence into 2n
  chunks, two per rank, head and tail (docs §1) → :func:`~.split.shard_sequence`,
  :func:`~.split.chunk_ids`, :func:`~.split.zigzag_positions`
* ``learn/collectives.py``'s ``ring_step`` (send to rank + 1, receive from rank − 1) →
  :class:`~.attention._Ring`: K/V blocks go round the ring while each block is computed
* blocks merged by log-sum-exp (docs §1) → :class:`~.attention._RingAttention`
* ``learn/fsdp.py``'s ``gather`` forward and ``dist.reduce_scatter`` backward (of weights) →
  the same pair of K/V for ``method="allgather"``: :class:`~.attention._GatherKV`
* bytes per layer (docs §2) → :func:`~.attention.cp_attention_bytes`, :func:`cp_bytes_formula`
"""

from __future__ import annotations

import contextlib

from torch import nn

from ...precision import FP32, Precision
from .attention import ContextParallelAttention, cp_attention_bytes
from .split import (CP_METHODS, chunk_ids, document_starts, shard_sequence, validate_cp,
                    zigzag_positions)

__all__ = ["CP_METHODS", "ContextParallelAttention", "chunk_ids", "cp_attention_bytes",
           "cp_bytes_formula", "document_starts", "parallelize_context", "plain_attention",
           "shard_sequence", "validate_cp", "zigzag_positions"]


def _attentions(model: nn.Module):
    """Every module of ``model`` with a ``core`` attention (plain or TP attention)."""
    return [m for m in model.modules() if isinstance(getattr(m, "core", None), nn.Module)]


def parallelize_context(model: nn.Module, topo, method: str = "ring") -> nn.Module:
    """Replace, in place, the core attention of every block of ``model`` (a plain Llama, before
    pipeline split and TP) by :class:`~.attention.ContextParallelAttention` over ``topo``'s
    "cp" axis with ``method`` ("ring" | "allgather"). Returns ``model``. No collective; checks
    ran in :meth:`~..layout.Layout.check`."""
    for m in _attentions(model):
        m.core = ContextParallelAttention(topo, method)
    return model


@contextlib.contextmanager
def plain_attention(model: nn.Module | None):
    """Context: ``model``'s context-parallel core attentions swapped back to the plain causal
    core while inside, for whole sequences on every rank (sampling). ``model`` None: nothing."""
    from ...models.llama import CoreAttention

    swapped = [(m, m.core) for m in (_attentions(model) if model is not None else [])
               if isinstance(m.core, ContextParallelAttention)]
    for m, _ in swapped:
        m.core = CoreAttention()
    try:
        yield model
    finally:
        for m, core in swapped:
            m.core = core


def cp_bytes_formula(module: nn.Module, topo, sequences: int, seq_len: int,
                     precision: Precision = FP32) -> dict[str, float]:
    """{"cp_kv", "cp_dkv": bytes} this rank sends over cp in one step: for each block of
    ``module`` (this rank's layers) :func:`~.attention.cp_attention_bytes` with KV =
    2·``sequences``·(``seq_len``/cp)·k·hd·elem, k = n_kv_heads / tp, elem the compute
    dtype's bytes (``precision.act``: 2 for bf16 autocast, else 4). ``sequences``: this rank's
    sequences per step (all micro-batches), ``seq_len``: the whole sequence. Empty when cp = 1."""
    cp = topo.size("cp")
    cores = [m.core for m in _attentions(module)
             if isinstance(m.core, ContextParallelAttention)]
    if cp == 1 or not cores:
        return {}
    cfg = module.config
    elem = precision.act
    per = 2.0 * sequences * (seq_len // cp) * (cfg.n_kv_heads // topo.size("tp")) * cfg.head_dim
    out = {"cp_kv": 0.0, "cp_dkv": 0.0}
    for core in cores:
        for k, v in cp_attention_bytes(core.method, cp, per * elem, per * 4).items():
            out[k] += v
    return out
