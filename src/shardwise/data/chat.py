"""Chat-format SFT data: ``{"messages": [{"role", "content"}, …]}`` records, the loss on the
assistant turns only.

Input: a ``.jsonl`` file, one record per line, each with a ``messages`` list of
``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` holding at least one
assistant turn (the format of TRL's ``SFTTrainer`` and of most instruction sets on the Hub).

Rows from a model folder's own tokenizer (``--init-from-hf DIR`` or ``--tokenizer DIR``:
:class:`HFChatTemplate`): the ids are exactly transformers'
``apply_chat_template(messages, tokenize=True)`` — the template's special tokens
(``<|eot_id|>``, ``<|im_end|>``, ``[INST]``) are special tokens, and so, as in transformers, is
special-token text written inside a message (docs/interop.md). The label mask: transformers'
``return_assistant_tokens_mask`` when the template marks the assistant's output with
``{% generation %}``; otherwise the **segment rule** on the same ids: for assistant turn i,
``render(messages[:i], add_generation_prompt=True)`` ends where its turn begins (where that is
no prefix of the turn's rendering — Mistral v0.3 moves the system message into the last user
turn — where its content begins) and ``render(messages[:i + 1])``, a prefix of the whole, ends
where it ends (the content and the template's end-of-turn marker);
each token overlapping such a character span is a target (transformers' own span → token rule).
A template that does not render a conversation as the concatenation of its turns is refused,
naming the line and the fix (add generation marks). A folder with no template uses
:data:`BUILTIN_TEMPLATE` through the same path.

Rows from our own tokenizers (bytes, bpe): the plain built-in template::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>\\n

cut into segments at the turn boundaries (each assistant content and the EOS after it a target),
each segment tokenized on its own (:func:`encode_segments`).

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


def check_messages(msgs: list, where: str, name: str) -> None:
    """Raise ShardwiseConfigError naming ``where`` and ``name[j]`` unless every item of ``msgs``
    is a ``{"role": one of ROLES, "content": str}`` message."""
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                or m.get("role") not in ROLES:
            raise ShardwiseConfigError(
                f"{where}: {name}[{j}] = {str(m)[:80]}: each message needs \"role\" (one of "
                f"{', '.join(ROLES)}) and a string \"content\"")


def check_chat_record(rec: dict, where: str) -> None:
    """Raise ShardwiseConfigError (``where`` = ``--data FILE:LINE``) unless ``rec`` is a chat
    record: ``messages`` a list of {role in :data:`ROLES`, content str} with ≥ 1 assistant."""
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ShardwiseConfigError(f"{where}: \"messages\" must be a non-empty list of "
                                   '{"role", "content"} objects')
    check_messages(msgs, where, "messages")
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


# the built-in template as Jinja, for a model folder without one (GPT-2): the same text as
# builtin_segments, the assistant content and EOS marked as the generation (the targets)
BUILTIN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def has_generation_marks(template: str) -> bool:
    """True when the Jinja ``template`` marks the assistant's output with ``{% generation %}``
    (whitespace control ``{%-`` included), so transformers can return the assistant mask."""
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character range ``[start, end)`` overlaps one of ``spans`` (sorted,
    disjoint ``[start, end)``), else 0: transformers' rule for ``return_assistant_tokens_mask``
    (``PreTrainedTokenizerBase.apply_chat_template``), so a token cut by a span border counts."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


class HFChatTemplate:
    """Chat rows from a model folder's tokenizer (module docstring): ``row(messages)`` is
    ``apply_chat_template(messages, tokenize=True)`` and its assistant mask.

    ``tok``: a :class:`~.hf_tokenizer.HFFolderTokenizer`. ``template``: the Jinja template to
    use instead of the folder's (default: the folder's, else :data:`BUILTIN_TEMPLATE`)."""

    def __init__(self, tok, template: str | None = None):
        self.tok, self.hf = tok, tok.hf
        own = tok.chat_template
        self.template = template or own or BUILTIN_TEMPLATE
        self.marked = has_generation_marks(self.template)
        self.source = (f"{tok.folder}'s chat template" if (template or own)
                       else "the built-in chat template (the folder has none)")
        self.rule = "its {% generation %} marks" if self.marked else "the segment rule"

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The conversation as text (what ``tokenize=True`` then encodes)."""
        return self.hf.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                           add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Ids of ``messages`` followed by the generation prompt (what a sample continues)."""
        return list(self.hf.apply_chat_template(
            messages, chat_template=self.template, tokenize=True, return_dict=True,
            add_generation_prompt=True)["input_ids"])

    def ids(self, messages: list[dict]) -> list[int]:
        """``apply_chat_template(messages, tokenize=True)``'s ids."""
        return list(self.hf.apply_chat_template(messages, chat_template=self.template,
                                                tokenize=True, return_dict=True)["input_ids"])

    def row(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation: the ids of ``apply_chat_template(tokenize=True)``,
        mask 1 on the assistant tokens. Raises ShardwiseConfigError (``where`` = ``FILE:LINE``)
        when the template raises or is not prefix-preserving (segment rule)."""
        try:
            if self.marked:
                out = self.hf.apply_chat_template(
                    messages, chat_template=self.template, tokenize=True, return_dict=True,
                    return_assistant_tokens_mask=True)
                return list(out["input_ids"]), list(out["assistant_masks"])
            text = self.render(messages)
            spans = self._assistant_spans(messages, text, where)
        except ShardwiseConfigError:
            raise
        except Exception as e:  # jinja2's TemplateError, the template's raise_exception
            raise ShardwiseConfigError(
                f"{where}: {self.source} cannot render this conversation ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}): fix the record or the template") from None
        # apply_chat_template(tokenize=True) encodes the rendered text exactly so
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), spans_to_mask(enc["offset_mapping"], spans)

    def _assistant_spans(self, messages, full: str, where: str) -> list[tuple[int, int]]:
        """The segment rule's character spans ``[start, end)`` of the assistant turns."""
        spans, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], generation_prompt=True)
            through = self.render(messages[:i + 1])
            start = len(before)
            if not through.startswith(before):  # e.g. Mistral v0.3 moves the system message
                start = self._content_start(messages, i)  # into the last user turn
            if not (full.startswith(through) and done <= start < len(through)):
                raise ShardwiseConfigError(
                    f"{where}: {self.source} does not render this conversation as the "
                    f"concatenation of its turns (message {i}), so its assistant tokens cannot be "
                    "told apart: mark the assistant's output in the template with {% generation "
                    "%}…{% endgeneration %} (TRL ships marked copies of common templates), or "
                    "drop the record")
            spans.append((start, len(through)))
            done = len(through)
        return spans

    def _content_start(self, messages, i: int) -> int:
        """Where assistant message ``i``'s content begins in ``render(messages[:i + 1])``: the
        first character at which two renderings with different one-character contents differ."""
        a, b = (self.render([*messages[:i], {**messages[i], "content": c}])
                for c in ("\x01", "\x02"))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n


