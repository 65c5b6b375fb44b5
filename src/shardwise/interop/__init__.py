"""Weights in and out of shardwise: Hugging Face ``LlamaForCausalLM`` and ``MixtralForCausalLM``
folders (:mod:`.hf`).

Nothing here touches a process group: export reads a checkpoint on one process, and import
fills the *plain* model before ``parallelize``, so it works for every layout.
"""

from .hf import (
    check_hf_exportable,
    export_hf,
    from_hf_state_dict,
    hf_model_kind,
    hf_to_llama_config,
    llama_to_hf_config,
    load_hf_weights,
    mixtral_to_hf_config,
    read_checkpoint,
    read_hf_config,
    to_hf_state_dict,
)

__all__ = ["check_hf_exportable", "export_hf", "from_hf_state_dict", "hf_model_kind",
           "hf_to_llama_config", "llama_to_hf_config", "load_hf_weights", "mixtral_to_hf_config",
           "read_checkpoint", "read_hf_config", "to_hf_state_dict"]
