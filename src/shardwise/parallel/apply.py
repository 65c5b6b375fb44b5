"""Choose and apply the strategy for a layout over a plain model: :func:`parallelize`.

:func:`parallelize` turns a plain model into an :class:`~.model.ParallelModel` for a :class:`Layout` on
a :class:`~shardwise.topology.Topology`, with our explicit implementation (``engine="explicit"``)
or PyTorch's own (``engine="torch"``: the same steps, each engine's constructors in
:mod:`.engines`). It reads as the order of the transforms (torchtitan's ``parallelize_llama``,
picotron's order; mesh (pp, dp, cp, tp), tp innermost):

0. check the layout (:meth:`~.layout.Layout.check`, the one validator: every refusal, on every
   rank, before any collective); decide once where the values come from
   (:class:`~.materialize.Values`: the model's own, or streamed into a meta model's shards);
1. transforms on the plain model: cp > 1, every block's core attention becomes ring (or
   all-gather) attention over cp (:func:`~.cp.parallelize_context`; the dp strategies then run
   over dp × cp); ep > 1, every MoE layer keeps E/ep experts and dispatches tokens by
   all-to-all over ep (:func:`~.ep.parallelize_experts`); then the numerics transforms
   (``numerics``: e.g. a quantizer), before TP so that they reach our TP layers;
2. the runner: pp = 1, the micro-batch loop over the whole model (:class:`~.runner.
   NoPipelining`); pp > 1, this rank's pipeline stages and the schedule's runner, the rest
   composed inside the stage (:func:`_pipeline`);
3. the loss: tp > 1, tensor parallelism on the model — Megatron f/g
   (:func:`~.tp.parallelize_tensor`) or DTensor ``parallelize_module``
   (:func:`~.tp.parallelize_tensor_dtensor`) — and the converted model's loss function; tp = 1,
   :class:`~.loss.PlainLoss` of the sync's forward module;
4. the gradient sync over dp (:func:`dp_sync`): DP (:mod:`.dp`), ZeRO-1/2/3 (:mod:`.zero`),
   DDP, ``ZeroRedundancyOptimizer`` / FSDP2, or FSDP2 over DTensor TP
   (:class:`~.zero.fsdp2.FSDP2Sync`); with tp > 1 and dp × cp = 1, none
   (:class:`~.sync.NoSync`); a meta model's values come first where the sync reads them as it
   is built (DP, ZeRO-1/2: :meth:`~.materialize.Values.local`), else with its ``fill`` (ZeRO-3's
   flat slices, FSDP2's and DTensor's shards, the plain copy under ``NoSync``);
5. the finishers, in order after the sync: the SP sum over tp on what the sync leaves on each
   rank.

``Layout``, ``parse_layout`` and ``check_supported`` live in :mod:`.layout` and are re-exported
here.
"""

from __future__ import annotations

from torch import nn

from ..precision import FP32, Precision
from .engines import ENGINES, dp_sync
from .layout import Layout, check_supported, parse_layout
from .loss import PlainLoss
from .materialize import Values
from .model import ParallelModel
from .storage import arm_main_grads, fsdp2_masters, store_parameters

__all__ = ["Layout", "check_supported", "dp_sync", "parallelize", "parse_layout"]