def encode_ids(ids: list[int], target: list[int] | list[bool], seq_len: int, pad_id: int
               ) -> tuple[torch.Tensor, torch.Tensor, int, int, bool] | None:
    """A tokenized example → (``tokens`` [seq_len + 1] int64 right-padded with ``pad_id``,
    ``labels`` [seq_len] int64, target tokens kept, input positions used, whether targets were
    cut off), or None when no target fits the row.

    ``labels[t] = tokens[t + 1]`` where token t + 1 is a target, −100 elsewhere (and on
    padding). Cut on the right at seq_len + 1 tokens."""
    cut = sum(target[seq_len + 1:]) > 0
    ids, target = ids[: seq_len + 1], target[: seq_len + 1]
    kept = int(sum(target[1:]))
    if kept == 0:
        return None
    tokens = torch.full((seq_len + 1,), pad_id, dtype=torch.long)
    tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    for t in range(len(ids) - 1):
        if target[t + 1]:
            labels[t] = ids[t + 1]
    return tokens, labels, kept, len(ids) - 1, cut


def encode_segments(tok, segments: Segments, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int, int, bool] | None:
    """Segments → :func:`encode_ids`'s row (padded with the tokenizer's PAD, else EOS).

    Each segment is tokenized on its own; its tokens are targets when the segment is. A segment
    given as token ids (the built-in template's EOS) is taken as is."""
    ids: list[int] = []
    target: list[bool] = []
    for text, is_target in segments:
        part = list(text) if isinstance(text, list) else tok.encode(text) if text else []
        ids += part
        target += [is_target] * len(part)
    return encode_ids(ids, target, seq_len, getattr(tok, "pad_id", tok.eos_id))
