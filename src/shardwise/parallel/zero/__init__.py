"""ZeRO over the dp axis (Rajbhandari et al. 2019): the model state sharded, gradients still summed.

Reading order: :mod:`.flat` (the mechanism, also under the pipeline's ZeRO-1), :mod:`.zero`
(ZeRO-1/2), :mod:`.zero3` (ZeRO-3), :mod:`.units` (units and their order check),
:mod:`.formulas` (memory and bytes, :func:`validate_zero`), :mod:`.torch_zero` (the same through
PyTorch, imported on first use of :class:`ZeroRedundancySync`). ``docs/zero.md`` has the
derivations, the measurements and the pitfalls. Every class here is a plain gradient sync, put
into :class:`~..model.ParallelModel` by :func:`~..apply.parallelize`.

From learn/ (``learn/fsdp.py``: ZeRO-3; ZeRO-1/2, :class:`~.zero.ZeroSync`, have no script):

* ``W_in[D_X, F]`` (dim 0 of each tensor) → :class:`~.flat.FlatShards`: one padded flat buffer
  per unit (a block), this rank's ``shard`` the slice ``[i·k, (i+1)·k)`` of its ``full``
* ``gather`` (``AllGather_X`` before a block's forward, again before its backward) →
  :meth:`~.zero3.Zero3Sync._launch_gather`, from a forward pre-hook and
  :class:`~.zero3._PreBackward`, the next block's gather prefetched
* ``free`` (``untyped_storage().resize_(0)``) → :meth:`~.zero3.Zero3Sync._free`: the same
* ``dist.reduce_scatter`` per tensor → one per unit, :meth:`~.flat.FlatShards.launch_reduce_scatter`,
  as soon as the unit's last gradient has arrived
* ``adamw([s for b in shards for s in b.values()])`` → :func:`~.flat.sharded_optimizer`
* ``3(n−1)/n · 4Ψ``, ``16Ψ/n`` → :func:`~.formulas.zero_step_bytes_formula`,
  :func:`~.formulas.zero_memory_formula`; PyTorch's FSDP2: :func:`~.torch_zero.apply_fsdp`
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
