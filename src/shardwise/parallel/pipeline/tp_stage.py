"""Tensor parallelism inside a pipeline stage: the Megatron transform of :mod:`..tensor`, applied
to the modules one :class:`.split.StageModule` holds.

Composition order (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, §2.3 and §3): TP innermost (consecutive ranks),
each stage's blocks converted exactly as :func:`~..tensor.parallelize_tensor` converts the whole
model — wq/wk/wv, w1/w3 column-parallel, wo/w2 row-parallel, dropout from the tp-aware RNG
regions — plus, on the stage that holds them, the vocab-parallel embedding (first stage) and the
vocab-parallel head (last stage; its loss is :func:`~..tensor.vocab_parallel_cross_entropy`).

Between stages each tp rank talks to the *same tp index* of the neighbouring stage (the pp
groups of the topology are exactly those lines): without SP the hidden state is replicated over
tp, [b, s, d], and every tp rank sends the same tensor; with SP it is this rank's sequence shard
[b, s/tp, d], so the pipeline traffic per rank drops by tp (Korthikanti et al. 2022, arXiv
2205.05198, §4.2.2: the activations between TP regions are sequence-sharded; Megatron-LM sends
them as they are, its ``scatter_gather_tensors_in_pipeline`` optimisation applied instead to the
replicated case).

Tied embeddings across pp with tp: the last stage's own copy of the embedding (see
:mod:`.split`) becomes a :class:`~..tensor.VocabParallelHead` with its own [V_pad/tp, d] shard,
cut by the same rows as the first stage's :class:`~..tensor.VocabParallelEmbedding`; the runtime
sums the two shards' gradients between the first and the last stage of each tp index.
"""

from __future__ import annotations

from ... import comm
from ...errors import ShardwiseConfigError
from ..tensor import (AXIS, TPRNG, TensorParallelAttention, TensorParallelSwiGLU, TPDropout,
                      VocabParallelEmbedding, VocabParallelHead, _leftovers, validate_tp)
from .split import StageModule


def convert_stage_tp(stage: StageModule, topo, sp: bool = False, *, seed: int = 0) -> TPRNG:
    """Convert ``stage`` in place for tensor parallelism over ``topo``'s "tp" axis (with
    sequence parallelism if ``sp``) and return the dropout RNG (:class:`~..tensor.TPRNG`).

    Raises :class:`ShardwiseConfigError` before any collective if the stage is not a Llama
    stage or tp does not fit the model (:func:`~..tensor.validate_tp`). Then broadcasts the
    stage's parameters from tp index 0 (phase ``init``), replaces the blocks' attention, MLP
    and dropout, the embedding and the head, and points the stage's chunks at the new
    modules. RuntimeError if a plain Linear/Embedding/Dropout is left (a conversion bug)."""
    n = topo.size(AXIS)
    if not stage.is_llama:
        raise ShardwiseConfigError("--tp with --pp: tensor parallelism needs a Llama-style "
                                   "model (--model tiny, small or base); the MLP models have no "
                                   "TP plan")
    validate_tp(stage.config, n, sp)
    with topo.ledger.phase("init"):
        comm.broadcast_coalesced([p.data for p in stage.parameters()], topo, AXIS, tag="init")
    rng = TPRNG(seed, topo)
    for layer in stage.layers.values():
        layer.attention = TensorParallelAttention(layer.attention, topo, sp, rng)
        layer.feed_forward = TensorParallelSwiGLU(layer.feed_forward, topo, sp)
        layer.dropout = TPDropout(layer.dropout.p, rng, sp)
    emb = head = None
    if getattr(stage, "tok_embeddings", None) is not None:
        emb = VocabParallelEmbedding(stage.tok_embeddings, topo, sp)
        stage.tok_embeddings = emb
    if getattr(stage, "output", None) is not None:
        # tied on this very rank (only when one rank holds the first and the last stage):
        # one Parameter, as in parallelize_tensor
        shared = emb.weight if (emb is not None and stage.tied and not stage._tied_copy) else None
        head = VocabParallelHead(stage.output, topo, sp, weight=shared)
        stage.output = head
    for c in stage.chunks:
        if c.tok_embeddings is not None:
            c.tok_embeddings = emb
        if c.output is not None:
            c.output = head
        c.sp_degree = n if sp else 1
    left = _leftovers(stage)
    if left:
        raise RuntimeError("tensor-parallel stage conversion incomplete: " + ", ".join(left))
    return rng
