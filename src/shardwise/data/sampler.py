"""Which sequences each rank trains on, step by step: deterministic, resumable, layout-independent.

The sampler first draws the *global* batch — the same on every rank, whatever the layout — and
only then cuts out this data-parallel rank's slice. So the single-process reference (dp=1) and any
dp>1 run see the same global batch in the same order, which is what the parity tests compare, and
a checkpoint taken at dp=4 resumes exactly at dp=2 (the state holds no rank-dependent part).

Epoch ``e`` is ``torch.randperm(num_samples)`` from ``torch.Generator().manual_seed(seed + e)``;
global batches are consecutive slices of it, and a tail shorter than a global batch is dropped:
``num_samples % global_batch`` sequences per epoch (the last ones of that epoch's shuffle, so a
different set each epoch) do not train in that epoch. The loop logs and records the counts
(:meth:`DistributedSampler.epoch_counts`), so the tail is never dropped silently.
"""

from __future__ import annotations

import torch

from shardwise.errors import ShardwiseConfigError


class DistributedSampler:
    """Global batches of sequence indices, and this dp rank's contiguous slice of each.

    Args:
        num_samples: number of sequences in the split (rows of ``TokenData.train``).
        global_batch: sequences per optimizer step, over all dp ranks.
        dp_size: data-parallel degree; must divide ``global_batch``.
        dp_rank: this rank's index on the dp axis, in ``[0, dp_size)``.
        seed: epoch ``e`` is shuffled with seed ``seed + e``.

    Raises:
        ShardwiseConfigError: ``global_batch % dp_size != 0``, ``global_batch > num_samples``,
            or a non-positive size / out-of-range rank.
    """

    def __init__(
        self, num_samples: int, global_batch: int, dp_size: int = 1, dp_rank: int = 0, seed: int = 0
    ):
        if num_samples < 1 or global_batch < 1 or dp_size < 1:
            raise ShardwiseConfigError(
                f"sampler sizes must be positive, got num_samples={num_samples}, "
                f"global_batch={global_batch}, dp_size={dp_size}: check --global-batch and --dp"
            )
        if not 0 <= dp_rank < dp_size:
            raise ShardwiseConfigError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise ShardwiseConfigError(
                f"--global-batch {global_batch} is not divisible by --dp {dp_size}: choose a "
                f"multiple of {dp_size}"
            )
        if global_batch > num_samples:
            raise ShardwiseConfigError(
                f"--global-batch {global_batch} is larger than the {num_samples} sequences in the "
                "split: use a smaller --global-batch, a shorter --seq-len, or more data"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # position in this epoch's permutation of the next global batch
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def local_batch(self) -> int:
        """Sequences per step on one dp rank: ``global_batch // dp_size``."""
        return self.global_batch // self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch: ``num_samples // global_batch`` (the tail is dropped)."""
        return self.num_samples // self.global_batch

    @property
    def dropped_per_epoch(self) -> int:
        """Sequences of each epoch that no step trains on: ``num_samples % global_batch``."""
        return self.num_samples - self.steps_per_epoch * self.global_batch

    def epoch_counts(self) -> dict[str, int]:
        """``{"sequences_per_epoch", "steps_per_epoch", "dropped_per_epoch"}``: the sequences in
        the split (each epoch shuffles all of them), the global batches cut from an epoch, and
        the tail left over (``sequences = steps × global_batch + dropped``)."""
        return {"sequences_per_epoch": self.num_samples, "steps_per_epoch": self.steps_per_epoch,
                "dropped_per_epoch": self.dropped_per_epoch}

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen)  # [num_samples] int64
            self._perm_epoch = self.epoch
        return self._perm

    def next_global_batch(self) -> torch.Tensor:
        """The next global batch, ``[global_batch]`` int64 indices (same on every rank); advances."""
        if self.offset + self.global_batch > self.num_samples:  # tail too short: next epoch
            self.epoch += 1
            self.offset = 0
        batch = self._permutation()[self.offset : self.offset + self.global_batch].clone()
        self.offset += self.global_batch
        return batch

    def local_indices(self, global_indices: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``[r*B/dp, (r+1)*B/dp)`` of a global batch: ``[global_batch // dp]``.

        Slices of ranks 0..dp-1 are disjoint and, concatenated in rank order, give the global batch.

        Raises:
            ShardwiseConfigError: ``global_indices`` does not hold ``global_batch`` indices.
        """
        if global_indices.numel() != self.global_batch:
            raise ShardwiseConfigError(
                f"expected a global batch of {self.global_batch} indices, got "
                f"{global_indices.numel()}: pass the output of next_global_batch()"
            )
        start = self.dp_rank * self.local_batch
        return global_indices[start : start + self.local_batch]

    def next_local_batch(self) -> torch.Tensor:
        """``local_indices(next_global_batch())``: ``[global_batch // dp_size]`` int64."""
        return self.local_indices(self.next_global_batch())

    def state_dict(self) -> dict:
        """Position to resume from: ``{"epoch", "offset", "seed", "num_samples", "global_batch"}``."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`, possibly taken at another dp size).

        The saved seed is adopted, so the resumed run continues the saved run's sequence.

        Raises:
            ShardwiseConfigError: the state was taken with another ``num_samples`` or
                ``global_batch`` (the saved position would mean different sequences).
        """
        for field in ("num_samples", "global_batch"):
            if field in state and state[field] != getattr(self, field):
                raise ShardwiseConfigError(
                    f"cannot resume the data order: the checkpoint has {field}={state[field]} but "
                    f"this run has {getattr(self, field)}: resume with the same --data, --seq-len, "
                    "--tokenizer and --global-batch as the checkpointed run"
                )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._perm_epoch = -1


def microbatches(data: torch.Tensor, indices: torch.Tensor, micro_batch: int) -> list[dict]:
    """Cut this rank's local batch into consecutive micro-batches of ``micro_batch`` sequences.

    Args:
        data: packed sequences, ``[n, seq_len + 1]`` int64 (``TokenData.train`` or ``.val``).
        indices: rows of ``data`` for this rank and step, ``[local_batch]`` int64.
        micro_batch: sequences per micro-batch; must divide ``len(indices)``.

    Returns:
        ``len(indices) // micro_batch`` dicts ``{"input_ids": [mb, seq_len], "labels": [mb, seq_len]}``
        (int64), where ``labels`` is ``input_ids`` shifted left by one (the next token).

    Raises:
        ShardwiseConfigError: ``micro_batch < 1`` or it does not divide ``len(indices)``.
    """
    n = indices.numel()
    if micro_batch < 1 or n % micro_batch:
        raise ShardwiseConfigError(
            f"--micro-batch {micro_batch} does not divide the {n} sequences per dp rank "
            f"(global batch / dp): choose a divisor of {n}"
        )
    rows = data.index_select(0, indices)  # [n, seq_len + 1]
    out = []
    for chunk in rows.split(micro_batch):  # each [mb, seq_len + 1]
        out.append({"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()})
    return out
