"""One optimizer step, shared by training, ``verify``, ``trace`` and the single-process reference.

The sync points, in order, and why:

0. the collective check (``--check-collectives``, :mod:`shardwise.comm.fingerprint`): through
   the c10d store, not a collective, every rank compares what it issued since the last step, so
   a collective issued on some ranks only is named here instead of hanging the next step.
1. all_reduce of the step's counted-token total T over dp (before any forward): every rank
   divides its token-loss sum by the *global* T, so summed gradients are exactly ∇ of the
   token-weighted global mean (see :mod:`shardwise.parallel.dp`). With context parallelism each
   micro-batch is first cut to this rank's sequence chunks (:func:`~shardwise.parallel.cp.
   shard_sequence`), so T is summed over dp × cp (the engine's ``count_axes``).
2. micro-steps: forward + backward; gradient sync is suppressed on all but the last one, where
   bucket all-reduces launch from the backward hooks (overlapping compute).
3. finish_gradient_sync: wait for the buckets before touching gradients.
4. global grad-norm clip, optimizer step.
5. all_reduce of the loss sum for logging (after the step; nothing waits on it but the log).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import comm
from ..comm import fingerprint
from ..models import count_items
from ..models.moe import reset_moe_stats
from ..parallel.cp import shard_sequence


@dataclasses.dataclass
class StepResult:
    loss: float  # token-weighted global mean loss of the step
    grad_norm: float  # global gradient L2 norm before clipping
    tokens: int  # counted tokens (items) in the global batch
    state_bytes: dict | None = None  # model-state bytes this rank holds after the optimizer
    #                                  step, gradients still allocated (params/grads/optimizer)


def train_step(engine: nn.Module, microbatches: list[dict], optimizer, topo=None, *,
               max_norm: float = 0.0, scheduler=None, dtype: str = "fp32",
               zero_grad: bool = True, measure_memory: bool = False,
               step: int | None = None) -> StepResult:
    """Run one optimizer step over this rank's ``microbatches`` (dicts of tensors, see
    :mod:`shardwise.models`). ``topo=None`` = single process. Returns the global loss/norm.

    With ``zero_grad=False`` the gradients are left in ``.grad`` after the step (for tests
    that compare them); they are cleared at the start of the next step instead.
    ``measure_memory``: also count the model-state bytes this rank holds at the step's peak
    (after the optimizer step, before gradients are freed), in ``StepResult.state_bytes``.
    ``step``: this step's number, for messages (default: one more than the last).

    Before anything else the ranks compare the collectives they issued since the last step
    (``--check-collectives``, :func:`shardwise.comm.fingerprint.check`): raises
    :class:`~shardwise.errors.CollectiveMismatch` on every rank if they differ.
    """
    if topo is not None:
        fingerprint.check(topo, step)  # sync point 0: the store, not a collective
        topo.ledger.begin_step()
    optimizer.zero_grad(set_to_none=True)
    reset_moe_stats(engine)  # a mixture of experts: this step's routing statistics
    device = next(engine.parameters()).device  # scalars live there too (NCCL needs it)
    microbatches = [shard_sequence(mb, topo) for mb in microbatches]  # cp: this rank's chunks
    local = float(sum(count_items(mb) for mb in microbatches))
    total = torch.tensor([local], dtype=torch.float64, device=device)
    if topo is not None:  # sync point 1: the global token count
        for axis in engine.count_axes:
            comm.all_reduce(total, topo, axis, tag="loss")
    denom = float(total.item())
    loss_sum = engine.forward_backward(microbatches, denom, dtype)  # sync point 2
    engine.finish_gradient_sync()  # sync point 3
    norm = engine.clip_grad_norm_(max_norm)  # sync point 4
    optimizer.step()
    state_bytes = engine.model_state_bytes(optimizer) if measure_memory else None
    if scheduler is not None:
        scheduler.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    if topo is not None:  # sync point 5: loss for the log line, identical on every rank
        for axis in engine.reduce_loss_axes:
            comm.all_reduce(loss_sum, topo, axis, tag="loss")
    return StepResult(loss=float(loss_sum) / denom, grad_norm=float(norm), tokens=int(denom),
                      state_bytes=state_bytes)
