"""``--engine torch`` for pipelines: the same stage split, run by ``torch.distributed.pipelining``
(as torchtitan composes PP × TP × DP): :class:`TorchScheduleRunner`.

Schedule mapping: gpipe → ``ScheduleGPipe``, 1f1b → ``Schedule1F1B``, interleaved-1f1b →
``ScheduleInterleaved1F1B`` (v stages per rank, stage s on rank s % p), zb-h1 →
``ScheduleInterleavedZeroBubble`` with one stage per rank (its placement of the W passes is
ZB-H1's: rank r delays them by r microbatches), zbv → ``ScheduleZBVZeroBubble`` and dualpipev →
``ScheduleDualPipeV``, each with the two ``PipelineStage`` s r and 2p−1−r of the V placement
(their compute orders are :mod:`.schedules`' own: tests/test_pipeline_schedules.py).

What moves: over tp, DTensor's collectives (TP inside each stage by DTensor,
:func:`~shardwise.parallel.tp.dtensor.parallelize_stage_dtensor`), booked by
:class:`~shardwise.comm.torch_booking.BookFunctionalCollectives` (``tp_fwd``/``tp_bwd``/``ce``);
over pp, PyTorch's own ``batch_isend_irecv`` on its own communicator of the pp ranks
(``topo.p2p_group("pp", "batch")``), **not** in the ledger; after the schedule, the same
finishers and dp gradient sync as the explicit runner's (ZeRO-1 as ``ZeroRedundancyOptimizer``,
whose parameter broadcasts are not in the ledger either). Differences from the explicit runner:
docs/pipeline-parallel.md §5.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.distributed import pipelining as pl

from ...comm.torch_booking import BookFunctionalCollectives
from ...precision import FP32, Precision
from ..loss import autocast
from ..params import local
from .runner import ScheduleRunner
from .split import first_stage_input

_SCHEDULES = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
              "interleaved-1f1b": pl.ScheduleInterleaved1F1B,
              "zb-h1": pl.ScheduleInterleavedZeroBubble,
              "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}


class TorchScheduleRunner(ScheduleRunner):
    """:class:`.runner.ScheduleRunner` whose :meth:`forward_backward` is PyTorch's schedule.

    Same arguments, plus ``loss_context``: None, or a context the step (its backward too) and
    the evaluation run in (DTensor TP: ``loss_parallel()``); ``book``: book DTensor's
    collectives in the ledger (tp > 1); ``c10d_tag``: book c10d all-reduces inside the step
    under this tag (HSDP: FSDP2's all-reduce of the shards over dp_replicate). ``timeline`` holds one event per step ("STEP") rather
    than per action (PyTorch does not expose its action timestamps)."""

    def __init__(self, stage, topo, *, schedule: str, v: int, loss_sum, seq_shards: int = 1,
                 loss_context=None, book: bool = False, c10d_tag: str | None = None):
        super().__init__(stage, topo, schedule=schedule, v=v, loss_sum=loss_sum,
                         seq_shards=seq_shards)
        self.loss_context, self.book, self.c10d_tag = loss_context, book, c10d_tag
        self._torch_schedules = {}
        self._denom, self._loss, self._precision = 1.0, None, FP32

    def _context(self):
        return self.loss_context() if self.loss_context else contextlib.nullcontext()

    def evaluate(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`.runner.ScheduleRunner.evaluate` inside ``loss_context``; FSDP2 chunks are
        resharded after it (it keeps the units it does not reshard after forward gathered,
        and the next step would skip their all-gathers)."""
        from torch.distributed.fsdp import FSDPModule

        with self._context():
            out = super().evaluate(batch)
        for c in self.chunks:
            for m in c.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        return out

    def _stages(self, mb: dict, precision: Precision):
        """One ``PipelineStage`` per local chunk, with *static* metadata (meta tensors of this
        microbatch's shapes): else PyTorch runs a real forward and backward of the first
        microbatch to infer them, adding its loss and gradients to the step's."""
        device = next(self.module.parameters()).device
        hidden = self.act_shape(mb)
        x = first_stage_input(mb)
        # the residual stream crosses in bf16 under bf16 parameters (a bf16 model, or FSDP2's
        # bf16 gather of an fp32 one): a Llama's embedding output is bf16 and stays so
        act = (torch.bfloat16 if precision.param_dtype == "bf16" and self.module.is_llama
               else torch.float32)
        stages = []
        for c in self.chunks:
            if c.is_first:
                example_in = torch.empty(x.shape, dtype=x.dtype, device="meta")
            else:
                example_in = torch.empty(hidden, dtype=act, device="meta", requires_grad=True)
            if c.is_last and self.module.is_llama:  # logits, in the autocast dtype
                out_dtype = torch.bfloat16 if precision.compute == "bf16" else torch.float32
                vocab = local(self.module.output.weight).shape[0]  # local columns (tp)
                example_out = torch.empty((*x.shape, vocab),
                                          dtype=out_dtype, device="meta", requires_grad=True)
            else:
                example_out = torch.empty(hidden, dtype=act, device="meta", requires_grad=True)
            stages.append(pl.PipelineStage(c, c.index, self.p * self.v, device,
                                           input_args=(example_in,), output_args=(example_out,),
                                           group=self.topo.p2p_group("pp", "batch")))
        return stages

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        key = "labels" if self.module.is_llama else "targets"
        with autocast(self._precision, output.device):
            s = self.loss_sum(output, {key: target})
        self._loss += s.detach().double()
        return s / self._denom

    def _torch_schedule(self, microbatches: list[dict], precision: Precision):
        m, mb = len(microbatches), microbatches[0]
        key = (m, tuple(first_stage_input(mb).shape), precision.compute)
        if key not in self._torch_schedules:
            self.schedule(m)  # validates (same rules as the explicit runner)
            cls = _SCHEDULES[self.schedule_name]
            stages = self._stages(mb, precision)
            if self.schedule_name in ("gpipe", "1f1b"):
                stages = stages[0]
            self._torch_schedules[key] = cls(stages, m, loss_fn=self._loss_fn, scale_grads=False)
        return self._torch_schedules[key]

    def forward_backward(self, microbatches: list[dict], denom: float,
                         precision: Precision = FP32) -> torch.Tensor:
        """PyTorch's schedule over the concatenated microbatches (equal sizes required: PyTorch
        splits them back with ``tensor_split`` on dim 0). ``loss_fn`` returns each microbatch's
        token-loss sum divided by ``denom`` (the global count), with ``scale_grads=False``, so the
        gradients are ∇ of the global mean, as in the explicit runner. Returns the loss sum,
        fp64 [1] (0 except on the last rank). Raises ``ValueError`` for unequal microbatches."""
        sizes = {tuple(first_stage_input(mb).shape) for mb in microbatches}
        if len(sizes) != 1:
            raise ValueError(f"--engine torch needs equal-size microbatches, got {sizes}")
        sched = self._torch_schedule(microbatches, precision)
        device = next(self.module.parameters()).device
        self._denom, self._precision = denom, precision
        self._loss = torch.zeros(1, dtype=torch.float64, device=device)
        args, kw = (), {}
        if self.is_first:
            args = (torch.cat([first_stage_input(mb) for mb in microbatches]).to(device),)
        if self.is_last:
            key = "labels" if self.module.is_llama else "targets"
            kw["target"] = torch.cat([mb[key] for mb in microbatches]).to(device)
        t0 = time.time()
        book = (BookFunctionalCollectives(self.topo, c10d_tag=self.c10d_tag)
                if self.book or self.c10d_tag else contextlib.nullcontext())
        # loss_parallel() around the whole step: the loss's backward runs inside it too
        with book, self._context(), autocast(precision, device):
            sched.step(*args, return_outputs=False, **kw)
        self.timeline = [("STEP", 0, 0, -1, t0, time.time())]
        return self._loss

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                      precision: Precision = FP32) -> dict[str, float]:
        """``pp_fwd``/``pp_bwd`` = 0: PyTorch's own point-to-point traffic does not go
        through the ledger."""
        return {"pp_fwd": 0.0, "pp_bwd": 0.0}
