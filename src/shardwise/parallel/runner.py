"""The runner protocol (:class:`Runner`) and pp = 1's runner, :class:`NoPipelining`.

A runner runs the step's forward and backward over this rank's module, the evaluation, and
says which axes the loss is summed over. With a pipeline it is the schedule's
(:class:`~.pp.runner.ScheduleRunner`, :class:`~.pp.torch_runner.TorchScheduleRunner`); without
one it is the micro-batch loop below, Megatron-Core's ``forward_backward_no_pipelining``. So
:class:`~.model.ParallelModel` asks its runner and never tests which one it has.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from ..precision import FP32, Precision
from .loss import autocast
from .params import local


class Runner(Protocol):
    """What :class:`~.model.ParallelModel` asks of a runner. A pipeline's runners also answer
    ``peak_alive``, ``schedule_name`` and ``v`` (the report and the trace read them through
    the engine; at pp = 1 they do not exist)."""

    loss_axes: tuple[str, ...]  # axes the loss sum is reduced over before the data axis
    timeline: list  # a pipeline's last step: (kind, mb, chunk, peer, t0, t1) per action

    def forward_backward(self, microbatches: list[dict], denom: float,
                         precision: Precision) -> torch.Tensor: ...

    def evaluate(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]: ...

    def full_model(self, composed): ...

    def sampling_model(self, composed): ...

    def step_bytes(self, composed, micro_steps: int, sequences: int, seq_len: int,
                   precision: Precision) -> dict[str, float]: ...

    def memory_formula(self, sync) -> dict[str, float] | None: ...


class NoPipelining:
    """pp = 1: the one micro-batch loop over ``module`` (the whole converted model) with
    ``loss_fn`` and the gradient ``sync`` (plain objects, :mod:`.loss`, :mod:`.sync`)."""

    loss_axes: tuple[str, ...] = ()  # every rank holds its loss

    def __init__(self, module, loss_fn, sync):
        self.module, self.loss_fn, self.sync = module, loss_fn, sync
        self.timeline: list = []  # no schedule: nothing recorded

    def _step_context(self, batch: dict):
        if self.sync.step_context is None:  # torch's context_parallel (DDP over dp × cp)
            return contextlib.nullcontext()
        return self.sync.step_context(batch["input_ids"].shape[1])

    def forward_backward(self, microbatches: list[dict], denom: float,
                         precision: Precision = FP32) -> torch.Tensor:
        """Forward + backward each micro-batch; the loss back-propagated is its token-loss sum
        (the loss function's ``loss_sum``) divided by ``denom`` (the global token count), so
        gradients sum to ∇ of the global mean. Gradient sync is enabled on the last micro-step
        only (nanoGPT's ``require_backward_grad_sync``). Inside: the loss function's sum,
        booking and backward context, the sync's micro-step switch. Returns the loss sum, fp64
        [1]."""
        device = next(self.module.parameters()).device
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        sync, loss_fn = self.sync, self.loss_fn
        sync.begin_forward_backward()
        with self._step_context(microbatches[0]), sync.booking(), \
                loss_fn.booking(**sync.booking_options()):
            for i, mb in enumerate(microbatches):
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                with sync.sync_gradients(i == len(microbatches) - 1):
                    with autocast(precision, device):
                        s = loss_fn.loss_sum(mb)
                    with loss_fn.backward_context():
                        (s / denom).backward()
                loss_sum += local(s.detach()).double()
        return loss_sum

    def evaluate(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss function's evaluation sum and count of ``batch``, then the sync's
        ``after_evaluation`` (FSDP2 reshards what stayed gathered)."""
        with self._step_context(batch):
            out = self.loss_fn.loss_sum_and_count(batch)
        self.sync.after_evaluation()
        return out

    def full_model(self, composed):
        """Full weights and full logits of ``composed`` for sampling
        (:meth:`.sync.Sync.full_model_for`)."""
        return self.sync.full_model_for(composed)

    def sampling_model(self, composed):
        """The model to sample from, full logits (:meth:`.sync.Sync.sampling_model_for`)."""
        return self.sync.sampling_model_for(composed)

    def step_bytes(self, composed, micro_steps: int, sequences: int, seq_len: int,
                   precision: Precision = FP32) -> dict[str, float]:
        """{tag: bytes} this rank sends in one step: tp's activation, cross-entropy and tp-norm
        terms (``composed.traffic``) for its dp slice of the batch, plus the sync's gradient
        and parameter traffic of Ψ_tp and its norm scalar; ``sp_grad`` is the sync's share of
        the SP sum (ZeRO: the slice)."""
        traffic, sync = composed.traffic, self.sync
        args = (micro_steps, sequences, seq_len, precision)
        out = dict(traffic.bytes_formula(*args)) if traffic is not None else {}
        d = dict(sync.bytes_formula(*args))
        if "grad_norm" in out or "grad_norm" in d:  # absent when no piece sends a norm term
            out["grad_norm"] = out.get("grad_norm", 0.0) + d.pop("grad_norm", 0.0)
        out.update(d)
        if composed.sp:  # tp's term when not (0 with tp; absent without)
            out["sp_grad"] = sync.sp_grad_bytes(out.get("sp_grad", 0.0))
        return out

    def memory_formula(self, sync) -> dict[str, float] | None:
        """The sync's formula over Ψ_tp, this rank's TP shard (ZeRO paper §5.1–5.3)."""
        return sync.memory_formula()
