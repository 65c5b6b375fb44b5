"""The vocab-parallel cross-entropy: the loss of logits sharded over the vocabulary, ungathered.

Megatron-LM's ``vocab_parallel_cross_entropy`` (Shoeybi et al. 2019, arXiv 1909.08053, §3): with
z the logits of one token and t its target, ``ℓ = log Σ_v exp(z_v − m) − (z_t − m)`` with
``m = max_v z_v``. Each rank holds the columns [vocab_start, vocab_start + V_pad/n) of z, so

* m is an all-reduce(MAX) of the local maxima,
* Σ exp(z − m) an all-reduce(SUM) of the local sums,
* z_t − m an all-reduce(SUM) in which only the rank owning t contributes,

three fp32 values per token, in forward only (tag ``"ce"``). The gradient ``softmax(z) −
onehot(t)`` is local. Padded columns (the vocabulary padded to a multiple of n) are masked to −∞
before the max and the sum, so they get probability 0 and gradient 0.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ... import comm
from ...models import count_items, moe_aux_loss, positions_kw
from ...models.dpo import token_loss_sum
from ...models.llama import IGNORE_INDEX
from ..loss import PlainLoss
from .comms import AXIS
from .options import TPOptions


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``_VocabParallelCrossEntropy`` (math in the module docstring).
    forward(logits [N, V_pad/n] fp32, target [N]) → loss [N] (0 where target == IGNORE_INDEX):
    all-reduce MAX of [N], then SUM of [2, N] (tag ``"ce"``). backward: ∂ℓ/∂z = softmax(z) −
    onehot(t) on the local columns; no collective."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, topo):
        n_local = logits.shape[-1]
        cols = vocab_start + torch.arange(n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # padding: probability 0
        m = logits.max(dim=-1).values  # [N]; −inf only if this whole shard is padding
        comm.all_reduce(m, topo, AXIS, op="max", tag="ce")
        z = logits - m.unsqueeze(-1)  # [N, V_pad/n], ≤ 0
        exp = z.exp()
        ignore = target == IGNORE_INDEX
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n_local) & ~ignore  # this rank owns the target
        local_t = local_t.clamp(0, n_local - 1)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)  # [N]
        stats = torch.stack([exp.sum(dim=-1), torch.where(mine, z_t, torch.zeros_like(z_t))])
        comm.all_reduce(stats, topo, AXIS, tag="ce")  # [2, N]: Σ exp, z_t − m
        sum_exp, z_t = stats[0], stats[1]
        loss = torch.where(ignore, torch.zeros_like(z_t), sum_exp.log() - z_t)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine, ignore)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignore = ctx.saved_tensors
        grad = softmax.clone()  # [N, V_pad/n]
        rows = mine.nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= 1.0
        scale = torch.where(ignore, torch.zeros_like(grad_loss), grad_loss)
        return grad * scale.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor,
                                 vocab_start: int, vocab_size: int, topo) -> torch.Tensor:
    """Per-token loss [b·s] (fp32; 0 where ``labels == IGNORE_INDEX``), the same on every tp
    rank, from local logits [b, s, V_pad/n] (this rank's vocabulary entries from
    ``vocab_start``; entries ≥ ``vocab_size`` are padding) and labels [b, s], identical on every
    tp rank. Three fp32 values per token cross the wire, forward only."""
    return _VocabParallelCrossEntropy.apply(local_logits.flatten(0, 1).float(), labels.flatten(),
                                            vocab_start, vocab_size, topo)



class VocabParallelLoss(PlainLoss):
    """The loss function of a model (or a pipeline stage) converted by
    :func:`~.apply.apply_tp` (``module``, on ``topo``'s tp axis, with the layout's
    :class:`~.options.TPOptions` ``options``, dropout RNG ``rng``):
    :func:`vocab_parallel_cross_entropy` of the local logits, complete on every tp rank; the
    other members are :class:`~shardwise.parallel.loss.PlainLoss`'s."""

    def __init__(self, module, topo, options: TPOptions, rng):
        super().__init__(module)
        self.topo, self.options, self.rng = topo, options, rng

    @property
    def head(self):
        """The :class:`~.layers.VocabParallelHead`."""
        return self.module.output

    def loss(self, y: torch.Tensor, mb: dict) -> torch.Tensor:
        """The token (or DPO pair) loss sum of local logits ``y`` [b, s, V_pad/tp], fp32
        scalar, complete on every tp rank (a pipeline's last stage: called by the runner)."""
        return token_loss_sum(vocab_parallel_cross_entropy(  # DPO too (models/dpo.py)
            y, mb["labels"], self.head.vocab_start, self.head.vocab_size, self.topo), mb)

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-loss sum fp32 scalar, counted tokens) of ``batch`` via the vocab-parallel loss;
        the same on every tp rank. Usable for evaluation under ``torch.no_grad()``."""
        local_logits = self.module(batch["input_ids"], **positions_kw(batch))  # [b, s, V_pad/n]
        count = torch.tensor(count_items(batch), device=batch["labels"].device)  # DPO: pairs
        return self.loss(local_logits, batch), count

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The training objective's sum: the vocab-parallel loss, plus a mixture of experts'
        aux losses (:func:`~shardwise.models.moe_aux_loss`; computed whole on every tp rank)."""
        s = self.loss_sum_and_count(batch)[0]
        aux = moe_aux_loss(self.module)
        return s if aux is None else s + aux

    @contextlib.contextmanager
    def gathered_logits(self):
        """Inference helper: inside, the model returns full logits [b, s, V] (gathered over tp,
        unpadded) and SP is switched off (any sequence length works), so plain-model code
        (``generate``, ``loss_sum_and_count``) runs unchanged. Use under ``torch.no_grad()``."""
        mods = [m for m in self.module.modules()
                if isinstance(getattr(m, "options", None), TPOptions)]
        saved = [m.options for m in mods]
        for m in mods:
            m.options = dataclasses.replace(m.options, sp=False)
        self.head.gather_output = True
        try:
            yield self.module
        finally:
            self.head.gather_output = False
            for m, s in zip(mods, saved):
                m.options = s
