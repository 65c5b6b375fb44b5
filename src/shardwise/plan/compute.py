"""Compute time of one layout: a layer's and the head's seconds per micro-batch as a roofline of
matmul FLOPs, memory-bound elementwise traffic and the attention core (:func:`layer_seconds`,
:func:`head_seconds`), the pipeline bubble per schedule (:func:`bubble_time`; Narayanan et al.
2021 §2.2, Qi et al. 2023 §3.1) and the split of layers into stages (:func:`partition_layers`).
Formulas and sources: docs/planner.md, "The cost model's formulas" (compute, bubble).
"""

from __future__ import annotations

import functools
import math

from ..errors import ShardwiseConfigError
from .layout import PRECISIONS, SCHEDULES, Assumptions, PlanLayout
from .memory import attention_core_bytes, elementwise_bytes, etp
from .models import ModelSpec


def bubble_time(schedule: str, p: int, t_mb: float, v: int = 1, m: int | None = None) -> float:
    """Idle time per step on the critical stage (seconds), ``t_mb`` = forward + backward of one
    micro-batch on one stage (see the module docstring for the sources). With fewer micro-batches
    than stages (``m < p``) interleaving and ZB-H1 have nothing to fill the bubble with: they
    are charged as 1F1B, (p−1)·t_mb."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * t_mb
    if m is not None and m < p:  # too few micro-batches to fill the pipeline: as 1F1B
        return (p - 1) * t_mb
    if schedule == "interleaved-1f1b":
        return (p - 1) * t_mb / v
    if schedule == "zb-h1":
        t_f = t_b = t_w = t_mb / 3
        return (p - 1) * (t_f + t_b - t_w)
    raise ShardwiseConfigError(f"--schedule {schedule!r}: choose from {SCHEDULES}")


def layer_seconds(model: ModelSpec, layout: PlanLayout, gpu, assumptions: "Assumptions",
                  moe: bool = False) -> dict:
    """Seconds per token of one layer's forward + backward (recomputation included) on one GPU
    of ``layout``, by part: "dense", "core", "elementwise", and their sum "total" (the module
    docstring gives the roofline). Communication is not included. ``moe``: an MoE layer —
    the attention matmuls split over tp, the router, the shared experts and top_k experts per
    token (every token's k copies run on some rank: under uniform routing each rank computes
    as many copies as it sent, so expert parallelism leaves the FLOPs per rank unchanged) split
    over :func:`etp`; all at the same ``gemm_efficiency``."""
    m, lay, A = model, layout, assumptions
    prec = PRECISIONS[lay.precision]
    peak = gpu.bf16_flops if prec.compute == "bf16" else gpu.fp32_flops
    t, d, s = lay.tp, m.d_model, m.seq_len
    if moe:
        ffn = m.layer_active_matmul_params(moe=True) - m.attention_matmul_params()
        matmuls = m.attention_matmul_params() / t + ffn / etp(t, lay.sp)
    else:
        matmuls = m.layer_matmul_params() / t
    dense = 6 * matmuls * (4 / 3 if lay.ckpt == "full" else 1)
    core_flops = 12 * d * s / t
    if lay.ckpt == "full" or (lay.ckpt == "selective" and not m.flash_attention):
        core_flops *= 4 / 3
    t_dense = dense / (peak * A.gemm_efficiency)
    if m.flash_attention:
        t_core = core_flops / (peak * gpu.flash_efficiency)
    else:
        t_core = max(core_flops / (peak * A.gemm_efficiency),
                     attention_core_bytes(m, tp=t, ckpt=lay.ckpt, act_bytes=prec.act)
                     / gpu.hbm_bandwidth)
    t_elem = elementwise_bytes(m, tp=t, sp=lay.sp, ckpt=lay.ckpt, act_bytes=prec.act,
                               moe=moe) / gpu.hbm_bandwidth
    return {"dense": t_dense, "core": t_core, "elementwise": t_elem,
            "total": t_dense + t_core + t_elem}


def head_seconds(model: ModelSpec, layout: PlanLayout, gpu, assumptions: "Assumptions") -> float:
    """Seconds per token of the output layer and the loss on one GPU: 6·V·d/t FLOPs at the GEMM
    rate, plus the logits (``a``) and four fp32 passes over them (cast, log-softmax, and their
    gradients) over the HBM bandwidth."""
    prec = PRECISIONS[layout.precision]
    peak = gpu.bf16_flops if prec.compute == "bf16" else gpu.fp32_flops
    v = model.vocab_size / layout.tp
    return (6 * v * model.d_model / (peak * assumptions.gemm_efficiency)
            + (prec.act + 16) * v / gpu.hbm_bandwidth)


# ---------------------------------------------------------------------------------------------
# parameters and model state


def partition_layers(n_layers: int, p: int, head_cost: float) -> list[int]:
    """Layers per pipeline stage, contiguous, minimising the slowest stage when a layer costs 1
    and the last stage also runs the output layer (``head_cost`` layers' worth). Llama 3 §3.3.2
    does the same by giving the first and the last stage one layer less. Raises when p > L."""
    return list(_partition(n_layers, p, head_cost))


@functools.lru_cache(maxsize=4096)
def _partition(n_layers: int, p: int, head_cost: float) -> tuple[int, ...]:
    if p == 1:
        return (n_layers,)
    if p > n_layers:
        raise ShardwiseConfigError(f"--pp {p} exceeds the model's {n_layers} layers: choose "
                                   f"pp ≤ {n_layers}")
    best = None
    for last in range(0, math.ceil(n_layers / p) + 1):
        rest = n_layers - last
        if rest < p - 1:
            continue
        q, r = divmod(rest, p - 1)
        stages = [q + 1] * r + [q] * (p - 1 - r) + [last]
        if min(stages) < 1:
            continue
        slowest = max(max(stages[:-1]), last + head_cost)
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, tuple(stages))
    return best[1]
