"""Preference data for DPO: ``prompt`` / ``chosen`` / ``rejected`` records, two rows per pair.

Input: a ``.jsonl`` file, one JSON object per line with three non-empty string fields
``prompt``, ``chosen`` and ``rejected`` (other fields are ignored; blank lines are skipped). This
is the "standard, explicit prompt" preference format of TRL's ``DPOTrainer``. The prompt is used
as written (no template): put any chat or instruction template into the file.

Rows: each response becomes the text ``prompt + response + EOS``, the prompt and the response
tokenized separately and concatenated (so the boundary is exact, as in :mod:`.sft`), right-padded
to ``seq_len + 1`` tokens (padding id = EOS). Labels ``[seq_len]``: the next token where it is a
response token or the final EOS, ``IGNORE_INDEX`` (−100) on prompt and padding targets, so the
sum of the counted log-probs of a row is ``log π(response | prompt)``. A pair is **two adjacent
rows**, chosen at ``2i`` and rejected at ``2i + 1``, and every batch is cut in whole pairs, so a
pair always lands in one micro-batch on one rank, whatever the layout.

A response longer than the row is cut on the right (counted in ``stats["truncated"]``); a prompt
longer than ``seq_len`` tokens leaves no response token in the row and is an error (naming the
line), as are: a missing, non-string or empty (blank) field, a line that is not a JSON object,
a pair whose two responses are the same text (it carries no preference), fewer than 2 records.

Split: record ``i`` is validation when ``i % val_every == val_every - 1``; with fewer than
``val_every`` records, the last one.

Errors: :class:`~shardwise.errors.ShardwiseConfigError` naming ``FILE:LINE`` and the fix. They
are raised while the file is read, before any process group exists (on every rank alike).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.data.tokenizer import Tokenizer, load_tokenizer
from shardwise.errors import ShardwiseConfigError
from shardwise.readers import iter_jsonl

IGNORE_INDEX = -100  # the same value as shardwise.models.IGNORE_INDEX (data/ imports no models)
FIELDS = ("prompt", "chosen", "rejected")
FORMAT = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def load_dpo_records(path: str | os.PathLike) -> list[dict]:
    """Parse and check the preference records of ``path`` (see module doc). Each returned
    record carries its 1-based line number under ``"_line"``.

    Raises:
        ShardwiseConfigError: missing file, not UTF-8, a line that is not a JSON object, a
            missing, non-string or blank ``prompt``/``chosen``/``rejected``, ``chosen`` equal to
            ``rejected``, fewer than 2 records — each naming ``FILE:LINE``.
    """
    path = Path(path)
    fix = {"missing": f"give a .jsonl file of {FORMAT} records, one per line",
           "encoding": "re-encode the file as UTF-8",
           "syntax": f"write one {FORMAT} object per line"}
    records = []
    for no, rec in iter_jsonl(path, "--data", fix):
        where = f"--data {path}:{no}"
        if not isinstance(rec, dict):
            raise ShardwiseConfigError(f"{where}: expected a JSON object {FORMAT}, got "
                                       f"{type(rec).__name__}")
        for key in FIELDS:
            if key not in rec:
                raise ShardwiseConfigError(
                    f"{where}: missing field {key!r}: every DPO record needs \"prompt\", "
                    "\"chosen\" and \"rejected\" (a preference pair: the response preferred and "
                    "the one not); fix or drop the line")
            if not isinstance(rec[key], str):
                kind = type(rec[key]).__name__
                hint = (" (conversational message lists are not supported: apply the chat "
                        "template and give plain text)" if isinstance(rec[key], (list, dict))
                        else ": quote it")
                raise ShardwiseConfigError(f"{where}: field {key!r} is {kind}, not a string"
                                           + hint)
            if not rec[key].strip():
                what = "prompt" if key == "prompt" else f"{key} response"
                raise ShardwiseConfigError(
                    f"{where}: the {what} is empty: DPO compares log π(response | prompt) of "
                    "two non-empty responses to a non-empty prompt; fix or drop the line")
        if rec["chosen"] == rec["rejected"]:
            raise ShardwiseConfigError(
                f"{where}: \"chosen\" and \"rejected\" are the same text: the pair carries no "
                "preference (its DPO gradient is zero); drop the line")
        records.append({**{k: rec[k] for k in FIELDS}, "_line": no})
    if len(records) < 2:
        raise ShardwiseConfigError(f"--data {path}: {len(records)} record(s); DPO needs at least "
                                   "2 (one is held out for validation): add records")
    return records


def encode_response(tok: Tokenizer, prompt_ids: list[int], response: str, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """One row: (``tokens`` [seq_len + 1] int64, ``labels`` [seq_len] int64, response targets
    kept, truncated?) for ``prompt_ids`` (≤ ``seq_len`` tokens, so at least one response target
    fits) followed by ``response`` + EOS. ``labels[t] = tokens[t + 1]`` where ``t + 1`` is a
    response/EOS position, :data:`IGNORE_INDEX` elsewhere."""
    response_ids = tok.encode(response) + [tok.eos_id]
    full = (prompt_ids + response_ids)[: seq_len + 1]
    n_p = len(prompt_ids)
    tokens = torch.full((seq_len + 1,), tok.eos_id, dtype=torch.long)
    tokens[: len(full)] = torch.tensor(full, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[n_p - 1: len(full) - 1] = tokens[n_p: len(full)]
    return tokens, labels, len(full) - n_p, len(full) < n_p + len(response_ids)


@dataclass
class DPOData:
    """Preference rows. ``train``/``val``: ``[2n, seq_len + 1]`` int64 tokens, pair ``i`` in rows
    ``2i`` (chosen) and ``2i + 1`` (rejected); ``train_labels``/``val_labels``: ``[2n, seq_len]``
    int64 (−100 = not counted). ``prompts``: the validation prompts (for sampling)."""

    train: torch.Tensor
    train_labels: torch.Tensor
    val: torch.Tensor
    val_labels: torch.Tensor
    tokenizer: Tokenizer
    vocab_size: int
    prompts: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def prepare_dpo_data(path: str | os.PathLike, tokenizer: str = "bpe", vocab_size: int = 4096,
                     seq_len: int = 128, val_every: int = 20, cache_dir: Path | None = None
                     ) -> DPOData:
    """Records of ``path`` → paired padded rows and masked labels (module doc).

    ``tokenizer``: ``"bytes"``, a tokenizer ``.json``, or ``"bpe"`` (trained on the training
    records' prompt + response texts, cached like the LM tokenizer).

    Raises:
        ShardwiseConfigError: as :func:`load_dpo_records`; or a prompt longer than ``seq_len``
            tokens (naming its line, the prompt's length and the fix).
    """
    from shardwise.data.corpus import default_cache_dir

    records = load_dpo_records(path)
    is_val = [i % val_every == val_every - 1 for i in range(len(records))]
    if not any(is_val):
        is_val[-1] = True
    train_recs = [r for r, v in zip(records, is_val) if not v]
    docs = [r["prompt"] + r[k] for r in train_recs for k in ("chosen", "rejected")]
    tok = load_tokenizer(tokenizer, docs, vocab_size,
                         Path(cache_dir) if cache_dir is not None else default_cache_dir())
    stats = {"records": len(records), "truncated": 0, "response_tokens": 0}
    out = {"train": ([], []), "val": ([], [])}
    for rec, val in zip(records, is_val):
        prompt_ids = tok.encode(rec["prompt"])
        if len(prompt_ids) > seq_len:
            raise ShardwiseConfigError(
                f"--data {path}:{rec['_line']}: the prompt is {len(prompt_ids)} tokens, longer "
                f"than --seq-len {seq_len}, so no response token fits in its row: raise "
                f"--seq-len (≥ {len(prompt_ids) + 16}) or shorten or drop the prompt")
        rows, labels = out["val" if val else "train"]
        for key in ("chosen", "rejected"):
            t, lb, kept, cut = encode_response(tok, prompt_ids, rec[key], seq_len)
            rows.append(t)
            labels.append(lb)
            stats["truncated"] += int(cut)
            stats["response_tokens"] += kept
    n_rows = len(out["train"][0]) + len(out["val"][0])
    real = sum(int((lb != IGNORE_INDEX).sum()) for split in out.values() for lb in split[1])
    stats["train_pairs"], stats["val_pairs"] = len(train_recs), len(records) - len(train_recs)
    stats["response_fraction"] = real / (n_rows * seq_len)
    (train, train_lb), (val, val_lb) = ((torch.stack(r), torch.stack(lb))
                                        for r, lb in (out["train"], out["val"]))
    return DPOData(train=train, train_labels=train_lb, val=val, val_labels=val_lb,
                   tokenizer=tok, vocab_size=tok.vocab_size,
                   prompts=[r["prompt"] for r, v in zip(records, is_val) if v], stats=stats)
