"""Tensor parallelism (TP), with optional sequence parallelism (SP) and a vocab-parallel loss.

Reading order (picotron's: the strategy beside its communications): :mod:`.options` (the
layout's :class:`~.options.TPOptions`, SP and room for the next option: one argument to every
function here), :mod:`.comms`, :mod:`.layers`, :mod:`.mlp` (the stacked MLP, both engines),
:mod:`.loss` (the vocab-parallel loss function), :mod:`.apply` (:func:`apply_tp` for a model
or a pipeline stage, its checks, the SP finisher, :func:`tp_step_bytes_formula`),
:mod:`.dtensor` (the DTensor twin).

What crosses the tp axis per optimizer step (n = tp, L blocks, A = bytes of one [b, s, d]
activation over the step's micro-batches): the embedding exit, each block's two region entries
(f) and exits (g), and the head entry, (1 + 2L) · 2(n−1)/n · A forward and the same backward,
with or without SP (SP: all-gather / reduce-scatter pairs); the vocab-parallel loss, 3 fp32 per
token; with SP, the norm weights' (2L+1)·d fp32 gradients; one fp64 for the gradient norm. Table
and derivation: docs/tensor-parallel.md §2. Sources: Shoeybi et al. 2019, "Megatron-LM", arXiv
1909.08053, §3; Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2 (SP); JAX scaling book ch. 5.

From learn/ (the same in ``learn/fsdp_tp.py`` over its Y groups; ``learn/tp.py``'s names):

* ``F_op`` (Megatron's f) → :class:`~.comms.CopyToTP`, via :func:`~.layers.enter_tp_region`
* ``G_op`` (g) → :class:`~.comms.ReduceFromTP`, via :func:`~.layers.exit_tp_region` inside
  :class:`~.layers.RowParallelLinear`
* ``W_in[D, F_Y]``, ``b_in[F_Y]`` → :class:`~.layers.ColumnParallelLinear` (weight ``[F/n, D]``:
  ``nn.Linear`` stores Wᵀ)
* ``W_out[F_Y, D]``, ``b_out[D] (replicated)`` → :class:`~.layers.RowParallelLinear` (bias added
  once, after g)
* ``tp_block`` → :class:`~.mlp.TensorParallelMLPBlock`; the model's conversion
  :func:`~.mlp.apply_tp_mlp`; ``(2L − 1) · 2(n−1)/n`` → :func:`~.mlp.mlp_tp_bytes`
* no script: SP's halves of f and g, :class:`~.comms.GatherFromSP` /
  :class:`~.comms.ReduceScatterToSP`; a Llama block, :class:`~.layers.TensorParallelAttention`,
  :class:`~.layers.TensorParallelSwiGLU`; DTensor's twin, :func:`~.mlp.parallelize_mlp_dtensor`
"""

from .apply import (SPSum, TPTraffic, apply_tp, check_plan_covers,
                    parallelize_tensor,
                    tp_activation_bytes, tp_plan, tp_step_bytes_formula, valid_tp_degrees,
                    validate_tp)
from .comms import AXIS, CopyToTP, GatherFromSP, ReduceFromTP, ReduceScatterToSP
from ...comm.torch_booking import BookFunctionalCollectives, booked_as
from .dtensor import (LossParallel, StageTPTraffic, TorchSPSum, TorchTPTraffic, dtensor_tp_plan,
                      parallelize_tensor_dtensor, reduce_partial_grads)
from .layers import (TPRNG, ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                     TensorParallelSwiGLU, TPDropout, VocabParallelEmbedding, VocabParallelHead,
                     enter_tp_region, exit_tp_region, padded_vocab_size)
from .loss import VocabParallelLoss, vocab_parallel_cross_entropy
from .options import TPOptions

__all__ = ["AXIS", "BookFunctionalCollectives", "ColumnParallelLinear", "CopyToTP", "GatherFromSP",
           "LossParallel", "ReduceFromTP", "ReduceScatterToSP", "RowParallelLinear", "SPSum",
           "StageTPTraffic",
           "TPDropout", "TPOptions", "TPRNG", "TPTraffic", "TensorParallelAttention",
           "TensorParallelSwiGLU",
           "TorchSPSum", "TorchTPTraffic", "VocabParallelEmbedding", "VocabParallelHead",
           "VocabParallelLoss", "apply_tp",
           "booked_as", "check_plan_covers", "dtensor_tp_plan", "enter_tp_region", "exit_tp_region",
           "padded_vocab_size", "parallelize_tensor", "parallelize_tensor_dtensor",
           "reduce_partial_grads", "tp_activation_bytes", "tp_plan", "tp_step_bytes_formula",
           "valid_tp_degrees", "validate_tp", "vocab_parallel_cross_entropy"]
