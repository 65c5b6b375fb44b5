"""The DPO objective on per-token losses: what the last stage of every layout computes for a
preference micro-batch.

Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model", arXiv 2305.18290, eq. 7), the sigmoid loss of a pair
(prompt x, chosen y_w, rejected y_l) under the policy π_θ and the frozen reference π_ref::

    ℓ = −log σ( β·[ (log π_θ(y_w|x) − log π_ref(y_w|x)) − (log π_θ(y_l|x) − log π_ref(y_l|x)) ] )

where ``log π(y|x)`` is the *sum* over the response tokens (and the final EOS) of the
next-token log-probabilities, prompt and padding masked. The implicit rewards are
``r = β·(log π_θ − log π_ref)``; the reward margin is ``r_w − r_l`` (the argument of σ), and a
pair is "correct" when the margin is > 0 (TRL's ``rewards/accuracies``).

A DPO micro-batch is the usual ``{"input_ids", "labels"}`` of ``b`` rows (chosen at even rows,
rejected at the odd row after it: :mod:`shardwise.data.dpo`) plus:

* ``dpo_logps`` [b] fp64 on the compute device — its presence marks the batch as DPO. The
  objective *writes* each row's ``log π(y|x)`` of the model being run into it (in place,
  detached): the reference pass reads the reference's log-probs from it, the training step the
  policy's (for the metrics), without a second forward. (``Tensor.to`` returns the tensor itself
  when it already has the device and dtype, so the engines' ``.to(device)`` keep it.)
* ``ref_logps`` [b] fp64: the reference's log-probs. With it the objective returns the DPO loss
  *sum* over the batch's pairs (the step divides by the global number of pairs, so the logged
  loss is the mean over all pairs of the global batch, for any dp / micro-batch split). Without
  it (the reference pass) it returns the sum of the counted tokens' losses, −Σ log π.
* ``dpo_beta`` [] fp64: β.

The per-token losses come from whichever cross-entropy the layout uses (``F.cross_entropy`` on
whole logits, or the vocab-parallel one on tp-sharded logits, which is complete on every tp
rank), so the same code gives the DPO loss in every layout; the row sums are taken in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .llama import IGNORE_INDEX

DPO_LOGPS, REF_LOGPS, DPO_BETA = "dpo_logps", "ref_logps", "dpo_beta"


def is_dpo(batch: dict) -> bool:
    """Whether ``batch`` is a DPO micro-batch (it carries the ``dpo_logps`` buffer)."""
    return DPO_LOGPS in batch


def sigmoid_dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor,
                     ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
                     ) -> torch.Tensor:
    """Per-pair loss [n] of eq. 7 (module doc) from summed log-probs [n] each:
    ``−logsigmoid(β·((π_w − ref_w) − (π_l − ref_l)))`` (``logsigmoid`` is stable for any
    margin)."""
    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin)


def token_loss_sum(token_losses: torch.Tensor, batch: dict) -> torch.Tensor:
    """The objective's sum for one micro-batch from its per-token losses ``token_losses``
    ([b·s] or [b, s] fp32, −log p of each target, 0 where ``labels == IGNORE_INDEX``).

    A language-model batch: their sum. A DPO batch (:func:`is_dpo`): each row's log-prob
    ``log π = −Σ_t loss`` (fp64) is written into ``batch["dpo_logps"]``; then with
    ``batch["ref_logps"]`` the DPO loss summed over the ``b/2`` pairs, else −Σ log π.
    Returns an fp32 scalar with grad (where the losses have it). Raises ValueError for a DPO
    batch with an odd number of rows."""
    if not is_dpo(batch):
        return token_losses.sum()
    b = batch["labels"].shape[0]
    if b % 2:
        raise ValueError(f"a DPO micro-batch holds (chosen, rejected) pairs in adjacent rows, "
                         f"but this one has {b} rows")
    logps = -token_losses.reshape(b, -1).double().sum(-1)  # [b]
    batch[DPO_LOGPS].copy_(logps.detach())
    if REF_LOGPS not in batch:
        return (-logps).sum().float()
    ref = batch[REF_LOGPS].double()
    loss = sigmoid_dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2],
                            batch[DPO_BETA].double())
    return loss.sum().float()


def dpo_loss_sum_and_count(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective sum, pairs) of whole logits [b, s, V] for a DPO ``batch`` (or, without the
    DPO keys, the token-loss sum and counted tokens): ``F.cross_entropy`` per token, then
    :func:`token_loss_sum`."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                             ignore_index=IGNORE_INDEX, reduction="none")  # [b·s]
    return token_loss_sum(losses, batch), torch.tensor(count_pairs_or_tokens(batch),
                                                       device=logits.device)


def count_pairs_or_tokens(batch: dict) -> int:
    """Items a language-model ``batch``'s loss counts: pairs (``b / 2``) for DPO, else tokens
    with a label."""
    if is_dpo(batch):
        return batch["labels"].shape[0] // 2
    return int((batch["labels"] != IGNORE_INDEX).sum())
