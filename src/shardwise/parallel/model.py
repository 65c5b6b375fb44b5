"""The one composition of tensor parallelism with a data-parallel strategy: :class:`ParallelModel`.

dp × tp on either engine is a TP strategy (``tp``: :class:`~.tp.TensorParallel` or
:class:`~.tp.TorchTensorParallel`, which converted the plain model) and a gradient sync over dp
(``dp``: :class:`~.dp.DataParallel`, :class:`~.zero.ZeroDataParallel`, or FSDP2 over DTensor
TP, :class:`~.compose_torch.FSDP2Sync`) wrapping the same converted module. Each member of the
engine interface is answered by the part that owns it, in one place:

=================================  ==========================================================
the loss, its backward context     tp (vocab-parallel cross-entropy / ``loss_parallel``)
micro-step sync, finishing, the    dp (buckets / reduce-scatter / FSDP2), then the SP sum over
optimizer, full-shape dp views     tp of what dp leaves on this rank (:meth:`finish_gradient_sync`)
the global norm                    dp's held gradients over dp's axes and tp
bytes formula                      tp's terms + dp's terms (``grad_norm`` summed)
=================================  ==========================================================

Why TP goes innermost and which tags cross which axis: docs/composition.md (Megatron-LM §5.1,
scaling book ch. 5 "Mixing FSDP and model parallelism", ZeRO paper §7).
"""

from __future__ import annotations

import contextlib

import torch

from .engine import Engine


class ParallelModel(Engine):
    """dp × tp: ``tp`` (a TP engine over the converted model) and ``dp`` (a dp strategy engine
    over the same module), on ``topo`` (pp = 1). Every tp rank of a dp row holds the complete
    loss sum of its row, so the token count and the loss are all-reduced over dp only."""

    def __init__(self, tp: Engine, dp: Engine, topo):
        super().__init__(tp.module)
        # the parts share ``module``: a tuple, which nn.Module does not register, so that
        # state_dict()/parameters() see the model once
        self.parts = (tp, dp)
        self.topo, self.sp = topo, tp.sp

    @property
    def tp(self) -> Engine:
        return self.parts[0]

    @property
    def dp(self) -> Engine:
        return self.parts[1]

    # -- the step: the loss is tp's, the gradient sync dp's ---------------------------------
    def sync_gradients(self, enabled: bool):
        return self.dp.sync_gradients(enabled)

    def begin_forward_backward(self) -> None:
        self.dp.begin_forward_backward()

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The vocab-parallel loss sum of this dp row's micro-batch [b, s] (local logits
        [b, s, V_pad/tp]), the same on every tp rank of the row."""
        return self.tp.loss_sum(batch)

    def booking(self):
        return self.tp.booking(**self.dp.booking_options())

    def backward_context(self):
        return self.tp.backward_context()

    def finish_gradient_sync(self) -> None:
        """Wait for the dp reduction, then, with SP, SUM over tp the norm weights' partial
        gradients on what this rank holds after it (ZeRO: its slice only; tag ``sp_grad``)."""
        self.dp.finish_gradient_sync()
        if self.sp:
            self.dp.sum_replicated_grads()

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
        out = self.tp.loss_sum_and_count(batch)
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
        out = dict(self.tp.bytes_formula(micro_steps, sequences, seq_len, dtype))
        d = dict(self.dp.bytes_formula(micro_steps, sequences, seq_len, dtype))
        out["grad_norm"] = out.get("grad_norm", 0.0) + d.pop("grad_norm", 0.0)
        out.update(d)
        out["sp_grad"] = self.dp.sp_grad_bytes(out.get("sp_grad", 0.0)) if self.sp else 0.0
        return out
