"""The loss-function protocol every layout's loss follows, its defaults :class:`PlainLoss`, and
:func:`autocast`, the compute-dtype context the runners enter.

A loss function is a plain object over the module it runs (a converted model or a pipeline
stage): ``loss_sum(batch)`` (the training loss sum, aux losses included), ``loss_sum_and_count``
(the evaluation's), ``loss(out, mb)`` (a pipeline's last-stage output), ``booking``,
``backward_context`` and ``gathered_logits`` (for sampling). TP's loss functions
(:class:`~.tp.VocabParallelLoss`, :class:`~.tp.LossParallel`, :class:`~.tp.mlp.MLPLoss`)
override what differs. Strategies import this module, never :mod:`.model` (the engine).
"""

from __future__ import annotations

import contextlib

import torch

from ..models import lm_loss, loss_sum_and_count, mse_loss
from ..models.dpo import dpo_loss_sum_and_count, is_dpo


def autocast(precision, device: torch.device):
    """The compute-dtype context of ``precision`` (a :class:`~.precision.Precision`, or its
    compute-dtype name "fp32" | "bf16"): bf16 mixed precision runs matmuls in bf16 while master
    weights, gradients and optimizer state stay fp32; fp32 is no context."""
    compute = getattr(precision, "compute", precision)
    if compute == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class PlainLoss:
    """The loss function of a model whose logits are whole on this rank, and the defaults of
    every loss function's members (:class:`~.tp.VocabParallelLoss`, :class:`~.tp.LossParallel`,
    the MLP's :class:`~.tp.mlp.MLPLoss` override what differs). ``loss_sum``:
    :func:`shardwise.models.loss_sum_and_count` (language model, DPO or regression) of
    ``module`` with a mixture of experts' aux losses; ``loss_sum_and_count``: the evaluation's,
    without them; ``loss(out, mb)``: the sum of a pipeline's last-stage output ``out`` for
    micro-batch ``mb`` (the runners call it)."""

    def __init__(self, module):
        self.module = module

    def loss_sum(self, batch: dict) -> torch.Tensor:
        return loss_sum_and_count(self.module, batch)[0]

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum_and_count(self.module, batch, aux=False)

    def loss(self, out: torch.Tensor, mb: dict) -> torch.Tensor:
        """Sum of per-token (per-element) losses of ``out``, fp32 scalar: DPO pairs, the
        language model's tokens or the regression's elements."""
        if is_dpo(mb):  # preference pairs: the DPO objective (models/dpo.py)
            return dpo_loss_sum_and_count(out, mb)[0]
        if "labels" in mb:
            return lm_loss(out, mb["labels"])[0]
        return mse_loss(out, mb["targets"])[0]

    def booking(self, **options):
        """Context around the step: nothing to book (every collective goes through
        :mod:`shardwise.comm`)."""
        return contextlib.nullcontext()

    def backward_context(self):
        """Context each backward runs in: none."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered_logits(self):
        """The model with full logits, for sampling: the module itself."""
        yield self.module
