"""The batching a run derives when not given (:func:`derive_batching`: micro-batch size and
pipeline micro-batches) and the one line that explains it (:func:`batching_note`).
"""

from __future__ import annotations

import dataclasses

from ..errors import ShardwiseConfigError
from .fields import TrainConfig


def derive_batching(cfg: TrainConfig, auto: set[str]) -> TrainConfig:
    """Fill in the micro-batch (and, with pp > 1, the microbatches) named in ``auto`` — the
    ones the user did not give — from the layout, and record them in ``cfg.derived``.

    ``micro_batch`` in ``auto`` (and no explicit ``--microbatches``): the largest b ≤
    ``cfg.micro_batch`` (the default in effect, 8) that divides the local batch
    global batch / dp and, with pp > 1, leaves at least pp microbatches per step (for
    interleaved-1f1b, m that splits into m // pp equal rounds). With pp > 1 and
    ``microbatches`` in ``auto`` too, m = local / b is recorded: the smallest m ≥ pp that divides
    the local batch with micro-batches of at most the default (the fewest microbatches: least
    per-step overhead, the bubble (p − 1)/(m + p − 1) of GPipe/1F1B, Narayanan et al. 2021 §2.2,
    is the price). Where the default fits it is kept, so runs that worked before are unchanged.
    An explicit value is never changed: one that does not fit gets :func:`validate`'s error.

    Raises :class:`ShardwiseConfigError` when no value fits (global batch not a multiple of dp,
    or fewer sequences per pipeline than pp), naming the constraint and the fix. Values below 1
    are left for :func:`validate` to report."""
    cfg = dataclasses.replace(cfg, derived="")
    gb, dp, pp, cap = cfg.global_batch, cfg.dp, cfg.pp, cfg.micro_batch
    if "micro_batch" not in auto or min(gb, dp, pp, cap) < 1 or cfg.microbatches < 0 \
            or (pp > 1 and cfg.microbatches):  # explicit m: the micro-batch follows from it
        return cfg
    if gb % dp:
        lo = max(dp, gb // dp * dp)
        divisors = [d for d in range(1, gb + 1) if gb % d == 0]
        raise ShardwiseConfigError(
            f"--global-batch {gb} does not split over --dp {dp} (each dp rank takes global "
            f"batch / dp whole sequences), so no micro-batch fits: choose --global-batch a "
            f"multiple of {dp} (e.g. {lo} or {lo + dp}) or --dp from {divisors}")
    local = gb // dp
    fits = [b for b in range(min(cap, local), 0, -1) if local % b == 0
            and (pp == 1 or _pipeline_fits(cfg.schedule, pp, local // b))]
    if not fits:
        m_min = 2 * pp if cfg.schedule == "dualpipev" else pp  # dualpipev: m ≥ 2·pp
        need = dp * m_min
        raise ShardwiseConfigError(
            f"--pp {pp} needs at least {m_min} microbatches per step"
            + (" with --schedule dualpipev" if m_min > pp else "") + ", but global batch / dp = "
            f"{gb} / {dp} = {local} sequences per pipeline"
            + ("" if local >= m_min else f" (fewer than {m_min})") + ": choose --global-batch a "
            f"multiple of dp × {'2·pp' if m_min > pp else 'pp'} = {need} (e.g. "
            f"{max(need, gb // need * need)}) or a smaller --pp or --dp")
    b = fits[0]
    derived = ["micro_batch"]
    if pp > 1 and "microbatches" in auto:
        derived.append("microbatches")
        cfg = dataclasses.replace(cfg, microbatches=local // b)
    return dataclasses.replace(cfg, micro_batch=b, derived=",".join(derived))


def _pipeline_fits(schedule: str, pp: int, m: int) -> bool:
    """m microbatches fill a pp-stage pipeline: m ≥ pp, for interleaved-1f1b m splits into
    m // pp equal rounds (:func:`~.parallel.pp.schedules.rounds_of`), for dualpipev m ≥ 2·pp
    (:func:`~.parallel.pp.schedules.check_schedule`)."""
    if m < pp or (schedule == "dualpipev" and m < 2 * pp):
        return False
    return schedule != "interleaved-1f1b" or m % (m // pp) == 0


def batching_note(cfg: TrainConfig) -> str:
    """The start-up line's words on derived values ("" when the user chose them), e.g.
    ``micro-batch 4 (derived: global batch 16 / dp 4; pass --micro-batch to choose)``."""
    derived = set(filter(None, cfg.derived.split(",")))
    if "micro_batch" not in derived:
        return ""
    local = cfg.global_batch // cfg.dp
    if "microbatches" in derived:
        return (f"micro-batch {cfg.micro_batch}, {cfg.microbatches} microbatches (derived: "
                f"global batch {cfg.global_batch} / dp {cfg.dp} = {local} sequences per "
                f"pipeline, at least pp {cfg.pp} microbatches; pass --micro-batch or "
                "--microbatches to choose)")
    return (f"micro-batch {cfg.micro_batch} (derived: global batch {cfg.global_batch} / dp "
            f"{cfg.dp}; pass --micro-batch to choose)")
