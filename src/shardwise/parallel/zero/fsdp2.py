"""``--engine torch`` for dp × tp (2D): the dp part, FSDP2 over DTensor tensor parallelism.

torchtitan's 2D recipe on the mesh (pp, dp, tp), tp innermost (:func:`~..apply.parallelize`,
steps 3–5): ``parallelize_module`` on the tp mesh (the plan of :mod:`..tp.dtensor`), then over
the dp mesh FSDP2 on every block and the root
(:func:`.torch_zero.apply_fsdp`): zero 0 ``replicate`` (whole parameters, SUM all-reduce of
each unit's gradients, 2(n−1)/n·Ψ_local·b), zero 1 and 2 ``fully_shard`` without resharding after
forward (ZeRO-2's traffic; PyTorch has no optimizer-state-only sharding that composes with DTensor
parameters), zero 3 ``fully_shard`` with it (ZeRO paper §5.3, §7). Gradients are **summed** over
dp (each rank's loss is already divided by the global token count). The tp part and this dp part
(:class:`FSDP2Sync`) are composed by :class:`~..model.ParallelModel`.

Ledger tags: ``param`` (FSDP2's all-gathers, custom ledger collective), ``grad`` (its
reduce-scatter, or ``replicate``'s c10d all-reduce booked by the dispatch mode), ``tp_fwd`` /
``tp_bwd`` / ``ce`` / ``sp_grad`` (DTensor's collectives, booked), ``grad_norm`` (one fp64 scalar
per splitting axis), ``loss``. What ``fully_shard`` does to a DTensor parameter (strided
sharding), why DDP and ZeroRedundancyOptimizer cannot take this model, and the measurements:
docs/composition.md, "dp × tp with PyTorch's own implementations".
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ...comm.ledger import ring_bytes
from ...models.llama import Llama
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import is_dtensor as _is_dtensor, local as _local, reduce_bytes
from .torch_zero import apply_fsdp

class FSDP2Sync(Sync):
    """The dp part of dp × tp on the torch engine: PyTorch's FSDP2 (``fully_shard``, zero ≥ 1)
    or ``replicate`` (zero 0) over the dp mesh, on a module whose parameters DTensor TP already
    converted (so they become DTensors on the (dp, tp) mesh). Composed with the tp part by
    :class:`~..model.ParallelModel`. ``units``: the FSDP2-wrapped modules (blocks, then the
    root); ``local_shapes``: {FQN: this rank's tp-local shape} before dp (for the formulas)."""

    def __init__(self, module: Llama, topo, layout, units: list[nn.Module], *,
                 reshard_after_forward: bool, precision: Precision, local_shapes: dict,
                 replicate_axis: str | None = None, offload: str = "none"):
        super().__init__(module, topo)
        self.replicate_axis = replicate_axis  # HSDP: FSDP2 all-reduces the shards over it
        self.sp, self.zero = layout.sp, layout.zero
        self.units, self.reshard_after_forward = units, reshard_after_forward
        self.reduce_dtype, self.local_shapes = precision.reduce_dtype, local_shapes
        self.param_bytes = precision.param  # FSDP2 gathers in the stored / param dtype
        self.offload, self.fsdp2_state = offload, layout.zero > 0  # ..storage.fsdp2_state

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        """``set_requires_gradient_sync(False)`` accumulates unsharded gradients locally (no
        reduce) until the last micro-step."""
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def booking_options(self) -> dict:
        """``replicate`` issues its dp all-reduce with ``torch.distributed.all_reduce`` (booked
        as ``grad``); with SP, FSDP2 redistributes the norm weights' ``Partial`` gradients
        inside backward (booked as ``sp_grad``)."""
        rep = self.replicate_axis  # FSDP2's own all-reduce of the shards over the replicas
        return {"c10d_tag": "grad" if self.zero == 0 else "grad_replicate" if rep else None,
                "sp_grad": self.sp}

    def sum_replicated_grads(self) -> None:
        """Nothing: FSDP2 already summed the SP partial gradients over tp inside backward."""

    def after_evaluation(self) -> None:
        """Reshard the units not resharded after forward (the root; every unit at zero 1/2):
        FSDP2 would keep them gathered, and the next step would skip their all-gather."""
        self._reshard()

    def _reshard(self) -> None:
        """Make the registered parameters the sharded ones (FSDP2 swaps in the unsharded ones
        while a unit is gathered; ``replicate``, FSDP2's DDP mode, swaps them too) before reading
        them or their optimizer state."""
        for u in self.units:
            u.reshard()

    def finish_gradient_sync(self) -> None:
        """Nothing left: FSDP2 reduces each unit at the end of its backward (and waits for it at
        the end of the root's backward). RuntimeError if a gradient is left ``Partial``."""
        for n, p in self.module.named_parameters():
            if p.grad is not None and _is_dtensor(p.grad) and any(
                    pl.is_partial() for pl in p.grad.placements):
                raise RuntimeError(f"gradient of {n} still Partial {p.grad.placements}")

    def named_params(self):
        """Resharded first (:meth:`_reshard`): the DTensor shards, which the base engine's
        full-shape views gather over the (dp, tp) mesh (:func:`..views.to_full`)."""
        self._reshard()
        return super().named_params()

    @contextlib.contextmanager
    def full_model_for(self, composed):
        """A plain Llama with the full weights (collective gather on every rank), for sampling."""
        full = composed.named_full_parameters()
        plain = Llama(self.module.config).to(self.topo.device)
        plain.load_state_dict(full, strict=False)
        yield plain

    def memory_formula(self) -> dict[str, float]:
        """Model-state bytes by the ZeRO paper's formula (§5, fp32 AdamW 4 + 4 + 8 bytes per
        element) over Ψ_t = this rank's tp-local elements: zero ≥ 1 (FSDP2 keeps parameters,
        gradients and state sharded over dp at rest, every stage) ZeRO-3's 16Ψ_t/n with
        FSDP2's padding; zero 0 (replicate) plain DP's 16Ψ_t."""
        from .formulas import zero_memory_formula

        names = [nm for nm, _ in self.module.named_parameters()]
        return zero_memory_formula(3 if self.zero else 0, self._padded_local_numel(names),
                                   self.topo.size(self.topo.shard_axis))

    def _padded_local_numel(self, names) -> int:
        """Elements FSDP2 moves for parameters ``names``: each tp-local shard's dim 0 padded to a
        multiple of dp (``⌈rows/dp⌉·dp·rest``); ``replicate``: the tp-local numel."""
        n, total = self.topo.size(self.topo.shard_axis), 0
        for name in names:
            shape = self.local_shapes[name]
            rest = math.prod(shape[1:])
            total += (math.ceil(shape[0] / n) * n if self.zero else shape[0]) * rest
        return total

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """{"grad", "param", "grad_norm": bytes} this rank sends over dp per step, with n = dp,
        Ψ = this rank's elements after FSDP2's padding (:meth:`_padded_local_numel`), b = 4,
        b_r = bytes of the reduce dtype, m = ``micro_steps``:

        * ``param`` (zero ≥ 1): per micro-step an all-gather of every unit, plus (zero 3, with
          reshard-after-forward) the blocks again before backward: m·(n−1)/n·(Ψ + Ψ_blocks)·b;
          (zero 1/2) m·(n−1)/n·Ψ·b, b the gathered dtype's bytes (bf16 storage or FSDP2's
          ``param_dtype``: 2). ZeRO paper §5.3 / §7.2.2.
        * ``grad``: one reduce-scatter per step (n−1)/n·Ψ·b_r (zero ≥ 1); zero 0 one all-reduce
          2(n−1)/n·Ψ·b_r (ZeRO paper §7.1; scaling book ch. 5).
        * ``grad_norm``: zero ≥ 1 one fp64 [1] all-reduce over dp, 2(n−1)/n·8.

        Padding per rank makes the bytes differ between tp ranks when tp does not divide the
        vocabulary (each rank's own shard sizes are used)."""
        n = self.topo.size(self.topo.shard_axis)  # HSDP: the shard group
        f = (n - 1) / n
        b_r = reduce_bytes(self.reduce_dtype)
        names = [nm for nm, _ in self.module.named_parameters()]
        psi = self._padded_local_numel(names)
        if self.zero == 0:
            return {"grad": 2 * f * psi * b_r, "param": 0.0, "grad_norm": 0.0}
        block_names = [nm for nm in names if nm.startswith("layers.")]
        again = self._padded_local_numel(block_names) if self.reshard_after_forward else 0
        out = {"param": micro_steps * f * (psi + again) * self.param_bytes,
               "grad": f * psi * b_r,
               "grad_norm": ring_bytes("all_reduce", 8, n)}
        if self.replicate_axis:  # HSDP: the shards over the replicas
            from .formulas import hsdp_replicate_bytes

            out["grad_replicate"] = hsdp_replicate_bytes(psi, n,
                                                         self.topo.size(self.replicate_axis), b_r)
        return out


def fsdp2_over_tp(model: Llama, topo, layout, *, reshard_after_forward: bool = True,
                  precision: Precision = FP32, offload: str = "none") -> FSDP2Sync:
    """FSDP2 over dp (:func:`.torch_zero.apply_fsdp`) on every block, then the root, of
    ``model`` whose parameters DTensor TP already converted (the replicas already equal):
    step 4 of :func:`~..apply.parallelize` for dp × tp on the torch engine (module docstring).

    ``reshard_after_forward`` (zero 3 only): False keeps blocks gathered until backward (then
    zero 3 runs as zero 2). ``precision.reduce_dtype``: "fp32" | "bf16", the dtype gradients
    travel in over dp (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=...)``; the accumulated
    gradient stays fp32); Megatron's recipe in FSDP2's form and ``offload="params"``:
    :func:`.torch_zero.apply_fsdp`."""
    local_shapes = {n: tuple(_local(p).shape) for n, p in model.named_parameters()}
    blocks = list(model.layers)  # a Llama's TransformerBlocks, the MLP's blocks
    fsdp = apply_fsdp(model, topo, layout.zero, precision, units=blocks,
                      reshard_after_forward=reshard_after_forward,
                      what=f"FSDP2 (dp × tp, --zero {layout.zero} --engine torch)",
                      offload=offload)
    sync = FSDP2Sync(model, topo, layout, fsdp.modules,
                     reshard_after_forward=fsdp.reshard_after_forward, precision=precision,
                     local_shapes=local_shapes, replicate_axis=fsdp.replicate_axis,
                     offload=offload)
    sync._order = fsdp.order
    return sync
