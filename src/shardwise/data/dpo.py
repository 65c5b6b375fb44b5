"""Preference data for DPO: ``prompt`` / ``chosen`` / ``rejected`` records, two rows per pair.

Input: a ``.jsonl`` file, one JSON object per line, in one of TRL's two explicit-prompt
preference formats (one per file; other fields are ignored; blank lines are skipped):
**standard** — three non-empty strings ``prompt``, ``chosen``, ``rejected``, used as written;
**conversational** — ``prompt`` a list of ``{"role", "content"}`` messages, ``chosen`` and
``rejected`` lists of assistant messages, rendered by the chat template.

Rows from a model folder's own tokenizer (:class:`~.hf_tokenizer.HFFolderTokenizer`): exactly
TRL's ``DPOTrainer`` tokenization — standard pairs: EOS text appended to each response unless it
ends with it, ``tokenizer(prompt)`` and ``tokenizer(prompt + response)`` (special tokens added,
e.g. Llama 3's BOS); conversational: ``apply_chat_template(prompt, add_generation_prompt=True)``
and ``apply_chat_template(prompt + response)``; either way the response starts where the prompt's
ids and both prompt + response ids stop agreeing (the shorter common prefix). Rows from our own
tokenizers: the prompt (conversational: rendered by the built-in template) and ``response + EOS``
tokenized separately and concatenated (so the boundary is exact, as in :mod:`.sft`).

Rows are right-padded to ``seq_len + 1`` tokens (padding id = PAD, else EOS). Labels ``[seq_len]``: the next token where it is a
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
        chat = all(isinstance(rec.get(k), list) for k in FIELDS)
        if chat:
            _check_chat_pair(rec, where)
        elif any(isinstance(rec.get(k), list) for k in FIELDS):
            raise ShardwiseConfigError(
                f"{where}: some of \"prompt\", \"chosen\", \"rejected\" are message lists and "
                "some are not: give all three as strings, or all three as lists of "
                '{"role", "content"} messages (TRL\'s conversational format)')
        else:
            _check_string_pair(rec, where)
        if rec["chosen"] == rec["rejected"]:
            raise ShardwiseConfigError(
                f"{where}: \"chosen\" and \"rejected\" are the same "
                f"{'messages' if chat else 'text'}: the pair carries no "
                "preference (its DPO gradient is zero); drop the line")
        if records and chat != isinstance(records[0]["prompt"], list):
            raise ShardwiseConfigError(
                f"{where}: a {'conversational' if chat else 'standard'} record in a file whose "
                "first record is not: keep one format per file")
        records.append({**{k: rec[k] for k in FIELDS}, "_line": no})
    if len(records) < 2:
        raise ShardwiseConfigError(f"--data {path}: {len(records)} record(s); DPO needs at least "
                                   "2 (one is held out for validation): add records")
    return records


def _check_string_pair(rec: dict, where: str) -> None:
    """A standard record: three non-empty strings (ShardwiseConfigError naming the field)."""
    for key in FIELDS:
        if key not in rec:
            raise ShardwiseConfigError(
                f"{where}: missing field {key!r}: every DPO record needs \"prompt\", "
                "\"chosen\" and \"rejected\" (a preference pair: the response preferred and "
                "the one not); fix or drop the line")
        if not isinstance(rec[key], str):
            raise ShardwiseConfigError(f"{where}: field {key!r} is {type(rec[key]).__name__}, not "
                                       "a string (or a list of messages): quote it")
        if not rec[key].strip():
            what = "prompt" if key == "prompt" else f"{key} response"
            raise ShardwiseConfigError(
                f"{where}: the {what} is empty: DPO compares log π(response | prompt) of "
                "two non-empty responses to a non-empty prompt; fix or drop the line")


def _check_chat_pair(rec: dict, where: str) -> None:
    """A conversational record: ``prompt`` a non-empty message list, ``chosen``/``rejected``
    non-empty lists of assistant messages (ShardwiseConfigError naming the field)."""
    from shardwise.data.chat import check_messages

    for key in FIELDS:
        msgs = rec[key]
        if not msgs:
            raise ShardwiseConfigError(f"{where}: {key!r} is an empty message list: fix or drop "
                                       "the line")
        check_messages(msgs, where, key)
        for j, m in enumerate(msgs):
            if key != "prompt" and m["role"] != "assistant":
                raise ShardwiseConfigError(
                    f"{where}: {key}[{j}] has role {m['role']!r}: a response is the assistant's "
                    "(TRL's conversational format: \"chosen\": [{\"role\": \"assistant\", "
                    "\"content\": ...}])")


def pair_ids(tok, rec: dict, template=None) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one record (module doc).

    ``tok``: an :class:`~.hf_tokenizer.HFFolderTokenizer` (TRL's rule; ``template`` its
    :class:`~.chat.HFChatTemplate` for conversational records) or one of our own tokenizers
    (prompt, then each response + EOS, tokenized separately)."""
    from shardwise.data.hf_tokenizer import HFFolderTokenizer

    chat = isinstance(rec["prompt"], list)
    if not isinstance(tok, HFFolderTokenizer):
        prompt = builtin_prompt(rec["prompt"]) if chat else rec["prompt"]
        text = (lambda r: "".join(m["content"] for m in r)) if chat else (lambda r: r)
        return (tok.encode(prompt), tok.encode(text(rec["chosen"])) + [tok.eos_id],
                tok.encode(text(rec["rejected"])) + [tok.eos_id])
    if chat:  # trl DPOTrainer._prepare_dataset, conversational
        p = template.prompt_ids(rec["prompt"])
        full = [template.ids(rec["prompt"] + rec[k]) for k in ("chosen", "rejected")]
    else:  # standard: EOS text appended unless present, tokenizer(...) adds BOS where it does
        eos = tok.hf.eos_token
        p = list(tok.hf(rec["prompt"])["input_ids"])
        full = [list(tok.hf(rec["prompt"] + (rec[k] if rec[k].endswith(eos) else rec[k] + eos))
                     ["input_ids"]) for k in ("chosen", "rejected")]
    n = min(_common_prefix(p, f) for f in full)
    return p[:n], full[0][n:], full[1][n:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def builtin_prompt(messages: list[dict]) -> str:
    """A conversational prompt in the built-in template (:mod:`.chat`), generation prompt
    included: the text our own tokenizers encode."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def encode_pair_row(prompt_ids: list[int], response_ids: list[int], seq_len: int, pad_id: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """One row: (``tokens`` [seq_len + 1] int64, ``labels`` [seq_len] int64, response targets
    kept, truncated?) for ``prompt_ids`` (≤ ``seq_len`` tokens, so at least one response target
    fits) followed by ``response_ids``, right-padded with ``pad_id``. ``labels[t] =
    tokens[t + 1]`` where ``t + 1`` is a response position, :data:`IGNORE_INDEX` elsewhere."""
    full = (prompt_ids + response_ids)[: seq_len + 1]
    n_p = len(prompt_ids)
    tokens = torch.full((seq_len + 1,), pad_id, dtype=torch.long)
    tokens[: len(full)] = torch.tensor(full, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[n_p - 1: len(full) - 1] = tokens[n_p: len(full)]
    return tokens, labels, len(full) - n_p, len(full) < n_p + len(response_ids)


@dataclass
class DPOData:
    """Preference rows. ``train``/``val``: ``[2n, seq_len + 1]`` int64 tokens, pair ``i`` in rows
    ``2i`` (chosen) and ``2i + 1`` (rejected); ``train_labels``/``val_labels``: ``[2n, seq_len]``
    int64 (−100 = not counted). ``prompts``: the validation prompts (for sampling), as text;
    ``prompt_ids``: their ids (a model folder's tokenizer: the template's special tokens)."""

    train: torch.Tensor
    train_labels: torch.Tensor
    val: torch.Tensor
    val_labels: torch.Tensor
    tokenizer: Tokenizer
    vocab_size: int
    prompts: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    prompt_ids: list[list[int]] = field(default_factory=list)


def prepare_dpo_data(path: str | os.PathLike, tokenizer: str = "bpe", vocab_size: int = 4096,
                     seq_len: int = 128, val_every: int = 20, cache_dir: Path | None = None
                     ) -> DPOData:
    """Records of ``path`` → paired padded rows and masked labels (module doc).

    ``tokenizer``: ``"bytes"``, a tokenizer ``.json``, an HF model folder, or ``"bpe"`` (trained
    on the training records' prompt + response texts, cached like the LM tokenizer).

    Raises:
        ShardwiseConfigError: as :func:`load_dpo_records`; or a prompt longer than ``seq_len``
            tokens (naming its line, the prompt's length and the fix).
    """
    from shardwise.data.chat import HFChatTemplate
    from shardwise.data.corpus import default_cache_dir
    from shardwise.data.hf_tokenizer import HFFolderTokenizer

    records = load_dpo_records(path)
    is_val = [i % val_every == val_every - 1 for i in range(len(records))]
    if not any(is_val):
        is_val[-1] = True
    train_recs = [r for r, v in zip(records, is_val) if not v]
    chat = isinstance(records[0]["prompt"], list)
    flat = (lambda x: "\n".join(m["content"] for m in x)) if chat else (lambda x: x)
    docs = [flat(r["prompt"]) + flat(r[k]) for r in train_recs for k in ("chosen", "rejected")]
    tok = load_tokenizer(tokenizer, docs, vocab_size,
                         Path(cache_dir) if cache_dir is not None else default_cache_dir())
    template = HFChatTemplate(tok) if chat and isinstance(tok, HFFolderTokenizer) else None
    pad = getattr(tok, "pad_id", tok.eos_id)
    stats = {"records": len(records), "truncated": 0, "response_tokens": 0,
             "format": "conversational" if chat else "standard"}
    out = {"train": ([], []), "val": ([], [])}
    prompts, prompt_ids = [], []
    for rec, val in zip(records, is_val):
        p_ids, *responses = pair_ids(tok, rec, template)
        if len(p_ids) > seq_len:
            raise ShardwiseConfigError(
                f"--data {path}:{rec['_line']}: the prompt is {len(p_ids)} tokens, longer "
                f"than --seq-len {seq_len}, so no response token fits in its row: raise "
                f"--seq-len (≥ {len(p_ids) + 16}) or shorten or drop the prompt")
        rows, labels = out["val" if val else "train"]
        for r_ids in responses:
            t, lb, kept, cut = encode_pair_row(p_ids, r_ids, seq_len, pad)
            rows.append(t)
            labels.append(lb)
            stats["truncated"] += int(cut)
            stats["response_tokens"] += kept
        if val:
            prompts.append(template.render(rec["prompt"], True) if template else
                           builtin_prompt(rec["prompt"]) if chat else rec["prompt"])
            prompt_ids.append(p_ids)
    n_rows = len(out["train"][0]) + len(out["val"][0])
    real = sum(int((lb != IGNORE_INDEX).sum()) for split in out.values() for lb in split[1])
    stats["train_pairs"], stats["val_pairs"] = len(train_recs), len(records) - len(train_recs)
    stats["response_fraction"] = real / (n_rows * seq_len)
    (train, train_lb), (val, val_lb) = ((torch.stack(r), torch.stack(lb))
                                        for r, lb in (out["train"], out["val"]))
    return DPOData(train=train, train_labels=train_lb, val=val, val_labels=val_lb,
                   tokenizer=tok, vocab_size=tok.vocab_size, prompts=prompts, stats=stats,
                   prompt_ids=prompt_ids if isinstance(tok, HFFolderTokenizer) else [])
