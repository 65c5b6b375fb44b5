"""Supervised fine-tuning data: alpaca-style records, prompt tokens masked out of the loss.

Input: a ``.jsonl`` file, one JSON object per line with string fields ``instruction``,
``output`` and optionally ``input`` (blank lines are skipped); or chat records
``{"messages": [...]}``, one format per file (:mod:`.chat`: the loss on assistant turns only). Each record becomes the text
``PROMPT + output + EOS`` with the prompt template of Stanford Alpaca (Taori et al. 2023)::

    Below is an instruction that describes a task[, paired with an input that provides further
    context]. Write a response that appropriately completes the request.

    ### Instruction:
    {instruction}

    [### Input:
    {input}

    ]### Response:
    {output}<eos>

Masking: the prompt and the response are tokenized separately and concatenated, so the boundary
is exact. Row ``t`` of the labels is the next token ``tokens[t + 1]`` when that token belongs to
the response (or is the final EOS), and ``IGNORE_INDEX`` (−100) when it is a prompt token or
padding. The loss is the mean over response tokens only, so prompt tokens contribute exactly zero
gradient (tests/test_sft.py checks ∂loss/∂logits = 0 at every masked position).

Packing: **one example per row, right-padded** to ``seq_len + 1`` tokens (padding id = EOS,
label −100). With causal attention a real token only attends to earlier positions, i.e. to its
own example, never to padding or to another example — no attention mask and no model change are
needed. The cost is the padding: the run description reports the fraction of padded positions
(compute spent on them is wasted). ``--pack`` recovers it (:mod:`.pack`: several examples per
row, a block-diagonal document mask). An example longer than the row is cut on the
right (its response truncated); one whose prompt alone fills the row is dropped (it has no
response token to learn), and both are counted in ``stats``.

Split: record ``i`` is validation when ``i % val_every == val_every - 1``; with fewer than
``val_every`` records, the last one. The token rows are not cached (an SFT file is small).

Errors: :class:`~shardwise.errors.ShardwiseConfigError` naming ``FILE:LINE`` and the fix.
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

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def format_prompt(record: dict) -> str:
    """The Alpaca prompt of ``record`` (the text before the response)."""
    if record.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=record["input"])
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])


def load_sft_records(path: str | os.PathLike) -> list[dict]:
    """Parse and check the records of ``path`` (see module doc).

    Raises:
        ShardwiseConfigError: missing file, a line that is not a JSON object, a missing or
            non-string ``instruction``/``output``, a non-string ``input``, fewer than 2 records.
    """
    path = Path(path)
    fix = {"missing": 'give a .jsonl file of {"instruction", "input", "output"} records',
           "encoding": "re-encode the file as UTF-8", "syntax": "write one JSON object per line"}
    records = []
    for no, rec in iter_jsonl(path, "--data", fix):
        where = f"--data {path}:{no}"
        if not isinstance(rec, dict):
            raise ShardwiseConfigError(f"{where}: expected a JSON object with \"instruction\" and "
                                       f"\"output\" (or \"messages\"), got {type(rec).__name__}")
        kind = "chat" if "messages" in rec else "alpaca"
        if records and kind != ("chat" if "messages" in records[0] else "alpaca"):
            raise ShardwiseConfigError(f"{where}: a {kind} record in a file whose first record is "
                                       "not: keep one format per file (messages, or instruction/"
                                       "output)")
        if kind == "chat":
            from shardwise.data.chat import check_chat_record

            check_chat_record(rec, where)
            records.append(rec)
            continue
        for key in ("instruction", "output"):
            if key not in rec:
                raise ShardwiseConfigError(f"{where}: missing field {key!r}: every record needs "
                                           '"instruction" and "output" ("input" is optional)')
            if not isinstance(rec[key], str):
                raise ShardwiseConfigError(f"{where}: field {key!r} is "
                                           f"{type(rec[key]).__name__}, not a string: quote it")
        if not isinstance(rec.get("input", ""), str):
            raise ShardwiseConfigError(f"{where}: field 'input' is {type(rec['input']).__name__}, "
                                       "not a string: quote it or leave it out")
        records.append(rec)
    if len(records) < 2:
        raise ShardwiseConfigError(f"--data {path}: {len(records)} record(s); SFT needs at least "
                                   "2 (one is held out for validation): add records")
    return records


def encode_example(tok: Tokenizer, record: dict, seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """One record → (``tokens`` [seq_len + 1] int64, ``labels`` [seq_len] int64, response
    tokens kept), or None when the prompt alone fills the row.

    ``tokens[:-1]`` are the model's inputs; ``labels[t] = tokens[t + 1]`` for response/EOS
    targets and :data:`IGNORE_INDEX` for prompt targets and padding."""
    prompt = tok.encode(format_prompt(record))
    response = tok.encode(record["output"]) + [tok.eos_id]
    if len(prompt) > seq_len:  # no response token would be a target inside the row
        return None
    full = (prompt + response)[: seq_len + 1]
    kept = len(full) - len(prompt)
    tokens = torch.full((seq_len + 1,), tok.eos_id, dtype=torch.long)
    tokens[: len(full)] = torch.tensor(full, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    # target positions t whose next token is a response token: t + 1 in [len(prompt), len(full))
    labels[len(prompt) - 1: len(full) - 1] = tokens[len(prompt): len(full)]
    return tokens, labels, kept


@dataclass
class SFTData:
    """Padded SFT rows. ``train``/``val``: ``[n, seq_len + 1]`` int64 tokens;
    ``train_labels``/``val_labels``: ``[n, seq_len]`` int64 (−100 = not counted)."""

    train: torch.Tensor
    train_labels: torch.Tensor
    val: torch.Tensor
    val_labels: torch.Tensor
    tokenizer: Tokenizer
    vocab_size: int
    prompts: list[str] = field(default_factory=list)  # validation prompts (for sampling)
    stats: dict = field(default_factory=dict)
    # input positions each example uses in its row (the rest is padding): what --pack packs
    train_lengths: list[int] = field(default_factory=list)
    val_lengths: list[int] = field(default_factory=list)
    # chat rows from a model folder's tokenizer: each validation prompt's ids (template applied)
    prompt_ids: list[list[int]] = field(default_factory=list)


def record_segments(record: dict, eos_id: int, renderer=None, where: str = ""):
    """The (text or ids, is-target) segments of one record: an alpaca record's prompt (masked)
    then its output and EOS (targets); a chat record's turns through ``renderer`` (a
    :class:`~.chat.TemplateRenderer`) or the built-in template (:mod:`.chat`)."""
    if "messages" in record:
        from shardwise.data.chat import builtin_segments

        if renderer is not None:
            return renderer.segments(record["messages"], where)
        return builtin_segments(record["messages"], eos_id)
    return [(format_prompt(record), False), (record["output"], True), ([eos_id], True)]


def record_text(record: dict) -> str:
    """A record's text, for training a BPE on it."""
    if "messages" in record:
        return "\n".join(m["content"] for m in record["messages"])
    return format_prompt(record) + record["output"]


