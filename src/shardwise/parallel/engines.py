"""The two engines' choices at each step of :func:`~.apply.parallelize`, keyed by engine:
:class:`Explicit` (our collectives) and :class:`Torch` (PyTorch's DDP, FSDP2, DTensor,
``torch.distributed.pipelining``). Each member builds one step's piece; ``parallelize`` calls
the same members in the same order whichever engine it holds (:data:`ENGINES`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..precision import FP32, Precision
from .loss import PlainLoss
from .sync import NoSync


def _whole_sync(model, topo, layout, options, build, deferred: bool = False):
    """pp = 1's gradient sync: none when tp shards the model and the data axis has one rank,
    else ``build``'s sync over dp (:func:`dp_sync`; ``deferred``: its values come with its
    ``fill``)."""
    if layout.tp > 1 and layout.dp * layout.cp == 1:
        return NoSync(model, topo)
    return build.dp_sync(model, topo, layout, deferred=deferred, **options)


def dp_sync(model: nn.Module, topo, layout, engine: str, **options):
    """The gradient sync (a plain :class:`~.sync.Sync`) over ``topo``'s dp axis for
    ``layout.zero`` on ``engine``, of ``model`` (plain, or already converted for TP when
    ``layout.tp`` > 1: its parameters are then this rank's tp shards, Ψ/tp each; DTensors on
    the torch engine): :meth:`Explicit.dp_sync` or :meth:`Torch.dp_sync`.

    ======  ==========================  =================================================
    zero    explicit                    torch (tp = 1; tp > 1)
    ======  ==========================  =================================================
    0       :class:`~.dp.DataParallel`  DDP; FSDP2 ``replicate``
    1, 2    :mod:`.zero` (flat shards)  ZeroRedundancyOptimizer / FSDP2; FSDP2
    3       :mod:`.zero` (units)        FSDP2 ``fully_shard``; the same over DTensor TP
    ======  ==========================  =================================================

    ``options``: ``bucket_mb``, ``overlap``, ``prefetch``, ``reshard_after_forward``,
    ``precision`` as :func:`~.apply.parallelize`'s; ``deferred`` (explicit ZeRO only): the
    parameters hold no values yet, fill them with the sync's ``fill`` (:mod:`.materialize`).
    No checks here: :meth:`~.layout.Layout.check` ran before."""
    return ENGINES[engine].dp_sync(model, topo, layout, **options)


def _stage_sync(stage, topo, layout, options):
    """A pipeline stage's sync over dp: whole gradients after the schedule (DataParallel
    without overlap), none when the data axis has one rank."""
    if topo.size(topo.data_axis) == 1:
        return NoSync(stage, topo)
    from .dp import DataParallel

    return DataParallel(stage, topo, bucket_mb=options["bucket_mb"], overlap=False,
                        precision=options["precision"])


class Explicit:
    """Our implementation: Megatron f/g TP, :mod:`.dp` / :mod:`.zero` syncs, our ring attention
    and our schedule runner."""

    name = "explicit"

    @staticmethod
    def takes_meta(layout) -> bool:
        """Every part converts a meta model (materialize.py says how)."""
        return True

    @staticmethod
    def context(model, topo, layout) -> None:
        """cp > 1: every block's core attention becomes ring (or all-gather) attention."""
        if layout.cp > 1:
            from .cp import parallelize_context

            parallelize_context(model, topo, layout.cp_method)

    @staticmethod
    def tensor(model, topo, layout, *, seed: int, values):
        """TP on the whole model: (its loss function, its traffic); (None, None) at tp = 1."""
        if layout.tp == 1:
            return None, None
        from .tp import TPTraffic, parallelize_tensor

        loss_fn = parallelize_tensor(model, topo, options=layout.tp_options, seed=seed)
        return loss_fn, TPTraffic(model, topo, layout.tp_options)

    @staticmethod
    def dp_sync(model, topo, layout, *, bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                precision: Precision = FP32, deferred: bool = False):
        """ZeRO (:func:`~.zero.zero_sync`) for zero ≥ 1, else :class:`~.dp.DataParallel`."""
        if layout.zero:
            from .zero import zero_sync

            return zero_sync(model, topo, layout.zero, prefetch=prefetch,
                             reshard_after_forward=reshard_after_forward, overlap=overlap,
                             precision=precision, deferred=deferred)
        from .dp import DataParallel

        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap,
                            precision=precision)

    @classmethod
    def sync(cls, model, topo, layout, options, values):
        """:func:`_whole_sync`: ZeRO-3 over hollow parameters (its ``fill`` writes its slices),
        the others over this rank's values, given now."""
        if layout.zero == 3 and layout.dp * layout.cp > 1 and values.hollow(model):
            return _whole_sync(model, topo, layout, options, cls, deferred=True)
        values.local(model)
        return _whole_sync(model, topo, layout, options, cls)

    @staticmethod
    def sp_finishers(model, topo, layout, sync) -> list:
        """SP: the sum over tp of the replicated gradients the sync leaves (:class:`~.tp.SPSum`)."""
        from .tp import SPSum

        return [SPSum(sync)] if layout.sp else []

    @staticmethod
    def stage_tensor(stage, topo, layout, *, seed: int):
        """TP inside a pipeline stage: (loss function, backward context, finishers before the
        tied swap, tp's traffic)."""
        if layout.tp == 1:
            return PlainLoss(stage), None, [], None
        from .tp import StageTPTraffic, VocabParallelLoss, apply_tp

        rng = apply_tp(stage, topo, layout.tp_options, seed=seed)
        return (VocabParallelLoss(stage, topo, layout.tp_options, rng), None, [],
                StageTPTraffic(stage, topo, layout.tp_options))

    @staticmethod
    def stage_sync(stage, topo, layout, options):
        """ZeRO-2/3, or any ZeRO stage under HSDP, over the stage's units
        (:func:`~.zero.stage_zero.stage_zero_sync`); ZeRO-1 over the stage's flat buffer; else
        :func:`_stage_sync`."""
        if layout.zero >= 2 or (layout.zero and layout.dp_replicate > 1):
            from .zero.stage_zero import stage_zero_sync

            return stage_zero_sync(stage, topo, layout.zero, precision=options["precision"],
                                   reshard_after_forward=options["reshard_after_forward"])
        if layout.zero == 1 and topo.size(topo.data_axis) > 1:
            from .zero.stage_zero1 import StageZero1

            return StageZero1(stage, topo, precision=options["precision"])
        return _stage_sync(stage, topo, layout, options)

    @staticmethod
    def stage_sp(stage, topo, sync):
        from .tp import SPSum

        return SPSum(sync)

    @staticmethod
    def runner(stage, topo, layout, v: int, loss_fn, loss_context, seq_shards: int):
        from .pp.runner import ScheduleRunner

        return ScheduleRunner(stage, topo, schedule=layout.schedule, v=v, loss_sum=loss_fn.loss,
                              seq_shards=seq_shards)


