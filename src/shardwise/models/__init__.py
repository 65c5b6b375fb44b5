"""Plain models that know nothing of parallelism, and the loss each is trained with.

A batch is a dict. ``{"input_ids", "labels"}`` → language model (:class:`Llama`);
``{"inputs", "targets"}`` → regression (:class:`StackedMLP`). :func:`loss_sum_and_count` returns
the *sum* of per-item losses and the number of items, so callers can form the global
token-weighted mean (sum over all micro-batches and ranks / total count).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .ac import AC_MODES, checkpoint_block, set_activation_checkpointing
from .dpo import count_pairs_or_tokens, dpo_loss_sum_and_count, is_dpo
from .llama import IGNORE_INDEX, PRESETS, Llama, LlamaConfig, generate, lm_loss
from .mlp import MLPConfig, StackedMLP, mse_loss, regression_data
from .moe import MOE_PRESETS, MoEConfig, MoELlama, moe_aux_loss, moe_layers

MLP_PRESETS = {"mlp": {}, "mlp-tiny": dict(d_model=16, d_ff=32, n_layers=4)}


def model_names() -> list[str]:
    return sorted(PRESETS) + sorted(MOE_PRESETS) + sorted(MLP_PRESETS)


def is_llama_name(name: str) -> bool:
    """Whether preset ``name`` is a Llama-style model (dense or mixture of experts)."""
    return name in PRESETS or name in MOE_PRESETS


def max_seq_len_of(name: str) -> int:
    """The ``max_seq_len`` of Llama-style preset ``name``."""
    return {**PRESETS, **MOE_PRESETS}[name]["max_seq_len"]


def preset_config(name: str, vocab_size: int = 4096, **overrides):
    """The config (:class:`LlamaConfig` or :class:`MLPConfig`) of preset ``name``, no weights."""
    if name in PRESETS:
        return LlamaConfig(vocab_size=vocab_size, **{**PRESETS[name], **overrides})
    if name in MOE_PRESETS:
        return MoEConfig(vocab_size=vocab_size, **{**MOE_PRESETS[name], **overrides})
    if name in MLP_PRESETS:
        return MLPConfig(**{**MLP_PRESETS[name], **overrides})
    raise ValueError(f"unknown model {name!r}: choose from {model_names()}")


def build_model(name: str, vocab_size: int = 4096, **overrides) -> nn.Module:
    """Build preset ``name`` (see :func:`model_names`) on the current default device/dtype.
    ``overrides`` replace config fields (e.g. ``tie_embeddings=False``, ``n_layers=3``).
    Initialisation uses the global torch RNG: seed it identically for identical models.
    ``ac="none"|"selective"|"full"`` sets activation checkpointing on every block (see
    :mod:`.ac`; use :func:`set_activation_checkpointing` to also name a recompute context, e.g.
    the ledger phase that books a recompute's TP collectives)."""
    ac = overrides.pop("ac", "none")
    cfg = preset_config(name, vocab_size, **overrides)
    if isinstance(cfg, MoEConfig):
        model = MoELlama(cfg)
    else:
        model = Llama(cfg) if isinstance(cfg, LlamaConfig) else StackedMLP(cfg)
    set_activation_checkpointing(model, ac)
    return model


def loss_sum_and_count(model: nn.Module, batch: dict, aux: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ``batch`` through ``model``: (sum of losses fp32 scalar, number of counted items).
    A mixture-of-experts model's auxiliary loss sums (:func:`~.moe.moe_aux_loss`: load balance
    and router z-loss, already token sums) are added unless ``aux`` is False (evaluation
    reports the language-model loss alone)."""
    if "input_ids" in batch:
        logits = model(batch["input_ids"], **positions_kw(batch))
        if is_dpo(batch):  # preference pairs: the DPO objective (.dpo), counted in pairs
            return dpo_loss_sum_and_count(logits, batch)
        loss, count = lm_loss(logits, batch["labels"])
        extra = moe_aux_loss(model) if aux else None
        return (loss if extra is None else loss + extra), count
    return mse_loss(model(batch["inputs"]), batch["targets"])


def positions_kw(batch: dict) -> dict:
    """The model's keyword arguments for the token positions a batch carries: ``positions`` =
    ``batch["position_ids"]`` [b, s] (a context-parallel rank's chunks,
    :func:`shardwise.parallel.cp.shard_sequence`; a packed batch's per-example positions) and
    ``documents`` = ``batch["document_ids"]`` [b, s] (a packed batch: attention stays inside
    each document, :func:`.llama.document_mask`); {} for a plain batch."""
    kw = {"positions": batch["position_ids"]} if "position_ids" in batch else {}
    if "document_ids" in batch:
        kw["documents"] = batch["document_ids"]
    return kw


def count_items(batch: dict) -> int:
    """Items the loss will count in ``batch`` (tokens with a label, or regression elements) —
    known before the forward pass."""
    if "labels" in batch:
        return count_pairs_or_tokens(batch)  # DPO: pairs (.dpo)
    return batch["targets"].numel()


def config_of(model: nn.Module):
    return dataclasses.asdict(model.config)


__all__ = ["AC_MODES", "IGNORE_INDEX", "MLP_PRESETS", "MOE_PRESETS", "PRESETS", "Llama",
           "LlamaConfig", "MLPConfig", "MoEConfig", "MoELlama", "StackedMLP", "build_model",
           "checkpoint_block", "count_items", "generate", "is_llama_name", "lm_loss",
           "loss_sum_and_count", "max_seq_len_of", "model_names", "moe_aux_loss", "moe_layers",
           "mse_loss", "positions_kw", "preset_config", "regression_data",
           "set_activation_checkpointing"]
