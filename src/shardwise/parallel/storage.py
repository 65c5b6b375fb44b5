"""Where and in which dtype the model state lives: the parameters' storage dtype, their master
copy (:class:`~shardwise.precision.Precision`) and host offload (``--offload``), and the rules
of what the engines wire (:func:`check_storage`, called by :meth:`~.layout.Layout.check`).

Megatron-LM's recipe (``--param-dtype bf16 --master-dtype fp32``) keeps a bf16 parameter for
the forward and backward, and beside it an fp32 **main gradient** (Megatron's ``main_grad``):
each micro-batch's bf16 ``.grad`` is added into it and freed (:func:`fold_grad_`), so the
accumulation over micro-batches and the dp reduction run in fp32; the optimizer
(:class:`~.master.MasterAdamW`) steps fp32 master weights with it and writes them back rounded
to bf16. The gradient syncs, the norm and the optimizer read a parameter's gradient through
:func:`grad_of` and write a reduced one through :func:`set_grad_`, so every layout gets the
recipe from these three functions. Derivation and accuracy: docs/precision-memory-mfu.md,
"bf16 storage"; parity rule: docs/parity.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ShardwiseConfigError
from ..precision import Precision

OFFLOADS = ("none", "optimizer", "params")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_storage(layout, precision: Precision, offload: str, engine: str) -> None:
    """Where and in which dtype the model state lives — ``precision.param_dtype`` (and its
    master copy) and ``offload`` ("none" | "optimizer" | "params") — against what the engines
    wire for ``layout`` on ``engine``: the one definition ``train`` and the planner share.
    Wired: the explicit engine at pp = 1 (dp, ZeRO-1/2/3, HSDP, tp, cp), bf16 storage (both
    recipes) and ``--offload optimizer``. Raises :class:`ShardwiseConfigError`."""
    if offload not in OFFLOADS:
        raise ShardwiseConfigError(f"--offload {offload!r}: choose none, optimizer or params")
    stored = precision.param_dtype != "fp32"
    if not stored and offload == "none":
        return
    what = (f"--param-dtype {precision.param_dtype}" if stored else f"--offload {offload}")
    if engine != "explicit":
        raise ShardwiseConfigError(
            f"{what} is wired on the explicit engine only (torch's FSDP2 MixedPrecisionPolicy "
            "/ CPUOffloadPolicy are not yet): use --engine explicit")
    if layout.pp > 1:
        raise ShardwiseConfigError(
            f"{what} is not wired with a pipeline yet (the stage syncs do not read the fp32 "
            "main gradients): use --pp 1, or --param-dtype fp32 --offload none")
    if offload == "params":
        raise ShardwiseConfigError("--offload params is not wired yet (the ZeRO-3 shards "
                                   "would live on the host): use --offload optimizer")


def storage_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype the parameters are stored in (``precision.param_dtype``)."""
    return TORCH_DTYPES[precision.param_dtype]


def main_grads(precision: Precision) -> bool:
    """Whether gradients are accumulated in another dtype than the parameters are stored in
    (Megatron's recipe: bf16 parameters, fp32 main gradients)."""
    return precision.grad_dtype != precision.param_dtype


