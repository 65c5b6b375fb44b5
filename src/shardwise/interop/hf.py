"""Hugging Face folders in and out of shardwise's decoder: ``LlamaForCausalLM``, the families
that are the same decoder with a few config fields (``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``GPT2LMHeadModel``: :mod:`.hf_config` and :mod:`.gpt2`) and
``MixtralForCausalLM`` for its mixture of experts (:class:`~shardwise.models.MoELlama`).

This module only re-exports the public names; the work is split by job:

=========================  ====================================================================
:mod:`.hf_names`           tensor names ours ↔ Hugging Face (the name map, Mixtral's experts, why
                           no tensor is permuted)
:mod:`.hf_config`          ``config.json`` ↔ our LlamaConfig / MoEConfig (families, RoPE
                           scaling, router coefficients, what export can represent,
                           ``describe_source``)
:mod:`.hf_import`          ``--init-from-hf DIR``: weight files into the plain model, the
                           pre-flight
:mod:`.hf_export`          ``shardwise export --to hf``: our checkpoint (read through
                           :mod:`shardwise.checkpoint`'s ``COMPLETE`` check) → a folder with the
                           tokenizer files
:mod:`.hf_tokenizer_copy`  a model folder's tokenizer carried whole: the run folder's copy made
                           at train start, the files and special ids export ships
=========================  ====================================================================

Errors: every bad folder raises :class:`~shardwise.errors.ShardwiseConfigError` naming the file
and the fix; a bad checkpoint its subclass :class:`~shardwise.checkpoint.CheckpointError`.
Nothing here needs a process group.
"""

from __future__ import annotations

from .hf_config import (
    ARCH_FIELDS,
    MOE_ARCH_FIELDS,
    SUPPORTED_MODEL_TYPES,
    check_hf_exportable,
    describe_source,
    hf_model_kind,
    hf_model_overrides,
    hf_to_llama_config,
    llama_to_hf_config,
    mixtral_to_hf_config,
    read_hf_config,
)
from .hf_export import (
    byte_tokenizer_json,
    checkpoint_model_config,
    export_hf,
    read_checkpoint,
    resolve_checkpoint,
    write_tokenizer_files,
)
from .hf_import import (check_weight_files, hf_weight_stream, load_hf_weights, model_for,
                         read_hf_weights, weight_files)
from .hf_names import from_hf_state_dict, hf_to_ours, ours_to_hf, to_hf_state_dict

__all__ = ["ARCH_FIELDS", "MOE_ARCH_FIELDS", "SUPPORTED_MODEL_TYPES", "byte_tokenizer_json",
           "check_hf_exportable", "check_weight_files", "checkpoint_model_config",
           "describe_source", "export_hf", "from_hf_state_dict", "hf_model_kind",
           "hf_model_overrides", "hf_to_llama_config", "hf_to_ours", "hf_weight_stream",
           "llama_to_hf_config",
           "load_hf_weights", "mixtral_to_hf_config", "model_for", "ours_to_hf",
           "read_checkpoint", "read_hf_config", "read_hf_weights", "resolve_checkpoint",
           "to_hf_state_dict", "weight_files", "write_tokenizer_files"]
