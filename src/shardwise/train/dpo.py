"""``--task dpo``: Direct Preference Optimization beside a frozen reference in the same layout.

What it adds to the loop (:mod:`.loop` calls these at four places, all ``cfg.task == "dpo"``):

1. **The reference model** (:func:`build_reference`): the plain policy model as right after
   initialisation (the seeded init, or ``--init-from-hf`` weights): a second meta model filled
   with the init replayed from the same RNG state (``InitPlan.stream_from``) or the HF folder
   again, or, built whole, :func:`reference_copy` before a ``--resume`` checkpoint is loaded
   into the policy; so the reference is always the starting policy. It goes through the same :func:`~shardwise.parallel.apply.parallelize` with the same
   layout (same dp/tp/pp degrees, stage split, SP), so each rank holds the same shards of it as
   of the policy: with ZeRO-3 its parameters are sharded over dp and gathered unit by unit in its
   forward; ZeRO-1/2 shard only gradients and optimizer state, which the reference does not
   have, so it is built with zero=0 there (its parameters are replicated over dp exactly like the
   policy's; with HSDP, which needs zero ≥ 1, it keeps the policy's stage). Then every parameter gets ``requires_grad=False``, the engine is put in eval mode
   (no dropout), no optimizer is built for it, and the checkpointer never sees it.
2. **The reference pass** (:meth:`DPOReference.with_reference`): before each training step, one
   forward of the reference per micro-batch under ``no_grad`` (its layout's collectives: TP
   all-reduces, ZeRO-3 gathers, pipeline sends, booked under the ledger phase ``"reference"``,
   outside the step's bytes). The objective (:mod:`shardwise.models.dpo`) writes each row's
   summed response log-prob into the micro-batch's ``dpo_logps`` buffer; it becomes
   ``ref_logps``. With a pipeline only the last stage computes log-probs; it is also the rank
   whose policy stage computes the loss, so nothing needs to travel.
3. **The step** is the ordinary :func:`~.step.train_step`: the count it all-reduces is pairs
   (``count_items``), the objective returns each micro-batch's DPO loss sum, so the loss and
   every gradient are those of the mean over all pairs of the global batch.
4. **Metrics** (:meth:`DPOReference.step_metrics`): from the log-probs the step's forward wrote
   (no extra forward), per global batch: ``dpo_reward_margin`` = mean of r_w − r_l with
   r = β·(log π_θ − log π_ref), ``dpo_reward_accuracy`` = fraction of pairs with r_w > r_l,
   ``dpo_reward_chosen``/``_rejected``, ``dpo_logps_chosen``/``_rejected`` (mean summed
   log-probs of the policy; TRL's ``rewards/*`` and ``logps/*``). One fp64 all-reduce of 8
   numbers over the data axis and pp (phase ``"metrics"``). Validation (:meth:`evaluate`) gives
   the same numbers on the held-out pairs, and its mean loss as ``val_loss``.

Costs: one reference forward per micro-batch (≈ 1/3 of a forward + backward), not counted in
``tflops``/``mfu``; the reference's parameters (``mem_reference_bytes``); ``tokens`` in
metrics.jsonl counts pairs (the step's counted items).

Not supported (clear errors in :func:`shardwise.config.validate`): cp > 1 (a row's log-prob would
be split over cp ranks), mixture-of-experts models, the torch engine with tp or pp > 1.
"""

from __future__ import annotations

import copy
import logging

import torch

from .. import comm
from ..config import TrainConfig
from ..models.dpo import DPO_BETA, DPO_LOGPS, REF_LOGPS, sigmoid_dpo_loss
from ..parallel.loss import autocast
from .workload import DPOWorkload

log = logging.getLogger("shardwise")

STATS = ("loss", "margin", "correct", "pi_chosen", "pi_rejected", "ref_chosen", "ref_rejected",
         "pairs")  # the fp64 sums reduced for the metrics, in this order


