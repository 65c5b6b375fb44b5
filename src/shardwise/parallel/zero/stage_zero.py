"""ZeRO-2/3 and HSDP inside a pipeline stage (explicit engine): the stage's gradient sync for
``--zero 2``/``--zero 3`` with pp > 1, and for every ZeRO stage with ``--dp-replicate`` > 1.

The units are the stage's own modules in forward order, chunk by chunk (:func:`stage_units`):
the first stage's embeddings, every block, the last stage's final norm and output head (the tied
embedding's copy there). There is no root unit: a stage has no forward of its own (its chunks
run inside the schedule), so every unit is gathered by the hooks on its own module. Each unit is
a :class:`.flat.FlatShards` over the shard axis (HSDP: dp_shard; the summed slices then
all-reduced over dp_replicate).

What moves, per step of m micro-batches (P_u a unit's padded elements, n the shard group, b
bytes per element; the same as pp = 1's ZeRO-2/3 over m micro-batches, docs/composition.md §5):

* ``grad``: every backward (B, or zero bubble's I + W) accumulates whole gradients in ``.grad``;
  after the schedule's last backward, the tied swap and the SP sum, one reduce-scatter per unit,
  (n−1)/n·P_u·b_r, once per step (``overlap=False``: the runner never reduces during the
  schedule — torch.distributed.pipelining likewise enables FSDP's gradient sync on the last
  backward only); HSDP then ``grad_replicate``, 2(R−1)/R·P_u·b_r/S;
* ``param``, ZeRO-1/2: one all-gather of the updated slices after the optimizer step;
  ZeRO-3 with ``reshard_after_forward=True``: each unit all-gathered before every F and every B
  of its chunk and freed after each, 2m·(n−1)/n·P_u·b (pp = 1's per-micro-batch FULL_SHARD);
  with ``False``: gathered at its first use in the step and held to the step's end (freed by
  :meth:`StageZero3.finish_gradient_sync`), (n−1)/n·P_u·b once (SHARD_GRAD_OP across the step,
  torchtitan's default under PP). No prefetch: the next action is the schedule's, not the next
  unit's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..params import Held, placement
from ..sync import Sync
from .zero import ZeroSync
from .zero3 import Zero3Sync


def stage_units(stage: nn.Module) -> list[str]:
    """FQNs of ``stage``'s units in forward order, chunk by chunk: a chunk's embeddings, its
    blocks (``layers.<i>``), its final norm and output head — every child module holding
    parameters, so no parameter is left to a root unit."""
    owned = {id(m) for c in stage.chunks for m in c.layers}
    names = {id(m): n for n, m in stage.named_modules()}
    out = []
    for c in stage.chunks:
        before = [m for m in (getattr(c, "tok_embeddings", None), getattr(c, "pos_embeddings", None))
                  if m is not None]
        after = [m for m in (getattr(c, "norm", None), getattr(c, "output", None)) if m is not None]
        out += [names[id(m)] for m in before + list(c.layers) + after
                if id(m) in names and any(True for _ in m.parameters())]
    rest = [n for n, m in stage.named_children() if n != "layers" and id(m) not in owned
            and n not in out and any(True for _ in m.parameters())]
    return out + rest


class _Stage:
    """What a stage's ZeRO sync changes in :class:`.zero.ZeroSync`: the units' names are the
    plain model's (the tied copy is ``tok_embeddings.weight``); the tied copy's slice never
    counts in the norm (it is the first stage's, summed); the SP sum runs on the whole
    gradients before the reduce-scatter (the pipeline's finisher order) with
    :class:`~..sync.Sync`'s default; the sliced axes are the units'."""

    in_stage = True  # a pipeline stage's sync (:func:`.offload.offload_params_bytes`)

    def _rename(self, stage) -> None:
        for u in self.units:
            u.fqns = [stage.fqn(f) for f in u.fqns]

    @property
    def sliced(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u.axis for u in self.units))

    def held_grads(self) -> Held:
        dup = [p for u in self.units for p in u.params if placement(p).duplicate]
        return Held([h for u in self.units for h in u.held_grads(skip=dup)], self.sliced)

    sum_replicated_grads = Sync.sum_replicated_grads
    sp_grad_bytes = Sync.sp_grad_bytes


class StageZero(_Stage, ZeroSync):
    """ZeRO-1/2 of a pipeline stage over its units (module docstring): :class:`.zero.ZeroSync`
    with ``overlap=False``, its reduce-scatters after the schedule."""

    def __init__(self, stage: nn.Module, topo, zero: int, **kw):
        super().__init__(stage, topo, zero, units=stage_units(stage), overlap=False,
                         prefetch=False, **kw)
        self._rename(stage)


class StageZero3(_Stage, Zero3Sync):
    """ZeRO-3 of a pipeline stage (module docstring): :class:`.zero3.Zero3Sync` over the
    stage's units, no prefetch, reduce-scatters after the schedule; with
    ``reshard_after_forward=False`` a unit stays gathered from its first use to the step's
    end."""

    def __init__(self, stage: nn.Module, topo, **kw):
        super().__init__(stage, topo, 3, units=stage_units(stage), overlap=False, prefetch=False,
                         **kw)
        assert not self.roots, "a stage's units hold every parameter"
        self._rename(stage)

    def _unit_backward_done(self, u) -> None:
        if self.reshard_after_forward:  # else held to the end of the step
            self._free(u)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """End the first step's forward order check too (a stage has no forward of its own to
        end it), then :meth:`.zero3.Zero3Sync.finish_gradient_sync`."""
        if self._order.active["forward"]:
            self._order.agree("forward", self._order.END)
            self._order.finish("forward")
        super().finish_gradient_sync()

    def step_bytes_formula(self, micro_steps: int = 1) -> dict[str, float]:
        """:meth:`.zero.ZeroSync.step_bytes_formula` with every unit gathered 2m times
        (``reshard_after_forward``: m forwards, m backwards; every unit is a block) or once."""
        return super().step_bytes_formula(micro_steps if self.reshard_after_forward else 1)


def stage_zero_sync(stage: nn.Module, topo, zero: int, **kw) -> ZeroSync:
    """The sync of a pipeline stage for ZeRO ``zero`` (:class:`StageZero3` for 3, else
    :class:`StageZero`); ``kw``: ``precision``, and ``reshard_after_forward`` for ZeRO-3."""
    if zero == 3:
        return StageZero3(stage, topo, **kw)
    kw.pop("reshard_after_forward", None)
    return StageZero(stage, topo, zero, **kw)