def main_grad_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype of a sync's gradient buffers under ``precision``: fp32 where
    :func:`main_grads`, else None (the parameters' own)."""
    return torch.float32 if main_grads(precision) else None


@torch.no_grad()
def store_parameters(module: nn.Module, precision: Precision) -> None:
    """Cast ``module``'s floating parameters (not its buffers: RoPE tables stay as built) to
    the storage dtype in place (same ``nn.Parameter`` objects; a meta model stays meta).
    Nothing for fp32 storage."""
    dtype = storage_dtype(precision)
    if dtype == torch.float32:
        return
    for p in dict.fromkeys(module.parameters()):
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def arm_main_grads(module: nn.Module, precision: Precision) -> None:
    """Megatron's recipe: give every trainable parameter of ``module`` an fp32 main gradient
    (``p.main_grad``, None = zero) and a post-accumulate-grad hook that folds each backward's
    ``.grad`` into it (:func:`fold_grad_`). Hook order does not matter: a sync that reads a
    gradient first folds it itself (:func:`grad_of`). Nothing unless :func:`main_grads`."""
    if not main_grads(precision):
        return
    for p in dict.fromkeys(module.parameters()):
        if p.requires_grad and not hasattr(p, "main_grad"):
            p.main_grad = None
            p.register_post_accumulate_grad_hook(fold_grad_)


@torch.no_grad()
def fold_grad_(p) -> None:
    """``p.main_grad += p.grad`` in fp32 (created from it when None), then ``p.grad = None``:
    one micro-batch's bf16 gradient into the fp32 accumulator. Nothing for a parameter without
    a main gradient or without ``.grad``."""
    g = p.grad
    if g is None or not hasattr(p, "main_grad"):
        return
    if p.main_grad is None:
        p.main_grad = g.to(torch.float32)
    else:
        p.main_grad.add_(g)
    p.grad = None


def grad_of(p):
    """The gradient a sync, the norm and the optimizer read: the fp32 main gradient of a
    parameter that has one (folded first), else ``.grad`` (None: no gradient)."""
    if hasattr(p, "main_grad"):
        fold_grad_(p)
        return p.main_grad
    return p.grad


def set_grad_(p, value: torch.Tensor) -> None:
    """Write a reduced gradient ``value`` back: into ``p.main_grad`` (fp32, allocated when
    None) or ``.grad`` (allocated when None; cast to the parameter's dtype)."""
    if hasattr(p, "main_grad"):
        if p.main_grad is None:
            p.main_grad = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        p.main_grad.copy_(value.view_as(p.main_grad))
        return
    from .params import local

    if p.grad is None:
        p.grad = torch.zeros_like(p)
    local(p.grad).copy_(value)


def attach_grad_(p, view: torch.Tensor) -> None:
    """Make ``view`` (of a flat gradient buffer) ``p``'s gradient: its ``main_grad`` when ``p``
    has one or ``view``'s dtype is not ``p``'s (a bf16 ZeRO slice over fp32 main gradients),
    else its ``.grad`` (autograd then accumulates into ``view`` in place)."""
    if hasattr(p, "main_grad") or view.dtype != p.dtype:
        p.grad, p.main_grad = None, view
    else:
        p.grad = view


def clear_main_grads(params) -> None:
    """Set every main gradient of ``params`` to None (a step's ``zero_grad``)."""
    for p in params:
        if hasattr(p, "main_grad"):
            p.main_grad = None


def optimized_numel(sync) -> int:
    """Elements this rank's optimizer steps: ZeRO's slices without their padding (Σ_u of
    |[lo, hi) ∩ [0, Ψ_u)|, :mod:`.zero.flat`), else every trainable parameter it holds (each
    once)."""
    units = getattr(sync, "units", None)
    if units is not None:
        return sum(max(0, min(u.hi, u.numel) - u.lo) for u in units)
    return sum(p.numel() for p in dict.fromkeys(sync.module.parameters()) if p.requires_grad)


def offload_bytes_formula(engine) -> dict[str, float]:
    """``{"offload_d2h", "offload_h2d"}`` bytes one rank copies per step with ``--offload
    optimizer`` ({} without): its N optimized elements (:func:`optimized_numel`) cross once
    each way — the gradients to the host in the gradient dtype (fp32 main gradients: 4 B),
    the updated parameters back in the storage dtype (bf16: 2 B). ZeRO-Offload (Ren et al.
    2021, §4.1: gradients down, fp16 parameters up, the optimizer on the CPU)."""
    if getattr(engine, "offload", "none") == "none":
        return {}
    n, p = optimized_numel(engine.grad_sync), engine.precision
    return {"offload_d2h": float(n * p.grad), "offload_h2d": float(n * p.param)}
