"""ZeRO over the dp axis (Rajbhandari et al. 2019): the model state sharded, gradients still summed.

Reading order: :mod:`.flat` (the mechanism, also under the pipeline's ZeRO-1), :mod:`.zero`
(ZeRO-1/2), :mod:`.zero3` (ZeRO-3), :mod:`.units` (units and their order check),
:mod:`.formulas` (memory and bytes, :func:`validate_zero`), :mod:`.torch_zero` (the same through
PyTorch, imported on first use of :class:`ZeroRedundancySync`). ``docs/zero.md`` has the
derivations, the measurements and the pitfalls. Every class here is a plain gradient sync, put
into :class:`~..model.ParallelModel` by :func:`~..apply.parallelize`.
"""

from .flat import FlatShards
from .units import UnitOrderCheck, assign_units, default_unit_names
from .formulas import (validate_zero, zero_ep_memory_formula, zero_ep_step_bytes_formula,
                       zero_memory_formula, zero_step_bytes_formula)
from .zero import ZeroSync
from .zero3 import Zero3Sync


def zero_sync(module, topo, stage: int, **kw) -> ZeroSync:
    """The explicit ZeRO gradient sync for ``stage``: :class:`ZeroSync` (1, 2) or
    :class:`Zero3Sync` (3), with ``kw`` as their constructor's (a plain call, no
    registry)."""
    return (Zero3Sync if stage == 3 else ZeroSync)(module, topo, stage, **kw)


def __getattr__(name: str):
    if name in ("ZeroRedundancySync", "apply_fsdp"):  # FSDP2 and DDP load only when asked for
        from . import torch_zero

        return getattr(torch_zero, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FlatShards", "UnitOrderCheck", "Zero3Sync", "ZeroRedundancySync", "ZeroSync",
           "apply_fsdp", "assign_units", "default_unit_names", "validate_zero",
           "zero_ep_memory_formula", "zero_ep_step_bytes_formula", "zero_sync",
           "zero_memory_formula", "zero_step_bytes_formula"]
