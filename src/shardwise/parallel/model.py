"""The engine of every layout, :class:`ParallelModel` (:class:`Local`: one process, the
reference).

A :class:`ParallelModel` is put together by :func:`~.apply.parallelize` (the only composition
site) from plain pieces over one converted module, each answering the members it owns:

=================================  ==========================================================
``loss_fn``                        the loss sum, its booking and backward context, the
                                   gathered logits for sampling (:class:`~.loss.PlainLoss`,
                                   :class:`~.tp.VocabParallelLoss`, :class:`~.tp.LossParallel`,
                                   the MLP's :class:`~.tp.mlp.MLPLoss`)
``grad_sync``                      micro-step sync, the reduction, the optimizer, the norm's
                                   held gradients, full-shape dp views, the module the loss
                                   runs forward (:class:`~.dp.DataParallel`, DDP, :mod:`.zero`,
                                   FSDP2, or :class:`~.sync.NoSync` when dp × cp = 1): a
                                   plain :class:`~.sync.Sync`
``finishers``                      run in order after the sync: the SP sum over tp of what the
                                   sync leaves on this rank (:class:`~.tp.SPSum`, or DTensor's
                                   :class:`~.tp.TorchSPSum`)
``traffic``                        tp's byte terms (:class:`~.tp.TPTraffic`; None without
                                   tp), added to the sync's (``grad_norm`` summed)
``runner``                         the step's forward/backward and the evaluation: the
                                   micro-batch loop (:class:`~.runner.NoPipelining`, pp = 1)
                                   or a pipeline's schedule on this rank's stage
                                   (:class:`~.pp.runner.ScheduleRunner`,
                                   :class:`~.pp.torch_runner.TorchScheduleRunner`)
=================================  ==========================================================

The finishers run in the order given, the sync's own finish among them
(:func:`~.apply.parallelize` keeps each layout's order: pp = 1 the sync then the SP sum; a
pipeline the tied swap, the SP sum on whole gradients, then the sync).

Why TP goes innermost and which tags cross which axis: docs/composition.md (Megatron-LM §5.1,
scaling book ch. 5 "Mixing FSDP and model parallelism", ZeRO paper §7).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..precision import FP32, Precision
from .loss import PlainLoss
from .runner import NoPipelining
from .params import grad_norm_, grad_of
from .storage import fsdp2_state, load_masters_, store
from .sync import NoSync
from .views import full_named, full_state, local_state


class ParallelModel(nn.Module):
    """``module`` (converted for TP; with a pipeline runner, this rank's stage) on ``topo``
    with its ``loss_fn``, ``grad_sync``, ``finishers``, ``traffic`` and ``runner`` (module
    docstring; ``runner`` None: :class:`~.runner.NoPipelining` over ``module``); ``sp``:
    sequence parallelism (the ``sp_grad`` term at pp = 1). ``finishers``: run in order after
    the last backward, the sync's ``finish_gradient_sync`` among them (None: that one alone).
    Every tp rank of a dp row holds the complete loss sum of its row, so the token count and the
    loss are all-reduced over the data axis only.

    The training step (``train/step.py``), ``verify``, ``trace`` and checkpoints use only the
    members under the comments "the step", "evaluation, sampling", "full shape" and
    "accounting" (docs/architecture.md, "The engine interface", lists them with their rules).
    """

    def __init__(self, module, topo, *, loss_fn, grad_sync, finishers=None,
                 traffic=None, sp: bool = False, runner=None, precision: Precision = FP32,
                 offload: str = "none"):
        super().__init__()
        self.module = module
        # the sync holds ``module`` too: a tuple, which nn.Module does not register, so that
        # state_dict()/parameters() see the model once
        self.parts = (grad_sync,)
        self.topo, self.sp, self.loss_fn, self.precision = topo, sp, loss_fn, precision
        self.offload = offload  # "none" | "optimizer": where its optimizer keeps its state
        self.runner = runner or NoPipelining(module, loss_fn, grad_sync)
        self.finishers = [grad_sync.finish_gradient_sync] if finishers is None else list(finishers)
        self.traffic = traffic
        self._views_cache: dict = {}  # DTensor layouts' element positions (:func:`.views.to_full`)

    @property
    def grad_sync(self):
        """The gradient sync (a :class:`~.sync.Sync`)."""
        return self.parts[0]

    @property
    def count_axes(self) -> tuple[str, ...]:
        """Axes the step's token count is summed over: the data axis, "dp" or "dp_cp" (each cp
        rank counts the tokens of its own chunks)."""
        return (self.topo.data_axis if self.topo is not None else "dp",)

    @property
    def reduce_loss_axes(self) -> tuple[str, ...]:
        """The runner's loss axes ("pp" for a pipeline: only the last stage holds a loss), then
        the data axis."""
        return self.runner.loss_axes + self.count_axes

    # -- a pipeline's schedule: what the step, the report and the trace read -----------------
    @property
    def timeline(self) -> list[tuple]:
        """A pipeline's last step: (kind, mb, chunk, peer, t_start, t_end) per action ([] at
        pp = 1)."""
        return self.runner.timeline

    @property
    def peak_alive(self) -> int:
        return self.runner.peak_alive

    @property
    def schedule_name(self) -> str:
        return self.runner.schedule_name

    @property
    def v(self) -> int:
        """Pipeline chunks per rank."""
        return self.runner.v

    # -- the step: the runner's loop, the loss tp's, the gradient sync dp's ------------------
    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """The runner's forward and backward over ``microbatches`` (the micro-batch loop, or a
        pipeline's schedule) in the engine's :class:`~shardwise.precision.Precision` with
        ``dtype`` as its compute dtype (the step's ``--dtype``: "fp32" | "bf16"); the loss sum
        of this rank, fp64 [1]."""
        return self.runner.forward_backward(microbatches, denom, self._compute(dtype))

    def _compute(self, dtype: str) -> Precision:
        """The record with ``dtype`` as compute, except that bf16 storage computes in bf16."""
        return self.precision.with_compute(dtype if self.precision.param_dtype == "fp32"
                                           else self.precision.compute)

    def forward(self, *args, **kwargs):
        return self.grad_sync.forward_module(*args, **kwargs)

    def train(self, mode: bool = True):
        """Train / eval mode, also of the sync's forward module (DDP's wrapper is not a
        registered submodule: the model's parameters are seen once)."""
        super().train(mode)
        if self.grad_sync.forward_module is not self.module:
            self.grad_sync.forward_module.train(mode)
        return self

    def finish_gradient_sync(self) -> None:
        """The finishers in order, the sync's finish among them (module docstring; with SP:
        SUM over tp the norm weights' partial gradients on what this rank holds, ZeRO at pp = 1
        its slice only, tag ``sp_grad``)."""
        for finish in self.finishers:
            finish()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient L2 norm, every element of the model counted once, clipping to
        ``max_norm`` if > 0 (:func:`.params.grad_norm_` over the sync's held gradients, axes
        derived). Returns the norm before clipping, fp32 []."""
        return grad_norm_(self.held_grads(), self.topo, None, max_norm)

    def held_grads(self):
        """dp's pieces (ZeRO slices, FSDP2 shards, whole gradients); tp, which splits them, is
        among the derived norm axes (:meth:`.params.Held.norm_axes`)."""
        return self.grad_sync.held_grads()

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        return self.grad_sync.make_optimizer(param_groups, **adamw)

    # -- evaluation, sampling ---------------------------------------------------------------
    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation under ``no_grad`` (ZeRO-3 frees what it gathers; FSDP2 reshards after):
        tp's loss sum of ``batch`` and its counted tokens (a pipeline: the runner's forward
        through the stages, the loss summed over pp)."""
        return self.runner.evaluate(batch)

    def full_model(self):
        """Context: full weights and full logits for sampling (:meth:`.sync.Sync.full_model_for`);
        every rank of the layout enters it together. None for a pipeline (this rank holds only
        its stage: no sampling from a pipeline)."""
        return self.runner.full_model(self)

    def sampling_model(self):
        """Context: the model to sample from (full logits), every rank of the layout together:
        :meth:`full_model`'s, except that ZeRO-3 samples through its sharded forward, a unit
        gathered at a time (:meth:`.sync.Sync.sampling_model_for`). None for a pipeline."""
        return self.runner.sampling_model(self)

    # -- full-shape views and accounting: the dp part is the sync's --------------------------
    def named_params(self):
        return self.grad_sync.named_params()

    def dp_parameters(self) -> dict[str, torch.Tensor]:
        return self.grad_sync.dp_parameters()

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        return self.grad_sync.dp_gradients()

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        return self.grad_sync.dp_optimizer_state(optimizer)

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        self.grad_sync.dp_load_optimizer_state(optimizer, local)

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        return self.grad_sync.model_state_bytes(optimizer)

    @property
    def local_numel(self) -> int:
        """Ψ_tp: parameters of this rank's TP shard (a tied weight once, vocabulary padding
        included: it is stored, reduced and optimized like any element)."""
        return sum(p.numel() for p in self.module.parameters())

    def memory_formula(self) -> dict[str, float]:
        """dp's formula over Ψ_tp, this rank's TP shard (ZeRO paper §5.1–5.3); None for a
        pipeline stage (no closed form here)."""
        return self.runner.memory_formula(self.grad_sync)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{tag: bytes} this rank sends in one step, composed by the runner from the pieces
        (:meth:`.runner.NoPipelining.step_bytes`: tp's terms for its dp slice of the batch,
        ``sequences`` sequences of ``seq_len`` tokens over all micro-batches, plus the sync's;
        a pipeline: :meth:`.pp.runner.ScheduleRunner.step_bytes`)."""
        return self.runner.step_bytes(self, micro_steps, sequences, seq_len,
                                      self._compute(dtype))

    # -- full shape: the dp part (the sync), then the tp part (:mod:`.views`) -----------------
    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return full_named(local, dict(self.named_params()), self.topo, self._views_cache)

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN of the plain model: full-shape parameter} for the parameters this rank holds:
        :meth:`dp_parameters` (whole over dp), then :func:`.views.to_full` over tp. Collective
        wherever the parameters are sharded (every rank of those axes calls it)."""
        return self._full(self.dp_parameters())

    def named_full_gradients(self) -> dict[str, torch.Tensor]:
        """The same for gradients (after ``finish_gradient_sync``)."""
        return self._full(self.dp_gradients())

    def full_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN of the plain model: {state key: tensor}}: :meth:`dp_optimizer_state`, then
        :func:`.views.full_state` (tensors in full shape, as the parameters). Collective
        wherever :meth:`named_full_parameters` is."""
        return full_state(self.dp_optimizer_state(optimizer), dict(self.named_params()),
                          self.topo, self._views_cache)

    def held_boxes(self, optimizer=None) -> list:
        """Every box of a full-shape tensor this rank holds (:class:`.boxes.Box`: checkpoint
        key, the values as a view, the full shape, the offsets): the sync's pieces
        (:meth:`.sync.Sync.dp_pieces`: whole tensors, ZeRO's flat slices, DTensor shards) of
        the parameters and, given ``optimizer``, of its state, put in the full shape by each
        parameter's placement (:func:`.boxes.full_boxes`: tp chunk, ep experts, padding cut).
        No collective, no copy: what a shard-by-shard checkpoint writes. A box held by several
        ranks (replicas over dp, cp, tp or a tied copy) is listed on each of them."""
        from .boxes import full_boxes

        params = dict(self.named_params())
        return [b for piece in self.grad_sync.dp_pieces(optimizer)
                for b in full_boxes(piece, params[piece.fqn], self.topo)]

    def load_full_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Set ``optimizer``'s state from :meth:`full_optimizer_state`'s form (possibly saved
        under another layout): :func:`.views.local_state` (tp), then
        :meth:`dp_load_optimizer_state` (dp); a ``master`` saved beside the state (the explicit
        engine's :class:`~.master.MasterAdamW`) goes into the parameter where FSDP2's shards are
        the masters (:func:`.storage.load_masters_`). No collective; raises as ``local_state``."""
        local = local_state(state, self.named_params(), self.topo)
        if fsdp2_state(self):
            load_masters_(self.named_params(), local)
        self.dp_load_optimizer_state(optimizer, local)


class Local(ParallelModel):
    """The single-process reference: the plain ``module`` with :class:`~.loss.PlainLoss` and
    :class:`~.sync.NoSync`, no communication (no topology). Its norm is
    ``torch.nn.utils.clip_grad_norm_`` itself, independent of :func:`.params.grad_norm_`
    (its rule by hand on the fp32 main gradients of bf16 storage). ``precision``: the storage
    recipe (:mod:`.storage`: parameters cast, main gradients armed) and ``offload``, as
    :func:`~.apply.parallelize` gives a layout: the reference with the same storage."""

    def __init__(self, module: nn.Module, precision: Precision = FP32, offload: str = "none"):
        store(module, precision)
        super().__init__(module, None, loss_fn=PlainLoss(module), grad_sync=NoSync(module, None),
                         precision=precision, offload=offload)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.module.parameters() if grad_of(p) is not None]
        if any(hasattr(p, "main_grad") for p in params):
            grads = [grad_of(p) for p in params]
            norm = torch.nn.utils.get_total_norm(grads)
            if max_norm and max_norm > 0:  # clip_grad_norm_'s rule
                torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            return norm
        if max_norm and max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])
