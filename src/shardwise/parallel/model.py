"""The engine of every layout without a pipeline: :class:`ParallelModel`.

A :class:`ParallelModel` is put together by :func:`~.apply.parallelize` (the only composition
site) from plain pieces over one converted module, each answering the members it owns:

=================================  ==========================================================
``loss_fn``                        the loss sum, its booking and backward context, the
                                   gathered logits for sampling (:class:`PlainLoss`,
                                   :class:`~.tp.VocabParallelLoss`, :class:`~.tp.LossParallel`)
``grad_sync``                      micro-step sync, the reduction, the optimizer, the norm's
                                   held gradients, full-shape dp views, the module the loss
                                   runs forward (:class:`~.dp.DataParallel`, DDP, :mod:`.zero`,
                                   FSDP2, or :class:`~.engine.NoSync` when dp × cp = 1): a
                                   plain :class:`~.engine.Sync`
``finishers``                      run in order after the sync: the SP sum over tp of what the
                                   sync leaves on this rank (:class:`~.tp.SPSum`, or DTensor's
                                   :class:`~.tp.TorchSPSum`)
``traffic``                        tp's byte terms (:class:`~.tp.TPTraffic`; None without
                                   tp), added to the sync's (``grad_norm`` summed)
=================================  ==========================================================

Why TP goes innermost and which tags cross which axis: docs/composition.md (Megatron-LM §5.1,
scaling book ch. 5 "Mixing FSDP and model parallelism", ZeRO paper §7).
"""

from __future__ import annotations

import contextlib

import torch

from ..models import loss_sum_and_count
from .engine import Engine


class PlainLoss:
    """The loss function of a model whose logits are whole on this rank:
    :func:`shardwise.models.loss_sum_and_count` (language model, DPO or regression) of
    ``module``; the training sum adds a mixture of experts' aux losses, the evaluation does not."""

    def __init__(self, module):
        self.module = module

    def loss_sum(self, batch: dict) -> torch.Tensor:
        return loss_sum_and_count(self.module, batch)[0]

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum_and_count(self.module, batch, aux=False)

    def booking(self, **options):
        return contextlib.nullcontext()

    def backward_context(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered_logits(self):
        yield self.module


class ParallelModel(Engine):
    """``module`` (converted for TP) on ``topo`` (pp = 1) with its ``loss_fn``, ``grad_sync``,
    ``finishers`` and ``traffic`` (module docstring); ``sp``: sequence parallelism (the
    ``sp_grad`` term). Every tp rank of a dp row holds the complete loss sum of its row, so the
    token count and the loss are all-reduced over the data axis only."""

    def __init__(self, module, topo, *, loss_fn, grad_sync, finishers=(),
                 traffic=None, sp: bool = False):
        super().__init__(module)
        # the sync holds ``module`` too: a tuple, which nn.Module does not register, so that
        # state_dict()/parameters() see the model once
        self.parts = (grad_sync,)
        self.topo, self.sp, self.loss_fn = topo, sp, loss_fn
        self.finishers, self.traffic = list(finishers), traffic
        self.step_context = grad_sync.step_context  # torch's context_parallel (DDP over dp × cp)

    @property
    def dp(self):
        """The gradient sync."""
        return self.parts[0]

    def forward(self, *args, **kwargs):
        return self.dp.forward_module(*args, **kwargs)

    def train(self, mode: bool = True):
        """Train / eval mode, also of the sync's forward module (DDP's wrapper is not a
        registered submodule: the model's parameters are seen once)."""
        super().train(mode)
        if self.dp.forward_module is not self.module:
            self.dp.forward_module.train(mode)
        return self

    # -- the step: the loss is tp's, the gradient sync dp's ---------------------------------
    def sync_gradients(self, enabled: bool):
        return self.dp.sync_gradients(enabled)

    def begin_forward_backward(self) -> None:
        self.dp.begin_forward_backward()

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The vocab-parallel loss sum of this dp row's micro-batch [b, s] (local logits
        [b, s, V_pad/tp]), the same on every tp rank of the row."""
        return self.loss_fn.loss_sum(batch)

    @contextlib.contextmanager
    def booking(self):
        """The sync's own booking, then the loss function's (with the sync's options)."""
        with self.dp.booking(), self.loss_fn.booking(**self.dp.booking_options()):
            yield

    def backward_context(self):
        return self.loss_fn.backward_context()

    def finish_gradient_sync(self) -> None:
        """Wait for the dp reduction, then the finishers in order (with SP: SUM over tp the
        norm weights' partial gradients on what this rank holds; ZeRO: its slice only; tag
        ``sp_grad``)."""
        self.dp.finish_gradient_sync()
        for finish in self.finishers:
            finish()

    def held_grads(self):
        """dp's pieces (ZeRO slices, FSDP2 shards, whole gradients); tp, which splits them, is
        among the derived norm axes (:meth:`.params.Held.norm_axes`)."""
        return self.dp.held_grads()

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        return self.dp.make_optimizer(param_groups, **adamw)

    # -- evaluation, sampling ---------------------------------------------------------------
    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation under ``no_grad`` (ZeRO-3 frees what it gathers; FSDP2 reshards after):
        tp's loss sum of ``batch`` and its counted tokens."""
        with self._step_context(batch):
            out = self.loss_fn.loss_sum_and_count(batch)
        self.dp.after_evaluation()
        return out

    @contextlib.contextmanager
    def full_model(self):
        """Full weights and full logits for sampling (:meth:`~.engine.Engine.full_model_for`);
        every rank of the layout enters it together."""
        with self.dp.full_model_for(self) as model:
            yield model

    # -- full-shape views and accounting: the dp part is dp's ---------------------------------
    def named_params(self):
        return self.dp.named_params()

    def dp_parameters(self) -> dict[str, torch.Tensor]:
        return self.dp.dp_parameters()

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        return self.dp.dp_gradients()

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        return self.dp.dp_optimizer_state(optimizer)

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        self.dp.dp_load_optimizer_state(optimizer, local)

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        return self.dp.model_state_bytes(optimizer)

    @property
    def local_numel(self) -> int:
        """Ψ_tp: parameters of this rank's TP shard (a tied weight once, vocabulary padding
        included: it is stored, reduced and optimized like any element)."""
        return sum(p.numel() for p in self.module.parameters())

    def memory_formula(self) -> dict[str, float]:
        """dp's formula over Ψ_tp, this rank's TP shard (ZeRO paper §5.1–5.3)."""
        return self.dp.memory_formula()

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{tag: bytes} this rank sends in one step: tp's activation, cross-entropy and tp-norm
        terms for its dp slice of the batch (``sequences`` sequences of ``seq_len`` tokens,
        all micro-batches), plus dp's gradient and parameter traffic of Ψ_tp and its norm
        scalar; ``sp_grad`` is dp's share of the SP sum (ZeRO: the slice)."""
        out = (dict(self.traffic.bytes_formula(micro_steps, sequences, seq_len, dtype))
               if self.traffic is not None else {})
        d = dict(self.dp.bytes_formula(micro_steps, sequences, seq_len, dtype))
        if "grad_norm" in out or "grad_norm" in d:  # absent when no piece sends a norm term
            out["grad_norm"] = out.get("grad_norm", 0.0) + d.pop("grad_norm", 0.0)
        out.update(d)
        if self.sp:  # tp's term when not (0 with tp; absent without)
            out["sp_grad"] = self.dp.sp_grad_bytes(out.get("sp_grad", 0.0))
        return out
