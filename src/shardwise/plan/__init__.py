"""``shardwise plan``: choose a layout for a real cluster from the same formulas the ledger checks.

* :mod:`.hardware` — GPU and cluster presets (datasheets), custom ones from TOML.
* :mod:`.models` — model shapes (Llama 3, GPT-3, Megatron's GPT runs, our LlamaConfig).
* :mod:`.cost` — the analytical model: memory, compute, communication, bubble, MFU.
* :mod:`.search` — enumerate layouts and rank them by predicted MFU.
* :mod:`.estimate` — the real model under FakeTensorMode with a fake process group: bytes per rank.
* :mod:`.plot` — predicted MFU against the number of GPUs, one line per strategy family.
* :mod:`.cli` — the ``plan`` subcommand.

The cost model's entry point is :func:`shardwise.plan.cost.estimate` (not re-exported here: the
name would clash with the :mod:`shardwise.tools.estimate` module).
"""

from .cost import Estimate
from .layout import Assumptions, PlanLayout
from .hardware import GPU, Cluster, get_cluster, load_cluster
from .models import ModelSpec, from_llama_config, get_model

__all__ = ["Assumptions", "Cluster", "Estimate", "GPU", "ModelSpec", "PlanLayout",
           "from_llama_config", "get_cluster", "get_model", "load_cluster"]
