"""Tokenizers: raw bytes, a byte-level BPE trained on the corpus, or an existing HF file.

All three share one small interface (:class:`Tokenizer`). Encoding never adds special tokens: the
data pipeline appends ``eos_id`` after each document itself, and text that happens to contain the
literal string ``<|endoftext|>`` is encoded as ordinary text, so a document cannot forge a boundary.
Decoding drops ``eos_id``, so ``decode(encode(s)) == s`` for every string ``s`` (for the built-in
tokenizers; a user file with a lossy normalizer, e.g. lower-casing, cannot round-trip).

Byte-level BPE as in GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", §2.2): start from the 256 byte symbols, pre-split text with the GPT-2 regex, and merge
the most frequent adjacent pair until the vocabulary is full.

Long documents: HF ``tokenizers`` holds per-character bookkeeping (alignments, offsets, token
strings) for a whole text while it trains on or encodes it, ~160 bytes per character, so one
24 MB single-line file took ~4 GB. Texts longer than :data:`LONG_TEXT_CHUNK_CHARS` are therefore
cut by :func:`split_long_text` before training and encoding, at borders where the GPT-2 regex
always splits too, so the pieces give the same pre-tokens — and so the same merges and the same
ids — as the whole text (:attr:`HFTokenizer.chunk_safe` says when a tokenizer qualifies).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

from shardwise.data._cache import atomic_write_bytes, cache_key, check_cache_writable, file_lock
from shardwise.data.hf_tokenizer import (  # noqa: F401  (HFTokenizer, EOS_TOKEN re-exported)
    EOS_TOKEN,
    HFFolderTokenizer,
    HFTokenizer,
    folder_fingerprint,
    is_tokenizer_folder,
)
from shardwise.errors import ShardwiseConfigError, ShardwiseFileError
from shardwise.readers import read_json

# BPE training reads at most this many characters, as a sample of whole documents spread evenly
# over the corpus (every k-th one). On 2 CPU cores, 3 MB of stdlib trains a 4096 vocab in ~0.8 s
# (the full 12 MB: ~2.5 s) for nearly the same merges; encoding the whole corpus is the larger cost.
BPE_TRAIN_BUDGET_CHARS = 3_000_000
# Bump when the BPE recipe changes, so cached tokenizers trained the old way are not reused.
# v2: long documents are cut into pieces (split_long_text) and the budget holds for them too.
_BPE_RECIPE = "bytelevel-bpe-v2"
# Texts longer than this many characters are trained on and encoded in pieces of at most this
# many (split_long_text); 0 = never cut. 64 Ki characters keep one piece's bookkeeping in the
# Rust library near 10 MB; pieces stay long enough that the cut borders cost nothing measurable.
LONG_TEXT_CHUNK_CHARS = 65_536
# A border: a space, newline or tab after a non-whitespace character (re's \S is not
# str.isspace(), which covers the GPT-2 regex's \s and more); a piece starts at its second char.
_BORDER = re.compile(r"\S[ \n\t]")


def split_long_text(text: str, max_chars: int | None = None) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters whose concatenation is
    ``text``; ``[text]`` when it is short enough (or ``max_chars`` is 0).

    ``max_chars`` defaults to :data:`LONG_TEXT_CHUNK_CHARS` (read at call time). Each cut goes
    before the last space, newline or tab in the window whose preceding character is not
    whitespace (``str.isspace``, which covers the tokenizer regex's ``\\s``). Why the pieces
    encode like the whole: the GPT-2 pre-tokenizer regex is
    ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``;
    whitespace in a pre-token is either one leading space (`` ?`` before letters, digits or
    punctuation) or a run of whitespace alone, so no pre-token holds a non-whitespace character
    followed by a whitespace one — every cut falls between two pre-tokens — and the lookahead
    ``(?!\\S)`` (the character after a whitespace run) never looks across a cut, since the
    character before a cut is not whitespace. The pre-tokens of the pieces are therefore
    exactly those of ``text``, and a byte-level BPE gives the same ids. Only a window with no
    such border (``max_chars`` characters without a space after a non-space, e.g. a base64
    blob) is cut hard at ``max_chars``; then the one pre-token across the cut is split in two.

    Raises nothing; ``max_chars < 0`` is treated as 0.
    """
    if max_chars is None:
        max_chars = LONG_TEXT_CHUNK_CHARS
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        hi = start + max_chars  # the next piece is text[start:cut], start < cut <= hi
        cut = _last_border(text, start, hi)
        cut = cut if cut > start else hi  # no border in the window: cut hard
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _last_border(text: str, lo: int, hi: int) -> int:
    """The largest ``cut`` in ``(lo, hi]`` with ``text[cut]`` a space/newline/tab and
    ``text[cut - 1]`` not whitespace; -1 if none. Scans windows growing leftwards from ``hi``."""
    span = 256
    while True:
        a = max(lo, hi - span)
        last = None
        for last in _BORDER.finditer(text, a, hi + 1):
            pass
        if last is not None:
            return last.start() + 1
        if a == lo:
            return -1
        span *= 16


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the training loop need from a tokenizer.

    Optional: ``chunk_safe`` (bool, default False), true when encoding the pieces of
    :func:`split_long_text` gives the same ids as encoding the whole text; the data pipeline
    then encodes long documents in pieces.
    """

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
    chunk_safe = True  # the UTF-8 of a concatenation is the concatenation of the UTF-8s

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


def tokenizer_fingerprint(spec: str) -> str:
    """A string that changes whenever ``load_tokenizer(spec, same documents, ...)`` may change.

    Raises:
        ShardwiseConfigError: as :func:`load_tokenizer` for a bad spec or a missing file.
    """
    if spec in ("bytes", "bpe"):
        return spec if spec == "bytes" else f"{_BPE_RECIPE}:{BPE_TRAIN_BUDGET_CHARS}"
    folder = model_tokenizer_folder(spec)
    if folder is not None:
        return folder_fingerprint(folder)
    path = _tokenizer_file(spec)
    return "file:" + hashlib.sha256(path.read_bytes()).hexdigest()


def model_tokenizer_folder(spec: str) -> Path | None:
    """The HF model folder whose tokenizer ``spec`` names, or None: ``spec`` is a folder holding
    a tokenizer, or a ``tokenizer.json`` beside a ``tokenizer_config.json`` (whose special
    tokens then count: :class:`~.hf_tokenizer.HFFolderTokenizer`)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p if is_tokenizer_folder(p) else None
    if p.name == "tokenizer.json" and p.is_file() and (p.parent / "tokenizer_config.json").is_file():
        return p.parent
    return None


