"""Pipeline parallelism: stage split, schedules as data, simulator, explicit runtime, torch engine.

Read in this order: :mod:`.schedules` (what each rank does, as data), :mod:`.simulate` (bubble,
deadlock, memory), :mod:`.split` (how the model is cut), :mod:`.runner` and :mod:`.comms` (how
the actions run, what crosses between stages), :mod:`.runtime` (the engine around the runner),
:mod:`.torch_pipelining` (the same through ``torch.distributed.pipelining``). The math and the
measurements: docs/pipeline-parallel.md and docs/composition.md.
"""

from .schedules import (SCHEDULES, Action, Schedule, build_schedule, check_schedule,
                        compute_order, format_schedule, peak_activations)
from .simulate import (Costs, DeadlockError, Event, ScheduleError, SimResult, bubble_formula,
                       simulate)
from .split import StageModule, split_layers, validate_pp
from .comms import p2p_bytes_formula
from .runner import KINDS
from .runtime import PipelineParallel


def build_pipeline(model, topo, *, layout=None, engine: str = "explicit",
                   schedule: str = "1f1b", microbatches: int | None = None,
                   virtual_stages: int | None = None, layers_per_stage: list[int] | None = None,
                   seed: int = 0, sp: bool = False, zero: int = 0, reduce_dtype: str = "fp32",
                   **dp_kw):
    """The pipeline engine for ``engine`` ("explicit" → :class:`.runtime.PipelineParallel`,
    "torch" → :class:`.torch_pipelining.TorchPipelineParallel`; the arguments are theirs).

    ``layout`` (a :class:`~shardwise.parallel.apply.Layout`) overrides ``schedule``/
    ``microbatches``/``virtual_stages``/``sp``/``zero``. ``dp_kw``: the other dp-axis options of
    :func:`~..apply.parallelize`; only ``bucket_mb`` applies (ZeRO-2/3 are refused with pp).
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
