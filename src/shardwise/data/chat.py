"""Chat-format SFT data: ``{"messages": [{"role", "content"}, …]}`` records, the loss on the
assistant turns only.

Input: a ``.jsonl`` file, one record per line, each with a ``messages`` list of
``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` holding at least one
assistant turn (the format of TRL's ``SFTTrainer`` and of most instruction sets on the Hub).

Rendering: with ``--init-from-hf DIR`` whose tokenizer has a chat template
(``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``), each conversation is
rendered by transformers' ``apply_chat_template`` of that folder, i.e. exactly the text the
model was tuned on. Without one, a plain built-in template::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>\\n

Masking: the rendered text is cut into segments at the turn boundaries, found by rendering
prefixes of the conversation: for assistant turn i, ``render(messages[:i],
add_generation_prompt=True)`` ends where the assistant's text begins and ``render(messages[:i +
1])`` where it ends (every template we know renders a conversation as the concatenation of its
turns; one that does not is refused, naming the line). The segment between the two — the
assistant's content and the template's own end-of-turn marker (``<|eot_id|>``, ``<|im_end|>``) —
is a target, everything else (system, user, tool turns, the headers of every turn) is masked.
Segments are tokenized separately and concatenated, so each boundary is exact (as in
:mod:`.sft`); labels follow :func:`encode_segments`.

Errors: :class:`~shardwise.errors.ShardwiseConfigError` naming ``FILE:LINE`` and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardwise.errors import ShardwiseConfigError, ShardwiseFileError
from shardwise.readers import read_json

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
Segments = list[tuple[str | list[int], bool]]  # (text, or token ids; is a target)


def check_chat_record(rec: dict, where: str) -> None:
    """Raise ShardwiseConfigError (``where`` = ``--data FILE:LINE``) unless ``rec`` is a chat
    record: ``messages`` a list of {role in :data:`ROLES`, content str} with ≥ 1 assistant."""
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ShardwiseConfigError(f"{where}: \"messages\" must be a non-empty list of "
                                   '{"role", "content"} objects')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                or m.get("role") not in ROLES:
            raise ShardwiseConfigError(
                f"{where}: messages[{j}] = {str(m)[:80]}: each message needs \"role\" (one of "
                f"{', '.join(ROLES)}) and a string \"content\"")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ShardwiseConfigError(f"{where}: no assistant message, so nothing to learn: add "
                                   "the assistant's reply (the loss is on assistant turns only)")


def builtin_segments(messages: list[dict], eos_id: int) -> Segments:
    """The built-in template's segments (module docstring): headers and non-assistant content
    masked; each assistant content and the EOS id ``eos_id`` after it a target."""
    out: Segments = []
    for m in messages:
        if m["role"] == "assistant":
            out += [("<|assistant|>\n", False), (m["content"], True), ([eos_id], True),
                    ("\n", False)]
        else:
            out.append((f"<|{m['role']}|>\n{m['content']}\n", False))
    return out


def has_chat_template(folder: str | os.PathLike | None) -> bool:
    """True when the HF folder's tokenizer carries a chat template."""
    if not folder:
        return False
    f = Path(folder)
    if (f / "chat_template.jinja").is_file():
        return True
    cfg = f / "tokenizer_config.json"
    try:
        return bool(read_json(cfg, "tokenizer_config.json").get("chat_template"))
    except ShardwiseFileError:  # missing or not JSON: no template
        return False


class TemplateRenderer:
    """``apply_chat_template`` of the HF folder ``folder`` (transformers' own Jinja renderer)."""

    def __init__(self, folder: str | os.PathLike):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.source = f"{folder}'s chat template"

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def segments(self, messages: list[dict], where: str) -> Segments:
        """The conversation's segments (module docstring: rendered prefixes)."""
        out: Segments = []
        done = ""  # the text rendered so far
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (before.startswith(done) and through.startswith(before)):
                raise ShardwiseConfigError(
                    f"{where}: {self.source} does not render this conversation as the "
                    f"concatenation of its turns (message {i}), so the assistant tokens cannot be "
                    "told apart: use a folder whose template does, or --tokenizer bytes/bpe for "
                    "the built-in template")
            out += [(before[len(done):], False), (through[len(before):], True)]
            done = through
        full = self.render(messages)
        if full.startswith(done) and len(full) > len(done):
            out.append((full[len(done):], False))
        return out


def encode_segments(tok, segments: Segments, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int, int, bool] | None:
    """Segments → (``tokens`` [seq_len + 1] int64 right-padded with EOS, ``labels`` [seq_len]
    int64, target tokens kept, input positions used, whether targets were cut off), or None
    when no target fits the row.

    Each segment is tokenized on its own; ``labels[t] = tokens[t + 1]`` where token t + 1 comes
    from a target segment, −100 elsewhere (and on padding). Cut on the right at seq_len + 1
    tokens. A segment given as token ids (the built-in template's EOS) is taken as is."""
    ids: list[int] = []
    target: list[bool] = []
    for text, is_target in segments:
        part = list(text) if isinstance(text, list) else tok.encode(text) if text else []
        ids += part
        target += [is_target] * len(part)
    cut = sum(target[seq_len + 1:]) > 0
    ids, target = ids[: seq_len + 1], target[: seq_len + 1]
    kept = sum(target[1:])
    if kept == 0:
        return None
    tokens = torch.full((seq_len + 1,), tok.eos_id, dtype=torch.long)
    tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    for t in range(len(ids) - 1):
        if target[t + 1]:
            labels[t] = ids[t + 1]
    return tokens, labels, kept, len(ids) - 1, cut