def parallelize(model: nn.Module, topo, layout: Layout | None = None, *,
                engine: str = "explicit", bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                layers_per_stage: list[int] | None = None, seed: int = 0,
                precision: Precision = FP32, weights=None, numerics=(),
                offload: str = "none") -> nn.Module:
    """Return ``model`` wrapped for ``layout`` (default: the degrees of ``topo``) by ``engine``
    ("explicit" | "torch"), by the steps of the module docstring; ``model`` may be converted in
    place: use the returned engine's ``.module`` afterwards. ``bucket_mb``/``overlap``: DP
    gradient buckets; ``prefetch``/``reshard_after_forward``: ZeRO-3 / FSDP2;
    ``layers_per_stage``: an explicit pipeline split; ``seed``: TP dropout RNG; ``precision``:
    the run's :class:`~shardwise.precision.Precision` (held by the engine; its storage dtype
    cast in, with fp32 main gradients under Megatron's recipe: :mod:`.storage`); ``offload``:
    "none" | "optimizer" (held by the engine: its optimizer's state on the host) | "params"
    (ZeRO-3's shards on the host too: :mod:`.zero.offload`);
    ``weights``: (name, full tensor) for a model built on the meta device
    (:mod:`.materialize`); ``numerics``:
    callables applied in order to the model before TP. Raises :class:`ShardwiseConfigError`
    for a layout that cannot run (on every rank, before any collective), ``ValueError`` for an
    unknown engine or a meta model without ``weights``."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
    build = ENGINES[engine]
    layout = layout or Layout(dp=topo.size("dp"), tp=topo.size("tp"), pp=topo.size("pp"),
                              cp=topo.size("cp"), ep=topo.size("ep"))
    layout.check(model=model, topo=topo, engine=engine, precision=precision,
                 offload=offload)  # 0.
    values = Values(model, weights, topo, whole=not build.takes_meta(layout))
    options = dict(bucket_mb=bucket_mb, overlap=overlap, prefetch=prefetch,
                   reshard_after_forward=reshard_after_forward, precision=precision)
    if engine == "torch":  # --offload params: FSDP2's CPUOffloadPolicy, given to fully_shard
        options["offload"] = offload
    # bf16 storage (.storage), but not Megatron's recipe on the torch engine: there the model
    # stays fp32 and FSDP2 gathers it in bf16 (its shards are the masters, .storage.fsdp2_masters)
    stored = precision.param_dtype != "fp32" and not fsdp2_masters(precision, engine)
    transform(model, topo, layout, build, numerics)  # 1.
    if layout.pp > 1:  # 2. (a pipeline composes steps 3–5 inside its stage)
        return _pipeline(model, topo, layout, build, values, options,
                         layers_per_stage=layers_per_stage, seed=seed, offload=offload,
                         stored=stored)
    loss_fn, traffic = build.tensor(model, topo, layout, seed=seed, values=values)  # 3.
    if stored:  # bf16 storage (.storage): cast before the sync's buffers take the parameters
        store_parameters(model, precision)
    sync = build.sync(model, topo, layout, options, values)  # 4.
    values.fill(sync)
    if offload == "params" and engine == "explicit":  # ZeRO-3's shards to host memory
        from .zero.offload import offload_params

        offload_params(sync)
    if stored:  # Megatron's recipe: fp32 main gradients, once the values are in place
        arm_main_grads(model, precision)
    finishers = [sync.finish_gradient_sync] + build.sp_finishers(model, topo, layout, sync)  # 5.
    return ParallelModel(model, topo, loss_fn=loss_fn or PlainLoss(sync.forward_module),
                         grad_sync=sync, finishers=finishers, traffic=traffic, sp=layout.sp,
                         precision=precision, offload=offload)


def transform(model: nn.Module, topo, layout: Layout, build, numerics=()) -> None:
    """Step 1 of :func:`parallelize`, in place: context parallelism (``build``'s: ours converts
    the attention cores; torch's wraps each step instead), expert parallelism, then each of
    ``numerics`` (a callable taking the model: the slot of a numerics transform such as a
    fake quantizer or an FP8 swap, before TP so that our TP layers, which call their linear
    themselves, carry it; :mod:`.numerics`)."""
    build.context(model, topo, layout)
    if layout.ep > 1:  # every MoE layer keeps its E/ep experts and dispatches by all-to-all
        from .ep import parallelize_experts

        parallelize_experts(model, topo)
    for numeric in numerics:
        numeric(model)


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


def _pipeline(model: nn.Module, topo, layout: Layout, build, values: Values, options: dict, *,
              layers_per_stage=None, seed: int = 0, offload: str = "none",
              stored: bool = False):
    """pp > 1: this rank's stage (:class:`~.pp.StageModule`, its v chunks; every pp rank's
    stages start as pp index 0's plain model), the same TP as pp = 1 on the stage (``build``'s
    ``stage_tensor``), its values (a meta model's: this rank's part, then the tied draw), the
    tied copy made equal to the first stage's (before the sync: ZeRO-3 frees whole
    parameters), the stage's gradient sync over dp (whole gradients reduced after the
    schedule: :class:`~.dp.DataParallel` without overlap; ZeRO-1 :class:`~.zero.stage_zero1.
    StageZero1`; ZeRO-2/3 and HSDP over the stage's units, :mod:`.zero.stage_zero`; none when
    the data axis has one rank), the finishers in the pipeline's order (DTensor TP: the gradients'
    placements; the tied swap; with SP the sum over tp on whole gradients; then the sync) and
    the runner of the schedule (``build.runner``). Options as :func:`parallelize`; ``stored``:
    the parameters cast to the storage dtype (bf16 storage, not in FSDP2's form)."""
    from .params import mark_duplicate
    from .pp import StageModule, copy_stages_from_first
    from .pp.comms import TiedSwap
    from .pp.schedules import placement_of

    tp, sp, v = layout.tp, layout.sp, pipeline_chunks(layout)
    placement = placement_of(layout.schedule)  # loop, or the V of zbv / dualpipev
    stage = StageModule(model, topo.index("pp"), layout.pp, v, layers_per_stage, placement)
    values.start_equal(copy_stages_from_first, model, topo, v, layers_per_stage, placement)
    loss_fn, loss_context, finishers, traffic = build.stage_tensor(stage, topo, layout, seed=seed)
    values.local(stage, fqn=stage.fqn, after=stage.replay_tied_draw)  # after the init's draws
    if stage.tied_output is not None:
        mark_duplicate(stage.tied_output)  # reduced over dp like the others, counted once
    precision = options["precision"]
    if stored:  # bf16 storage (.storage): as parallelize's step 4
        store_parameters(stage, precision)
    tied = TiedSwap(stage, topo)  # before the sync: ZeRO-3 frees the whole parameters
    values.start_equal(tied.copy_initial)  # a meta model's last stage: from the same tensor
    sync = build.stage_sync(stage, topo, layout, options)
    values.fill(sync)
    if offload == "params" and "offload" not in options:  # explicit: the stage's ZeRO-3
        from .zero.offload import offload_params  # shards to the host (torch: FSDP2's policy)

        offload_params(sync)
    if stored:
        arm_main_grads(stage, precision)
    finishers += [tied] + ([build.stage_sp(stage, topo, sync)] if tp > 1 and sp else [])
    finishers.append(sync.finish_gradient_sync)
    runner = build.runner(stage, topo, layout, v, loss_fn, loss_context, tp if sp else 1)
    return ParallelModel(stage, topo, loss_fn=loss_fn, grad_sync=sync, finishers=finishers,
                         traffic=traffic, runner=runner, precision=precision, offload=offload)
