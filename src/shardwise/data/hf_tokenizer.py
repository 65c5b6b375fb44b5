"""HF tokenizers: a bare ``tokenizer.json`` (:class:`HFTokenizer`), and a model folder's own
tokenizer — its ids, its special tokens, its chat template (:class:`HFFolderTokenizer`).

``--tokenizer DIR`` (or ``--init-from-hf DIR`` with the default ``--tokenizer bpe``) loads the
folder's tokenizer with transformers' ``AutoTokenizer`` — the object TRL and every HF script
use — so a row is the ids the model's own tooling would feed it (docs/interop.md, "Your
tokenizer, token for token").

Special tokens, per family (no ``<|endoftext|>`` assumption): BOS, EOS and PAD are what
``AutoTokenizer`` reads from ``tokenizer_config.json`` and ``special_tokens_map.json``; the stop
ids of generation are ``generation_config.json``'s ``eos_token_id`` (an int or a list: Llama 3.x
stops on ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``) plus the tokenizer's EOS. A
folder with no pad token pads with its EOS (always masked), as transformers' trainers do.

Plain text (``--task lm`` documents, alpaca fields) is encoded with the special tokens matched as
text (a document cannot forge an EOS); chat rows are ``apply_chat_template``'s ids, where the
template's special tokens — and, as in transformers, literal special-token text inside a message
— are special tokens (:mod:`.chat`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from shardwise.data._cache import atomic_write_bytes
from shardwise.errors import ShardwiseConfigError, ShardwiseFileError
from shardwise.readers import read_json

EOS_TOKEN = "<|endoftext|>"
# a bare tokenizer.json names no EOS: the first of these it holds (GPT-2/Qwen, Llama 3 base,
# Mistral/Llama 2, Gemma). A model folder's own EOS comes from its config (HFFolderTokenizer).
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")

# the files that make up an HF tokenizer (those present are hashed, copied on export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
# what makes a folder hold a tokenizer that AutoTokenizer can load without a download
_LOADABLE = ("tokenizer.json", "tokenizer.model", "vocab.json")


def is_tokenizer_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a tokenizer transformers can load."""
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in _LOADABLE)


def folder_fingerprint(folder: str | os.PathLike) -> str:
    """A digest of the folder's tokenizer files and generation config (the LM token cache's key:
    any change to the vocabulary or the special tokens rebuilds the stream)."""
    h = hashlib.sha256()
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        f = Path(folder) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return "hf-folder:" + h.hexdigest()


def generation_eos_ids(folder: str | os.PathLike) -> list[int]:
    """``generation_config.json``'s ``eos_token_id`` as a list (absent file or key: ``[]``).

    Raises ShardwiseConfigError for a file that is not JSON or an id that is not an int."""
    f = Path(folder) / "generation_config.json"
    if not f.is_file():
        return []
    try:
        cfg = read_json(f, "generation_config.json")
    except ShardwiseFileError as e:
        raise ShardwiseConfigError(f"{f}: {e}: fix or remove the file") from None
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ShardwiseConfigError(f"{f}: eos_token_id {eos!r} is not an int or a list of ints: "
                                   "fix the file")
    return ids


class HFTokenizer:
    """A HF ``tokenizers.Tokenizer`` behind the :class:`Tokenizer` interface.

    ``eos_id``: the end-of-text id; None = the first of :data:`_EOS_CANDIDATES` the vocabulary
    holds (a bare ``tokenizer.json`` names none; a model folder's comes from its config:
    :class:`~.hf_tokenizer.HFFolderTokenizer`).

    Raises:
        ShardwiseConfigError: ``eos_id`` is None and the tokenizer has none of the candidates.
    """

    def __init__(self, tok, name: str, eos_id: int | None = None):
        if eos_id is None:
            eos = next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
            if eos is None:
                raise ShardwiseConfigError(
                    f"tokenizer {name} names no end-of-text token (none of "
                    f"{', '.join(_EOS_CANDIDATES)}): pass the model's folder instead "
                    "(--tokenizer DIR, whose tokenizer_config.json names its EOS), or, for a "
                    f"tokenizer of your own, add one: tok.add_special_tokens(['{EOS_TOKEN}'])")
            eos_id = tok.token_to_id(eos)
        if hasattr(tok, "encode_special_tokens"):
            tok.encode_special_tokens = True  # literal "<|endoftext|>" in text stays text
        self._tok = tok
        self._chunk_safe: bool | None = None
        self.name = name
        self.eos_id = eos_id
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), self.eos_id + 1)

    @classmethod
    def from_file(cls, path: Path, name: str | None = None) -> HFTokenizer:
        """Load a ``tokenizer.json``; ShardwiseConfigError if it cannot be parsed."""
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_file(str(path))
        except Exception as err:  # the Rust parser raises a bare Exception
            raise ShardwiseConfigError(
                f"--tokenizer {path}: not a HF tokenizers file ({err}): pass a tokenizer.json "
                "saved by `tokenizers` (tok.save(path)), 'bpe' or 'bytes'"
            ) from err
        return cls(tok, name or f"file:{path}")

    @property
    def chunk_safe(self) -> bool:
        """True when the pieces of :func:`split_long_text` encode to the same ids as the whole
        text: a GPT-2-style byte-level tokenizer — no normalizer, pre-tokenizer
        ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 regex, see
        :func:`split_long_text`), and no added token matched inside text (special tokens are
        encoded as text here). The BPE that ``load_tokenizer("bpe", ...)`` trains qualifies; a
        user file with another pre-tokenizer is encoded whole (memory then grows with its longest
        document)."""
        if self._chunk_safe is None:
            from tokenizers import pre_tokenizers

            pre = self._tok.pre_tokenizer
            added = self._tok.get_added_tokens_decoder().values()
            self._chunk_safe = bool(
                self._tok.normalizer is None
                and isinstance(pre, pre_tokenizers.ByteLevel)
                and not pre.add_prefix_space and pre.use_regex
                and getattr(self._tok, "encode_special_tokens", False)
                and all(t.special for t in added))
        return self._chunk_safe

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust library (all CPU cores)."""
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens (EOS) are dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as HF ``tokenizer.json`` (readable by ``load_tokenizer(path)``)."""
        atomic_write_bytes(Path(path), self._tok.to_str().encode())

    def to_str(self) -> str:
        """The tokenizer's HF JSON serialisation."""
        return self._tok.to_str()


