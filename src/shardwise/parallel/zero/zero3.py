"""ZeRO-3 over the dp axis, by hand: parameters sharded too, gathered around each unit's compute.

Each rank keeps only its k-element slice of every unit's flat buffer (:mod:`.flat`) — parameters,
gradients and optimizer state: (4Ψ + 4Ψ + 8Ψ)/n bytes per rank (ZeRO paper, Rajbhandari et al.
2019, §5.3; PyTorch FSDP's FULL_SHARD). What moves over dp, per optimizer step with M micro-steps
(b bytes per element, ring collectives):

* ``param``: before each unit's forward, an all_gather of its slices, (n−1)/n·P_u·b; again before
  its backward unless it stayed gathered: M·(n−1)/n·(Ψ + Ψ_regathered)·b. Ψ_regathered is every
  block (not the root, gathered from the model's forward to the end of backward) with
  ``reshard_after_forward=True`` — the paper's 3Ψ total less the root (§7.2.2) — and 0 with
  False (FSDP's SHARD_GRAD_OP: 2Ψ, ZeRO-2's parameter memory during forward/backward);
* ``grad``: one reduce_scatter of each unit's gradient per step (:mod:`.zero`), (n−1)/n·Ψ·b_r;
* ``grad_norm``: one fp64 scalar all_reduce; ``unit_order`` (first step only): :mod:`.units`.

Besides the slices, a rank holds the gathered parameters of the units being computed: the root +
the current unit + the prefetched one at peak (measured: ``gathered_params_peak``).

With expert parallelism a block's experts are a unit of their own over "edp" (:mod:`.zero`),
listed right after the block's dense unit and hooked on the same module: the block's pre-forward
gathers its dense part and prefetches its experts, the experts' hook then waits for them and
prefetches the next block — one order, the same on every rank (checked by
:class:`.units.UnitOrderCheck` like any unit). Expert units over an axis of one rank (ep =
dp·cp) are never freed: each rank owns its experts whole, and there is nothing to gather.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ... import comm
from ..params import storage_bytes
from .flat import FlatShards, gather_named
from .units import UnitOrderCheck
from .zero import ZeroSync


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward runs ``hook()`` when the output's gradient is
    ready, i.e. just before autograd enters the unit's backward. Moves no data itself."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


def _wrap_outputs(out, hook):
    if isinstance(out, torch.Tensor):
        return _PreBackward.apply(hook, out) if out.requires_grad else out
    if isinstance(out, tuple):
        return tuple(_wrap_outputs(o, hook) for o in out)
    return out


class Zero3Sync(ZeroSync):
    """ZeRO-3: :class:`.zero.ZeroSync`'s gradient sync (ZeRO-2's: slices only) with the
    parameters sharded too; built by ``Zero3Sync(module, topo, 3, ...)`` (or
    :func:`~shardwise.parallel.zero.zero_sync`, which picks the class by stage). A plain
    gradient sync: it installs its hooks on the module's units and on the module itself.

    A forward pre-hook on each block gathers it (or waits for its prefetch) and, with
    ``prefetch=True``, launches the next block's all_gather (FSDP paper, Zhao et al. 2023,
    "Forward Prefetching"). A forward hook frees it (``reshard_after_forward``) and wraps its
    output in :class:`_PreBackward`, which gathers it again just before autograd enters it and
    prefetches the block backward reaches next ("Backward Prefetching"). A unit is freed when its
    last gradient has arrived; the root (holding a tied weight) is gathered by a pre-hook on the
    whole model, so it stays gathered to the end of backward (as FSDP2's root). Blocks that run
    in a rank-dependent order are an error on the first step (:class:`.units.UnitOrderCheck`).

    Read full parameters only through :meth:`named_full_parameters` or inside
    :meth:`summon_full_params`.
    """

    keeps_full_params = False  # the slice is the parameter; the next forward gathers it

    def __init__(self, module: nn.Module, topo, stage: int = 3, **kwargs):
        super().__init__(module, topo, stage, **kwargs)
        self.gathered_peak_bytes = 0
        self._pinned = False  # inside summon_full_params: nothing is freed
        self._gathered: set[FlatShards] = set(self.units)
        self._inflight: dict[FlatShards, object] = {}  # unit → Handle of its async all_gather
        self._direction = "fwd"  # the pass the hooks serve now: the gathers' ledger note
        for u in self.units:
            if u.n == 1:  # owned whole (expert shards, ep = dp·cp): `shard` stays `full`
                continue
            if not self.deferred:  # (deferred: FlatShards made its own slice and freed `full`)
                u.shard = u.full[u.lo:u.hi].clone()  # [k]: the only persistent copy
            self._free(u)
        # on the first step, check the order is the same on every rank before each gather
        self._order = UnitOrderCheck(topo, [u.name for u in self.blocks],
                                     "ZeRO-3 (--zero 3 --engine explicit)")
        module.register_forward_hook(self._model_post_forward)
        for u in self.blocks:
            u.module.register_forward_pre_hook(self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u))

    # -- gather and free ------------------------------------------------------------------------
    def _free(self, u: FlatShards) -> None:
        """Free the storage only: the views autograd saved in forward (e.g. a Linear's weight)
        stay valid and see the next gather's values (the FSDP technique). A unit over an axis
        of one rank stays: its ``full`` is its only copy."""
        if self._pinned or u.n == 1:
            return
        u.full.untyped_storage().resize_(0)
        self._gathered.discard(u)

    def _launch_gather(self, u: FlatShards, async_op: bool) -> None:
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        self.gathered_peak_bytes = max(self.gathered_peak_bytes,
                                       storage_bytes(v.full for v in self.units))
        # [k] from every rank → [P_u]; rank j's slice lands at [j·k, (j+1)·k)
        with self.topo.ledger.note(f"{u.name} {self._direction}"
                                   + (" (prefetch)" if async_op else "")):
            src = u.offload.device_shard() if u.offload else u.shard  # (--offload params)
            self._inflight[u] = comm.all_gather(u.full, src, self.topo, u.axis,
                                                tag="param", async_op=async_op)

    def _unshard(self, u: FlatShards | None) -> None:
        """Wait for ``u``'s prefetch, or gather it now."""
        if u is None or u in self._gathered:
            return
        if u not in self._inflight:
            self._launch_gather(u, async_op=False)
        else:
            self._inflight[u].wait()
        self._inflight.pop(u, None)
        self._gathered.add(u)

    def _prefetch(self, u: FlatShards | None) -> None:
        if self.prefetch and u is not None and u not in self._gathered and u not in self._inflight:
            self._launch_gather(u, async_op=True)

    def _reshard(self, u: FlatShards) -> None:
        if u in self._inflight:  # a prefetch nobody used: finish it before freeing its buffer
            self._inflight.pop(u).wait()
            self._gathered.add(u)
        if u in self._gathered:
            self._free(u)

    def _neighbour(self, u: FlatShards | None, step: int) -> FlatShards | None:
        """The block after (+1) or before (−1) ``u``; from a root unit (or None), the first /
        last."""
        if not self.blocks:
            return None
        if u is None or u in self.roots:
            return self.blocks[0] if step > 0 else self.blocks[-1]
        j = self.blocks.index(u) + step
        return self.blocks[j] if 0 <= j < len(self.blocks) else None

    # -- the hooks ------------------------------------------------------------------------------
    def _model_pre_forward(self, module, args) -> None:
        super()._model_pre_forward(module, args)
        self._direction = "fwd"
        for r in self.roots:
            self._unshard(r)
        self._prefetch(self._neighbour(None, +1))  # overlaps the embedding lookup

    def _model_post_forward(self, module, args, out):
        self._order.agree("forward", UnitOrderCheck.END)  # first forward: same unit count
        self._order.finish("forward")
        if not torch.is_grad_enabled():  # evaluation: no backward will come to free them
            for u in self.units:
                self._reshard(u)
            return out
        # root stays gathered: the output head's backward needs it next (FSDP2 does the same)
        return _wrap_outputs(out, lambda: self._pre_backward(None))

    def _make_pre_forward(self, u: FlatShards):
        j = self.blocks.index(u)

        def hook(module, args):
            self._order.agree("forward", j)  # first forward: before any gather of this unit
            self._direction = "fwd"
            self._unshard(u)
            self._prefetch(self._neighbour(u, +1))
        return hook

    def _make_post_forward(self, u: FlatShards):
        def hook(module, args, out):
            if not torch.is_grad_enabled():
                self._reshard(u)
                return out
            if self.reshard_after_forward:
                self._free(u)
            return _wrap_outputs(out, lambda: self._pre_backward(u))
        return hook

    def _pre_backward(self, u: FlatShards | None) -> None:
        """Autograd is about to enter unit ``u`` (None: the model's output, whose backward
        needs the root units, still gathered from the forward)."""
        self._direction = "bwd"
        if u is None:
            for r in self.roots:
                self._unshard(r)
        else:
            if self._order.active["backward"]:
                self._order.agree("backward", self.blocks.index(u))  # before any gather of u
            self._unshard(u)
        self._prefetch(self._neighbour(u, -1))

    def _unit_backward_done(self, u: FlatShards) -> None:
        self._free(u)  # its backward is done: drop the gathered parameters

    # -- the step -------------------------------------------------------------------------------
    def begin_forward_backward(self) -> None:
        """Every unit starts the step sharded, whatever ran before (an evaluation forward with
        grad enabled leaves the root gathered), and the gathered peak is measured afresh."""
        for u in self.units:
            self._reshard(u)
        self.gathered_peak_bytes = self.reduce_inputs_peak_bytes = 0

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """End the first step's backward order check, reduce as ZeRO-2, free every unit."""
        self._order.agree("backward", UnitOrderCheck.END)
        self._order.finish("backward")
        super().finish_gradient_sync()
        for u in self.units:
            self._reshard(u)

    # -- full parameters ------------------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self):
        """Gather every unit for the block and keep them gathered through any forwards inside it
        (e.g. sampling many tokens, or reading the full model); free them after. Collective:
        every dp rank enters it together. Do not train inside."""
        if self._pinned:
            yield
            return
        for u in self.units:
            self._unshard(u)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for u in self.units:
                self._reshard(u)

    @contextlib.contextmanager
    def full_model(self):
        """The plain model with its full weights, gathered once for the whole block
        (:meth:`summon_full_params`). Every dp rank enters it together."""
        with self.summon_full_params():
            yield self.module

    @contextlib.contextmanager
    def sampling_model_for(self, composed):
        """The sharded model itself, with full logits: each ``no_grad`` forward gathers every
        unit in turn and frees it after (:meth:`_make_post_forward`; a gather per unit per
        token), so sampling holds the state plus the root and two blocks (one prefetched), not
        the whole model (:meth:`full_model`). The same weights, so the same logits and text.
        Collective: every dp rank samples together."""
        with composed.loss_fn.gathered_logits() as model:
            yield model

    def dp_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN: full-shape parameter} (tied weight once), all-gathered from the slices (ledger
        phase ``verify``). Collective over dp."""
        return gather_named(self.units, [u.shard for u in self.units])

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """:meth:`.zero.ZeroSync.model_state_bytes` plus ``gathered_params_peak``: the
        most bytes of gathered parameters held at once during the last forward/backward, and
        ``reduce_inputs_peak``: of full-size flat gradients [P_u] handed to reduce_scatter
        (one unit at a time, :meth:`.zero.ZeroSync._launch_reduce`)."""
        out = super().model_state_bytes(optimizer)
        out["gathered_params_peak"] = self.gathered_peak_bytes
        out["reduce_inputs_peak"] = self.reduce_inputs_peak_bytes
        return out

    def _regathered(self, axis: str | None = None) -> float:
        """Every block (over ``axis``; None: all) again before backward if
        ``reshard_after_forward`` (not the root, which stays gathered), else nothing."""
        return (sum(u.padded for u in self.blocks if axis is None or u.axis == axis)
                if self.reshard_after_forward else 0)
