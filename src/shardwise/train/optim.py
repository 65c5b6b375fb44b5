"""AdamW with the usual parameter groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices, none on norms, biases and embeddings
    (Loshchilov & Hutter 2019; the GPT-2/nanoGPT convention). A tied embedding is an embedding."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or id(p) in embedding_params:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(engine: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW(lr, betas=(beta1, beta2), eps=1e-8) over :func:`param_groups` of the engine's plain
    model, built by the engine (so a sharded strategy can shard its state). State is fp32."""
    return engine.make_optimizer(param_groups(engine.module, cfg.weight_decay), lr=cfg.lr,
                                 betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor for optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps to 1,
    then cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter 2017, SGDR)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
