"""ZeRO-1/2 over the dp axis, by hand: gradients reduce-scattered, a sharded step, params gathered.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) keeps data parallelism's math — the gradients
are **summed** over dp (:mod:`shardwise.parallel.dp`) — but stops replicating the model state.
Bytes per rank, Ψ parameters, n dp ranks, fp32 AdamW: ZeRO-1 4Ψ + 4Ψ + 8Ψ/n (P_os, §5.1),
ZeRO-2 4Ψ + (4Ψ + 8Ψ)/n (P_os+g, §5.2), ZeRO-3 (:mod:`.zero3`) (4Ψ + 4Ψ + 8Ψ)/n (§5.3).

What moves over dp per optimizer step (ring collectives, b bytes per element):

* ``grad``: one reduce_scatter of each unit's gradient, (n−1)/n·Ψb, once per step whatever the
  accumulation (``reduce_dtype="bf16"``: b = 2 in this term only);
* ``param``: one all_gather of the updated parameters after the step, (n−1)/n·Ψb: together DP's
  2Ψb(n−1)/n (§7.2.1: an all_reduce *is* a reduce_scatter then an all_gather; ZeRO runs the
  optimizer in between). ZeRO-3: 3Ψb(n−1)/n, 1.5× DP (§7.2.2);
* ``grad_norm``: one all_reduce of one fp64 scalar, Σ g² of the local slices, 2(n−1)/n·8.

Ψ above is what travels: Σ over units of the padded size ⌈Ψ_u/n⌉·n (:mod:`.flat`). The formulas
are :func:`.formulas.zero_memory_formula` and :func:`.formulas.zero_step_bytes_formula`;
``docs/zero.md`` has the table, the derivation and the pitfalls.

**HSDP** (``dp_replicate`` R > 1: dp = R × S; PyTorch FSDP paper, Zhao et al. 2023, §3.2.3
"hybrid sharding"): every flat buffer is sharded over the S ranks of "dp_shard" only (the
model state ÷ S, not ÷ dp), the gradient reduce-scatter runs within the shard group, and each
rank's summed 1/S shard is then all-reduced across the R replicas over "dp_replicate" (tag
``grad_replicate``, 2(R−1)/R·Ψb/S); parameters are all-gathered within the shard group only.
The norm's scalar is summed over dp_shard (the replicas hold the same slices). Each unit reads
this from its parameters' record (:class:`..params.ReduceGroup`: ``axis``, ``replicate_axis``).

**With expert parallelism** (:mod:`shardwise.parallel.ep`) a unit's expert shards (this rank's
E/ep experts, :func:`..params.ep_sharded`) are summed over "edp", the dp·cp/ep ranks that hold
the same experts, not over the whole data axis. So each unit with experts becomes two flat
buffers: its dense parameters over the data axis (n = dp·cp) and its experts over "edp"
(n_e = dp·cp/ep; the unit ``"<name>:experts"``, right after its dense part in forward order, so
ZeRO-3 gathers and prefetches both in the same order on every rank). Every term above is then
the sum of the two parts, each with its own n and Ψ (:func:`.formulas.zero_ep_memory_formula`,
:func:`.formulas.zero_ep_step_bytes_formula`); with n_e = 1 (ep = dp·cp) the experts are not
sharded and move nothing. The norm's one scalar all-reduce over the data axis still counts
every element once: a dense element lives in one dp slice, an expert element in one edp slice
of the one ep rank that holds its expert, and the data axis is exactly the ep × edp ranks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ... import comm
from ...comm.ledger import ring_bytes
from ..muon import Muon, Orthogonalizer
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import (Held, ReduceGroup, reduce_groups, storage_state_bytes,
                      sum_coalesced_, tp_sharded)
from .flat import (FlatShards, gather_named, gather_optimizer_state, load_optimizer_state,
                   sharded_optimizer)
from .formulas import units_memory_formula, units_step_bytes_formula, validate_zero
from .units import assign_units

EXPERTS = ":experts"  # suffix of the unit name of a unit's expert shards (sharded over "edp")


def split_experts(named_units, topo) -> list[tuple[str, nn.Module, ReduceGroup]]:
    """``[(name, module, [(fqn, param)])]`` (:func:`.units.assign_units`) → ``[(name, module,
    group)]``: each unit split by :func:`..params.reduce_groups` (``shard=True``), whose
    :class:`..params.ReduceGroup` records say where each part is summed: its parameters over
    the shard axis (the data axis, or HSDP's dp_shard with ``replicate_axis`` dp_replicate),
    then, if it has any, those of another group (expert shards, over "edp") as unit ``name +
    ":experts"``, same module. Without expert parallelism: the units unchanged."""
    return [(name if g.axis == topo.shard_axis else name + EXPERTS, mod, g)
            for name, mod, named in named_units for g in reduce_groups(named, topo, shard=True)]

# -- the gradient sync -----------------------------------------------------------------------------
class ZeroSync(Sync):
    """ZeRO ``stage`` ∈ {1, 2} over ``topo``'s "dp" axis (module docstring): a plain gradient
    sync, which :func:`~..apply.parallelize` puts into a :class:`~..model.ParallelModel`; ZeRO-3
    is the subclass :class:`.zero3.Zero3Sync`, which overrides the hooks below
    (:func:`~shardwise.parallel.zero.zero_sync` picks the class by stage).

    ``module``: the plain model (each unit's flat buffer, a :class:`.flat.FlatShards`, is
    broadcast from dp index 0: ledger phase ``init``). ``units``: FQNs of the unit submodules
    (default :func:`.units.default_unit_names`); the rest is the root unit. ``overlap``: launch
    each unit's reduce_scatter from the backward hooks (True) or all after backward (False).
    ``precision.reduce_dtype``: "fp32" | "bf16" (:func:`~shardwise.precision.reduce_torch_dtype`).
    ``prefetch`` /
    ``reshard_after_forward``: ZeRO-3 only. ``deferred`` (ZeRO-3 only, else ValueError): the
    parameters hold no values yet (a model built on the meta device, :mod:`..materialize`): no
    copy, no broadcast; call :meth:`fill` with the weights, the same on every rank.

    Inside dp × tp the module holds this tp rank's shards; only their placements
    (:func:`..params.tp_sharded`) are read here: the norm's counting, the SP sum. With expert
    parallelism a unit's expert shards are their own flat buffer over "edp" (module
    docstring; :func:`split_experts`).

    Raises :class:`ShardwiseConfigError` (before any collective) for dp < 2, a bad stage, a bad
    ``precision.reduce_dtype``, or bad ``units``. After wrapping, do not move or re-create the model's
    parameters (``.to()``, ``load_state_dict`` into them).
    """

    keeps_full_params = True  # ``u.full`` always holds the whole parameters (not ZeRO-3)

    def __init__(self, module: nn.Module, topo, stage: int, *, units: list[str] | None = None,
                 prefetch: bool = True, reshard_after_forward: bool = True, overlap: bool = True,
                 precision: Precision = FP32, deferred: bool = False):
        validate_zero(stage, topo.size(topo.shard_axis))
        if deferred and stage != 3:
            raise ValueError("deferred=True is ZeRO-3's (ZeRO-1/2 keep whole parameters: give "
                             "them their values before the sync, materialize_local)")
        rdtype = precision.reduce_torch
        named_units = assign_units(module, units)  # all checks done before the first collective
        super().__init__(module, topo)
        self.stage = stage
        # the shard group: the data axis, or HSDP's dp_shard (each unit's record, a
        # ReduceGroup, names the replica axis its shards are then all-reduced over)
        self.n, self.rank = topo.size(topo.shard_axis), topo.index(topo.shard_axis)
        self.prefetch, self.reshard_after_forward, self.overlap = (prefetch, reshard_after_forward,
                                                                   overlap)
        self.reduce_dtype, self._rdtype = precision.reduce_dtype, rdtype  # of the reduce_scatter
        groups = split_experts(named_units, topo)
        self.units = [FlatShards(g.items, topo, keep_full_grad=stage == 1, reduce_torch=rdtype,
                                 name=name, module=mod, axis=g.axis,
                                 replicate_axis=g.replicate_axis, deferred=deferred,
                                 grad_torch=precision.main_grad_torch)
                      for name, mod, g in groups]
        self.deferred = deferred  # the values come later, the same on every rank (fill)
        with topo.ledger.phase("init"):
            for u, (_, _, g) in zip(self.units, groups):  # replicas start identical over
                # g.replicas (expert shards: edp; HSDP's shard groups: the whole data axis)
                if not deferred:
                    comm.broadcast(u.full, topo, g.replicas, src=0, tag="init")
        # the root unit (module: the model itself; with its experts, if any sit outside the
        # blocks): gathered for the whole forward and backward by ZeRO-3
        self.roots = [u for u in self.units if u.module is module]
        self.blocks = [u for u in self.units if u not in self.roots]  # forward order
        # gradients become complete in reverse forward order, the root (tied embedding) last
        self._reduce_order = self.blocks[::-1] + self.roots
        self._next_reduce = 0
        self.reduce_inputs_peak_bytes = 0  # most bytes of reduce_scatter inputs alive at once
        self._ready: set[FlatShards] = set()  # all gradients arrived on the syncing micro-step
        self._arrived = {u: set() for u in self.units}  # ids of parameters, this backward
        self._sync = True
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        for u in self.units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        module.register_forward_pre_hook(self._model_pre_forward)

    @torch.no_grad()
    def fill(self, weights) -> None:
        """The values of a ``deferred`` sync: for each (name, full tensor) of ``weights`` (names
        as the unsharded model's, one at a time), this rank's part of it (its tp/ep shard,
        :func:`..views.to_local`, flattened) into its flat buffer: the whole parameter where
        ``full`` keeps them (ZeRO-1/2, a unit over one rank), else the piece inside this rank's
        slice ``shard`` (ZeRO-3; of a lazy tensor only the rows holding it are read,
        :func:`..views.local_flat_range`). No collective. Raises ``ValueError`` for a parameter the
        stream never gave."""
        from ..views import local_flat_range, to_local

        where = {fqn: (u, j) for u in self.units for j, fqn in enumerate(u.fqns)}
        seen = set()
        for name, full in weights:
            if name not in where:
                continue
            u, j = where[name]
            off, k = u.offsets[j], u.numels[j]
            if self.keeps_full_params or u.n == 1:
                u.full[off: off + k].copy_(to_local(full, u.params[j], self.topo,
                                                    copy=False).reshape(-1))
            else:
                a, b = max(off, u.lo), min(off + k, u.hi)
                if a < b:  # a lazy tensor: only the rows holding this piece are read
                    u.shard[a - u.lo: b - u.lo].copy_(
                        local_flat_range(full, u.params[j], self.topo, a - off, b - off))
            seen.add(name)
        missing = sorted(set(where) - seen)
        if missing:
            raise ValueError(f"no weights for {', '.join(missing[:5])}"
                             f"{' …' if len(missing) > 5 else ''}")

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Ψ: trainable parameters (a tied weight once)."""
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Σ_u P_u: elements of all flat buffers, padding included (what the collectives move)."""
        return sum(u.padded for u in self.units)

    def unit_sizes(self) -> dict[str, tuple[int, int]]:
        """{unit name: (Ψ_u, P_u)} in elements."""
        return {u.name: (u.numel, u.padded) for u in self.units}

    # -- the step -------------------------------------------------------------------------------
    def _model_pre_forward(self, module, args) -> None:
        for u in self.units:  # a new forward (micro-step): count gradient arrivals afresh
            self._arrived[u].clear()

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        """Inside ``sync_gradients(False)`` backward only accumulates full gradients locally."""
        prev, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Once all of a unit's gradients arrived on the syncing micro-step, reduce-scatter it
        (async, while backward goes on; earlier micro-steps only accumulate)."""
        u = self._unit_of[id(p)]
        arrived = self._arrived[u]
        arrived.add(id(p))
        if len(arrived) < len(u.params):
            return
        arrived.clear()
        self._unit_backward_done(u)
        if not self._sync:
            return
        self._ready.add(u)
        if self.overlap:  # launch in backward order only: every rank issues the same sequence
            while (self._next_reduce < len(self._reduce_order)
                   and self._reduce_order[self._next_reduce] in self._ready):
                self._launch_reduce(self._reduce_order[self._next_reduce])

    def _unit_backward_done(self, u: FlatShards) -> None:
        """Every gradient of ``u`` arrived this backward (ZeRO-3: free its parameters)."""

    def _launch_reduce(self, u: FlatShards) -> None:
        """Wait for the reduce_scatter launched before (it ran during ``u``'s backward; HSDP's
        wait all-reduces), then pack and launch ``u``'s: one flat gradient [P_u] alive."""
        if self._next_reduce > 0:
            self._reduce_order[self._next_reduce - 1].wait_reduce_scatter()
        with self.topo.ledger.note(f"{u.name} grads"):
            u.launch_reduce_scatter()
        self.reduce_inputs_peak_bytes = max(self.reduce_inputs_peak_bytes, sum(
            v._reduce[1] for v in self.units if v._reduce is not None))
        self._next_reduce += 1

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Launch the reduce_scatters not launched yet (units with an unused parameter, or
        ``overlap=False``), in backward order, and wait for the last (:meth:`_launch_reduce`)."""
        for u in self._reduce_order[self._next_reduce:]:
            self._launch_reduce(u)
        self._reduce_order[-1].wait_reduce_scatter()
        self._ready.clear()
        self._next_reduce = 0

    def held_grads(self) -> Held:
        """The gradient this rank holds is its slices (padding is 0), each piece counted as
        :meth:`.flat.FlatShards.held_grads` says (tp-replicated pieces on tp index 0 only),
        sliced over each unit's axis: the norm is summed over tp, then the shard axis
        (:meth:`..params.Held.norm_axes`; HSDP's replicas hold the same slices). Expert slices
        over "edp" count on every rank too: each is held by one (ep, edp) pair of data ranks,
        so the data axis's one all-reduce sums them once (no all-reduce over "ep")."""
        return Held([h for u in self.units for h in u.held_grads()],
                    tuple(dict.fromkeys(u.axis for u in self.units)))

    def make_optimizer(self, param_groups: list[dict], optimizer_class=torch.optim.AdamW,
                       **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class`` (``kwargs``: lr, betas, eps) over this rank's slices only
        (:func:`.flat.sharded_optimizer`; the decay / no-decay groups are kept): its state exists
        only here, and ``step()`` updates the slices in place, then ZeRO-1/2 all_gather them (one
        per unit). Raises :class:`ShardwiseConfigError` for a non-element-wise optimizer."""
        if optimizer_class is not Muon:  # Muon: element-wise but for NS, which gathers
            validate_zero(self.stage, self.n, optimizer=optimizer_class)
        opt = sharded_optimizer(self.units, param_groups, optimizer_class,
                                gather_params=self.keeps_full_params, **kwargs)
        if optimizer_class is Muon:  # a matrix cut by slice boundaries goes to its owner
            muon = {id(p) for g in param_groups if g.get("muon") for p in g["params"]}
            opt.orthogonalize = Orthogonalizer(self.topo, self.units)
            # the formula (Sync.muon_bytes): the pieces sent to and from owners, plus the tp
            # gathers of the matrices this rank owns
            self._muon = (opt.orthogonalize, [p for u in self.units for p in u.params
                                              if id(p) in muon])
        return opt

    # -- tp-replicated gradients (dp × tp with sequence parallelism) ----------------------------
    @torch.no_grad()
    def sum_replicated_grads(self) -> None:
        """SUM over tp (tag ``sp_grad``, after :meth:`finish_gradient_sync`) the gradient pieces
        of this rank's slices that belong to tp-replicated parameters: with SP each tp rank saw
        only s/tp positions, so the norm weights' gradients are partial sums over tp; only the
        summed dp slice this rank owns needs completing: one flat all_reduce of
        :meth:`replicated_slice_numel` elements (tp peers have the same unit layout, hence the
        same pieces). Nothing is sent when the slice holds none."""
        pieces = [u.shard_grad[a - u.lo: b - u.lo] for u, a, b in self._replicated_pieces()]
        sum_coalesced_(pieces, self.topo, "tp", tag="sp_grad")

    def sp_grad_bytes(self, whole: float) -> float:
        """The SP sum of only this rank's slice: 2(t−1)/t · 4 · :meth:`replicated_slice_numel`
        bytes over tp (fp32), instead of ``whole``."""
        return ring_bytes("all_reduce", 4 * self.replicated_slice_numel(), self.topo.size("tp"))

    def _replicated_pieces(self) -> list[tuple[FlatShards, int, int]]:
        return [(u, a, b) for u in self.units for j, a, b in u.pieces()
                if not tp_sharded(u.params[j])]

    def replicated_slice_numel(self) -> int:
        """Elements of this rank's slices that belong to tp-replicated parameters (no
        tp placement; the norm weights in a TP model)."""
        return sum(b - a for _, a, b in self._replicated_pieces())

    # -- full shapes over dp: parity checks, layout-free checkpoints ----------------------------
    def dp_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN: parameter} (tied weight once): the model's own (dp-replicated) parameters."""
        return {fqn: view.detach().clone() for u in self.units
                for fqn, (_, view) in zip(u.fqns, u.views(u.full))}

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        """{FQN: summed (and clipped) gradient}, all-gathered from every rank's slice (ledger
        phase ``verify``). Call after :meth:`finish_gradient_sync`. Collective over dp."""
        return gather_named(self.units, [u.shard_grad for u in self.units])

    def dp_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN: {"step", "exp_avg", "exp_avg_sq"}} in this module's parameter shapes (inside
        dp × tp: the tp shard), gathered over dp (:func:`.flat.gather_optimizer_state`)."""
        return gather_optimizer_state(self.units, optimizer)

    def dp_load_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Cut full-shape state to this rank's pieces (:func:`.flat.load_optimizer_state`)."""
        load_optimizer_state(self.units, optimizer, state)

    def dp_pieces(self, optimizer=None) -> list:
        """This rank's slices of the parameters and their state (:func:`..boxes.flat_pieces`:
        the same for ZeRO-1/2/3 and HSDP, no collective)."""
        from ..boxes import flat_pieces

        return flat_pieces(self.units, optimizer)

    # -- accounting -----------------------------------------------------------------------------
    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """:func:`..params.storage_state_bytes`: ``params`` (ZeRO-1/2 the full flat buffers; ZeRO-3
        the slices plus whatever is gathered right now), ``grads`` (ZeRO-1 the full gradient
        buffers; ZeRO-2/3 the slices plus any full ``.grad`` not yet reduced), ``optimizer``,
        ``total``."""
        params = [p for u in self.units for p in u.params] + [u.shard for u in self.units]
        grads = ([p.grad for u in self.units for p in u.params]
                 + [getattr(p, "main_grad", None) for u in self.units for p in u.params]
                 + [u.shard_grad for u in self.units])
        return storage_state_bytes(params, grads, optimizer)

    def memory_formula(self) -> dict[str, float]:
        """:func:`.formulas.zero_memory_formula` for this stage, Ψ = :attr:`numel`, n = dp (fp32
        AdamW); with expert parallelism the sum of the dense part (n = dp·cp) and the expert
        part (Ψ of this rank's experts, n = edp): :func:`.formulas.units_memory_formula`."""
        muon = sum(p.numel() for p in self._muon[1]) if self._muon else 0  # Muon's matrices
        return units_memory_formula(self.stage, self.units, self.topo.shard_axis, self.n, muon)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """{"grad", "param", "grad_norm": bytes} of :meth:`step_bytes_formula`."""
        z = self.step_bytes_formula(micro_steps)
        return {k: z[k] for k in ("grad", "param", "grad_norm", "grad_replicate") if k in z}

    def _regathered(self, axis: str | None = None) -> float | None:
        """Elements (of the units over ``axis``; None: all) all-gathered a second time, for
        backward (ZeRO-3 only)."""
        return None

    def step_bytes_formula(self, micro_steps: int = 1) -> dict[str, float]:
        """:func:`zero_step_bytes_formula` with this sync's padded Ψ, the reduce dtype's bytes
        for the gradient reduce_scatter, and what ZeRO-3 gathers a second time for backward;
        with expert parallelism one such term per axis, summed
        (:func:`.formulas.zero_ep_step_bytes_formula`). Inside dp × tp the tp scalar of the
        norm (tag ``"grad_norm"`` on axis tp) is not included."""
        grad_b = torch.empty(0, dtype=self._rdtype).element_size()
        return units_step_bytes_formula(
            self.stage, self.units, self.topo, self.n, grad_b, micro_steps=micro_steps,
            regathered=self._regathered(self.topo.shard_axis),
            regathered_experts=self._regathered("edp"))
