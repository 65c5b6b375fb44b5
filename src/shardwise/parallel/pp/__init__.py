"""Pipeline parallelism: stage split, schedules as data, simulator, the runners of a step.

Read in this order: :mod:`.schedule_data` (what each rank does, as data), :mod:`.schedules`
(building one: :mod:`.loop_schedules` for GPipe, 1F1B, interleaved and ZB-H1, :mod:`.v_schedules`
for the V placement's zbv and dualpipev), :mod:`.simulate` (bubble,
deadlock, memory), :mod:`.split` (how the model is cut), :mod:`.runner` and :mod:`.comms` (how
the actions run, what crosses between stages, the tied swap), :mod:`.torch_runner` (the same
through ``torch.distributed.pipelining``). :func:`shardwise.parallel.apply.parallelize` puts a
stage, its TP, its dp gradient sync, the finishers and a runner into one
:class:`~shardwise.parallel.model.ParallelModel`. The math and the
measurements: docs/pipeline-parallel.md and docs/composition.md.

From learn/ (``learn/pp.py``'s names → here):

* ``schedule``'s ``("F", i)`` / ``("B", i)`` → :func:`~.schedules.build_schedule`: a
  :class:`~.schedules.Schedule` of :class:`~.schedules.Action` (the sends and receives are
  actions too: SEND_F, RECV_F, SEND_B, RECV_B), for six schedules, gpipe and 1f1b among them
* ``warm = min(p - 1 - r, m)`` → the same warm-up in 1F1B's order (:func:`~.schedules.compute_order`)
* ``mine`` (my blocks) → :func:`~.split.split_layers`, :class:`~.split.StageModule`
* ``for action, i in program``, ``dist.recv``, ``dist.isend``, ``pending`` →
  :meth:`~.runner.ScheduleRunner.run` (isends waited at the end of the step, as here; gradients
  on a group of their own, :class:`~.comms.GradTraffic`)
* ``loss_sum`` (the last stage's) → summed over pp, :attr:`~.runner.ScheduleRunner.loss_axes`
* ``(p − 1)/(m + p − 1)`` → :func:`~.simulate.bubble_formula`; :func:`~.simulate.simulate`
  replays any schedule on a clock; PyTorch's twin: :class:`~.torch_runner.TorchScheduleRunner`
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
