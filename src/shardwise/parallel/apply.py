"""Choose and apply the strategy for a layout over a plain model: :func:`parallelize`.

:func:`parallelize` turns a plain model into an :class:`~.model.ParallelModel` for a :class:`Layout` on
a :class:`~shardwise.topology.Topology`, with our explicit implementation (``engine="explicit"``)
or PyTorch's own (``engine="torch"``). It reads as the order of the transforms (torchtitan's
``parallelize_llama``, picotron's order; mesh (pp, dp, cp, tp), tp innermost):

1. check the layout (:meth:`~.layout.Layout.check`, the one validator: every refusal, on every
   rank, before any collective);
   cp > 1: every block's core attention becomes ring (or all-gather) attention over cp
   (:func:`~.cp.parallelize_context`; the train step cuts each batch to this rank's chunks, and
   the dp strategies of step 4 run over dp × cp);
   ep > 1: every MoE layer keeps E/ep experts and dispatches tokens by all-to-all over ep
   (:func:`~.ep.parallelize_experts`; expert gradients are summed over the expert-data-parallel
   ranks, the rest over the data axis);
2. pp > 1: split into this rank's pipeline stages, and compose the rest inside the stage
   (:func:`_pipeline`: the same TP transform per stage, DP / ZeRO-1 over dp, the tied-embedding
   swap and the SP sum after the schedule, a runner of the schedule) into one
   :class:`~.model.ParallelModel`;
3. tp > 1: tensor parallelism on the model — Megatron f/g (:func:`~.tp.parallelize_tensor`) or
   DTensor ``parallelize_module`` (:func:`~.tp.parallelize_tensor_dtensor`), which return the
   converted model's loss function;
4. the gradient sync over dp (:func:`dp_sync`): DP (:mod:`.dp`), ZeRO-1/2/3 (:mod:`.zero`),
   DDP, ``ZeroRedundancyOptimizer`` / FSDP2, or FSDP2 over DTensor TP
   (:class:`~.zero.fsdp2.FSDP2Sync`); with tp > 1 and dp × cp = 1, none
   (:class:`~.sync.NoSync`);
5. one :class:`~.model.ParallelModel` of the loss function (tp = 1: the plain loss of the
   sync's forward module), the sync and the finishers (the SP sum over tp on what the sync
   leaves on each rank).

``Layout``, ``parse_layout`` and ``check_supported`` live in :mod:`.layout` and are re-exported
here.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .layout import Layout, check_supported, parse_layout

__all__ = ["Layout", "check_supported", "dp_sync", "parallelize", "parse_layout"]


def parallelize(model: nn.Module, topo, layout: Layout | None = None, *,
                engine: str = "explicit", bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                layers_per_stage: list[int] | None = None, seed: int = 0,
                reduce_dtype: str = "fp32", weights=None) -> nn.Module:
    """Return ``model`` wrapped for ``layout`` (default: the degrees of ``topo``) by ``engine``
    ("explicit" | "torch"), by the steps of the module docstring. The model may be converted in
    place (TP replaces modules, PP keeps only this rank's stages); use the returned engine's
    ``.module`` afterwards.

    ``bucket_mb``/``overlap``: DP gradient buckets; ``prefetch``/``reshard_after_forward``:
    ZeRO-3 / FSDP2; ``layers_per_stage``: an explicit pipeline split; ``seed``: TP dropout RNG;
    ``reduce_dtype``: "fp32" | "bf16", the dtype gradients are reduced in over dp.
    ``weights``: for a ``model`` built on the meta device (:mod:`shardwise.models.meta`), an
    iterator of (parameter name, full tensor), the same on every rank: each rank allocates and
    fills only what it holds (:mod:`.materialize`; the explicit engine, and the torch engine's
    DTensor TP and FSDP2; DDP, ZeroRedundancyOptimizer and torch's pipelining get the whole
    model first, then run as usual).
    Raises :class:`ShardwiseConfigError` for a layout that cannot run (on every rank, before any
    collective), ``ValueError`` for an unknown engine or a meta model without ``weights``."""
    if engine not in ("explicit", "torch"):
        raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
    layout = layout or Layout(dp=topo.size("dp"), tp=topo.size("tp"), pp=topo.size("pp"),
                              cp=topo.size("cp"), ep=topo.size("ep"))
    # 1. every refusal, before any collective
    layout.check(model=model, topo=topo, engine=engine, reduce_dtype=reduce_dtype)
    from .materialize import hollow, is_meta, materialize_local

    meta = is_meta(model)
    if meta and weights is None:
        raise ValueError("a model built on the meta device needs weights= (name, full tensor)")
    # the torch engine's DTensor TP and FSDP2 (ZeRO-2/3, HSDP) convert a meta model themselves;
    # DDP and ZeroRedundancyOptimizer (whole parameters on every rank anyway) read the values
    fsdp2_meta = (meta and engine == "torch" and layout.pp == layout.cp == 1
                  and (layout.tp > 1 or layout.zero >= 2
                       or (layout.zero == 1 and layout.dp_replicate > 1)))
    # torch's pipelining runs our stage modules: a stage is cut from the meta model as for the
    # explicit engine (DTensor TP converts it on meta, fill_dtensors fills it)
    stage_meta = meta and engine == "torch" and layout.pp > 1 and layout.cp == 1
    if meta and engine != "explicit" and not fsdp2_meta and not stage_meta:
        materialize_local(model, weights, topo)
        meta = False

    def sync_over_dp(m, **kw):  # step 4; a meta model gets its values here, the shards only
        if not meta:
            return dp_sync(m, topo, layout, engine, **kw)
        if fsdp2_meta:  # FSDP2 shards the meta model; its shards only are allocated
            from .materialize import fill_dtensors

            s = dp_sync(m, topo, layout, engine, **kw)
            fill_dtensors(m, weights, topo)
            return s
        if layout.zero == 3:  # flat buffers over storage-less parameters, then the slices
            hollow(m, topo)
            s = dp_sync(m, topo, layout, engine, deferred=True, **kw)
            s.fill(weights)
            return s
        materialize_local(m, weights, topo)  # DP, ZeRO-1/2: whole (tp-sharded) parameters
        return dp_sync(m, topo, layout, engine, **kw)

    if layout.cp > 1 and engine == "explicit":  # the attention cores (pp and tp keep them)
        from .cp import parallelize_context

        parallelize_context(model, topo, layout.cp_method)
    if layout.ep > 1:  # every MoE layer keeps its E/ep experts and dispatches by all-to-all
        from .ep import parallelize_experts

        parallelize_experts(model, topo)
    dp_kw = dict(bucket_mb=bucket_mb, overlap=overlap, prefetch=prefetch,
                 reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype)
    # 2. pipeline stages; TP, DP/ZeRO-1 and the finishers are composed inside each stage
    if layout.pp > 1:
        return _pipeline(model, topo, layout, engine, layers_per_stage=layers_per_stage,
                         seed=seed, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype,
                         weights=weights if meta else None)
    from .model import ParallelModel

    # 3. tensor parallelism on the whole model: the converted model's loss function
    if layout.tp == 1:
        from .model import PlainLoss

        sync = sync_over_dp(model, **dp_kw)
        return ParallelModel(model, topo, loss_fn=PlainLoss(sync.forward_module), grad_sync=sync)
    if engine == "explicit":
        from .tp import TPTraffic, parallelize_tensor

        loss_fn, traffic = parallelize_tensor(model, topo, sp=layout.sp, seed=seed), TPTraffic
    else:
        from .tp import TorchTPTraffic, parallelize_tensor_dtensor

        if layout.dp > 1 and not meta:  # FSDP2 shards what it is given: the dp replicas
            with topo.ledger.phase("init"), torch.no_grad():  # must start equal
                for p in model.parameters():
                    comm.broadcast(p.data, topo, "dp", src=0, tag="init")
        loss_fn, traffic = parallelize_tensor_dtensor(model, topo, sp=layout.sp), TorchTPTraffic
    # 4. the gradient sync over dp (× cp: the data axis), on the TP shards
    if layout.dp * layout.cp == 1:
        from .sync import NoSync

        if meta and engine == "torch":  # DTensor TP on the meta model: its shards only
            from .materialize import fill_dtensors

            fill_dtensors(model, weights, topo)
        elif meta:
            materialize_local(model, weights, topo)
        sync = NoSync(model, topo)
    else:
        sync = sync_over_dp(model, **dp_kw)
    # 5. the finishers, in order after the sync: the SP sum over tp of what the sync leaves
    # (FSDP2 over DTensor TP sums the SP partial gradients inside backward)
    from .tp import SPSum, TorchSPSum

    finishers = [sync.finish_gradient_sync]
    if engine == "explicit":
        finishers += [SPSum(sync)] if layout.sp else []
    else:
        finishers += [TorchSPSum(model, topo)] if layout.dp * layout.cp == 1 else []

    return ParallelModel(model, topo, loss_fn=loss_fn, grad_sync=sync, finishers=finishers,
                         traffic=traffic(model, topo, layout.sp), sp=layout.sp)


def pipeline_chunks(layout: Layout) -> int:
    """The model chunks v per pipeline rank of ``layout`` (pp > 1), its schedule checked by
    :func:`~.pp.schedules.check_schedule`. ``microbatches`` = 0 means the batch decides m (global
    batch / (dp × micro-batch)), which this function does not know: m is checked with the batch
    by :meth:`Layout.check` (``config.validate``, on every rank before any collective) and by
    the runner's schedule each step, so here only the rest is checked, with 2·pp microbatches
    (a count every schedule accepts). Passing pp there refused dualpipev (m ≥ 2·pp) whatever
    the batch gave (issue 51)."""
    from .pp import check_schedule

    return check_schedule(layout.schedule, layout.pp, layout.microbatches or 2 * layout.pp,
                          layout.virtual_stages or None)


def _pipeline(model: nn.Module, topo, layout: Layout, engine: str, *, layers_per_stage=None,
              seed: int = 0, bucket_mb: float = 25.0, reduce_dtype: str = "fp32",
              weights=None):
    """pp > 1: this rank's stage (:class:`~.pp.StageModule`, its v chunks; every pp rank's
    stages start as pp index 0's plain model), the same TP transform as pp = 1 on the stage, the
    stage's gradient sync over dp (whole gradients after the schedule: :class:`~.dp.
    DataParallel` without overlap, zb-h1's W pass writing ``.grad`` by hand where
    post-accumulate hooks do not fire; ZeRO-1 :class:`~.zero.stage_zero1.StageZero1`; none
    when the data axis has one rank), the finishers in the pipeline's order (DTensor TP: the
    gradients' placements; the tied swap; with SP the sum over tp on whole gradients; then the
    sync) and the runner of the schedule (explicit :class:`~.pp.runner.ScheduleRunner`, torch
    :class:`~.pp.torch_runner.TorchScheduleRunner`). Options as :func:`parallelize`;
    ``weights``: ``model`` is on the meta device: the stage is cut and TP converted on it
    (Megatron's or DTensor's), then gets its values from ``weights`` before the sync (no copy
    from the first stage: every rank reads the same weights)."""
    from .sync import NoSync
    from .model import ParallelModel, PlainLoss
    from .params import mark_duplicate
    from .pp import StageModule, copy_stages_from_first
    from .pp.schedules import placement_of
    from .pp.comms import TiedSwap
    from .tp import SPSum, StageTPTraffic

    p, tp, sp = layout.pp, layout.tp, layout.sp
    v = pipeline_chunks(layout)
    placement = placement_of(layout.schedule)  # loop, or the V of zbv / dualpipev
    stage = StageModule(model, topo.index("pp"), p, v, layers_per_stage, placement)
    if weights is None:  # before TP shards them
        copy_stages_from_first(model, topo, v, layers_per_stage, placement)
    finishers, loss_context = [], None
    if tp > 1 and engine == "explicit":  # Megatron TP inside the stage, as for a whole model
        from .tp import VocabParallelLoss, apply_tp

        loss_fn = VocabParallelLoss(stage, topo, sp, apply_tp(stage, topo, sp, seed=seed))
    elif tp > 1:  # DTensor TP inside the stage; its gradients given their params' placements
        from .tp.dtensor import LossParallel, match_grad_placements, parallelize_stage_dtensor

        parallelize_stage_dtensor(stage, topo, sp)
        loss_fn = LossParallel(stage, topo, sp)
        loss_context = loss_fn.backward_context
        finishers.append(lambda: match_grad_placements(stage))
    else:
        loss_fn = PlainLoss(stage)
    if weights is not None:  # this rank's stage (tp shards) from the full tensors
        from .materialize import fill_dtensors, materialize_local

        if tp > 1 and engine == "torch":  # DTensor TP: its local shards only
            fill_dtensors(stage, weights, topo, fqn=stage.fqn)
        else:
            materialize_local(stage, weights, topo, fqn=stage.fqn)
        stage.replay_tied_draw()  # after the init's draws, where a whole build takes it
    if stage.tied_output is not None:
        mark_duplicate(stage.tied_output)  # reduced over dp like the others, counted once
    if topo.size(topo.data_axis) == 1:
        sync = NoSync(stage, topo)
    elif layout.zero == 1 and engine == "explicit":
        from .zero.stage_zero1 import StageZero1

        sync = StageZero1(stage, topo, reduce_dtype=reduce_dtype)
    else:
        from .dp import DataParallel

        sync = DataParallel(stage, topo, bucket_mb=bucket_mb, overlap=False,
                            reduce_dtype=reduce_dtype)
    if engine == "torch" and layout.zero == 1:  # ZeroRedundancyOptimizer over the local shards
        from .zero.stage_zero1 import TorchStageZero1

        sync = TorchStageZero1(sync)
    tied = TiedSwap(stage, topo)
    if weights is None:  # from meta: the last stage's copy was filled from the same tensor
        tied.copy_initial()
    finishers.append(tied)
    if tp > 1 and sp:
        if engine == "explicit":
            finishers.append(SPSum(sync))
        else:
            from .tp import reduce_partial_grads

            finishers.append(lambda: reduce_partial_grads(
                [q for q in stage.parameters() if q.requires_grad], topo))
    finishers.append(sync.finish_gradient_sync)
    seq_shards = tp if sp else 1
    if engine == "explicit":
        from .pp.runner import ScheduleRunner

        runner = ScheduleRunner(stage, topo, schedule=layout.schedule, v=v, loss_sum=loss_fn.loss,
                                seq_shards=seq_shards)
    else:
        from .pp.torch_runner import TorchScheduleRunner

        runner = TorchScheduleRunner(stage, topo, schedule=layout.schedule, v=v,
                                     loss_sum=loss_fn.loss, seq_shards=seq_shards,
                                     loss_context=loss_context, book=tp > 1)
    return ParallelModel(stage, topo, loss_fn=loss_fn, grad_sync=sync, finishers=finishers,
                         traffic=StageTPTraffic(stage, topo, sp, dtensor=engine == "torch")
                         if tp > 1 else None, runner=runner)


def dp_sync(model: nn.Module, topo, layout: Layout, engine: str, *, bucket_mb: float = 25.0,
            overlap: bool = True, prefetch: bool = True, reshard_after_forward: bool = True,
            reduce_dtype: str = "fp32", deferred: bool = False):
    """The gradient sync (a plain :class:`~.sync.Sync`) over ``topo``'s dp axis for
    ``layout.zero`` on ``engine``, of ``model`` (plain, or already converted for TP when
    ``layout.tp`` > 1: its parameters are then this rank's tp shards, Ψ/tp each; DTensors on
    the torch engine).

    ======  ==========================  =================================================
    zero    explicit                    torch (tp = 1; tp > 1)
    ======  ==========================  =================================================
    0       :class:`~.dp.DataParallel`  DDP; FSDP2 ``replicate``
    1, 2    :mod:`.zero` (flat shards)  ZeroRedundancyOptimizer / FSDP2; FSDP2
    3       :mod:`.zero` (units)        FSDP2 ``fully_shard``; the same over DTensor TP
    ======  ==========================  =================================================

    Options as :func:`parallelize`; ``deferred`` (explicit ZeRO only): the parameters hold no
    values yet, fill them with the sync's ``fill`` (:mod:`.materialize`). No checks here:
    :meth:`Layout.check` ran before."""
    if engine == "explicit" and layout.zero:
        from .zero import zero_sync

        return zero_sync(model, topo, layout.zero, prefetch=prefetch,
                         reshard_after_forward=reshard_after_forward, overlap=overlap,
                         reduce_dtype=reduce_dtype, deferred=deferred)
    if engine == "explicit":
        from .dp import DataParallel

        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap,
                            reduce_dtype=reduce_dtype)
    if layout.cp > 1:  # torch's context_parallel with DDP over dp × cp (CUDA only)
        from .cp.torch_cp import step_context
        from .dp import DDPSync

        return DDPSync(model, topo, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype,
                       step_context=step_context(topo))  # each step inside context_parallel
    if layout.tp > 1:
        from .zero.fsdp2 import fsdp2_over_tp

        return fsdp2_over_tp(model, topo, layout, reshard_after_forward=reshard_after_forward,
                             reduce_dtype=reduce_dtype)
    if layout.zero:
        from .zero.torch_zero import ZeroRedundancySync

        return ZeroRedundancySync(model, topo, layout.zero, bucket_mb=bucket_mb,
                                  reduce_dtype=reduce_dtype)
    from .dp import DDPSync

    return DDPSync(model, topo, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
