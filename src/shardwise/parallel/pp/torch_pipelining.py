"""``--engine torch`` for pipelines: the same stage split, run by ``torch.distributed.pipelining``,
with TP inside each stage by DTensor and DP / ZeRO-1 over dp (as torchtitan composes PP × TP × DP).

Schedule mapping: gpipe → ``ScheduleGPipe``, 1f1b → ``Schedule1F1B``, interleaved-1f1b →
``ScheduleInterleaved1F1B`` (v stages per rank, stage s on rank s % p), zb-h1 →
``ScheduleInterleavedZeroBubble`` with one stage per rank (its placement of the W passes is
ZB-H1's: rank r delays them by r microbatches).

What moves: over tp, DTensor's collectives, booked by
:class:`~shardwise.comm.torch_booking.BookFunctionalCollectives` (``tp_fwd``/``tp_bwd``/``ce``);
over pp,
PyTorch's own ``batch_isend_irecv`` on the pp group, **not** in the ledger; after the schedule,
the explicit engine's tied swap, SP sum, dp reduction and norm on the local shards, with ZeRO-1
as ``ZeroRedundancyOptimizer`` (its parameter broadcasts are not in the ledger either).
Differences from the explicit engine: docs/pipeline-parallel.md §5.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch
import torch.nn.functional as F
from torch.distributed import pipelining as pl
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from ...comm.torch_booking import BookFunctionalCollectives, booked_as
from ...errors import ShardwiseConfigError
from ...models.llama import IGNORE_INDEX
from ..engine import autocast
from ..params import is_dtensor as _is_dtensor, local as _local, local_state_bytes
from ..tp.dtensor import (dtensor_tp_plan, prepare_replicated_for_dtensor, reduce_partial_grads,
                          row_bias_bytes)
from .runtime import PipelineParallel
from .split import first_stage_input, loss_sum

_SCHEDULES = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
              "interleaved-1f1b": pl.ScheduleInterleaved1F1B,
              "zb-h1": pl.ScheduleInterleavedZeroBubble}


class _LocalShardZeRO(ZeroRedundancyOptimizer):
    """Over DTensor parameters' local shards (``pairs``: (DTensor parameter, local tensor)):
    ``step`` first hands each shard its gradient's local tensor; ``zero_grad`` clears both."""

    pairs: list = []

    def step(self, closure=None, **kwargs):
        for p, t in self.pairs:
            t.grad = None if p.grad is None else _local(p.grad)
        return super().step(closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, t in self.pairs:
            p.grad = t.grad = None
        super().zero_grad(set_to_none)


class TorchPipelineParallel(PipelineParallel):
    """:class:`.runtime.PipelineParallel` whose :meth:`forward_backward` is PyTorch's schedule.

    Same constructor arguments and the same interface; ``timeline`` holds one event per step
    ("STEP") rather than per action (PyTorch does not expose its action timestamps)."""

    _engine_name = "torch"

    def __init__(self, model, topo, **kw):
        super().__init__(model, topo, **kw)
        self._torch_schedules = {}
        self._denom, self._loss, self._dtype = 1.0, None, "fp32"

    def _convert_tp(self, stage, seed):
        """DTensor TP: ``dtensor_tp_plan`` restricted to the stage's modules, the head returning
        plain local logits [b, s, V/tp] (a stage's outputs are plain tensors); between stages
        the plain local [b, s, d], with SP [b, s/tp, d]. None: dropout uses the default RNG."""
        cfg = stage.config
        # the whole model's plan (it only counts the layers), restricted to this stage's modules
        plan = dtensor_tp_plan(types.SimpleNamespace(layers=[None] * cfg.n_layers), self.sp)
        prepare_replicated_for_dtensor(stage, self.topo, self.sp)
        mine = dict(stage.named_modules())
        plan = {k: v for k, v in plan.items() if k in mine}
        if "output" in plan:  # plain local logits [b, s, V/tp] out of the pipeline stage
            act = Shard(1) if self.sp else None
            plan["output"] = ColwiseParallel(**({"input_layouts": act} if act else {}),
                                             output_layouts=Shard(-1), use_local_output=True)
        parallelize_module(stage, self.topo.mesh["tp"], plan)
        for c in stage.chunks:
            c.sp_degree = self.tp if self.sp else 1
        return None

    def _build_zero1(self):
        """None: ZeRO-1 is an optimizer here; the gradients are all-reduced over dp as without."""
        return None

    def sum_replicated_grads(self) -> None:
        """SP: DTensor leaves the norm weights' gradients ``Partial(sum)``; reduce them in one
        flat all-reduce over tp (:func:`..tp.dtensor.reduce_partial_grads`, tag ``sp_grad``)."""
        reduce_partial_grads(self._params(), self.topo)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """First give every DTensor gradient its parameter's placements: DTensor leaves the
        vocab-parallel embedding's gradient ``Replicate`` (full [V, d] on every tp rank) though
        the weight is ``Shard(0)``; Replicate → Shard is a local slice, no collective. Then the
        explicit engine's tied swap, SP sum, dp reduction on the local shards."""
        for p in self._params():
            g = p.grad
            if _is_dtensor(g) and _is_dtensor(p) and tuple(g.placements) != tuple(p.placements) \
                    and not any(place.is_partial() for place in g.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)
        super().finish_gradient_sync()

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of this rank's local shards (:func:`..params.local_state_bytes`; ZeRO-1: the
        state of ``ZeroRedundancyOptimizer``'s local optimizer)."""
        return local_state_bytes(self._params(), getattr(optimizer, "optim", optimizer))

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over this stage's parameters; ZeRO-1: ``ZeroRedundancyOptimizer`` over dp (each
        rank steps the whole parameters it owns, then broadcasts them, unbooked)."""
        if self.zero != 1:
            return super().make_optimizer(param_groups, **adamw)
        param_groups = self._tied_without_decay(param_groups)
        # DTensor (tp-sharded) parameters: ZeroRedundancyOptimizer partitions and broadcasts
        # plain tensors, so it gets their local shards — the dp peers of one tp index hold
        # shards of the same shapes, and its in-place broadcast updates the DTensors' storage
        pairs = [(p, _local(p)) for g in param_groups for p in g["params"]]
        local_of = {id(p): t for p, t in pairs}
        param_groups = [dict(g, params=[local_of[id(p)] for p in g["params"]])
                        for g in param_groups]
        first, *rest = param_groups
        opt = _LocalShardZeRO(first["params"], optimizer_class=torch.optim.AdamW,
                              process_group=self.topo.group("dp"),
                              **{k: v for k, v in first.items() if k != "params"}, **adamw)
        for g in rest:
            opt.add_param_group(dict(g, **{k: v for k, v in adamw.items() if k not in g}))
        opt.pairs = [(p, t) for p, t in pairs if t is not p]
        return opt

    def full_optimizer_state(self, optimizer):
        """Full-shape AdamW state (DTensor states gathered over tp). Not for ZeRO-1
        (ZeroRedundancyOptimizer keeps state only on the owning rank): ShardwiseConfigError."""
        if self.zero == 1:
            raise ShardwiseConfigError("--engine torch --zero 1 with --pp: the optimizer state "
                                       "lives in ZeroRedundancyOptimizer's partitions; use "
                                       "--engine explicit for layout-free optimizer checkpoints")
        return super().full_optimizer_state(optimizer)

    def load_full_optimizer_state(self, optimizer, state):
        if self.zero == 1:
            raise ShardwiseConfigError("--engine torch --zero 1 with --pp: use --engine explicit "
                                       "for layout-free optimizer checkpoints")
        return super().load_full_optimizer_state(optimizer, state)

    def _loss_sum(self, y: torch.Tensor, mb: dict) -> torch.Tensor:
        """tp > 1: local logits [b, s, V/tp] as a vocab-sharded DTensor through
        ``F.cross_entropy`` (inside ``loss_parallel()``); the replicated fp32 sum."""
        if self.tp == 1:
            return loss_sum(y, mb)
        shape = (*y.shape[:-1], self.module.config.vocab_size)
        stride = torch.empty(shape, device="meta").stride()
        logits = DTensor.from_local(y, self.topo.mesh["tp"], [Shard(-1)], run_check=False,
                                    shape=shape, stride=stride)
        with booked_as("ce"):
            s = F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return s.to_local()

    def _loss_parallel(self):
        return loss_parallel() if self.tp > 1 else contextlib.nullcontext()

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`.runtime.PipelineParallel.loss_sum_and_count` inside ``loss_parallel()``."""
        with self._loss_parallel():
            return super().loss_sum_and_count(batch)

    def _stages(self, mb: dict, dtype: str):
        """One ``PipelineStage`` per local chunk, with *static* metadata (meta tensors of this
        microbatch's shapes): else PyTorch runs a real forward and backward of the first
        microbatch to infer them, adding its loss and gradients to the step's."""
        device = next(self.module.parameters()).device
        hidden = self._act_shape(mb)
        x = first_stage_input(mb)
        stages = []
        for c in self.chunks:
            if c.is_first:
                example_in = torch.empty(x.shape, dtype=x.dtype, device="meta")
            else:
                example_in = torch.empty(hidden, dtype=torch.float32, device="meta",
                                         requires_grad=True)
            if c.is_last and self.module.is_llama:  # logits, in the autocast dtype
                out_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                vocab = _local(self.module.output.weight).shape[0]  # local columns (tp)
                example_out = torch.empty((*x.shape, vocab),
                                          dtype=out_dtype, device="meta", requires_grad=True)
            else:
                example_out = torch.empty(hidden, dtype=torch.float32, device="meta",
                                          requires_grad=True)
            stages.append(pl.PipelineStage(c, c.index, self.p * self.v, device,
                                           input_args=(example_in,), output_args=(example_out,),
                                           group=self.topo.p2p_group("pp", "batch")))
        return stages

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        key = "labels" if self.module.is_llama else "targets"
        with autocast(self._dtype, output.device):
            s = self._loss_sum(output, {key: target})
        self._loss += s.detach().double()
        return s / self._denom

    def _torch_schedule(self, microbatches: list[dict], dtype: str):
        m, mb = len(microbatches), microbatches[0]
        key = (m, tuple(first_stage_input(mb).shape), dtype)
        if key not in self._torch_schedules:
            self.schedule(m)  # validates (same rules as the explicit engine)
            cls = _SCHEDULES[self.schedule_name]
            stages = self._stages(mb, dtype)
            if self.schedule_name in ("gpipe", "1f1b"):
                stages = stages[0]
            self._torch_schedules[key] = cls(stages, m, loss_fn=self._loss_fn, scale_grads=False)
        return self._torch_schedules[key]

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """PyTorch's schedule over the concatenated microbatches (equal sizes required: PyTorch
        splits them back with ``tensor_split`` on dim 0). ``loss_fn`` returns each microbatch's
        token-loss sum divided by ``denom`` (the global count), with ``scale_grads=False``, so the
        gradients are ∇ of the global mean, as in the explicit engine. Returns the loss sum,
        fp64 [1] (0 except on the last rank). Raises ``ValueError`` for unequal microbatches."""
        sizes = {tuple(first_stage_input(mb).shape) for mb in microbatches}
        if len(sizes) != 1:
            raise ValueError(f"--engine torch needs equal-size microbatches, got {sizes}")
        sched = self._torch_schedule(microbatches, dtype)
        device = next(self.module.parameters()).device
        self._denom, self._dtype = denom, dtype
        self._loss = torch.zeros(1, dtype=torch.float64, device=device)
        args, kw = (), {}
        if self.is_first:
            args = (torch.cat([first_stage_input(mb) for mb in microbatches]).to(device),)
        if self.is_last:
            key = "labels" if self.module.is_llama else "targets"
            kw["target"] = torch.cat([mb[key] for mb in microbatches]).to(device)
        t0 = time.time()
        book = BookFunctionalCollectives(self.topo) if self.tp > 1 else contextlib.nullcontext()
        # loss_parallel() around the whole step: the loss's backward runs inside it too
        with book, self._loss_parallel(), autocast(dtype, device):
            sched.step(*args, return_outputs=False, **kw)
        self.timeline = [("STEP", 0, 0, -1, t0, time.time())]
        return self._loss

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                      dtype: str = "fp32") -> dict[str, float]:
        """As :meth:`.runtime.PipelineParallel.bytes_formula`, with ``pp_fwd``/``pp_bwd`` = 0:
        PyTorch's own point-to-point traffic does not go through the ledger; ZeRO-1: the
        gradient all-reduce (2(n−1)/n·Ψ_s) and no ``param`` (ZeroRedundancyOptimizer's
        broadcasts are not booked); with SP, less the sum of the row-parallel biases, which
        DTensor completes without one (:func:`..tp.dtensor.row_bias_bytes`)."""
        out = super().bytes_formula(micro_steps, sequences, seq_len, dtype)
        out["pp_fwd"] = out["pp_bwd"] = 0.0
        if self.sp and self.tp > 1:
            out["sp_grad"] -= row_bias_bytes(self.module, self.tp)
        return out