def load_tokenizer(
    spec: str, documents: list[str] | None, vocab_size: int, cache_dir: Path
) -> Tokenizer:
    """Build or load the tokenizer named by ``spec``.

    Args:
        spec: ``"bytes"`` (:class:`ByteTokenizer`), ``"bpe"`` (byte-level BPE trained on
            ``documents``, cached in ``cache_dir/tokenizers``), an HF model folder (or its
            ``tokenizer.json`` beside a ``tokenizer_config.json``: the model's own tokenizer
            and special tokens, :class:`~.hf_tokenizer.HFFolderTokenizer`), or a path ending in
            ``.json`` (a HF tokenizers file, or a ByteTokenizer marker written by
            ``ByteTokenizer.save``).
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
    folder = model_tokenizer_folder(spec)
    if folder is not None:
        return HFFolderTokenizer(folder)
    path = _tokenizer_file(spec)
    try:
        marker = read_json(path, "--tokenizer")
    except ShardwiseFileError:  # not JSON: HFTokenizer.from_file names the problem
        marker = None
    if isinstance(marker, dict) and marker.get("shardwise_tokenizer") == "bytes":
        return ByteTokenizer()
    return HFTokenizer.from_file(path)


def _tokenizer_file(spec: str) -> Path:
    if Path(spec).expanduser().is_dir():
        raise ShardwiseConfigError(
            f"--tokenizer {spec}: the folder holds no tokenizer (tokenizer.json, tokenizer.model "
            "or vocab.json): pass the model folder that has one, or a tokenizer .json file")
    if not spec.endswith(".json"):
        raise ShardwiseConfigError(
            f"--tokenizer {spec!r} is not one of 'bpe', 'bytes', an HF model folder or a path to "
            "a tokenizer .json file: pass one of those"
        )
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ShardwiseConfigError(
            f"--tokenizer {spec}: no such file: check the path, or use 'bpe' to train one on the "
            "corpus"
        )
    return path


def bpe_training_sample(documents: list[str], budget: int = BPE_TRAIN_BUDGET_CHARS) -> list[str]:
    """The texts BPE training reads: ~``budget`` characters spread evenly over the corpus.

    Every k-th document, k = ceil(total characters / budget) (all of them when the corpus is
    smaller), each cut by :func:`split_long_text` into pieces of at most
    :data:`LONG_TEXT_CHUNK_CHARS` characters: the trainer counts the same pre-tokens as in the
    whole documents, so it learns the same merges, at bounded memory. When a few huge documents
    make these pieces hold more than twice the budget (one single-line file is one document),
    every k'-th piece is kept instead, k' = ceil(their characters / budget). Deterministic.
    """
    total = sum(len(d) for d in documents)
    stride = max(1, -(-total // budget))
    pieces = [p for d in documents[::stride] for p in split_long_text(d)]
    chars = sum(len(p) for p in pieces)
    if chars > 2 * budget:
        pieces = pieces[:: -(-chars // budget)]
    return pieces


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
    tok = _cached_tokenizer(path, name)
    if tok is None:  # absent or damaged: train it (once, under the lock)
        check_cache_writable(cache_dir)
        with file_lock(path.with_suffix(".lock")):
            tok = _cached_tokenizer(path, name)  # another rank may have built it while we waited
            if tok is None:
                if path.exists():
                    print(f"shardwise: the cached tokenizer {path} cannot be read: retraining it",
                          file=sys.stderr, flush=True)
                atomic_write_bytes(path, _train_bpe(sample, vocab_size).to_str().encode())
                tok = HFTokenizer.from_file(path, name=name)
    return tok


def _cached_tokenizer(path: Path, name: str) -> HFTokenizer | None:
    """The cached BPE at ``path``; None when absent or unreadable (e.g. truncated JSON)."""
    if not path.is_file():
        return None
    try:
        return HFTokenizer.from_file(path, name=name)
    except ShardwiseConfigError:
        return None


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
