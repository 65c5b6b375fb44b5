"""Pipeline parallelism: stage split, schedules as data, simulator, explicit runtime, torch engine.

Read in this order: :mod:`.schedules` (what each rank does, as printable data),
:mod:`.simulate` (what that costs: bubble, deadlock, memory), :mod:`.split` (how the model is
cut), :mod:`.runner` (how the actions run, with every send and receive) and :mod:`.comms`
(the two channels, the tied-embedding swap), :mod:`.runtime` (the engine around the runner:
the step, gradient sync, norm), :mod:`.torch_pipelining` (the same through
``torch.distributed.pipelining``); compositions: TP + SP inside a stage (:func:`..tp.apply_tp`,
the whole model's transform), ZeRO-1 of a stage over dp (:mod:`..zero.flat`, shared with ZeRO).
The math and the measurements are in ``docs/pipeline-parallel.md`` and ``docs/composition.md``.
"""

from .schedules import (SCHEDULES, Action, Schedule, build_schedule, check_schedule,
                        compute_order, format_schedule, peak_activations)
from .simulate import (Costs, DeadlockError, Event, ScheduleError, SimResult, bubble_formula,
                       simulate)
from .split import StageModule, split_layers, validate_pp
from .comms import p2p_bytes_formula  # noqa: E402
from .runner import KINDS  # noqa: E402
from .runtime import PipelineParallel  # noqa: E402


def build_pipeline(model, topo, *, layout=None, engine: str = "explicit",
                   schedule: str = "1f1b", microbatches: int | None = None,
                   virtual_stages: int | None = None, layers_per_stage: list[int] | None = None,
                   seed: int = 0, sp: bool = False, zero: int = 0, reduce_dtype: str = "fp32",
                   **dp_kw):
    """The pipeline engine for ``engine`` ("explicit" → :class:`.runtime.PipelineParallel`,
    "torch" → :class:`.torch_pipelining.TorchPipelineParallel`), composed with TP (+SP) inside each
    stage (tp = ``topo.size("tp")``) and DP / ZeRO-1 over dp (docs/composition.md).

    ``layout`` (a :class:`~shardwise.parallel.apply.Layout`) overrides ``schedule``/
    ``microbatches``/``virtual_stages``/``sp``/``zero``. ``seed``: TP dropout RNG;
    ``reduce_dtype``: "fp32" | "bf16" dp gradient reduction. ``dp_kw``: the other dp-axis
    options of :func:`~..apply.parallelize`: ``bucket_mb`` sizes DP's gradient buckets
    (:class:`..dp.GradBuckets`, launched once after the last microbatch); ``overlap``,
    ``prefetch``, ``reshard_after_forward`` do not apply (ZeRO-2/3 are refused with pp).
    Raises ``ValueError`` for an unknown engine, :class:`~shardwise.errors.ShardwiseConfigError`
    for invalid settings (before any collective)."""
    if layout is not None:
        schedule = layout.schedule
        microbatches = layout.microbatches or None
        virtual_stages = layout.virtual_stages or None
        sp, zero = layout.sp, layout.zero
    kw = dict(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
              layers_per_stage=layers_per_stage, sp=sp, zero=zero, seed=seed,
              reduce_dtype=reduce_dtype, bucket_mb=dp_kw.get("bucket_mb", 25.0))
    if engine == "explicit":
        return PipelineParallel(model, topo, **kw)
    if engine == "torch":
        from .torch_pipelining import TorchPipelineParallel

        return TorchPipelineParallel(model, topo, **kw)
    raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")


__all__ = ["SCHEDULES", "Action", "Costs", "DeadlockError", "Event", "PipelineParallel",
           "Schedule", "ScheduleError", "SimResult", "StageModule", "bubble_formula",
           "build_pipeline", "build_schedule", "check_schedule", "compute_order",
           "KINDS", "format_schedule", "p2p_bytes_formula", "peak_activations",
           "simulate", "split_layers", "validate_pp"]
