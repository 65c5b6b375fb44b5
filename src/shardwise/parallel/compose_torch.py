"""``--engine torch`` for dp × tp (2D): DTensor tensor parallelism inside, FSDP2 over dp.

The 2D recipe of torchtitan and of the PyTorch 2D tutorial ("Large Scale Transformer model
training with Tensor Parallel"), on the mesh ``topo.mesh`` with dims (pp, dp, tp), tp innermost:

1. ``parallelize_module(model, topo.mesh["tp"], plan)`` — the plan of
   :mod:`shardwise.parallel.tp.dtensor` (column/row-parallel linears, vocab-parallel embedding
   and head, SP norms, ``loss_parallel``). Every Linear/Embedding weight becomes a DTensor on the
   1-D tp mesh: ``Shard(0)`` (column-parallel, embedding/head rows) or ``Shard(1)`` (row-parallel).
2. Over dp, PyTorch's FSDP2 machinery on every ``TransformerBlock`` and then the root, with
   ``mesh=topo.mesh["dp"]`` (a sub-mesh of the same root mesh as the tp mesh — FSDP2 requires it):

   ======  ===================================================================================
   zero    PyTorch
   ======  ===================================================================================
   0       ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``): FSDP2's
           DDP mode. Parameters stay whole over dp; each unit's gradients are SUM-all-reduced
           over dp after its backward (2(n−1)/n·Ψ_local·b).
           ``DistributedDataParallel`` cannot take this model: its constructor flattens every
           parameter, and DTensor refuses to flatten the vocabulary rows that tp does not divide
           (67 over tp=2); ``_pre_dp_module_transform`` would also untie tied embeddings.
   1      as 2 (below). PyTorch has no optimizer-state-only sharding that composes with DTensor
           parameters: ``ZeroRedundancyOptimizer`` broadcasts whole parameters with
           ``torch.distributed.broadcast`` (not DTensor-aware) and needs DDP, which fails here
           (above). FSDP2 without resharding after forward is the nearest PyTorch offers; its
           memory at rest is ZeRO-3's (smaller than ZeRO-1's), its traffic ZeRO-2's.
   2      ``fully_shard(unit, mesh=dp, reshard_after_forward=False)``: a unit is all-gathered
           once per micro-step and stays gathered until its backward (FSDP1's SHARD_GRAD_OP,
           which PyTorch listed as its ZeRO-2); gradients reduce-scattered (summed) over dp.
   3      ``fully_shard(unit, mesh=dp, reshard_after_forward=True)`` (root: FSDP2's default,
           kept gathered from forward to backward): blocks are gathered again for backward.
   ======  ===================================================================================

What ``fully_shard`` does to a DTensor parameter (``FSDPParam._init_sharding_spec_tp``): it takes
the parameter's *local* tp shard, chunks it along dim 0 over dp (``torch.chunk`` sizes, the
last chunks possibly short or empty; every chunk is padded to ⌈rows/dp⌉ rows for the
collectives), and describes the result as one DTensor on the 2-D (dp, tp) mesh. When tp already
shards dim 0 (``Shard(0)``: column-parallel weights, the embedding/head), the dp placement is
``_StridedShard(0, split_factor=tp)``: the dp shard of rank (i, j) is the i-th dp-chunk *of the
j-th tp chunk*, not the (i·tp + j)-th chunk of the whole tensor, so ``full_tensor()`` /
``distribute_tensor`` must undo the tp split first and the dp split inside it ("strided
sharding"). With tp on dim 1 (``Shard(1)``: row-parallel weights) the dp placement is a plain
``Shard(0)``. ``replicate`` gives the same 2-D DTensor with ``Replicate()`` on dp.

Collectives and the ledger (tags as booked):

* ``param`` — FSDP2's all-gathers over dp through ``set_custom_all_gather`` (:mod:`.fsdp`):
  per micro-step, each unit's padded local shards, (n−1)/n·S;
* ``grad`` — FSDP2's reduce-scatter over dp (``set_custom_reduce_scatter``, SUM) once per step,
  or ``replicate``'s all-reduce over dp, which FSDP2 issues with ``torch.distributed.all_reduce``
  itself: booked by the dispatch mode (:class:`~.tp.dtensor.BookFunctionalCollectives` with
  ``c10d_tag="grad"``), 2(n−1)/n·S. In ``reduce_dtype`` (fp32 or bf16: half the bytes);
* ``tp_fwd`` / ``tp_bwd`` — DTensor's functional collectives over tp (activations, the
  vocab-parallel cross-entropy and, with SP, the norm weights' partial gradients, which FSDP2
  redistributes ``Partial → Replicate`` before reducing over dp), booked by the dispatch mode;
* ``grad_norm`` (dp and tp) — the global gradient norm (:func:`.params.grad_norm_`): Σ g² of
  the local shards, a tp-replicated one counted on tp index 0 only, one fp64 [1] all-reduce
  over dp (FSDP2 only: ``replicate``'s gradients are whole over dp), then one over tp;
* ``loss`` — token count and loss sum over dp (``train_step``).

The initial broadcast of the parameters over dp is booked (phase ``init``); not in the ledger:
``distribute_tensor``'s scatter over tp inside ``parallelize_module`` and the all-gathers of
``full_tensor()`` (parity checks, :meth:`TorchParallel2D.full_optimizer_state`). Gradients are
**summed** over dp (``set_gradient_divide_factor(1.0)``,
``set_force_sum_reduction_for_comms(True)``): each rank's loss is already divided by the global
token count.

``bucket_mb``, ``overlap`` and ``prefetch`` do not apply (FSDP2 groups by unit, and on CPU it has
no side streams to overlap or prefetch on). Dropout draws from the default RNG (as in
:mod:`.tp.dtensor`): use dropout 0.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .. import comm
from ..comm.ledger import ring_bytes
from ..models.llama import Llama, TransformerBlock
from .engine import Engine
from .params import is_dtensor as _is_dtensor, local as _local
from .tp import BookFunctionalCollectives, parallelize_tensor_dtensor
from .zero.torch_zero import apply_fsdp

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchParallel2D(Engine):
    """dp × tp through DTensor TP + FSDP2 (``fully_shard`` / ``replicate``) — module docstring.

    ``module``: the plain model after :func:`parallelize_2d_torch` converted it (parameters are
    DTensors on the (dp, tp) mesh). Counts and losses are reduced over dp (every tp rank holds
    the same batch and, through ``loss_parallel``, the same loss)."""

    count_axes = ("dp",)
    reduce_loss_axes = ("dp",)

    def __init__(self, module: Llama, topo, layout, tp_engine, units: list[nn.Module], *,
                 reshard_after_forward: bool, reduce_dtype: str, local_shapes: dict,
                 book_collectives: bool = True):
        super().__init__(module)
        self.topo, self.layout, self.sp, self.zero = topo, layout, layout.sp, layout.zero
        self.tp_engine, self.units = tp_engine, units
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        self.local_shapes = local_shapes  # {FQN: shape of this rank's tp shard} (before dp)
        self.book_collectives = book_collectives

    # -- the step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        """FSDP2/replicate: ``set_requires_gradient_sync(False)`` accumulates unsharded
        gradients locally (no reduce) until the last micro-step."""
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The ``loss_parallel`` CE sum (a DTensor scalar, Replicate over tp)."""
        return self.tp_engine._loss_sum(batch)

    def booking(self):
        """Book DTensor's collectives (and ``replicate``'s dp all-reduce) during the step."""
        if not self.book_collectives:
            return contextlib.nullcontext()
        return BookFunctionalCollectives(self.topo, c10d_tag="grad" if self.zero == 0 else None,
                                         sp_grad=self.sp)

    def backward_context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation: (loss sum, counted tokens) under ``no_grad``. Units not resharded after
        forward (the root; every unit at zero 1/2) are resharded explicitly afterwards: FSDP2
        would keep them gathered, and the next training step would skip their all-gather."""
        out = self.tp_engine.loss_sum_and_count(batch)
        self._reshard()
        return out

    def _reshard(self) -> None:
        """Make the registered parameters the sharded ones (FSDP2 swaps in the unsharded ones
        while a unit is gathered) before reading them or their optimizer state."""
        if self.zero:
            for u in self.units:
                u.reshard()

    def finish_gradient_sync(self) -> None:
        """Nothing left: FSDP2 reduces each unit at the end of its backward (and waits for it at
        the end of the root's backward). Checks that no gradient is left ``Partial``."""
        for n, p in self.module.named_parameters():
            if p.grad is not None and _is_dtensor(p.grad) and any(
                    pl.is_partial() for pl in p.grad.placements):
                raise RuntimeError(f"gradient of {n} still Partial {p.grad.placements}")

    def norm_axes(self) -> tuple[str, ...]:
        """FSDP2 (zero ≥ 1): every gradient is a dp shard, and tp shards differ over tp;
        ``replicate`` (zero 0): dp replicas are identical, so tp only."""
        return ("dp", "tp") if self.zero else ("tp",)

    # -- inspection -------------------------------------------------------------------------
    def named_params(self):
        """The base engine's full-shape views and optimizer-state conversion read the
        parameters through this: resharded first (:meth:`_reshard`), so they are the DTensor
        shards, gathered over the (dp, tp) mesh by :func:`.params.to_full`."""
        self._reshard()
        return super().named_params()

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of this rank's local shards (params, grads, optimizer state)."""
        return self.tp_engine.model_state_bytes(optimizer)

    @contextlib.contextmanager
    def full_model(self):
        """A plain Llama with the full weights (collective gather on every rank), for sampling."""
        full = self.named_full_parameters()
        plain = Llama(self.module.config).to(self.topo.device)
        plain.load_state_dict(full, strict=False)
        yield plain

    def memory_formula(self) -> dict[str, float]:
        """Model-state bytes of this rank by the ZeRO paper's formula (§5, fp32 AdamW
        4 + 4 + 8 bytes per element) over Ψ_t = this rank's tp-local elements: zero ≥ 1 (FSDP2
        keeps parameters, gradients and state sharded over dp at rest, every stage) ZeRO-3's
        16Ψ_t/n with FSDP2's padding; zero 0 (replicate) plain DP's 16Ψ_t."""
        from .zero import zero_memory_formula

        names = [nm for nm, _ in self.module.named_parameters()]
        return zero_memory_formula(3 if self.zero else 0, self._padded_local_numel(names),
                                   self.topo.size("dp"))

    # -- bytes ------------------------------------------------------------------------------
    def _padded_local_numel(self, names) -> int:
        """Elements FSDP2 moves for parameters ``names``: each tp-local shard's dim 0 padded to a
        multiple of dp (``⌈rows/dp⌉·dp·rest``); ``replicate``: the tp-local numel."""
        n, total = self.topo.size("dp"), 0
        for name in names:
            shape = self.local_shapes[name]
            rest = math.prod(shape[1:])
            total += (math.ceil(shape[0] / n) * n if self.zero else shape[0]) * rest
        return total

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int,
                      dtype: str = "fp32") -> dict[str, float]:
        """{tag: bytes} this rank sends per step (``loss`` added by :mod:`shardwise.formulas`).

        With n = dp, t = tp, Ψ_u = elements of unit u on this rank after FSDP2's padding
        (:meth:`_padded_local_numel`), b = 4 (fp32) and b_r = bytes of ``reduce_dtype``:

        * ``param`` (zero ≥ 1): per micro-step an all-gather of every unit, plus (zero 3, with
          reshard-after-forward) the blocks again before backward:
          m·(n−1)/n·(Ψ + Ψ_blocks)·b; (zero 1/2) m·(n−1)/n·Ψ·b. ZeRO paper §5.3 / §7.2.2.
        * ``grad``: one reduce-scatter per step (n−1)/n·Ψ·b_r (zero ≥ 1); zero 0 one all-reduce
          2(n−1)/n·Ψ·b_r (ZeRO paper §7.1; scaling book ch. 5).
        * ``grad_norm``: zero ≥ 1 one fp64 [1] all-reduce over dp, 2(n−1)/n·8; plus one fp64
          [1] all-reduce over tp, 2(t−1)/t·8 (:func:`.params.grad_norm_`).
        * ``tp_fwd``/``tp_bwd``/``ce``/``sp_grad``: DTensor's activation collectives, the
          cross-entropy's (``loss_parallel`` all-reduces the max and the sums in forward; its
          backward is local) and (SP) the norm weights' gradient all-reduce r_t·(2L+1)·d·4,
          which FSDP2 issues inside backward (``Partial → Replicate``): the explicit TP
          formula's (:func:`tp_step_bytes_formula`; Megatron-LM §3, Korthikanti et al. 2022
          §4.2.2), booked under the same tags.

        Raises nothing; padding per rank makes the bytes differ between tp ranks when tp does
        not divide the vocabulary (each rank's own shard sizes are used)."""
        from .tp import tp_step_bytes_formula

        n, t = self.topo.size("dp"), self.topo.size("tp")
        f = (n - 1) / n
        b_r = torch.finfo(REDUCE_DTYPES[self.reduce_dtype]).bits // 8
        names = [nm for nm, _ in self.module.named_parameters()]
        psi = self._padded_local_numel(names)
        block_names = [nm for nm in names if nm.startswith("layers.")]
        out: dict[str, float] = {}
        if self.zero == 0:
            out["grad"] = 2 * f * psi * b_r
            out["param"] = 0.0
            out["grad_norm"] = 0.0
        else:
            again = self._padded_local_numel(block_names) if self.reshard_after_forward else 0
            out["param"] = micro_steps * f * (psi + again) * 4
            out["grad"] = f * psi * b_r
            out["grad_norm"] = ring_bytes("all_reduce", 8, n)
        out["grad_norm"] += ring_bytes("all_reduce", 8, t)
        tpf = tp_step_bytes_formula(self.module.config, sequences, seq_len, t, self.sp,
                                    dtype=dtype)
        for tag in ("tp_fwd", "tp_bwd", "ce", "sp_grad"):
            out[tag] = tpf[tag]
        return out