def _broadcast_dp(model: nn.Module, topo) -> None:
    """FSDP2 shards what it is given: the dp replicas must start equal."""
    with topo.ledger.phase("init"), torch.no_grad():
        for p in model.parameters():
            comm.broadcast(p.data, topo, "dp", src=0, tag="init")


class Torch:
    """PyTorch's own: DTensor TP, DDP / ZeroRedundancyOptimizer / FSDP2, its
    ``context_parallel`` and ``torch.distributed.pipelining``."""

    name = "torch"

    @staticmethod
    def takes_meta(layout) -> bool:
        """DTensor TP, FSDP2 (ZeRO-2/3, HSDP) and a pipeline's stages convert a meta model
        themselves; DDP and ZeroRedundancyOptimizer (whole parameters on every rank anyway) and
        torch's context parallelism read the values first."""
        if layout.cp > 1:
            return False
        return layout.pp > 1 or layout.tp > 1 or layout.zero >= 2 or (
            layout.zero == 1 and layout.dp_replicate > 1)

    @staticmethod
    def context(model, topo, layout) -> None:
        """Nothing on the model: torch's ``context_parallel`` wraps each step (the sync's
        ``step_context``)."""

    @staticmethod
    def tensor(model, topo, layout, *, seed: int, values):
        """DTensor TP on the whole model (the dp replicas made equal first): (its loss, its
        traffic); (None, None) at tp = 1."""
        if layout.tp == 1:
            return None, None
        from .tp import TorchTPTraffic, parallelize_tensor_dtensor

        if layout.dp > 1:
            values.start_equal(_broadcast_dp, model, topo)
        loss_fn = parallelize_tensor_dtensor(model, topo, options=layout.tp_options)
        return loss_fn, TorchTPTraffic(model, topo, layout.tp_options)

    @staticmethod
    def dp_sync(model, topo, layout, *, bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                precision: Precision = FP32, deferred: bool = False, offload: str = "none"):
        """DDP (with cp > 1 inside torch's ``context_parallel``), FSDP2 over DTensor TP,
        ZeroRedundancyOptimizer / FSDP2 for zero ≥ 1 (``overlap``, ``prefetch``, ``deferred``:
        the explicit engine's only; ``offload="params"``: FSDP2's ``CPUOffloadPolicy``)."""
        if layout.cp > 1:  # torch's context_parallel with DDP over dp × cp (CUDA only)
            from .cp.torch_cp import step_context
            from .dp import DDPSync

            return DDPSync(model, topo, bucket_mb=bucket_mb, precision=precision,
                           step_context=step_context(topo))  # each step inside context_parallel
        if layout.tp > 1:
            from .zero.fsdp2 import fsdp2_over_tp

            return fsdp2_over_tp(model, topo, layout, reshard_after_forward=reshard_after_forward,
                                 precision=precision, offload=offload)
        if layout.zero:
            from .zero.torch_zero import ZeroRedundancySync

            return ZeroRedundancySync(model, topo, layout.zero, bucket_mb=bucket_mb,
                                      precision=precision, offload=offload)
        from .dp import DDPSync

        return DDPSync(model, topo, bucket_mb=bucket_mb, precision=precision)

    @classmethod
    def sync(cls, model, topo, layout, options, values):
        """:func:`_whole_sync`; FSDP2 and DTensor get their values from the sync's ``fill``."""
        return _whole_sync(model, topo, layout, options, cls)

    @staticmethod
    def sp_finishers(model, topo, layout, sync) -> list:
        """DTensor TP with no dp sync: the ``Partial`` gradients summed over tp
        (:class:`~.tp.TorchSPSum`); FSDP2 over DTensor TP sums them inside backward."""
        from .tp import TorchSPSum

        return [TorchSPSum(model, topo)] if layout.tp > 1 and layout.dp * layout.cp == 1 else []

    @staticmethod
    def stage_tensor(stage, topo, layout, *, seed: int):
        """DTensor TP inside the stage; its gradients given their parameters' placements (as
        :meth:`Explicit.stage_tensor`)."""
        if layout.tp == 1:
            return PlainLoss(stage), None, [], None
        from .tp.dtensor import (LossParallel, StageTPTraffic, match_grad_placements,
                                 parallelize_stage_dtensor)

        parallelize_stage_dtensor(stage, topo, layout.tp_options)
        loss_fn = LossParallel(stage, topo, layout.tp_options)
        return (loss_fn, loss_fn.backward_context, [lambda: match_grad_placements(stage)],
                StageTPTraffic(stage, topo, layout.tp_options, dtensor=True))

    @staticmethod
    def stage_sync(stage, topo, layout, options):
        """``--zero 2/3`` and HSDP: FSDP2 on each chunk (:class:`~.zero.stage_fsdp2.StageFSDP2`,
        its formula reads this rank's F/B order of the schedule); else :func:`_stage_sync`;
        ``--zero 1``: ZeroRedundancyOptimizer over the local shards."""
        if layout.zero >= 2 or layout.dp_replicate > 1:
            from .pp.schedules import build_schedule
            from .zero.stage_fsdp2 import StageFSDP2

            p, r, v = topo.size("pp"), topo.index("pp"), len(stage.chunks)
            return StageFSDP2(stage, topo, layout.zero, lambda m: [
                (a.kind, a.chunk) for a in build_schedule(layout.schedule, p, m, v)[r]
                if a.kind in ("F", "B")], precision=options["precision"],
                reshard_after_forward=options["reshard_after_forward"],
                offload=options.get("offload", "none"))
        sync = _stage_sync(stage, topo, layout, options)
        if layout.zero == 1:
            from .zero.stage_zero1 import TorchStageZero1

            return TorchStageZero1(sync)
        return sync

    @staticmethod
    def stage_sp(stage, topo, sync):
        from .tp import reduce_partial_grads

        return lambda: reduce_partial_grads([q for q in stage.parameters() if q.requires_grad],
                                            topo)

    @staticmethod
    def runner(stage, topo, layout, v: int, loss_fn, loss_context, seq_shards: int):
        from .pp.torch_runner import TorchScheduleRunner

        return TorchScheduleRunner(stage, topo, schedule=layout.schedule, v=v,
                                   loss_sum=loss_fn.loss, seq_shards=seq_shards,
                                   loss_context=loss_context, book=layout.tp > 1,
                                   c10d_tag="grad_replicate" if layout.dp_replicate > 1 else None)


ENGINES = {"explicit": Explicit, "torch": Torch}
