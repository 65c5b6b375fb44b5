"""Tensor parallelism (TP), with optional sequence parallelism (SP) and a vocab-parallel loss.

Reading order (picotron's shape: the strategy beside its communications):

1. :mod:`.comms` — Megatron's f and g and the SP all-gather / reduce-scatter, as autograd
   functions that say what moves in forward and in backward;
2. :mod:`.layers` — the column/row-parallel linears, vocab-parallel embedding and head, the TP
   attention and SwiGLU, dropout with tp-aware RNG regions;
3. :mod:`.loss` — the vocab-parallel cross-entropy (the logits are never gathered);
4. :mod:`.apply` — :func:`apply_tp`, the one transform for a whole model or a pipeline stage,
   its checks, and :func:`tp_step_bytes_formula`;
5. :mod:`.engine` — :class:`TensorParallel` and :func:`parallelize_tensor`;
6. :mod:`.dtensor` — the PyTorch twin (DTensor ``parallelize_module``), with the ledger booking
   of DTensor's collectives; :mod:`..dtensor_full` — DTensors to full shape.

Collectives per optimizer step (A = bytes of one [b, s, d] activation summed over the step's
micro-batches, L blocks, n = tp; see :func:`tp_step_bytes_formula`; docs/tensor-parallel.md has
the derivation):

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
"How to Parallelize a Transformer for Training"). Sources: Shoeybi et al. 2019, "Megatron-LM",
arXiv 1909.08053, §3; Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2 (SP).
"""

from .apply import (apply_tp, check_plan_covers, tp_activation_bytes, tp_bytes_by_tag, tp_plan,
                    tp_step_bytes_formula, valid_tp_degrees, validate_tp)
from .comms import AXIS, copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from .dtensor import (BookFunctionalCollectives, TorchTensorParallel, booked_as,
                      dtensor_tp_plan, parallelize_tensor_dtensor, reduce_partial_grads)
from ..dtensor_full import full_tensors
from .engine import TensorParallel, parallelize_tensor
from .layers import (TPRNG, ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                     TensorParallelSwiGLU, TPDropout, VocabParallelEmbedding, VocabParallelHead,
                     enter_tp_region, exit_tp_region, padded_vocab_size)
from .loss import vocab_parallel_cross_entropy

__all__ = ["AXIS", "BookFunctionalCollectives", "ColumnParallelLinear", "RowParallelLinear",
           "TPDropout", "TPRNG", "TensorParallel", "TensorParallelAttention",
           "TensorParallelSwiGLU", "TorchTensorParallel", "VocabParallelEmbedding",
           "VocabParallelHead", "apply_tp", "booked_as", "check_plan_covers", "copy_to_tp",
           "dtensor_tp_plan", "enter_tp_region", "exit_tp_region", "full_tensors",
           "gather_from_sp", "padded_vocab_size", "parallelize_tensor",
           "parallelize_tensor_dtensor", "reduce_from_tp", "reduce_partial_grads",
           "reduce_scatter_to_sp", "tp_activation_bytes", "tp_bytes_by_tag", "tp_plan",
           "tp_step_bytes_formula", "valid_tp_degrees", "validate_tp",
           "vocab_parallel_cross_entropy"]