class DPOReference:
    """The frozen reference engine (from :func:`build_reference`) of a DPO run and what the loop
    does with it: the reference pass, the step's metrics, the validation. ``beta``: β;
    ``dtype``: the training step's compute dtype (``--dtype``), which the reference pass runs
    in too (under the same autocast as the policy's forward, so that at step 1, policy =
    reference, every margin is exactly 0 in bf16 as in fp32)."""

    def __init__(self, ref_engine, topo, beta: float, dtype: str = "fp32"):
        self.ref, self.topo, self.beta, self.dtype = ref_engine, topo, beta, dtype

    @torch.no_grad()
    def with_reference(self, microbatches: list[dict], dtype: str | None = None) -> list[dict]:
        """The micro-batches on the device with the DPO keys (:mod:`shardwise.models.dpo`):
        ``dpo_beta``, ``ref_logps`` [b] (the reference's summed response log-probs, from one
        forward of the reference engine per micro-batch) and a zeroed ``dpo_logps`` [b] buffer
        for the policy's. ``dtype``: the autocast of the forward (default: the step's). Collective
        over the layout (every rank calls it together, with the same number of micro-batches)."""
        dev, out = self.topo.device, []
        with self.topo.ledger.phase("reference"), autocast(dtype or self.dtype, dev):
            for mb in microbatches:
                mb = {k: v.to(dev) for k, v in mb.items()}
                b = mb["labels"].shape[0]
                mb[DPO_BETA] = torch.tensor(float(self.beta), dtype=torch.float64, device=dev)
                mb[DPO_LOGPS] = torch.zeros(b, dtype=torch.float64, device=dev)
                self.ref.loss_sum_and_count(mb)  # writes the reference's log-probs
                mb[REF_LOGPS] = mb.pop(DPO_LOGPS)
                mb[DPO_LOGPS] = torch.zeros(b, dtype=torch.float64, device=dev)
                out.append(mb)
        return out

    def _holds_logps(self) -> bool:
        """Whether this rank computes log-probs: the one holding the last pipeline stage (pp
        index p−1, or 0 under the V placement of zbv/dualpipev; every rank without a pipeline;
        every tp rank of it, each with the complete values)."""
        holds_head = getattr(getattr(self.ref, "module", None), "holds_head", None)
        if holds_head is not None:  # a pipeline stage says where the head is
            return bool(holds_head)
        return self.topo.index("pp") == self.topo.size("pp") - 1

    def _local_sums(self, microbatches: list[dict]) -> torch.Tensor:
        """This rank's :data:`STATS` sums (fp64 [8]) over the pairs of ``microbatches`` (zeros
        off the last pipeline stage, so a sum over pp counts each pair once)."""
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.topo.device)
        if not self._holds_logps():
            return sums
        for mb in microbatches:
            pi, ref = mb[DPO_LOGPS], mb[REF_LOGPS]
            pc, pr, rc, rr = pi[0::2], pi[1::2], ref[0::2], ref[1::2]
            margin = self.beta * ((pc - rc) - (pr - rr))
            sums += torch.stack([sigmoid_dpo_loss(pc, pr, rc, rr, self.beta).sum(),
                                 margin.sum(), (margin > 0).double().sum(), pc.sum(), pr.sum(),
                                 rc.sum(), rr.sum(),
                                 torch.tensor(float(pc.numel()), dtype=torch.float64,
                                              device=sums.device)])
        return sums

    def _reduce(self, sums: torch.Tensor, prefix: str = "dpo_") -> dict:
        """All-reduce ``sums`` over the data axis and pp (phase ``"metrics"``) → the metrics."""
        axes = [self.topo.data_axis] + (["pp"] if self.topo.size("pp") > 1 else [])
        with self.topo.ledger.phase("metrics"):
            for axis in axes:
                comm.all_reduce(sums, self.topo, axis, tag="dpo_stats")
        s = dict(zip(STATS, sums.cpu().tolist()))
        n = s["pairs"]
        return {f"{prefix}loss": s["loss"] / n, f"{prefix}reward_margin": s["margin"] / n,
                f"{prefix}reward_accuracy": s["correct"] / n,
                f"{prefix}reward_chosen": self.beta * (s["pi_chosen"] - s["ref_chosen"]) / n,
                f"{prefix}reward_rejected": self.beta * (s["pi_rejected"] - s["ref_rejected"]) / n,
                f"{prefix}logps_chosen": s["pi_chosen"] / n,
                f"{prefix}logps_rejected": s["pi_rejected"] / n, f"{prefix}pairs": int(n)}

    def step_metrics(self, microbatches: list[dict]) -> dict:
        """The step's DPO metrics (module doc, item 4) from the log-probs its forward wrote into
        ``microbatches`` (the list :meth:`with_reference` returned). Collective."""
        out = self._reduce(self._local_sums(microbatches))
        out.pop("dpo_loss")  # the step's "loss" already
        out["mem_reference_bytes"] = self.ref.model_state_bytes()["params"]
        return out

    @torch.no_grad()
    def evaluate(self, engine, work, cfg: TrainConfig, eval_shard) -> float:
        """Mean DPO loss of ``engine`` (the policy) over the first ``max(1, eval_sequences //
        2)`` validation pairs of ``work``, each once, split over dp by ``eval_shard`` (the
        loop's :func:`~.loop.eval_shard`, in pairs); padding forwards on the pair 0 keep the
        collectives matched. Logs the validation reward margin and accuracy (rank 0) and keeps
        them in ``last_eval``. Collective."""
        topo = self.topo
        dp, r = topo.size("dp"), topo.index("dp")
        micro = cfg.microbatching()[0]
        n = min(work.num_val // 2, max(1, cfg.eval_sequences // 2))
        idx, forwards = eval_shard(n, dp, r, micro // 2)
        real = work.batches(idx, micro, split="val") if idx.numel() else []
        pad = work.batches(torch.zeros(1, dtype=torch.long), 2, split="val")[0]
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=topo.device)
        engine.eval()
        for i in range(forwards):
            # fp32, as the policy's evaluation forward (the loop evaluates without autocast)
            (mb,) = self.with_reference([real[i] if i < len(real) else pad], dtype="fp32")
            engine.loss_sum_and_count(mb)  # the policy's log-probs into mb["dpo_logps"]
            if i < len(real):
                sums += self._local_sums([mb])
        engine.train()
        self.last_eval = self._reduce(sums, prefix="val_dpo_")
        log.info(f"  validation: reward margin {self.last_eval['val_dpo_reward_margin']:.4f}, "
                 f"accuracy {self.last_eval['val_dpo_reward_accuracy']:.3f} over "
                 f"{self.last_eval['val_dpo_pairs']} pairs")
        return self.last_eval["val_dpo_loss"]


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference's plain model: a deep copy of the freshly initialised policy
    (call it before any checkpoint is loaded into the policy)."""
    return copy.deepcopy(model)


def build_reference(ref_model: torch.nn.Module, layout, parallelize_fn):
    """Parallelize ``ref_model`` like the policy (``parallelize_fn(model, layout)``, the loop's
    own call) and freeze it: ZeRO-1/2 → zero=0 (module doc), no gradients, eval mode."""
    import dataclasses

    if layout.zero in (1, 2) and layout.dp_replicate == 1:
        layout = dataclasses.replace(layout, zero=0)
    ref = parallelize_fn(ref_model, layout)
    for p in ref.parameters():
        p.requires_grad_(False)
    # ZeRO-3 allocates each unit's gradient slice up front; the reference never runs backward
    for u in getattr(ref.grad_sync, "units", ()):
        if hasattr(u, "shard_grad"):
            u.shard_grad = torch.zeros(0, dtype=u.shard_grad.dtype, device=u.shard_grad.device)
    ref.eval()
    return ref


def log_suffix(rec: dict) -> str:
    """The log line's DPO part, e.g. ``, reward margin 0.0123 (acc 0.625)``."""
    return (f", reward margin {rec['dpo_reward_margin']:.4f} (acc "
            f"{rec['dpo_reward_accuracy']:.3f}, chosen {rec['dpo_logps_chosen']:.2f}, rejected "
            f"{rec['dpo_logps_rejected']:.2f})")


class SyntheticDPOWorkload(DPOWorkload):
    """Random preference pairs for parity checks (no files): vocab ``vocab_size`` (default 67,
    which no small dp/tp degree divides), each pair a random prompt of 1 … seq_len − 2 tokens
    shared by two random responses of random lengths (at least 1 token, cut at the
    row), then padding: so rows count very different numbers of response targets and a pair's
    two rows differ in length. Labels as :mod:`shardwise.data.dpo` makes them (prompt and
    padding targets −100)."""

    def __init__(self, vocab_size: int = 67, seq_len: int = 16, num_pairs: int = 64,
                 num_val_pairs: int = 4, beta: float = 0.1, seed: int = 0):
        from types import SimpleNamespace

        from ..data.dpo import IGNORE_INDEX

        g = torch.Generator().manual_seed(seed + 7)
        rows, labels = [], []
        for _ in range(num_pairs + num_val_pairs):
            n_p = int(torch.randint(1, seq_len - 1, (1,), generator=g))
            prompt = torch.randint(0, vocab_size, (n_p,), generator=g)
            for _ in range(2):
                n_r = int(torch.randint(1, seq_len + 1 - n_p + 1, (1,), generator=g))
                t = torch.randint(0, vocab_size, (seq_len + 1,), generator=g)
                t[:n_p] = prompt
                lb = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
                lb[n_p - 1: n_p - 1 + n_r] = t[n_p: n_p + n_r]
                rows.append(t)
                labels.append(lb)
        rows, labels = torch.stack(rows), torch.stack(labels)
        cut = 2 * num_pairs
        self.data = SimpleNamespace(train=rows[:cut], train_labels=labels[:cut], val=rows[cut:],
                                    val_labels=labels[cut:], tokenizer=None, prompts=[])
        self.vocab_size, self.beta, self.reference = vocab_size, beta, None
        self.num_train, self.num_val = cut, 2 * num_val_pairs
        self.description = f"synthetic preference pairs (vocab {vocab_size}, seq {seq_len})"

    def sample_text(self, model, cfg):
        return None
