"""ZeRO through PyTorch's own implementations (``--zero {1,2,3} --engine torch``), over dp.

* stage 3: FSDP2, ``fully_shard(unit, mesh=topo.mesh["dp"])`` on every unit (as in :mod:`.zero`),
  then on the root (:func:`apply_fsdp`, which the 2D engine :mod:`.fsdp2` calls too, on a
  DTensor-TP model). Each parameter is a DTensor sharded on dim 0 over dp (``torch.chunk`` rows,
  each padded to ⌈d₀/n⌉ for the collectives).
* stage 2: the same with ``reshard_after_forward=False`` (FSDP1's SHARD_GRAD_OP): each unit
  all-gathered once per micro-step (2Ψ traffic, like ZeRO-2); ZeRO-3's memory at rest.
* stage 1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP: DDP all-reduces the
  full gradients (2Ψ); each rank steps AdamW on the whole parameters it owns (greedily by size,
  not flat slices), then **broadcasts** them from their owners (another Ψ): 3Ψ on the wire, not
  the paper's 2Ψ (ZeRO paper §7.2.1).

The ledger: FSDP2's all-gathers (tag ``param``) and reduce-scatters (tag ``grad``) go through
:mod:`shardwise.comm` via ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (interfaces in
the private ``torch.distributed.fsdp._fully_shard._fsdp_api``: this relies on the pinned torch);
DDP's buckets through a comm hook (:mod:`shardwise.parallel.dp.ddp`). **Not in the ledger:**
ZeroRedundancyOptimizer's parameter broadcasts (``torch.distributed.broadcast``, no hook) and
DDP's initial broadcast.

Gradients are **summed** over dp (each rank's loss is already divided by the global token count).
The grad norm of FSDP2's sharded gradients is one fp64 all_reduce over dp (tag ``grad_norm``);
ZeRO-1's gradients are replicated, so its norm needs no collective. Measurements: docs/zero.md §3.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import comm
from ...comm.torch_booking import BookFunctionalCollectives, ddp_comm_hook
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import reduce_bytes, reduce_groups, storage_state_bytes
from .units import UnitOrderCheck, assign_units
from .formulas import (hsdp_replicate_bytes, validate_zero, zero_memory_formula,
                       zero_step_bytes_formula)

try:  # FSDP2's pluggable collectives (private module in torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - other torch versions: FSDP2's own calls, not booked
    AllGather = ReduceScatter = None


if AllGather is not None:
    class _LedgerComm:
        """An FSDP2 collective issued through :mod:`shardwise.comm` over dp. Synchronous: on CPU
        FSDP2 has no side streams to overlap with anyway."""

        def __init__(self, topo):
            self.topo = topo

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class _LedgerAllGather(_LedgerComm, AllGather):
        """A unit's padded shards, all-gathered (tag ``param``) over the shard axis (dp;
        HSDP: dp_shard)."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            comm.all_gather(output_tensor, input_tensor, self.topo, self.topo.shard_axis,
                            tag="param")
            return None

    class _LedgerReduceScatter(_LedgerComm, ReduceScatter):
        """A unit's padded gradients, reduce-scattered (tag ``grad``); SUM only."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op != dist.ReduceOp.SUM:
                raise RuntimeError(f"FSDP2 asked for reduce op {op}; shardwise sums gradients")
            comm.reduce_scatter(output_tensor, input_tensor, self.topo, self.topo.shard_axis,
                                tag="grad")
            return None


class FSDPUnits(NamedTuple):
    """What :func:`apply_fsdp` wrapped: ``modules`` (the units, then the root last), ``order``
    (their first-forward order check), ``reshard_after_forward`` (of the units) and
    ``replicate_axis`` (HSDP's "dp_replicate", or None: :func:`replica_axis`)."""

    modules: list[nn.Module]
    order: UnitOrderCheck
    reshard_after_forward: bool
    replicate_axis: str | None


def replica_axis(module: nn.Module, topo) -> str | None:
    """The axis over which ``module``'s sharded gradients are then all-reduced, as its
    parameters' record says (:func:`..params.reduce_groups`, ``shard=True``): HSDP's
    "dp_replicate", or None."""
    return reduce_groups(list(module.parameters()), topo, shard=True)[0].replicate_axis


def apply_fsdp(module: nn.Module, topo, stage: int, precision: Precision = FP32, *,
               units: list[nn.Module], reshard_after_forward: bool = True,
               what: str = "FSDP2", offload: str = "none") -> FSDPUnits:
    """Wrap ``module`` for ZeRO ``stage`` over ``topo.mesh["dp"]`` with PyTorch's FSDP2 (1D, or
    2D on a DTensor-TP model: FSDP2 shards each tp-local shard further over dp), units first,
    then the root (torchtitan's one ``apply_fsdp``). Stage 0: ``replicate`` (FSDP2's DDP mode:
    gradients all-reduced over dp); stages 1, 2: ``fully_shard(unit,
    reshard_after_forward=False)`` (FSDP1's SHARD_GRAD_OP); stage 3: ``reshard_after_forward``
    as given, the root keeping FSDP2's default (None: gathered from forward to backward, which
    needs it first).

    Every wrapped module sums (each loss is already divided by the global token count) and, for
    stages ≥ 1, all-gathers / reduce-scatters through the ledger, under
    :func:`mixed_precision_policy` of ``precision``. ``offload="params"``: FSDP2's
    ``CPUOffloadPolicy`` (sharded parameters, their gradients and so the optimizer step in host
    memory; pinned when the device is an accelerator). The units' forward order is
    checked on the first step (:class:`.units.UnitOrderCheck`, named ``what`` in its error)."""
    fqn = {id(m): n for n, m in module.named_modules()}
    names = [fqn[id(u)] for u in units]
    mp = mixed_precision_policy(precision)
    kw = {"mp_policy": mp}
    if offload == "params":  # FSDP2 keeps shards, gradients and the AdamW step on the host
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=topo.device.type != "cpu")
    # with a replica axis (HSDP): FSDP2's 2-D mesh (replicate, shard): it reduce-scatters within
    # the shard axis (our hook) and all-reduces the shards over the replicas itself (c10d,
    # booked by :meth:`booking`)
    rep = replica_axis(module, topo)
    mesh = topo.mesh[rep, topo.shard_axis] if rep else topo.mesh["dp"]
    if stage == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrapped = [replicate(u, mesh=mesh, **kw) for u in units]
        wrapped.append(replicate(module, mesh=mesh, **kw))
        reshard = False
    else:
        reshard = stage == 3 and reshard_after_forward
        wrapped = [fully_shard(u, mesh=mesh, reshard_after_forward=reshard, **kw)
                   for u in units]
        wrapped.append(fully_shard(module, mesh=mesh, **kw,
                                   reshard_after_forward=None if reshard else False))
    for m in wrapped:
        m.set_gradient_divide_factor(1.0)  # SUM, not FSDP's default average
        m.set_force_sum_reduction_for_comms(True)
        if stage and AllGather is not None:
            m.set_custom_all_gather(_LedgerAllGather(topo))
            m.set_custom_reduce_scatter(_LedgerReduceScatter(topo))
    # FSDP2 all-gathers a unit in its pre-forward hook: on the first forward every rank first
    # agrees on the unit (hooks prepended before FSDP2's), so that a rank-dependent order is an
    # error, not mismatched gathers (silently wrong gradients)
    order = UnitOrderCheck(topo, names, what)
    order.hook_forward(wrapped[:-1], module)
    return FSDPUnits(wrapped, order, reshard, rep)


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision`` (docs/parity.md §7):

    * fp32 storage: gradients reduced in ``precision.reduce_dtype`` (None = the parameters');
    * the guide's recipe (a bf16 model, no master): reduced in fp32 unless told bf16;
    * Megatron's recipe in FSDP2's form (:func:`..storage.fsdp2_masters`: the model stays
      fp32, its shards are the masters): ``param_dtype=bf16`` — each unit's shards cast to
      bf16 and all-gathered in 2 B, the forward and backward in bf16, each micro-batch's bf16
      gradient accumulated in fp32 without sync (FSDP2's ``unsharded_accumulated_grad``) and
      reduce-scattered in ``reduce_dtype`` (fp32) into the fp32 shard. Inputs are not cast
      (``cast_forward_inputs=False``): the blocks' RoPE tables stay fp32, as the bf16 model's."""
    reduce = torch.bfloat16 if precision.reduce_dtype == "bf16" else None
    if precision.param_dtype == "fp32":
        return MixedPrecisionPolicy(reduce_dtype=reduce)
    if precision.master_dtype is None:
        return MixedPrecisionPolicy(reduce_dtype=reduce or torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce or torch.float32,
                                cast_forward_inputs=False)


class ZeroRedundancySync(Sync):
    """ZeRO ``stage`` over ``topo``'s dp axis with PyTorch's implementations (module docstring),
    a plain gradient sync (stage 1: the loss function runs :attr:`forward_module`, DDP's wrapper).

    ``units``: submodule FQNs wrapped by ``fully_shard`` before the root (default: every
    transformer / MLP block); ignored for stage 1. ``bucket_mb``: DDP bucket size (stage 1).
    ``precision.reduce_dtype``: "fp32" | "bf16", the dtype gradients travel in over dp — FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` (stages 2, 3; the sharded gradient is
    cast back to fp32), DDP's bf16 compression hook through the ledger (stage 1).
    ``offload``: "params" for FSDP2's ``CPUOffloadPolicy`` (:func:`apply_fsdp`).
    Raises :class:`ShardwiseConfigError` (before any collective) for dp < 2, bad units or another
    reduce dtype. Parameters are broadcast from dp index 0 first (ledger phase ``init``).
    """

    def __init__(self, module: nn.Module, topo, stage: int, *, units: list[str] | None = None,
                 bucket_mb: float = 25.0, precision: Precision = FP32, offload: str = "none"):
        validate_zero(stage, topo.size(topo.shard_axis), engine="torch")
        precision.reduce_torch  # checked before any collective
        hook = ddp_comm_hook(precision.reduce_dtype)
        self.reduce_dtype = precision.reduce_dtype
        self.param_bytes = precision.param  # FSDP2 gathers the stored dtype (bf16 storage: 2)
        named_units = assign_units(module, units)  # same checks (tied weights) as explicit ZeRO
        super().__init__(module, topo)
        # with a replica axis (HSDP): FSDP2 over the 2-D mesh (dp_replicate, dp_shard), ZeRO-1
        # as FSDP2's ZeRO-2 (ZeroRedundancyOptimizer has no hybrid mode); n is the shard group
        self.replicate_axis = replica_axis(module, topo)
        self.topo, self.stage, self.n = topo, stage, topo.size(topo.shard_axis)
        self._numel = sum(p.numel() for _, _, ps in named_units for _, p in ps)
        self._ddp = stage == 1 and self.replicate_axis is None
        if self._ddp:
            # gradient_as_bucket_view: .grad are views of DDP's buckets, so gradients take 4Ψ
            no_buffer_sync = ({"forward_sync_buffers": False}  # RoPE tables are deterministic
                              if "forward_sync_buffers" in inspect.signature(DDP).parameters
                              else {"broadcast_buffers": False})
            self.ddp = DDP(module, process_group=topo.group("dp"), bucket_cap_mb=bucket_mb,
                           gradient_as_bucket_view=True, **no_buffer_sync)
            self.ddp.register_comm_hook(topo, hook)
            return
        with topo.ledger.phase("init"), torch.no_grad():
            for p in module.parameters():  # fully_shard keeps each rank's own chunk
                comm.broadcast(p.data, topo, "dp", src=0, tag="init")
        fsdp = apply_fsdp(module, topo, stage, precision,
                          units=[mod for name, mod, _ in named_units if name != "root"],
                          what=f"FSDP2 (--zero {stage} --engine torch)", offload=offload)
        self.fsdp_modules = fsdp.modules
        self.reshard_after_forward = fsdp.reshard_after_forward
        self.fsdp2_state = True  # AdamW on FSDP2's shards (..storage.fsdp2_state)

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp if self._ddp else self.module

    def booking(self):
        """HSDP: FSDP2 all-reduces the gradient shards over dp_replicate with
        ``torch.distributed.all_reduce`` itself (no hook into :mod:`shardwise.comm`): booked by
        :class:`~shardwise.comm.torch_booking.BookFunctionalCollectives` as tag
        ``grad_replicate``."""
        if self.replicate_axis is None:
            return contextlib.nullcontext()
        return BookFunctionalCollectives(self.topo, c10d_tag="grad_replicate")

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        if self._ddp:
            with (contextlib.nullcontext() if enabled else self.ddp.no_sync()):
                yield
            return
        self.module.set_requires_gradient_sync(enabled)  # recurses into every unit
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def after_evaluation(self) -> None:
        """After an evaluation forward: FSDP2 keeps units with ``reshard_after_forward=False``
        (the root; every unit at stage 2) gathered after a forward even without grad, so they
        are resharded here: otherwise the next training step would skip their all-gather (the
        ledger would fall short of the formula)."""
        if not self._ddp:
            for m in self.fsdp_modules:
                m.reshard()

    def make_optimizer(self, param_groups: list[dict], optimizer_class=torch.optim.AdamW,
                       **kwargs) -> torch.optim.Optimizer:
        """FSDP2: the plain optimizer over the DTensor parameters (its state is sharded like
        them). Stage 1: ``ZeroRedundancyOptimizer`` wrapping ``optimizer_class``."""
        validate_zero(self.stage, self.n, optimizer=optimizer_class, engine="torch")
        if self._ddp:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(param_groups, optimizer_class=optimizer_class,
                                           process_group=self.topo.group("dp"), **kwargs)
        return optimizer_class(param_groups, **kwargs)

    # -- layout-free optimizer state -------------------------------------------------------------
    def dp_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN: {"step", "exp_avg", "exp_avg_sq"}} whole over dp, on every dp rank.

        FSDP2: the AdamW state is DTensors sharded like the parameters, left as they are (the
        base engine's full-shape view gathers them, :func:`..views.to_full`). Stage 1: ZeroRedundancyOptimizer keeps a
        parameter's state only on its owner rank, so the owner broadcasts it over dp
        (``comm.broadcast``, phase ``checkpoint``, tag ``optim_state``: one packed fp32 tensor
        [1 + 1 + 2·numel] = (has-state flag, step, exp_avg, exp_avg_sq) per parameter).
        Collective: every dp rank calls it."""
        if not self._ddp:
            return super().dp_optimizer_state(optimizer)
        owner = optimizer._param_to_rank  # ZeroRedundancyOptimizer: dp group rank = dp index
        out = {}
        with self.topo.ledger.phase("checkpoint"):
            for n, p in self.module.named_parameters():
                packed = torch.zeros(2 + 2 * p.numel(), dtype=torch.float32, device=p.device)
                st = optimizer.optim.state.get(p) if owner[p] == self.topo.index("dp") else None
                if st:
                    packed[0] = 1.0
                    packed[1] = float(st["step"])
                    packed[2:2 + p.numel()] = st["exp_avg"].reshape(-1)
                    packed[2 + p.numel():] = st["exp_avg_sq"].reshape(-1)
                comm.broadcast(packed, self.topo, "dp", src=owner[p], tag="optim_state")
                if packed[0] > 0:
                    out[n] = {"step": packed[1].clone(),
                              "exp_avg": packed[2:2 + p.numel()].view_as(p).clone(),
                              "exp_avg_sq": packed[2 + p.numel():].view_as(p).clone()}
        return out

    def dp_load_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Inverse of :meth:`dp_optimizer_state` (state possibly saved under another layout):
        FSDP2 cuts each full tensor to this rank's dp shard (``distribute_tensor``, no
        collective); stage 1 keeps only the parameters this rank owns (into
        ``optimizer.optim``). Raises ``KeyError`` naming missing FQNs."""
        if not self._ddp:
            return super().dp_load_optimizer_state(optimizer, state)
        owner = optimizer._param_to_rank
        for n, p in self.named_params():
            if owner[p] == self.topo.index("dp"):
                optimizer.optim.state[p] = {
                    k: (v.detach().clone().to(p.device) if torch.is_tensor(v) else v)
                    for k, v in state[n].items()}

    def dp_pieces(self, optimizer=None) -> list:
        """FSDP2: the DTensor shards (:meth:`..sync.Sync.dp_pieces`). Stage 1: the whole
        parameters, and the state of the parameters this rank owns (no broadcast)."""
        if not self._ddp or optimizer is None:
            return super().dp_pieces(optimizer)
        from ..boxes import Piece

        owner, me = optimizer._param_to_rank, self.topo.index("dp")
        return super().dp_pieces() + [
            Piece(k, n, v) for n, p in self.named_params() if owner[p] == me
            for k, v in optimizer.optim.state.get(p, {}).items() if torch.is_tensor(v)]

    # -- inspection -----------------------------------------------------------------------------
    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """:func:`..params.storage_state_bytes` of this rank's storages (local shards for FSDP2, with
        FSDP2's dim-0 padding; DDP's full parameters and bucket-view gradients plus
        ZeroRedundancyOptimizer's local state for stage 1)."""
        params = list(self.module.parameters())
        return storage_state_bytes(params, [p.grad for p in params], optimizer)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def padded_numel(self) -> int:
        """Elements FSDP2's collectives move: each parameter's dim 0 padded to a multiple of n
        (stage 1: Ψ, DDP does not pad)."""
        if self._ddp:
            return self._numel
        return self._fsdp_padded(self.module.parameters())

    def _fsdp_padded(self, params) -> int:
        return sum(math.ceil(p.shape[0] / self.n) * self.n * (p.numel() // p.shape[0])
                   for p in params)

    def memory_formula(self) -> dict[str, float]:
        """ZeRO-1's formula for stage 1; ZeRO-3's for stages 2 and 3 (FSDP2 keeps parameters
        sharded between steps in both)."""
        return zero_memory_formula(1 if self._ddp else 3, self._numel, self.n)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """{"grad", "param", "grad_norm": bytes} of :meth:`step_bytes_formula`."""
        z = self.step_bytes_formula(micro_steps)
        return {k: z[k] for k in ("grad", "param", "grad_norm", "grad_replicate") if k in z}

    def step_bytes_formula(self, micro_steps: int = 1) -> dict[str, float]:
        """What the ledger sees per step (tags grad / param / grad_norm). Stage 1: DDP's SUM
        all_reduce of 4Ψ bytes, 2(n−1)/n·4Ψ; ZeroRedundancyOptimizer's broadcasts of (n−1)/n·4Ψ
        are not booked (``unbooked_param_broadcast``). FSDP2: :func:`zero_step_bytes_formula`
        with FSDP2's per-parameter padding, the parameters gathered in their stored dtype
        (``--param-dtype bf16``: 2 B); the root is gathered once per micro-step, blocks
        twice with reshard-after-forward (stage 3), once without (stage 2)."""
        b_r = reduce_bytes(self.reduce_dtype)  # gradients travel in the reduce dtype
        if self._ddp:
            out = zero_step_bytes_formula(0, self._numel, self.n, 4, grad_bytes_per_elem=b_r)
            out["unbooked_param_broadcast"] = (self.n - 1) / self.n * 4 * self._numel
            return out
        blocks = self._fsdp_padded(p for m in self.fsdp_modules[:-1] for p in m.parameters())
        out = zero_step_bytes_formula(3, self.padded_numel, self.n, self.param_bytes,
                                      micro_steps=micro_steps,
                                      regathered=blocks if self.reshard_after_forward else 0,
                                      grad_bytes_per_elem=b_r)
        if self.replicate_axis:  # FSDP2 all-reduces each rank's padded shards over the replicas
            out["grad_replicate"] = hsdp_replicate_bytes(
                self.padded_numel, self.n, self.topo.size(self.replicate_axis), b_r)
            out["total"] += out["grad_replicate"]
        return out

