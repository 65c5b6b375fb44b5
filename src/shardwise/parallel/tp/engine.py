"""The explicit TP engine, :class:`TensorParallel` (:func:`parallelize_tensor` builds it), and
what both TP engines add to the base :class:`~shardwise.parallel.engine.Engine`, whose loop, norm,
full-shape views and optimizer state read each parameter's
:class:`~shardwise.parallel.params.Placement`.
"""

from __future__ import annotations

import contextlib

import torch

from ...models import count_items, moe_aux_loss, positions_kw
from ...models.dpo import token_loss_sum
from ...models.llama import Llama
from ..engine import Engine
from .apply import apply_tp, tp_step_bytes_formula
from .comms import AXIS
from .layers import TPRNG, VocabParallelHead
from .loss import vocab_parallel_cross_entropy


class TPEngineBase(Engine):
    """Both TP engines (this one and :class:`~.dtensor.TorchTensorParallel`): every tp rank sees
    the same batch and holds the complete loss sum, so the token count and the loss are reduced
    over dp only (the base's ``count_axes``/``reduce_loss_axes``); the norm's Σ g² of the sharded
    params is all-reduced over tp (one fp64, tag ``"grad_norm"``)."""

    def __init__(self, module: Llama, topo, sp: bool):
        super().__init__(module)
        self.topo, self.sp = topo, sp

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """:func:`~.apply.tp_step_bytes_formula` on ``topo``'s tp and dp sizes without ``loss``
        and ``total`` (:func:`shardwise.formulas.step_bytes_formula` adds them); micro_steps do
        matter only for Qwen3's q/k norms without SP (every other byte is linear in the batch).
        DTensor moves the same bytes, same tags (see :meth:`.dtensor.TorchTensorParallel.
        bytes_formula` for the families' replicated parameters under SP)."""
        t = tp_step_bytes_formula(self.module.config, sequences, seq_len, self.topo.size(AXIS),
                                  self.sp, dp=self.topo.size("dp"), dtype=dtype,
                                  micro_steps=micro_steps)
        return {k: v for k, v in t.items() if k not in ("total", "loss")}


class TensorParallel(TPEngineBase):
    """A Llama model converted by :func:`~.apply.apply_tp` (``module``), its ``topo``, ``sp`` and
    dropout RNG ``rng``; the loss is the vocab-parallel cross-entropy of the local logits. DP or
    ZeRO sits on top in :class:`shardwise.parallel.model.ParallelModel` (dp × tp): the local
    shards are ordinary Parameters whose gradients are summed over dp."""

    def __init__(self, module: Llama, topo, sp: bool, rng: TPRNG):
        super().__init__(module, topo, sp)
        self.rng = rng

    @property
    def head(self) -> VocabParallelHead:
        return self.module.output

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-loss sum fp32 scalar, counted tokens) of ``batch`` via the vocab-parallel loss;
        the same on every tp rank. Usable for evaluation under ``torch.no_grad()``."""
        local_logits = self.module(batch["input_ids"], **positions_kw(batch))  # [b, s, V_pad/n]
        losses = vocab_parallel_cross_entropy(local_logits, batch["labels"],
                                              self.head.vocab_start, self.head.vocab_size,
                                              self.topo)
        count = torch.tensor(count_items(batch), device=batch["labels"].device)  # DPO: pairs
        return token_loss_sum(losses, batch), count

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The training objective's sum: the vocab-parallel loss, plus a mixture of experts'
        aux losses (:func:`~shardwise.models.moe_aux_loss`; computed whole on every tp rank)."""
        s = self.loss_sum_and_count(batch)[0]
        aux = moe_aux_loss(self.module)
        return s if aux is None else s + aux

    def finish_gradient_sync(self) -> None:
        """With SP: SUM the norm weights' partial gradients over tp, one flat all-reduce of
        (2L+1)·d fp32 (the base engine's :meth:`sum_replicated_grads`)."""
        if self.sp:
            self.sum_replicated_grads()

    def full_model(self):
        """The base engine's hook for sampling: :meth:`gathered_logits`."""
        return self.gathered_logits()

    @contextlib.contextmanager
    def gathered_logits(self):
        """Inference helper: inside, the model returns full logits [b, s, V] (gathered over tp,
        unpadded) and SP is switched off (any sequence length works), so plain-model code
        (``generate``, ``loss_sum_and_count``) runs unchanged. Use under ``torch.no_grad()``."""
        mods = [m for m in self.module.modules() if hasattr(m, "sp")]
        saved = [m.sp for m in mods]
        for m in mods:
            m.sp = False
        self.head.gather_output = True
        try:
            yield self.module
        finally:
            self.head.gather_output = False
            for m, s in zip(mods, saved):
                m.sp = s


def parallelize_tensor(model: Llama, topo, sp: bool = False, *, seed: int = 0) -> TensorParallel:
    """Convert the plain Llama ``model`` in place for tensor parallelism over ``topo``'s "tp"
    axis (:func:`~.apply.apply_tp`: checks, broadcast, conversion, check) and return its
    :class:`TensorParallel` engine. ``seed`` seeds the dropout RNG regions."""
    rng = apply_tp(model, topo, sp, seed=seed)
    return TensorParallel(model, topo, sp, rng)
