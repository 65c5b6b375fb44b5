"""2D parallelism, written out: tensor parallelism inside each dp replica, DP or ZeRO-1/2/3 (FSDP)
over the dp axis of the local TP shards.

Math
----
The mesh is (pp, dp, tp) with tp innermost: the dp × tp ranks form a grid, rank (i, j) holds
tp shard j of the model and trains on dp slice i of the global batch. TP (``parallel/tp/``,
Megatron-LM §3) makes the tp ranks of one row compute the loss of *their* batch slice exactly as
one device would; DP then sums the gradients of the rows. Both are linear in the gradient, so they
compose without interaction: with Ψ parameters, the TP-local model of one rank has Ψ_tp ≈ Ψ/tp
parameters (norm weights replicated), and DP/ZeRO acts on those Ψ_tp as if they were a whole
model over the n = dp ranks of its column (the ranks with the same tp index):

* the loss: every tp rank holds the complete loss sum of its row (vocab-parallel CE), so the
  token count and the loss are all-reduced over dp only: ``count_axes = ("dp",)``;
* the gradients: SUM over dp of the TP-local gradients — all-reduce (zero 0) or reduce-scatter
  (ZeRO-1/2/3) of the Ψ_tp local elements (ZeRO paper §7; PyTorch's FSDP2 + TP "2D", the
  torchtitan order: TP first, FSDP over the dp mesh dimension);
* parameters: ZeRO-3 all-gathers the Ψ_tp/n shards over dp before each unit's forward/backward.

Why TP innermost (scaling book ch. 5, "Mixing FSDP and model parallelism"; Megatron-LM §5.1):
TP moves activations — (1 + 2L) all-reduces of a [b, s, d] tensor forward and again backward in
*every* micro-step, on the critical path — so it goes on the fastest links (NVLink inside a
node: consecutive ranks). DP moves ≈ 2Ψ_tp (ZeRO-3: 3Ψ_tp) bytes once per step, overlapped with
backward: it tolerates the slower inter-node links.

Collectives per optimizer step (bytes one rank sends; :meth:`DataTensorParallel.bytes_formula`)
----------------------------------------------------------------------------------------------
=============  =====================================================================  ==========
tag            what                                                                    axis
=============  =====================================================================  ==========
tp_fwd/tp_bwd  Megatron f/g (SP: all-gather/reduce-scatter) of this dp rank's          tp
               activations: :func:`~.tp.tp_step_bytes_formula` with its sequences
ce             vocab-parallel cross-entropy statistics                                 tp
grad           DP: all-reduce 2(n−1)/n·Ψ_tp·b; ZeRO: reduce-scatter (n−1)/n·P·b        dp
               (b = bytes of the reduce dtype: 4, or 2 with ``reduce_dtype="bf16"``)
param          ZeRO-1/2: all-gather after the step; ZeRO-3: per micro-step gathers     dp
               (:func:`~.zero.zero_step_bytes_formula`, P = padded Ψ_tp)
sp_grad        SP only: the norm weights' partial gradients summed over tp — zero 0:   tp
               all of them, (2L+1)·d fp32; ZeRO: only this rank's dp slice of them
norm           the tp-sharded part of Σ g², one fp64 scalar                            tp
grad_norm      ZeRO: Σ g² of the slice (sharded part already summed over tp), fp64     dp
loss           token count and loss sum, one fp64 scalar each                          dp
=============  =====================================================================  ==========

Pitfalls (each guarded and tested in ``tests/test_compose_2d.py``)
-------------------------------------------------------------------
* **norm counting**: a tp-replicated gradient element (norm weights) lives on all tp ranks;
  summing Σ g² over dp *and* tp would count it tp times. Sharded elements are summed over tp,
  replicated ones are not (:meth:`.zero.ZeroDataParallel.clip_grad_norm_`; zero 0 uses
  :meth:`.tp.TensorParallel.clip_grad_norm_` on the dp-summed, dp-replicated gradients).
* **SP partial gradients**: with sequence parallelism a norm weight's gradient on one tp rank
  covers only its s/tp positions; it must be summed over tp *as well as* over dp. The sums
  commute, so it is done after the dp reduction, on what the rank holds (ZeRO: its slice only).
* **RNG**: dropout masks must agree across tp where activations are replicated and differ across
  dp replicas (different data): :class:`~.tp.TPRNG` seeds by (dp index, tp index).
* **init**: TP broadcasts the plain weights over tp before cutting shards, then DP/ZeRO broadcasts
  the shards over dp: every rank of a column starts from the same shard.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..comm.ledger import ring_bytes
from .data import DataParallel
from .engine import Engine
from .tp import TensorParallel, parallelize_tensor, tp_step_bytes_formula
from .zero import ZeroDataParallel, zero_memory_formula


class DataTensorParallel(Engine):
    """dp × tp: a :class:`~.tp.TensorParallel` model (``tp``) whose local shards are data
    parallel over dp through ``dp`` — a :class:`~.data.DataParallel` (zero 0) or a
    :class:`~.zero.ZeroDataParallel` (ZeRO-1/2/3) wrapping the same converted module.

    Built by :func:`parallelize_2d`. The module docstring has the math and every collective."""

    count_axes = ("dp",)
    reduce_loss_axes = ("dp",)

    def __init__(self, tp: TensorParallel, dp: Engine, topo, zero: int):
        super().__init__(tp.module)
        # the two engines share ``module``: keep them out of nn.Module's registry so that
        # state_dict()/parameters() see the model once
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "dp", dp)
        self.topo, self.zero, self.sp = topo, zero, tp.sp

    # -- one step -------------------------------------------------------------------------------
    def sync_gradients(self, enabled: bool):
        return self.dp.sync_gradients(enabled)

    def begin_forward_backward(self) -> None:
        self.dp.begin_forward_backward()

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The vocab-parallel loss sum of this dp row's micro-batch [b, s] (local logits
        [b, s, V_pad/tp]), the same on every tp rank of the row."""
        return self.tp.loss_sum(batch)

    def finish_gradient_sync(self) -> None:
        """Wait for the dp reduction (all-reduce / reduce-scatter), then, with SP, SUM the norm
        weights' partial gradients over tp (tag ``"sp_grad"``) on what this rank holds."""
        self.dp.finish_gradient_sync()
        if not self.sp:
            return
        if self.zero:
            self.dp.reduce_replicated_grads("tp", tag="sp_grad")
        else:
            self.tp.reduce_replicated_grads(tag="sp_grad")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm, each element of the whole model counted once: zero 0 — the gradients
        are dp-replicated after the all-reduce, so TP's norm (sharded² over tp + replicated²);
        ZeRO — ZeroDataParallel's tp-aware norm of the slices (over tp, then dp)."""
        return (self.dp if self.zero else self.tp).clip_grad_norm_(max_norm)

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over the local TP shards (zero 0) or ZeRO's sharded AdamW over their dp slices."""
        return self.dp.make_optimizer(param_groups, **adamw)

    # -- evaluation, sampling -------------------------------------------------------------------
    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation (under ``no_grad``, so ZeRO-3 frees what it gathers): the vocab-parallel
        loss sum of ``batch`` and its counted tokens, the same on every tp rank of the row."""
        return self.tp.loss_sum_and_count(batch)

    @contextlib.contextmanager
    def full_model(self):
        """Full weights (ZeRO-3: gathered over dp for the whole block) and full logits (gathered
        over tp). Every rank of the layout enters it together."""
        with self.dp.full_model(), self.tp.gathered_logits() as model:
            yield model

    # -- full-shape views (parity checks, checkpoints): dp part by the dp engine ------------
    def dp_parameters(self) -> dict[str, torch.Tensor]:
        return self.dp.dp_parameters()

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        return self.dp.dp_gradients()

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        return self.dp.dp_optimizer_state(optimizer)

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        self.dp.dp_load_optimizer_state(optimizer, local)

    # -- accounting -----------------------------------------------------------------------------
    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        return self.dp.model_state_bytes(optimizer)

    @property
    def local_numel(self) -> int:
        """Ψ_tp: parameters of this rank's TP shard (a tied weight once, vocabulary padding
        included: it is stored, reduced and optimized like any element)."""
        return sum(p.numel() for p in self.module.parameters())

    def memory_formula(self) -> dict[str, float]:
        """Model-state bytes per rank, fp32 AdamW: the ZeRO paper's 4Ψ + 4Ψ + 8Ψ with stage
        ``zero`` dividing optimizer / gradients / parameters by n = dp (§5.1–5.3), for
        Ψ = Ψ_tp, this rank's TP shard (:func:`~.zero.zero_memory_formula`)."""
        return zero_memory_formula(self.zero, self.local_numel, self.topo.size("dp"))

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{tag: bytes} this rank sends in one step (see the module docstring's table), plus
        ``"loss"`` and ``"total"``. ``sequences``: sequences this rank processes per step (its dp
        slice of the global batch, all micro-batches); ``seq_len`` tokens each; ``dtype``:
        autocast ("bf16" narrows the row-parallel outputs, see tp_step_bytes_formula)."""
        tp_n, dp_n = self.topo.size("tp"), self.topo.size("dp")
        t = tp_step_bytes_formula(self.module.config, sequences, seq_len, tp_n, self.sp,
                                  dp=dp_n, dtype=dtype)
        out = {k: t[k] for k in ("tp_fwd", "tp_bwd", "ce", "grad_norm", "loss")}
        if not self.zero:
            out.update(self.dp.bytes_formula())  # "grad": 2(n−1)/n · Ψ_tp · b
            out["sp_grad"] = t["sp_grad"]  # (2L+1)·d fp32 over tp (0 without SP)
        else:
            z = self.dp.step_bytes_formula(micro_steps)
            out.update({k: z[k] for k in ("grad", "param")})
            out["grad_norm"] += z["grad_norm"]  # over tp (t's) and over dp
            out["sp_grad"] = (ring_bytes("all_reduce", 4 * self.dp.replicated_slice_numel(), tp_n)
                              if self.sp else 0.0)
        out["total"] = sum(out.values())
        return out


def parallelize_2d(model: nn.Module, topo, layout, *, seed: int = 0, bucket_mb: float = 25.0,
                   overlap: bool = True, prefetch: bool = True, reshard_after_forward: bool = True,
                   reduce_dtype: str = "fp32") -> DataTensorParallel:
    """Convert the plain Llama ``model`` for ``layout`` (dp ≥ 2, tp ≥ 2, zero ∈ {0..3}, sp) on
    ``topo`` (mesh (pp=1, dp, tp)) and return its :class:`DataTensorParallel` engine.

    Order: (1) checks — :class:`ShardwiseConfigError` before any collective for a layout or
    topology that does not match, a non-Llama model, a tp that does not divide the heads, a bad
    zero stage or reduce dtype; (2) TP: :func:`~.tp.parallelize_tensor` (broadcast over tp,
    cut shards, ``seed`` seeds :class:`~.tp.TPRNG`); (3) over dp: DataParallel
    (``bucket_mb``, ``overlap``) or ZeroDataParallel (``prefetch``, ``reshard_after_forward``,
    ``overlap``), both reducing gradients in ``reduce_dtype``."""
    layout.check(model=model, topo=topo, reduce_dtype=reduce_dtype, composition="dp×tp")
    tp = parallelize_tensor(model, topo, sp=layout.sp, seed=seed)
    if layout.zero:
        dp = ZeroDataParallel(tp.module, topo, layout.zero, prefetch=prefetch,
                              reshard_after_forward=reshard_after_forward, overlap=overlap,
                              reduce_dtype=reduce_dtype)
    else:
        dp = DataParallel(tp.module, topo, bucket_mb=bucket_mb, overlap=overlap,
                          reduce_dtype=reduce_dtype)
    return DataTensorParallel(tp, dp, topo, layout.zero)


__all__ = ["DataTensorParallel", "parallelize_2d"]
