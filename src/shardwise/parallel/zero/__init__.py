"""ZeRO over the dp axis (Rajbhandari et al. 2019): the model state sharded, gradients still summed.

Reading order:

* :mod:`.flat` — the mechanism: flat padded buffers sharded over dp, their pieces, the sharded
  optimizer, full-shape gathers. Used per unit by ZeRO-1/2/3, and per stage by the pipeline's
  ZeRO-1 (:mod:`..pp.runtime`).
* :mod:`.zero` — ZeRO-1/2: reduce_scatter, sharded step, all_gather; the memory and byte
  formulas (ZeRO paper §5, §7) and :func:`validate_zero`.
* :mod:`.zero3` — ZeRO-3: gather / free / prefetch around each unit's compute.
* :mod:`.units` — which parameters form a unit, and the first step's unit-order check.
* :mod:`.torch_zero` — the same through PyTorch (ZeroRedundancyOptimizer, FSDP2's
  :func:`~.torch_zero.apply_fsdp`), imported on first use of :class:`TorchZero`.

``docs/zero.md`` has the derivations, the measurements and the pitfalls.
"""

from .flat import FlatShards
from .units import UnitOrderCheck, assign_units, default_unit_names
from .formulas import validate_zero, zero_memory_formula, zero_step_bytes_formula
from .zero import ZeroDataParallel
from .zero3 import Zero3DataParallel  # registers stage 3 with ZeroDataParallel


def __getattr__(name: str):
    if name in ("TorchZero", "apply_fsdp"):  # FSDP2 and DDP load only when asked for
        from . import torch_zero

        return getattr(torch_zero, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FlatShards", "TorchZero", "UnitOrderCheck", "Zero3DataParallel", "ZeroDataParallel",
           "apply_fsdp", "assign_units", "default_unit_names", "validate_zero",
           "zero_memory_formula", "zero_step_bytes_formula"]
