"""``--engine torch`` for TP: the plan of :mod:`.apply` through PyTorch DTensor (the twin).

``parallelize_module`` on ``topo.mesh["tp"]`` with the layout of our explicit modules
(:func:`dtensor_tp_plan`; torchtitan's Llama plan is the model), so the same collectives move
over tp. DTensor issues them as functional collectives, not through :mod:`shardwise.comm`;
:class:`BookFunctionalCollectives` books them in the same ledger under the explicit engine's
tags, so both engines equal :func:`~.apply.tp_step_bytes_formula`. How it differs (SP gradients,
padding, tied embeddings): docs/tensor-parallel.md §3. Limitation: dropout draws from the
default RNG (no tp-aware RNG regions), so use it with dropout 0.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.ledger import ring_bytes
from ...comm.torch_booking import BookFunctionalCollectives, booked_as
from ...models.llama import IGNORE_INDEX, Llama
from ...precision import FP32, Precision
from ..loss import PlainLoss
from ..params import (is_dtensor as _is_dtensor, local as _local, sum_coalesced_,
                      tp_sharded)
from .apply import TPTraffic, check_plan_covers, tp_activation_bytes, validate_tp
from .comms import AXIS
from .mlp import MLPLoss, is_mlp, parallelize_mlp_dtensor
from .options import TPOptions

def dtensor_tp_plan(model: Llama, options: TPOptions) -> dict:
    """The ``parallelize_module`` plan {FQN: ParallelStyle} for ``model``: our explicit layout
    (docs/tensor-parallel.md §3), the residual stream between regions Replicate or, with SP
    (``options.sp``), Shard(1). ``PrepareModuleInput`` on each block's ``attention`` /
    ``feed_forward`` makes the block input enter the TP region once (one backward all-reduce or
    reduce-scatter per region, as in Megatron); the head's output stays a DTensor sharded on the
    vocabulary (never gathered: the loss is ``loss_parallel()``); with SP the norms are
    ``SequenceParallel`` (gradients left ``Partial``: :func:`reduce_partial_grads`). DTensor
    shards a vocabulary tp does not divide unevenly (``torch.chunk``), so there is no padding.
    The embedding and the head come out as separate Parameters, both Shard(0) on the same mesh:
    :func:`parallelize_tensor_dtensor` re-ties them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    sp = options.sp
    act = Shard(1) if sp else Replicate()  # layout of the residual stream between regions
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1),
                                      use_local_output=False)}
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan |= {
            p + "attention": PrepareModuleInput(input_layouts=(act, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=act),
            p + "feed_forward": PrepareModuleInput(input_layouts=(act,),
                                                   desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


def prepare_replicated_for_dtensor(model: nn.Module, topo, options: TPOptions) -> None:
    """The model families' tp-replicated parameters that act *inside* a TP region or on a
    sequence shard, made exact under DTensor TP before :func:`dtensor_tp_plan` applies (in
    place; a Llama is left alone). The plan leaves them plain tensors, so DTensor would neither
    complete nor reduce their gradients: Qwen3's per-head q/k norm (each rank's heads give a
    partial gradient) becomes :class:`~.layers.TPSummedNorm`, GPT-2's learned positions
    :class:`~.layers.TPPositionEmbedding` (with SP: this rank's sequence shard, its gradient
    summed over tp by f). Both sum through :mod:`shardwise.comm` (tag ``tp_bwd``)."""
    from .layers import TPPositionEmbedding, TPSummedNorm

    if getattr(model, "pos_embeddings", None) is not None:
        model.pos_embeddings = TPPositionEmbedding(model.pos_embeddings, topo, options,
                                                   grad_sum=options.sp)
        for c in getattr(model, "chunks", ()):
            if c.pos_embeddings is not None:
                c.pos_embeddings = model.pos_embeddings
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        att = layer.attention
        if getattr(att, "q_norm", None) is not None:
            att.q_norm, att.k_norm = TPSummedNorm(att.q_norm, topo), TPSummedNorm(att.k_norm,
                                                                                   topo)


def reduce_partial_grads(params, topo, tag: str = "sp_grad") -> None:
    """SP under DTensor: the norm weights' gradients are left ``Partial(sum)`` (each tp rank
    summed over its sequence shard), which DTensor would reduce lazily wherever next used. Reduce
    them here in one flat all-reduce over tp through :mod:`shardwise.comm` (tag ``sp_grad``, as
    on the explicit engine) and store them ``Replicate``; nothing is sent when none is Partial."""
    from torch.distributed.tensor import DTensor, Replicate

    partial = [p for p in params if _is_dtensor(p.grad)
               and any(pl.is_partial() for pl in p.grad.placements)]
    locals_ = [p.grad.to_local().clone() for p in partial]
    sum_coalesced_(locals_, topo, AXIS, tag=tag)
    for p, t in zip(partial, locals_):
        p.grad = DTensor.from_local(t, p.device_mesh, [Replicate()], run_check=False)


class LossParallel(PlainLoss):
    """The loss function of a model (or a pipeline stage) converted by
    :func:`parallelize_tensor_dtensor` (``module`` on ``topo``, the layout's
    :class:`~.options.TPOptions` ``options``): cross-entropy under
    ``loss_parallel`` of the logits sharded over the vocabulary, a DTensor scalar Replicate over
    tp. ``book_collectives``: book DTensor's collectives in the ledger during the step (a
    dispatch mode sees every op, which costs Python time per op: turn it off to time). The
    other members are :class:`~shardwise.parallel.loss.PlainLoss`'s."""

    def __init__(self, module: nn.Module, topo, options: TPOptions,
                 book_collectives: bool = True):
        super().__init__(module)
        self.topo, self.options = topo, options
        self.book_collectives = book_collectives

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Token-loss sum through ``loss_parallel``: a DTensor scalar, Replicate over tp."""
        from torch.distributed.tensor.parallel import loss_parallel

        logits = self.module(batch["input_ids"])  # DTensor [b, s, V], Shard(-1) over tp
        with loss_parallel(), booked_as("ce"):
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")

    def loss(self, y: torch.Tensor, mb: dict) -> torch.Tensor:
        """A pipeline's last stage: its local logits ``y`` [b, s, V/tp] as a vocab-sharded
        DTensor through ``F.cross_entropy`` (the runner calls it inside
        :meth:`backward_context`, ``loss_parallel()``; booked as ``ce``); the replicated fp32
        token-loss sum."""
        from torch.distributed.tensor import DTensor, Shard

        shape = (*y.shape[:-1], self.module.config.vocab_size)
        stride = torch.empty(shape, device="meta").stride()
        logits = DTensor.from_local(y, self.topo.mesh[AXIS], [Shard(-1)], run_check=False,
                                    shape=shape, stride=stride)
        with booked_as("ce"):
            s = F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return s.to_local()

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-loss sum as a plain fp32 scalar, complete on every tp rank; counted tokens),
        for evaluation under ``torch.no_grad()``."""
        return _local(self.loss_sum(batch)), (batch["labels"] != IGNORE_INDEX).sum()

    def booking(self, **options):
        """Book DTensor's collectives during the step if ``book_collectives``; ``options``
        (:class:`BookFunctionalCollectives`'s ``c10d_tag``, ``sp_grad``) come from the gradient
        sync (FSDP2: its c10d all-reduce and SP sum are booked too)."""
        return (BookFunctionalCollectives(self.topo, **options) if self.book_collectives
                else contextlib.nullcontext())

    def backward_context(self):
        """``loss_parallel``: its backward must run under the context too."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


class TorchSPSum:
    """The SP finisher of DTensor TP without FSDP2: :func:`reduce_partial_grads` of
    ``module``'s parameters (one flat all-reduce over tp, ``sp_grad``; nothing when none is
    ``Partial``)."""

    def __init__(self, module: nn.Module, topo):
        self.module, self.topo = module, topo

    def __call__(self) -> None:
        reduce_partial_grads(self.module.parameters(), self.topo)


class TorchTPTraffic(TPTraffic):
    """:class:`~.apply.TPTraffic`, except that under SP the parameters
    :func:`prepare_replicated_for_dtensor` routes through f (Qwen3's q/k norms, GPT-2's
    positions) are summed in each micro-step's backward (``tp_bwd``) instead of once in
    ``sp_grad``, and the row-parallel biases need no sum at all (:func:`row_bias_bytes`)."""

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        out = super().bytes_formula(micro_steps, sequences, seq_len, precision)
        if self.options.sp:
            n = self.topo.size(AXIS)
            moved = f_summed_bytes(self.module, n)
            out["sp_grad"] -= moved + row_bias_bytes(self.module, n)
            out["tp_bwd"] += micro_steps * moved
        return out


def row_bias_bytes(module: nn.Module, n: int) -> float:
    """The SP sum the explicit engine spends on the row-parallel biases (``wo``, ``w2``) and
    DTensor does not: ``RowwiseParallel`` adds the Replicate bias inside the partial sum,
    before the reduce-scatter, so its gradient comes from the all-gathered output gradient,
    complete on every rank (measured: ``Replicate`` and equal to one process's)."""
    return sum(ring_bytes("all_reduce", _local(p).numel() * 4, n)
               for name, p in module.named_parameters()
               if name.endswith(("attention.wo.bias", "feed_forward.w2.bias")))


def f_summed_bytes(module: nn.Module, n: int) -> float:
    """Bytes one backward sends to sum the gradients of ``module``'s parameters that enter
    through f (:class:`~.layers.TPSummedNorm`, a ``grad_sum`` :class:`~.layers.
    TPPositionEmbedding`): one fp32 all-reduce each over ``n`` tp ranks."""
    from .layers import TPPositionEmbedding, TPSummedNorm

    return sum(ring_bytes("all_reduce", m.weight.numel() * 4, n) for m in module.modules()
               if isinstance(m, TPSummedNorm)
               or (isinstance(m, TPPositionEmbedding) and m.grad_sum))


def parallelize_tensor_dtensor(model: Llama, topo, options: TPOptions = TPOptions(), *,
                               book_collectives: bool = True) -> LossParallel:
    """Apply :func:`dtensor_tp_plan` to ``model`` in place on ``topo.mesh["tp"]`` and return its
    loss function, :class:`LossParallel`. Validation (:func:`~.apply.validate_tp`, :func:`~.apply.check_plan_covers`) raises
    :class:`~shardwise.errors.ShardwiseConfigError` before any collective; afterwards every
    Linear/Embedding weight must be a DTensor (RuntimeError otherwise)."""
    from torch.distributed.tensor.parallel import parallelize_module

    validate_tp(getattr(model, "config", None), topo.size(AXIS), options)
    if is_mlp(model):  # ColwiseParallel W_in, RowwiseParallel W_out per block
        parallelize_mlp_dtensor(model, topo)
        return MLPLoss(model, topo, book=book_collectives)
    check_plan_covers(model)
    from .layers import TPPositionEmbedding

    tied = model.config.tie_embeddings
    prepare_replicated_for_dtensor(model, topo, options)
    mine = dict(model.named_modules())  # a GELU MLP has no w3
    plan = {k: v for k, v in dtensor_tp_plan(model, options).items() if k in mine}
    parallelize_module(model, topo.mesh[AXIS], plan)
    if tied:  # one Parameter again: both are Shard(0) over the same mesh
        model.output.weight = model.tok_embeddings.weight
    plain = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
             and not isinstance(m, TPPositionEmbedding) and not _is_dtensor(m.weight)]
    if plain:
        raise RuntimeError(f"DTensor TP conversion incomplete: {', '.join(plain)} not sharded")
    return LossParallel(model, topo, options, book_collectives)


class StageTPTraffic:
    """TP's terms of a pipeline stage's byte formula (``stage``: this rank's chunks converted by
    :func:`~.apply.apply_tp`, or by DTensor when ``dtensor``): :func:`~.apply.
    tp_activation_bytes` of its blocks (an MoE block's feed-forward stays whole per tp rank),
    embedding and head; the parameters
    entering through f summed in each backward (``tp_bwd``); with SP, ``sp_grad``: 2(t−1)/t of
    the tp-replicated gradients' bytes less those (DTensor: less the row-parallel biases too,
    :func:`row_bias_bytes`). Nothing for tp = 1. ``options``: the layout's
    :class:`~.options.TPOptions`."""

    def __init__(self, stage, topo, options: TPOptions, *, dtensor: bool = False):
        self.stage, self.topo, self.options, self.dtensor = stage, topo, options, dtensor

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        from ...models.moe import moe_layers

        stage, n = self.stage, self.topo.size(AXIS)
        if n == 1:
            return {}
        params = [p for p in dict.fromkeys(stage.parameters()) if p.requires_grad]
        elem = _local(params[0]).element_size()
        moe = sum(len(moe_layers(c)) for c in stage.chunks)
        out = dict(tp_activation_bytes(sequences * seq_len, stage.config.d_model, n, self.options,
                                       blocks=sum(len(c.layers) for c in stage.chunks),
                                       has_embedding=stage.holds_embedding,
                                       has_head=stage.holds_head, precision=precision,
                                       moe_blocks=moe))
        f_summed = f_summed_bytes(stage, n)  # the families' q/k norms, positions
        out["tp_bwd"] += micro_steps * f_summed
        if self.options.sp:
            rep = sum(_local(p).numel() * elem for p in params if not tp_sharded(p))
            out["sp_grad"] = ring_bytes("all_reduce", rep, n) - f_summed
            if self.dtensor:
                out["sp_grad"] -= row_bias_bytes(stage, n)
        return out


# -- a pipeline stage (the torch pipeline's TP, :mod:`shardwise.parallel.pp.torch_runner`) -------
def parallelize_stage_dtensor(stage: nn.Module, topo, options: TPOptions) -> None:
    """DTensor TP on a pipeline stage: :func:`dtensor_tp_plan` restricted to the stage's modules,
    the head returning plain local logits [b, s, V/tp] (a stage's outputs are plain tensors);
    between stages the plain local [b, s, d], with SP (``options.sp``) [b, s/tp, d]. Dropout
    uses the default RNG."""
    import types

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    cfg, n = stage.config, topo.size(AXIS)
    # the whole model's plan (it only counts the layers), restricted to this stage's modules
    plan = dtensor_tp_plan(types.SimpleNamespace(layers=[None] * cfg.n_layers), options)
    # the embedding and a head tied to it on this rank (the V placement's rank 0)
    tied_here = getattr(stage, "output", None) is not None and \
        getattr(stage, "tok_embeddings", None) is not None and \
        stage.output.weight is stage.tok_embeddings.weight
    prepare_replicated_for_dtensor(stage, topo, options)
    mine = dict(stage.named_modules())
    plan = {k: v for k, v in plan.items() if k in mine}
    if "output" in plan:  # plain local logits [b, s, V/tp] out of the pipeline stage
        act = Shard(1) if options.sp else None
        plan["output"] = ColwiseParallel(**({"input_layouts": act} if act else {}),
                                         output_layouts=Shard(-1), use_local_output=True)
    parallelize_module(stage, topo.mesh[AXIS], plan)
    if tied_here:  # one Parameter again: both are Shard(0) over the same mesh
        stage.output.weight = stage.tok_embeddings.weight
    for c in stage.chunks:
        c.sp_degree = n if options.sp else 1


@torch.no_grad()
def match_grad_placements(module: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements: DTensor leaves the
    vocab-parallel embedding's gradient ``Replicate`` (full [V, d] on every tp rank) though the
    weight is ``Shard(0)``; Replicate → Shard is a local slice, no collective (``Partial``
    gradients are left to the SP sum)."""
    for p in dict.fromkeys(module.parameters()):
        g = p.grad
        if p.requires_grad and _is_dtensor(g) and _is_dtensor(p) \
                and tuple(g.placements) != tuple(p.placements) \
                and not any(place.is_partial() for place in g.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