class HFFolderTokenizer(HFTokenizer):
    """An HF folder's tokenizer behind the :class:`~shardwise.data.tokenizer.Tokenizer`
    interface, with the folder's special tokens.

    Attributes (besides the interface's ``name``, ``vocab_size``, ``eos_id``):
        hf: transformers' tokenizer of the folder (``apply_chat_template``, assistant masks).
        folder: the folder (a :class:`~pathlib.Path`).
        bos_id: the BOS id, or None (Qwen has none).
        pad_id: the PAD id, the EOS id when the folder names none.
        stop_ids: ids that end a generation: the EOS and ``generation_config.json``'s list.

    Raises:
        ShardwiseConfigError: transformers missing; the folder's tokenizer cannot be loaded;
            no EOS in ``tokenizer_config.json``, ``special_tokens_map.json`` or
            ``generation_config.json``; an id outside the vocabulary.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        try:
            from tokenizers import Tokenizer as _Tok
            from transformers import AutoTokenizer
        except ImportError:
            raise ShardwiseConfigError(
                f"--tokenizer {folder}: an HF folder's tokenizer needs transformers: pip install "
                "'shardwise[hf]'") from None
        try:
            hf = AutoTokenizer.from_pretrained(str(self.folder))
        except Exception as e:  # transformers raises many kinds for a broken folder
            raise ShardwiseConfigError(
                f"--tokenizer {folder}: transformers cannot load the folder's tokenizer "
                f"({type(e).__name__}: {str(e).splitlines()[0][:160]}): fix its tokenizer files, "
                "or pass --tokenizer FILE.json") from None
        if not getattr(hf, "is_fast", False):
            raise ShardwiseConfigError(
                f"--tokenizer {folder}: only a fast tokenizer (tokenizer.json) is supported: "
                "write one with AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        self.hf = hf
        gen_eos = generation_eos_ids(self.folder)
        eos = hf.eos_token_id if hf.eos_token_id is not None else (gen_eos or [None])[0]
        if eos is None:
            raise ShardwiseConfigError(
                f"--tokenizer {folder}: no EOS token in tokenizer_config.json, "
                "special_tokens_map.json or generation_config.json: set \"eos_token\" in "
                "tokenizer_config.json to the token that ends a document or a turn")
        # plain text: special tokens matched as text (a document cannot forge a boundary), on a
        # copy of the backend so apply_chat_template keeps matching them
        plain = _Tok.from_str(hf.backend_tokenizer.to_str())
        super().__init__(plain, f"hf:{self.folder}", eos_id=eos)
        self.vocab_size = max(len(hf), self.vocab_size)
        self.bos_id = hf.bos_token_id
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else eos
        self.stop_ids = tuple(dict.fromkeys([eos, *gen_eos]))
        for what, i in (("bos", self.bos_id), ("pad", self.pad_id), ("eos", eos),
                        *(("generation eos", s) for s in self.stop_ids)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ShardwiseConfigError(
                    f"--tokenizer {folder}: the {what} id {i} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1}): fix tokenizer_config.json / "
                    "generation_config.json")

    @property
    def chat_template(self) -> str | None:
        """The folder's chat template (``tokenizer_config.json`` or ``chat_template.jinja``)."""
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) and t else None

    def token(self, i: int | None) -> str | None:
        """The text of id ``i`` (None for None)."""
        return None if i is None else self.hf.convert_ids_to_tokens(i)

    def describe(self) -> str:
        """One line: the special tokens, for the start-up banner."""
        parts = [f"eos {self.token(self.eos_id)}"]
        if self.bos_id is not None:
            parts.insert(0, f"bos {self.token(self.bos_id)}")
        pad = "eos" if self.pad_id == self.eos_id else self.token(self.pad_id)
        stops = ", ".join(self.token(i) for i in self.stop_ids)
        return ", ".join(parts) + f", pad {pad}, stops on {stops}"


def special_tokens_summary(tok) -> dict:
    """The special ids of any tokenizer of ours: ``{"bos", "eos", "pad", "stop"}`` (None where
    the tokenizer has none). The built-in tokenizers pad and stop with their one EOS."""
    return {"bos": getattr(tok, "bos_id", None), "eos": tok.eos_id,
            "pad": getattr(tok, "pad_id", tok.eos_id),
            "stop": list(getattr(tok, "stop_ids", (tok.eos_id,)))}
