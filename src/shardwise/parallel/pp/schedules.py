"""Pipeline schedules, built: for every pipeline rank an ordered list of actions, to print
(:func:`format_schedule`), simulate (:mod:`.simulate`), draw (:mod:`shardwise.viz.timeline`) and
execute (:mod:`.runner`). :func:`build_schedule` takes each rank's compute order
(:func:`compute_order`: :mod:`.loop_schedules` for gpipe, 1f1b, interleaved-1f1b and zb-h1,
:mod:`.v_schedules` for zbv and dualpipev) and adds the sends and receives
(:func:`insert_comms`). What a schedule is (:class:`Action`, :class:`Schedule`, the placements,
:func:`check_schedule`) is :mod:`.schedule_data`, re-exported here. Nothing here touches a model
or a process group.

The orders, the simulator's checks and the tests: docs/pipeline-parallel.md §2–3.
"""

from __future__ import annotations

from .loop_schedules import gpipe, interleaved, one_f_one_b
from .schedule_data import (B, COMM, COMPUTE, PLACEMENTS, SCHEDULES, V_SCHEDULES, Action, F, I,
                            Schedule, W, check_schedule, chunk_of, default_chunks,
                            format_schedule, min_microbatches, peak_activations, placement_of,
                            rank_of, rounds_of, stage_of, stages_of)
from .v_schedules import dualpipev, zbv


def compute_order(name: str, p: int, m: int, v: int | None = None) -> list[list[Action]]:
    """Per rank, the compute actions (F/B/I/W) of schedule ``name`` in execution order."""
    v = check_schedule(name, p, m, v)
    if name == "gpipe":
        return [gpipe(m) for _ in range(p)]
    if name == "1f1b":
        return [one_f_one_b(p, m, r) for r in range(p)]
    if name == "zb-h1":
        return [one_f_one_b(p, m, r, split_backward=True) for r in range(p)]
    if name == "zbv":
        return [zbv(p, m, r) for r in range(p)]
    if name == "dualpipev":
        return [dualpipev(p, m, r) for r in range(p)]
    return [interleaved(p, m, v, r) for r in range(p)]


def insert_comms(order: list[list[Action]], p: int, v: int,
                 placement: str = "loop") -> list[list[Action]]:
    """Add the point-to-point actions to compute orders: each RECV right before the compute that
    consumes the tensor, each SEND right after the compute that produces it. Two consecutive
    stages on the same rank (the V placement's stages p−1 and p) exchange nothing: the runner
    hands the tensor over locally."""
    n_stages = p * v
    out = []
    for r, acts in enumerate(order):
        lst = []
        for a in acts:
            s = stage_of(r, a.chunk, p, placement)
            prev = rank_of(s - 1, p, placement) if s > 0 else r
            nxt = rank_of(s + 1, p, placement) if s < n_stages - 1 else r
            if a.kind == "F":
                if prev != r:
                    lst.append(Action("RECV_F", a.microbatch, a.chunk, prev))
                lst.append(a)
                if nxt != r:
                    lst.append(Action("SEND_F", a.microbatch, a.chunk, nxt))
            elif a.kind in ("B", "I"):
                if nxt != r:
                    lst.append(Action("RECV_B", a.microbatch, a.chunk, nxt))
                lst.append(a)
                if prev != r:
                    lst.append(Action("SEND_B", a.microbatch, a.chunk, prev))
            else:
                lst.append(a)
        out.append(lst)
    return out


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The full schedule (compute and communication actions per rank) for ``p`` ranks, ``m``
    microbatches and ``v`` chunks per rank. Raises :class:`ShardwiseConfigError` for invalid
    combinations (:func:`check_schedule`)."""
    v = check_schedule(name, p, m, v)
    order = compute_order(name, p, m, v)
    placement = placement_of(name)
    ranks = tuple(tuple(acts) for acts in insert_comms(order, p, v, placement))
    return Schedule(name=name, p=p, m=m, v=v, ranks=ranks, placement=placement)


__all__ = ["B", "COMM", "COMPUTE", "PLACEMENTS", "SCHEDULES", "V_SCHEDULES", "Action", "F", "I",
           "Schedule", "W", "build_schedule", "check_schedule", "chunk_of", "compute_order",
           "default_chunks", "format_schedule", "insert_comms", "min_microbatches",
           "peak_activations", "placement_of", "rank_of", "rounds_of", "stage_of", "stages_of"]