def parallelize_2d_torch(model: Llama, topo, layout, *, bucket_mb: float = 25.0,
                         overlap: bool = True, prefetch: bool = True,
                         reshard_after_forward: bool = True, reduce_dtype: str = "fp32",
                         book_collectives: bool = True) -> TorchParallel2D:
    """Convert ``model`` in place for ``layout`` (dp × tp, zero 0–3, ±sp) on ``topo`` with
    PyTorch's implementations and return its engine (module docstring).

    ``reshard_after_forward`` (zero 3 only): False keeps blocks gathered until backward (then
    zero 3 runs as zero 2). ``reduce_dtype``: "fp32" | "bf16", the dtype gradients travel in over
    dp (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=...)``; the accumulated gradient stays fp32).
    ``bucket_mb``/``overlap``/``prefetch``: accepted for the common signature, not used.
    Raises :class:`ShardwiseConfigError` before any collective for a layout that cannot run."""
    layout.check(model=model, topo=topo, engine="torch", reduce_dtype=reduce_dtype,
                 composition="dp×tp")
    with topo.ledger.phase("init"), torch.no_grad():  # same start on every dp replica
        for p in model.parameters():
            comm.broadcast(p.data, topo, "dp", src=0, tag="init")
    tp_engine = parallelize_tensor_dtensor(model, topo, sp=layout.sp,
                                           book_collectives=book_collectives)
    local_shapes = {n: tuple(_local(p).shape) for n, p in model.named_parameters()}
    # FSDP2 over dp on every block, then the root (zero 0: replicate; 1 runs as 2), see
    # zero.torch_zero.apply_fsdp
    blocks = [m for m in model.layers if isinstance(m, TransformerBlock)]
    fsdp = apply_fsdp(model, topo, layout.zero, reduce_dtype, units=blocks,
                      reshard_after_forward=reshard_after_forward,
                      what=f"FSDP2 (dp × tp, --zero {layout.zero} --engine torch)")
    units, reshard = fsdp.modules, fsdp.reshard_after_forward
    engine = TorchParallel2D(model, topo, layout, tp_engine, units,
                             reshard_after_forward=reshard, reduce_dtype=reduce_dtype,
                             local_shapes=local_shapes, book_collectives=book_collectives)
    engine._order = fsdp.order
    return engine
