"""AdamW with the usual parameter groups (or Muon on the hidden matrices, ``--optimizer muon``),
and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ShardwiseConfigError
from ..parallel.muon import MOMENTUM, NS_COEFFICIENTS, NS_STEPS, Muon, is_hidden_matrix


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices, none on norms, biases and embeddings
    (Loshchilov & Hutter 2019; the GPT-2/nanoGPT convention). A tied embedding is an embedding."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # a pipeline's last stage holds its own copy of a tied embedding: an embedding too (last)
    tied = getattr(model, "tied_output", None)
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or p is tied:
            continue
        if p.dim() < 2 or id(p) in embedding_params:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if tied is not None and tied.requires_grad:
        no_decay.append(tied)
        groups = [g for g in groups if g["params"]]  # a head-only stage: no matrices
    return groups


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """:func:`param_groups` with the hidden matrices (:func:`~shardwise.parallel.muon.
    is_hidden_matrix`: matrices inside the blocks) taken out into a first group marked
    ``"muon": True`` (decay ``weight_decay``, decoupled as AdamW's); the embeddings, the output
    head, norms and biases stay in AdamW's two groups. Names are the plain model's (a pipeline
    stage maps its own, ``model.fqn``). Groups left empty are dropped (a head-only pipeline
    stage has no Muon group)."""
    fqn = getattr(model, "fqn", None)
    hidden = {id(p) for n, p in model.named_parameters()
              if is_hidden_matrix(fqn(n) if fqn else n, p)}
    groups = param_groups(model, weight_decay)
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in hidden]} for g in groups]
    muon = [p for g in groups for p in g["params"] if id(p) in hidden]
    return [g for g in [{"params": muon, "weight_decay": weight_decay, "muon": True}, *rest]
            if g["params"]]


def optimizer_lines(model: nn.Module, cfg) -> list[str]:
    """Start-up lines naming which parameters each optimizer updates (``--optimizer``)."""
    if cfg.optimizer != "muon":
        return []
    fqn = getattr(model, "fqn", None)
    named = [(fqn(n) if fqn else n, p) for n, p in model.named_parameters()]
    muon = [n for n, p in named if is_hidden_matrix(n, p)]
    other = [n for n, p in named if not is_hidden_matrix(n, p)]
    return [f"  optimizer: Muon (momentum {MOMENTUM}, Nesterov, Newton–Schulz {NS_STEPS} steps "
            f"{NS_COEFFICIENTS}, lr × 0.2·√max(A, B), weight decay {cfg.weight_decay}) on "
            f"{len(muon)} hidden matrices ({_names(muon)}); AdamW on {len(other)} others "
            f"({_names(other)})"]


def _names(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f", … {len(names) - k} more" if len(names) > k else "")


ADAMW_IMPLS = ("for-loop", "foreach", "fused")
# device types whose torch has the fused (one kernel for every tensor) AdamW; CPU has one too
# (torch ≥ 2.4), but there the multi-tensor ``foreach`` path is the one whose results equal the
# for-loop reference bitwise (tests/test_gpu_path.py), so CPU keeps ``foreach``
FUSED_DEVICE_TYPES = ("cuda", "xpu")


def adamw_impl(device: torch.device | str) -> str:
    """The AdamW implementation for parameters on ``device``: "fused" where the device type has
    torch's fused kernel (:data:`FUSED_DEVICE_TYPES`: one launch updates every tensor of a
    group), else "foreach" (multi-tensor ops, ``torch._foreach_*``: a few calls per group
    instead of ~10 per parameter tensor). Both compute Loshchilov & Hutter 2019's Alg. 2 as
    the for-loop does; ``foreach`` with the same elementwise ops in the same order."""
    return "fused" if torch.device(device).type in FUSED_DEVICE_TYPES else "foreach"


def adamw_kwargs(impl: str) -> dict:
    """``torch.optim.AdamW`` keyword arguments selecting ``impl`` (:data:`ADAMW_IMPLS`).
    Raises ``ValueError`` for another name."""
    if impl not in ADAMW_IMPLS:
        raise ValueError(f"AdamW implementation {impl!r}: choose from {ADAMW_IMPLS}")
    return {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[impl]


def build_optimizer(engine: nn.Module, cfg, impl: str | None = None) -> torch.optim.Optimizer:
    """AdamW(lr, betas=(beta1, beta2), eps=1e-8) over :func:`param_groups` of the engine's plain
    model, built by the engine (so a sharded strategy can shard its state). State is fp32.
    ``impl``: "for-loop" | "foreach" | "fused" (:data:`ADAMW_IMPLS`); None = :func:`adamw_impl`
    of the parameters' device (fused on CUDA, foreach on CPU). The sharded ZeRO optimizers
    take the same keyword through ``make_optimizer``. ``cfg.optimizer == "muon"``:
    :class:`~shardwise.parallel.muon.Muon` over :func:`muon_param_groups` (AdamW, with the same
    keywords, on the groups it leaves)."""
    from ..parallel.master import optimizer_options
    from ..parallel.storage import fsdp2_state

    storage = {} if fsdp2_state(engine) else optimizer_options(  # bf16 storage, offload
        engine.precision, getattr(engine, "offload", "none"), getattr(engine, "topo", None))
    if getattr(cfg, "optimizer", "adamw") == "muon":
        if storage:
            raise ShardwiseConfigError("--optimizer muon with a master copy or --offload is "
                                       "not wired: use --optimizer adamw")
        return engine.make_optimizer(muon_param_groups(engine.module, cfg.weight_decay),
                                     optimizer_class=Muon, lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                     **adamw_kwargs(impl or adamw_impl_of(engine.module)))
    return engine.make_optimizer(param_groups(engine.module, cfg.weight_decay), lr=cfg.lr,
                                 betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                 **adamw_kwargs(impl or adamw_impl_of(engine.module)), **storage)


def adamw_impl_of(model: nn.Module) -> str:
    """:func:`adamw_impl` of ``model``'s parameters' device; "for-loop" when they mix tensor
    types (DTensor TP shards next to plain tensors, ``--engine torch --tp``): one multi-tensor
    or fused call cannot take both (``_foreach_lerp_ got mixed torch.Tensor and DTensor``)."""
    params = list(model.parameters())
    if not params:
        return adamw_impl("cpu")
    if len({type(p.data) for p in params}) > 1:
        return "for-loop"
    return adamw_impl(params[0].device)


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor for optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps to 1,
    then cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter 2017, SGDR)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_warning(cfg) -> str | None:
    """One line when ``--warmup-steps`` is longer than the run (issue 51): the LR then climbs
    only to steps / warmup of ``--lr`` (:func:`lr_multiplier` at the last step) and the cosine
    decay never starts. None otherwise."""
    if cfg.warmup_steps <= cfg.steps:
        return None
    return (f"warning: --warmup-steps {cfg.warmup_steps} is longer than the run (--steps "
            f"{cfg.steps}): the LR climbs only to {cfg.steps / cfg.warmup_steps:.0%} of --lr "
            f"{cfg.lr:g} and never decays; choose --warmup-steps ≤ {cfg.steps} (e.g. "
            f"{max(1, cfg.steps // 10)}) for the whole warm-up + cosine schedule")


def build_scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
