"""Pipeline parallelism: stage split, schedules as data, simulator, the runners of a step.

Read in this order: :mod:`.schedules` (what each rank does, as data), :mod:`.simulate` (bubble,
deadlock, memory), :mod:`.split` (how the model is cut), :mod:`.runner` and :mod:`.comms` (how
the actions run, what crosses between stages, the tied swap), :mod:`.torch_runner` (the same
through ``torch.distributed.pipelining``). :func:`shardwise.parallel.apply.parallelize` puts a
stage, its TP, its dp gradient sync, the finishers and a runner into one
:class:`~shardwise.parallel.model.ParallelModel`. The math and the
measurements: docs/pipeline-parallel.md and docs/composition.md.
"""

from .schedules import (SCHEDULES, V_SCHEDULES, Action, Schedule, build_schedule,
                        check_schedule, chunk_of, compute_order, format_schedule,
                        peak_activations, rank_of, stage_of)
from .simulate import (Costs, DeadlockError, Event, ScheduleError, SimResult, bubble_formula,
                       simulate)
from .split import StageModule, split_layers, validate_pp
from .comms import copy_stages_from_first, p2p_bytes_formula
from .runner import KINDS


__all__ = ["SCHEDULES", "V_SCHEDULES", "Action", "Costs", "DeadlockError", "Event", "KINDS",
           "Schedule", "ScheduleError", "SimResult", "StageModule", "bubble_formula",
           "build_schedule", "check_schedule", "chunk_of", "compute_order",
           "copy_stages_from_first", "format_schedule", "p2p_bytes_formula",
           "peak_activations", "rank_of", "simulate", "split_layers", "stage_of", "validate_pp"]
