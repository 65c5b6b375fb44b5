"""ZeRO-1 of a pipeline stage: the explicit pipeline's gradient sync for ``--zero 1`` with pp > 1.

The stage's trainable parameters become one flat buffer (:class:`.flat.FlatShards`) sharded over
the data axis, with expert parallelism the expert shards a second one over "edp" (one per
:func:`~..params.reduce_groups` group). The runner leaves whole gradients (every micro-batch's
backward accumulates into ``.grad``; zb-h1's W pass writes ``.grad`` by hand, so no hooks): after
the schedule and the other finishers (tied swap, SP sum on the whole gradients) one
reduce-scatter per buffer (:meth:`StageZero1.finish_gradient_sync`); each rank steps its slice
and all-gathers the parameters (:func:`.flat.sharded_optimizer`).

Bytes per step, P_r the buffer's elements padded to a multiple of n (its group's size):
``grad`` (n−1)/n·P_r in the reduce dtype, ``param`` (n−1)/n·P_r in the parameters' dtype (ZeRO
paper §5.1, §7.2.1; scaling book ch. 5).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import ring_bytes
from ...errors import ShardwiseConfigError
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import (Held, broadcast_replicas, local, local_state_bytes, placement,
                      reduce_bytes, reduce_groups)
from .flat import (FlatShards, gather_named, gather_optimizer_state, load_optimizer_state,
                   sharded_optimizer)


class StageZero1(Sync):
    """ZeRO-1 over the data axis (expert shards over "edp") of ``stage``'s gradients on
    ``topo``; ``precision.reduce_dtype``: "fp32" | "bf16". The stage's replicas are made
    identical first (a broadcast from dp index 0, phase ``init``). Raises
    :class:`ShardwiseConfigError` for an unknown reduce dtype (before any collective)."""

    def __init__(self, stage: nn.Module, topo, *, precision: Precision = FP32):
        red = precision.reduce_torch
        super().__init__(stage, topo)
        self.reduce_dtype = precision.reduce_dtype
        if topo.size(topo.data_axis) > 1:
            with topo.ledger.phase("init"):  # replicas of a stage start identical
                broadcast_replicas([p for p in stage.parameters()], topo)
        named = [(n, p) for n, p in self.named_params() if p.requires_grad]
        self.flats = [FlatShards(g.items, topo, keep_full_grad=True,
                                 reduce_torch=red,  # (bf16 storage: fp32 unless told bf16)
                                 grad_torch=precision.main_grad_torch,
                                 **({} if g.axis == topo.data_axis
                                    else {"name": "experts", "axis": g.axis}))
                      for g in reduce_groups(named, topo)]

    @property
    def sliced(self) -> tuple[str, ...]:
        """The axes over which the held gradient pieces are slices (each buffer's axis)."""
        return tuple(dict.fromkeys(f.axis for f in self.flats))

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        for f in self.flats:
            f.reduce_scatter()

    def held_grads(self) -> Held:
        """The pieces of this rank's slices; a duplicate (the tied copy) never counts."""
        dup = [p for f in self.flats for p in f.params if placement(p).duplicate]
        return Held([h for f in self.flats for h in f.held_grads(skip=dup)], self.sliced)

    def make_optimizer(self, param_groups: list[dict], optimizer_class=torch.optim.AdamW,
                       **adamw) -> torch.optim.Optimizer:
        """AdamW (or :class:`..master.MasterAdamW`) over this rank's slice of each buffer."""
        return sharded_optimizer(self.flats, param_groups, optimizer_class, **adamw)

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        return gather_named(self.flats, [f.shard_grad for f in self.flats])

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        return gather_optimizer_state(self.flats, optimizer)

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        load_optimizer_state(self.flats, optimizer, local)

    def dp_pieces(self, optimizer=None) -> list:
        """The stage's whole parameters (frozen ones too; replicas write once), the optimizer
        state of this rank's slices (:func:`..boxes.flat_pieces`)."""
        from ..boxes import flat_pieces

        return Sync.dp_pieces(self) + flat_pieces(self.flats, optimizer, params=False)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """``grad`` and ``param`` of the module docstring, each buffer over its own axis."""
        elem = self.flats[0].params[0].element_size()
        grad = self.flats[0].grad_dtype.itemsize  # main grads: 4
        red = reduce_bytes(self.reduce_dtype) if self.reduce_dtype == "bf16" else grad
        return {"grad": sum(ring_bytes("reduce_scatter", f.padded * red, f.n) for f in self.flats),
                "param": sum(ring_bytes("all_gather", f.padded * elem, f.n) for f in self.flats)}


def _local_shard_zero():
    """``ZeroRedundancyOptimizer`` over DTensor parameters' local shards (``pairs``: (DTensor
    parameter, local tensor)): ``step`` first hands each shard its gradient's local tensor;
    ``zero_grad`` clears both. Made on first use (torch.distributed.optim imports slowly)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class LocalShardZeRO(ZeroRedundancyOptimizer):
        pairs: list = []

        def step(self, closure=None, **kwargs):
            for p, t in self.pairs:
                t.grad = None if p.grad is None else local(p.grad)
            return super().step(closure, **kwargs)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for p, t in self.pairs:
                p.grad = t.grad = None
            super().zero_grad(set_to_none)

    return LocalShardZeRO


class TorchStageZero1(Sync):
    """The torch pipeline's ``--zero 1``, a gradient sync of the stage ``inner`` holds: the
    gradients summed over dp by ``inner`` (the stage's plain sync, :class:`~..dp.DataParallel`:
    its micro-step switch, finish, formulas and buckets below), the optimizer PyTorch's
    ``ZeroRedundancyOptimizer`` over dp (each rank steps the whole parameters it owns, then
    broadcasts them, unbooked); every other member the :class:`~..sync.Sync` default over the
    same stage. Its state lives in the optimizer's partitions: no full-shape optimizer view
    (:class:`ShardwiseConfigError`; use the explicit engine)."""

    def __init__(self, inner: Sync):
        super().__init__(inner.module, inner.topo)
        self.inner = inner

    @property
    def buckets(self) -> list:
        return self.inner.buckets

    def sync_gradients(self, enabled: bool):
        return self.inner.sync_gradients(enabled)

    def finish_gradient_sync(self) -> None:
        self.inner.finish_gradient_sync()

    def bytes_formula(self, *args, **kw) -> dict[str, float]:
        return self.inner.bytes_formula(*args, **kw)

    def memory_formula(self) -> dict[str, float]:
        return self.inner.memory_formula()

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        # DTensor (tp-sharded) parameters: ZeroRedundancyOptimizer partitions and broadcasts
        # plain tensors, so it gets their local shards — the dp peers of one tp index hold
        # shards of the same shapes, and its in-place broadcast updates the DTensors' storage
        pairs = [(p, local(p)) for g in param_groups for p in g["params"]]
        local_of = {id(p): t for p, t in pairs}
        param_groups = [dict(g, params=[local_of[id(p)] for p in g["params"]])
                        for g in param_groups]
        first, *rest = param_groups
        opt = _local_shard_zero()(first["params"], optimizer_class=torch.optim.AdamW,
                                  process_group=self.topo.group("dp"),
                                  **{k: v for k, v in first.items() if k != "params"}, **adamw)
        for g in rest:
            opt.add_param_group(dict(g, **{k: v for k, v in adamw.items() if k not in g}))
        opt.pairs = [(p, t) for p, t in pairs if t is not p]
        return opt

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of this rank's local shards and of ``ZeroRedundancyOptimizer``'s local
        optimizer's state (:func:`~..params.local_state_bytes`)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        return local_state_bytes(params, getattr(optimizer, "optim", optimizer))

    def dp_optimizer_state(self, optimizer):
        raise ShardwiseConfigError("--engine torch --zero 1 with --pp: the optimizer state "
                                   "lives in ZeroRedundancyOptimizer's partitions; use "
                                   "--engine explicit for layout-free optimizer checkpoints")

    def dp_load_optimizer_state(self, optimizer, local_state):
        raise ShardwiseConfigError("--engine torch --zero 1 with --pp: use --engine explicit "
                                   "for layout-free optimizer checkpoints")
