"""Packed SFT rows: several examples in one row, each attending only to itself.

An SFT example is a run of model inputs and targets: ``inputs`` [n] and ``labels`` [n]
(``labels[t]`` the target after ``inputs[t]``, −100 where not counted), n ≤ seq_len. One per
row (:mod:`.sft`) pads every row to ``seq_len``; short examples then waste most of each row.
``--pack`` places examples one after another in a row instead (first fit, in file order: each
example goes into the first row with room, else a new row), and makes the row compute exactly
what the examples compute alone:

* ``position_ids`` restart at 0 for each example (RoPE / learned positions as if alone);
* ``document_ids`` name each token's example; the model's attention is then block-diagonal
  causal (:func:`shardwise.models.llama.document_mask`): token t attends u iff u ≤ t and both
  lie in the same example;
* the labels are the examples' own, so the summed token loss, the count and every gradient of a
  packed batch equal those of the same examples unpacked (tests/test_pack.py, in one process
  and in dp, ZeRO-3, tp and pp layouts).

The rest of a row is padding: input EOS, label −100, its own document (id −1) with positions
0, 1, … (so it attends only to padding and nothing attends to it). An example longer than a
row was already cut to ``seq_len`` by the encoder. Context parallelism takes packed rows on the
explicit engine: each cp rank keeps the per-document positions of its chunks, and its ring (or
all-gather) attention masks every K/V block by where each query's document starts
(docs/context-parallel.md, packed rows). ``--engine torch`` is refused with ``--pack``: its
model call passes no positions or document ids, and its context parallelism takes no attention
mask (:func:`check_pack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.errors import ShardwiseConfigError

IGNORE_INDEX = -100
PAD_DOCUMENT = -1


@dataclass
class PackedRows:
    """``input_ids``, ``labels``, ``position_ids``, ``document_ids``: [rows, seq_len] int64.
    ``examples``: how many examples the rows hold; ``padding_fraction``: share of the
    rows' positions that are padding."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    examples: int

    @property
    def padding_fraction(self) -> float:
        return float((self.document_ids == PAD_DOCUMENT).float().mean()) \
            if self.document_ids.numel() else 0.0

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of example indices: each length goes into the first bin with room (in the given
    order), else a new bin. Raises ``ValueError`` for a length outside 1..capacity."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"example {i} has {n} positions; a row holds 1..{capacity}")
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([])
            room.append(capacity)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= n
    return bins


def pack_examples(inputs: list[torch.Tensor], labels: list[torch.Tensor], seq_len: int,
                  pad_id: int) -> PackedRows:
    """Pack examples (``inputs[i]``, ``labels[i]``: [n_i] int64, n_i ≤ ``seq_len``) into rows
    of ``seq_len`` (module docstring). Documents are numbered 0, 1, … within each row."""
    bins = first_fit([len(x) for x in inputs], seq_len)
    shape = (len(bins), seq_len)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    lab = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(shape, dtype=torch.long)
    doc = torch.full(shape, PAD_DOCUMENT, dtype=torch.long)
    for r, members in enumerate(bins):
        o = 0
        for d, i in enumerate(members):
            n = len(inputs[i])
            ids[r, o:o + n], lab[r, o:o + n] = inputs[i], labels[i]
            pos[r, o:o + n] = torch.arange(n)
            doc[r, o:o + n] = d
            o += n
        pos[r, o:] = torch.arange(seq_len - o)  # the padding: its own document
    return PackedRows(ids, lab, pos, doc, examples=len(inputs))


def unpadded(tokens: torch.Tensor, labels: torch.Tensor, lengths: list[int]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The examples of padded SFT rows (``tokens`` [n, seq_len + 1], ``labels`` [n, seq_len],
    example i's inputs the first ``lengths[i]`` positions) as (inputs, labels) lists."""
    return ([tokens[i, :n] for i, n in enumerate(lengths)],
            [labels[i, :n] for i, n in enumerate(lengths)])


def check_pack(task: str, cp: int, engine: str) -> None:
    """Raise :class:`ShardwiseConfigError` where ``--pack`` cannot run (before any collective):
    only ``--task sft``; not ``--engine torch`` (its model call passes no positions or document
    ids, and with ``--cp > 1`` PyTorch's ``context_parallel`` ring attention takes no attention
    mask). ``--cp > 1`` on the explicit engine runs (the cp attention honours the mask)."""
    if task != "sft":
        raise ShardwiseConfigError(f"--pack packs SFT examples, but --task is {task}: use "
                                   "--task sft (language-model text is packed already)")
    if engine == "torch" and cp > 1:
        raise ShardwiseConfigError(
            f"--pack with --engine torch --cp {cp}: PyTorch's context_parallel ring attention "
            "takes no attention mask for scaled_dot_product_attention (torch 2.13: "
            "NotImplementedError: attn_bias is not supported yet), so it cannot keep each "
            "document to itself: use --engine explicit (its ring attention takes the document "
            "mask)")
    if engine == "torch":
        raise ShardwiseConfigError("--pack with --engine torch: the torch engine's model call "
                                   "passes no positions or document ids: use --engine explicit")