def prepare_sft_data(path: str | os.PathLike, tokenizer: str = "bpe", vocab_size: int = 4096,
                     seq_len: int = 128, val_every: int = 20, cache_dir: Path | None = None,
                     template_dir: str | os.PathLike | None = None) -> SFTData:
    """Records of ``path`` → padded token rows and masked labels (see module doc; chat records:
    :mod:`.chat`, rendered with ``template_dir``'s chat template when it has one).

    ``tokenizer``: ``"bytes"``, a tokenizer ``.json``, or ``"bpe"`` (trained on the training
    records' prompt + response text, cached like the LM tokenizer).

    Raises:
        ShardwiseConfigError: as :func:`load_sft_records`; or every example of a split is dropped
            because its prompt is longer than ``seq_len`` tokens.
    """
    from shardwise.data.chat import (HFChatTemplate, TemplateRenderer, encode_ids,
                                     encode_segments, has_chat_template)
    from shardwise.data.corpus import default_cache_dir
    from shardwise.data.hf_tokenizer import HFFolderTokenizer

    records = load_sft_records(path)
    is_val = [i % val_every == val_every - 1 for i in range(len(records))]
    if not any(is_val):
        is_val[-1] = True
    chat = "messages" in records[0]
    lines = _record_lines(path)
    train_recs = [(r, n) for r, n, v in zip(records, lines, is_val) if not v]
    val_recs = [(r, n) for r, n, v in zip(records, lines, is_val) if v]
    tok = load_tokenizer(tokenizer, [record_text(r) for r, _ in train_recs], vocab_size,
                         Path(cache_dir) if cache_dir is not None else default_cache_dir())
    # the model folder's own tokenizer: rows are apply_chat_template's ids (chat.HFChatTemplate)
    hf_chat = HFChatTemplate(tok) if chat and isinstance(tok, HFFolderTokenizer) else None
    renderer = (TemplateRenderer(template_dir) if chat and hf_chat is None
                and has_chat_template(template_dir) else None)
    source = hf_chat or renderer
    stats = {"records": len(records), "format": "chat" if chat else "alpaca",
             "template": (source.source if source else "the built-in template") if chat
             else "alpaca",
             "mask_rule": hf_chat.rule if hf_chat else "segments tokenized one by one"}

    def encode(r, n):
        where = f"--data {path}:{n}"
        if hf_chat is not None:
            return encode_ids(*hf_chat.row(r["messages"], where), seq_len, tok.pad_id)
        return encode_segments(tok, record_segments(r, tok.eos_id, renderer, where), seq_len)

    out, lengths, prompts, prompt_ids = [], {}, [], []
    for name, recs in (("train", train_recs), ("val", val_recs)):
        rows = [encode(r, n) for r, n in recs]
        kept = [x for x in rows if x is not None]
        if not kept:
            shortest = min(_prompt_tokens(tok, record_segments(r, tok.eos_id, renderer))
                           if hf_chat is None else  # the first assistant token's position
                           hf_chat.row(r["messages"], "")[1].index(1) for r, _ in recs)
            raise ShardwiseConfigError(
                f"--task sft: every {name} prompt is longer than --seq-len {seq_len} tokens "
                f"(shortest: {shortest}), so no response token fits: raise --seq-len (≥ "
                f"{shortest + 16}) or shorten the instructions")
        stats[f"{name}_examples"] = len(kept)
        stats[f"{name}_dropped"] = len(rows) - len(kept)
        stats[f"{name}_response_tokens"] = int(sum(x[2] for x in kept))
        lengths[name] = [x[3] for x in kept]
        out.append((torch.stack([x[0] for x in kept]), torch.stack([x[1] for x in kept])))
        if name == "train":
            stats["padding_fraction"] = 1 - sum(lengths[name]) / (len(kept) * seq_len)
            stats["truncated"] = sum(1 for x in kept if x[4])
        else:
            val_kept = [r for (r, _), x in zip(recs, rows) if x is not None]
            prompts = [_prompt_of(r, source) for r in val_kept]
            if hf_chat is not None:  # the ids a sample continues, special tokens as such
                prompt_ids = [hf_chat.prompt_ids(_prompt_messages(r)) for r in val_kept]
    (train, train_labels), (val, val_labels) = out
    return SFTData(train=train, train_labels=train_labels, val=val, val_labels=val_labels,
                   tokenizer=tok, vocab_size=tok.vocab_size, prompts=prompts, stats=stats,
                   train_lengths=lengths["train"], val_lengths=lengths["val"],
                   prompt_ids=prompt_ids)


def _prompt_of(record: dict, renderer) -> str:
    """The text a sample continues: the alpaca prompt, or the conversation up to its last
    assistant turn with the generation prompt."""
    if "messages" not in record:
        return format_prompt(record)
    msgs = _prompt_messages(record)
    if renderer is not None:
        return renderer.render(msgs, generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"


def _prompt_messages(record: dict) -> list[dict]:
    """A chat record's messages before its last assistant turn."""
    msgs = record["messages"]
    return msgs[:max(i for i, m in enumerate(msgs) if m["role"] == "assistant")]


def _prompt_tokens(tok, segments) -> int:
    """Tokens before the first target segment."""
    n = 0
    for text, is_target in segments:
        if is_target:
            break
        n += len(text) if isinstance(text, list) else len(tok.encode(text))
    return n


def _record_lines(path) -> list[int]:
    """The 1-based line number of each record of ``path`` (blank lines skipped)."""
    text = Path(path).read_text(encoding="utf-8").splitlines()
    return [i for i, line in enumerate(text, 1) if line.strip()]
