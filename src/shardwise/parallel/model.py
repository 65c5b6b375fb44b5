"""The engine of every layout, :class:`ParallelModel` (:class:`Local`: one process, the
reference), and the loss functions' base, :class:`PlainLoss`.

A :class:`ParallelModel` is put together by :func:`~.apply.parallelize` (the only composition
site) from plain pieces over one converted module, each answering the members it owns:

=================================  ==========================================================
``loss_fn``                        the loss sum, its booking and backward context, the
                                   gathered logits for sampling (:class:`PlainLoss`,
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
``runner``                         None: the micro-batch loop (pp = 1); a pipeline's schedule
                                   (:class:`~.pp.runner.ScheduleRunner`,
                                   :class:`~.pp.torch_runner.TorchScheduleRunner`) runs the step
                                   and the evaluation on this rank's stage instead
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

from ..models import lm_loss, loss_sum_and_count, mse_loss
from ..models.dpo import dpo_loss_sum_and_count, is_dpo
from .params import Held, grad_norm_, local, norm_bytes
from .sync import NoSync
from .views import full_named, full_state, local_state


def autocast(dtype: str, device: torch.device):
    """bf16 mixed precision: matmuls in bf16, master weights/grads/optimizer state stay fp32."""
    if dtype == "bf16":
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


class ParallelModel(nn.Module):
    """``module`` (converted for TP; with a pipeline ``runner``, this rank's stage) on ``topo``
    with its ``loss_fn``, ``grad_sync``, ``finishers``, ``traffic`` and ``runner`` (module
    docstring); ``sp``: sequence parallelism (the ``sp_grad`` term at pp = 1). ``finishers``:
    run in order after the last backward, the sync's ``finish_gradient_sync`` among them (None:
    that one alone). Every tp rank of a dp row holds the complete loss sum of its row, so the
    token count and the loss are all-reduced over the data axis only.

    The training step (``train/step.py``), ``verify``, ``trace`` and checkpoints use only the
    members under the comments "the step", "evaluation, sampling", "full shape" and
    "accounting" (docs/architecture.md, "The engine interface", lists them with their rules).
    """

    def __init__(self, module, topo, *, loss_fn, grad_sync, finishers=None,
                 traffic=None, sp: bool = False, runner=None):
        super().__init__()
        self.module = module
        # the sync holds ``module`` too: a tuple, which nn.Module does not register, so that
        # state_dict()/parameters() see the model once
        self.parts = (grad_sync,)
        self.topo, self.sp, self.loss_fn, self.runner = topo, sp, loss_fn, runner
        self.finishers = [grad_sync.finish_gradient_sync] if finishers is None else list(finishers)
        self.traffic = traffic
        self.step_context = grad_sync.step_context  # torch's context_parallel (DDP over dp × cp)
        self._views_cache: dict = {}  # DTensor layouts' element positions (:func:`.views.to_full`)

    @property
    def count_axes(self) -> tuple[str, ...]:
        """Axes the step's token count is summed over: the data axis, "dp" or "dp_cp" (each cp
        rank counts the tokens of its own chunks)."""
        return (self.topo.data_axis if self.topo is not None else "dp",)

    @property
    def reduce_loss_axes(self) -> tuple[str, ...]:
        """The data axis, and with a pipeline "pp" first (only the last stage holds a loss)."""
        return getattr(self.runner, "loss_axes", ()) + self.count_axes

    # -- a pipeline's schedule: what the step, the report and the trace read -----------------
    @property
    def timeline(self) -> list[tuple]:
        """A pipeline's last step: (kind, mb, chunk, peer, t_start, t_end) per action ([] at
        pp = 1)."""
        return getattr(self.runner, "timeline", [])

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

    # -- the step: the loss is tp's, the gradient sync dp's ---------------------------------
    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """The micro-batch loop (:meth:`_micro_batch_loop`), or the pipeline runner's schedule
        over ``microbatches``; the loss sum of this rank, fp64 [1]."""
        if self.runner is None:
            return self._micro_batch_loop(microbatches, denom, dtype)
        return self.runner.forward_backward(microbatches, denom, dtype)

    def _micro_batch_loop(self, microbatches: list[dict], denom: float,
                          dtype: str = "fp32") -> torch.Tensor:
        """The one micro-batch loop: forward + backward each micro-batch; the loss
        back-propagated is its token-loss sum (:meth:`loss_sum`) divided by ``denom`` (the global
        token count), so gradients sum to ∇ of the global mean. Gradient sync is enabled on the
        last micro-step only (nanoGPT's ``require_backward_grad_sync``). Inside: the loss
        function's sum, booking and backward context, the sync's micro-step switch. Returns the
        loss sum, fp64 [1]."""
        device = next(self.module.parameters()).device
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        sync, loss_fn = self.dp, self.loss_fn
        sync.begin_forward_backward()
        with self._step_context(microbatches[0]), sync.booking(), \
                loss_fn.booking(**sync.booking_options()):
            for i, mb in enumerate(microbatches):
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                with sync.sync_gradients(i == len(microbatches) - 1):
                    with autocast(dtype, device):
                        s = loss_fn.loss_sum(mb)
                    with loss_fn.backward_context():
                        (s / denom).backward()
                loss_sum += local(s.detach()).double()
        return loss_sum

    def _step_context(self, batch: dict):
        if self.step_context is None:
            return contextlib.nullcontext()
        return self.step_context(batch["input_ids"].shape[1])

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
        return self.dp.held_grads()

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        return self.dp.make_optimizer(param_groups, **adamw)

    # -- evaluation, sampling ---------------------------------------------------------------
    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation under ``no_grad`` (ZeRO-3 frees what it gathers; FSDP2 reshards after):
        tp's loss sum of ``batch`` and its counted tokens (a pipeline: the runner's forward
        through the stages, the loss summed over pp)."""
        if self.runner is not None:
            return self.runner.evaluate(batch)
        with self._step_context(batch):
            out = self.loss_fn.loss_sum_and_count(batch)
        self.dp.after_evaluation()
        return out

    @contextlib.contextmanager
    def full_model(self):
        """Full weights and full logits for sampling (:meth:`.sync.Sync.full_model_for`);
        every rank of the layout enters it together. None for a pipeline (this rank holds only
        its stage: no sampling from a pipeline)."""
        if self.runner is not None:
            yield None
            return
        with self.dp.full_model_for(self) as model:
            yield model

    # -- full-shape views and accounting: the dp part is the sync's --------------------------
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
        """dp's formula over Ψ_tp, this rank's TP shard (ZeRO paper §5.1–5.3); None for a
        pipeline stage (no closed form here)."""
        return None if self.runner is not None else self.dp.memory_formula()

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{tag: bytes} this rank sends in one step: tp's activation, cross-entropy and tp-norm
        terms for its dp slice of the batch (``sequences`` sequences of ``seq_len`` tokens,
        all micro-batches), plus dp's gradient and parameter traffic of Ψ_tp and its norm
        scalar; ``sp_grad`` is dp's share of the SP sum (ZeRO: the slice). A pipeline:
        :meth:`_pipeline_bytes`."""
        if self.runner is not None:
            return self._pipeline_bytes(micro_steps, sequences, seq_len, dtype)
        out = (dict(self.traffic.bytes_formula(micro_steps, sequences, seq_len, dtype))
               if self.traffic is not None else {})
        d = dict(self.dp.bytes_formula(micro_steps, sequences, seq_len, dtype))
        if "grad_norm" in out or "grad_norm" in d:  # absent when no piece sends a norm term
            out["grad_norm"] = out.get("grad_norm", 0.0) + d.pop("grad_norm", 0.0)
        out.update(d)
        if self.sp:  # tp's term when not (0 with tp; absent without)
            out["sp_grad"] = self.dp.sp_grad_bytes(out.get("sp_grad", 0.0))
        return out

    def _pipeline_bytes(self, micro_steps: int, sequences: int, seq_len: int,
                        dtype: str) -> dict[str, float]:
        """A pipeline stage's bytes by tag: the runner's ``pp_fwd``/``pp_bwd``, each finisher's
        term (``tied``), the norm's fp64 scalar over the derived axes (tp, the sync's sliced
        axes, ep, pp: :meth:`.params.Held.norm_axes`), the sync's ``grad`` (and ZeRO-1's
        ``param``), tp's terms for the stage's blocks (``tp_fwd``/``tp_bwd``/``ce``,
        ``sp_grad``). Derivation: docs/composition.md, "Pipelines composed"."""
        args = (micro_steps, sequences, seq_len, dtype)
        out = dict(self.runner.bytes_formula(*args))
        for finish in self.finishers:
            if hasattr(finish, "bytes_formula"):
                out.update(finish.bytes_formula())
        out["grad_norm"] = norm_bytes(Held([], self.dp.sliced).norm_axes(self.topo), self.topo)
        d = dict(self.dp.bytes_formula(*args))
        d.pop("grad_norm", None)  # counted above, over every derived axis at once
        out["grad"] = 0.0
        out.update(d)
        if self.traffic is not None:
            out.update(self.traffic.bytes_formula(*args))
        return out

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

    def load_full_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Set ``optimizer``'s state from :meth:`full_optimizer_state`'s form (possibly saved
        under another layout): :func:`.views.local_state` (tp), then
        :meth:`dp_load_optimizer_state` (dp). No collective; raises as ``local_state``."""
        self.dp_load_optimizer_state(optimizer,
                                     local_state(state, self.named_params(), self.topo))


class Local(ParallelModel):
    """The single-process reference: the plain ``module`` with :class:`PlainLoss` and
    :class:`~.sync.NoSync`, no communication (no topology). Its norm is
    ``torch.nn.utils.clip_grad_norm_`` itself, independent of :func:`.params.grad_norm_`."""

    def __init__(self, module: nn.Module):
        super().__init__(module, None, loss_fn=PlainLoss(module), grad_sync=NoSync(module, None))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if max_norm and max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])
