"""Tokenizers: raw bytes, a byte-level BPE trained on the corpus, or an existing HF file.

All three share one small interface (:class:`Tokenizer`). Encoding never adds special tokens: the
data pipeline appends ``eos_id`` after each document itself, and text that happens to contain the
literal string ``<|endoftext|>`` is encoded as ordinary text, so a document cannot forge a boundary.
Decoding drops ``eos_id``, so ``decode(encode(s)) == s`` for every string ``s`` (for the built-in
tokenizers; a user file with a lossy normalizer, e.g. lower-casing, cannot round-trip).

Byte-level BPE as in GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", §2.2): start from the 256 byte symbols, pre-split text with the GPT-2 regex, and merge
the most frequent adjacent pair until the vocabulary is full.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from shardwise.data._cache import atomic_write_bytes, cache_key, file_lock
from shardwise.errors import ShardwiseConfigError

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>")
# BPE training reads at most this many characters, as a sample of whole documents spread evenly
# over the corpus (every k-th one). On 2 CPU cores, 3 MB of stdlib trains a 4096 vocab in ~0.8 s
# (the full 12 MB: ~2.5 s) for nearly the same merges; encoding the whole corpus is the larger cost.
BPE_TRAIN_BUDGET_CHARS = 3_000_000
# Bump when the BPE recipe changes, so cached tokenizers trained the old way are not reused.
_BPE_RECIPE = "bytelevel-bpe-v1"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the training loop need from a tokenizer."""

    name: str
    vocab_size: int  # ids are in [0, vocab_size)
    eos_id: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def save(self, path: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``eos_id = 256``; ``vocab_size = 257``. Needs no training."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; EOS is dropped, and a sequence cut mid-character decodes as U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        """Write a small JSON marker that :func:`load_tokenizer` reads back as a ByteTokenizer."""
        marker = {"shardwise_tokenizer": "bytes", "vocab_size": 257, "eos_id": 256}
        atomic_write_bytes(Path(path), json.dumps(marker).encode())


class HFTokenizer:
    """A HF ``tokenizers.Tokenizer`` behind the :class:`Tokenizer` interface.

    Raises:
        ShardwiseConfigError: the tokenizer has none of ``<|endoftext|>``, ``</s>``, ``<eos>``.
    """

    def __init__(self, tok, name: str):
        eos = next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ShardwiseConfigError(
                f"tokenizer {name} has no end-of-text token (none of {', '.join(_EOS_CANDIDATES)}): "
                f"add one, e.g. tok.add_special_tokens(['{EOS_TOKEN}']); tok.save(path)"
            )
        if hasattr(tok, "encode_special_tokens"):
            tok.encode_special_tokens = True  # literal "<|endoftext|>" in text stays text
        self._tok = tok
        self.name = name
        self.eos_id = tok.token_to_id(eos)
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


def tokenizer_fingerprint(spec: str) -> str:
    """A string that changes whenever ``load_tokenizer(spec, same documents, ...)`` may change.

    Raises:
        ShardwiseConfigError: as :func:`load_tokenizer` for a bad spec or a missing file.
    """
    if spec in ("bytes", "bpe"):
        return spec if spec == "bytes" else f"{_BPE_RECIPE}:{BPE_TRAIN_BUDGET_CHARS}"
    path = _tokenizer_file(spec)
    return "file:" + hashlib.sha256(path.read_bytes()).hexdigest()


def load_tokenizer(
    spec: str, documents: list[str] | None, vocab_size: int, cache_dir: Path
) -> Tokenizer:
    """Build or load the tokenizer named by ``spec``.

    Args:
        spec: ``"bytes"`` (:class:`ByteTokenizer`), ``"bpe"`` (byte-level BPE trained on
            ``documents``, cached in ``cache_dir/tokenizers``), or a path ending in ``.json``
            (a HF tokenizers file, or a ByteTokenizer marker written by ``ByteTokenizer.save``).
        documents: the training text for ``"bpe"``; ignored otherwise.
        vocab_size: the BPE vocabulary size including the 256 byte symbols and EOS; ignored for
            the other specs. A small corpus may stop short of it: read ``.vocab_size`` back.
        cache_dir: the shardwise cache folder.

    Raises:
        ShardwiseConfigError: unknown spec, missing/unreadable ``.json``, a file without an EOS
            token, ``"bpe"`` without documents, or ``vocab_size < 258``.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        return _cached_bpe(documents, vocab_size, Path(cache_dir))
    path = _tokenizer_file(spec)
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        marker = None
    if isinstance(marker, dict) and marker.get("shardwise_tokenizer") == "bytes":
        return ByteTokenizer()
    return HFTokenizer.from_file(path)


def _tokenizer_file(spec: str) -> Path:
    if not spec.endswith(".json"):
        raise ShardwiseConfigError(
            f"--tokenizer {spec!r} is not one of 'bpe', 'bytes' or a path to a tokenizer .json "
            "file: pass one of those"
        )
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ShardwiseConfigError(
            f"--tokenizer {spec}: no such file: check the path, or use 'bpe' to train one on the "
            "corpus"
        )
    return path


def bpe_training_sample(documents: list[str], budget: int = BPE_TRAIN_BUDGET_CHARS) -> list[str]:
    """Every k-th document, k = ceil(total characters / budget): ~``budget`` characters of whole
    documents spread evenly over the corpus (all of it when it is smaller). Deterministic."""
    total = sum(len(d) for d in documents)
    stride = max(1, -(-total // budget))
    return documents[::stride]


def _cached_bpe(documents: list[str] | None, vocab_size: int, cache_dir: Path) -> HFTokenizer:
    if not documents:
        raise ShardwiseConfigError(
            "--tokenizer bpe trains on the corpus, but no documents were given: pass the "
            "documents, or use --tokenizer bytes"
        )
    if vocab_size < 258:
        raise ShardwiseConfigError(
            f"--vocab-size {vocab_size} is too small for byte-level BPE: it holds the 256 byte "
            "symbols and EOS before any merge: choose at least 258 (e.g. 4096), or use "
            "--tokenizer bytes"
        )
    sample = bpe_training_sample(documents)
    key = cache_key(_BPE_RECIPE, vocab_size, cache_key(*sample))
    path = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key[:16]}.json"
    name = f"bpe{vocab_size}-{key[:8]}"
    if not path.exists():
        with file_lock(path.with_suffix(".lock")):
            if not path.exists():  # another rank may have built it while we waited
                atomic_write_bytes(path, _train_bpe(sample, vocab_size).to_str().encode())
    return HFTokenizer.from_file(path, name=name)


def _train_bpe(texts: list[str], vocab_size: int):
    """Train a GPT-2-style byte-level BPE; returns a ``tokenizers.Tokenizer``. Deterministic."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
