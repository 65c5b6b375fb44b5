"""From a corpus to packed training sequences: split, tokenize, concatenate, pack, cache.

Pipeline (:func:`prepare_lm_data`):

1. Documents from :func:`~shardwise.data.corpus.load_documents`, in a fixed order.
2. Split by document index: document ``i`` is validation when ``i % val_every == val_every - 1``,
   so the split is interleaved over the corpus and deterministic. With fewer than ``val_every``
   documents (e.g. a single ``.txt`` file) no document would be held out; then the last
   ``1/val_every`` of the train token stream is held out instead.
3. The tokenizer (trained on the train documents only, for ``"bpe"``) encodes every document;
   ``eos_id`` is appended after each, and each split is concatenated into one token stream.
4. Each stream is cut into non-overlapping rows of ``seq_len + 1`` tokens (remainder dropped):
   a row's ``[:-1]`` are the inputs and its ``[1:]`` the targets. Rows cross document
   boundaries, which are marked only by EOS and not masked — the packing of Brown et al. 2020
   (GPT-3), appendix B.

Steps 1–3 are cached as int32 ``.npy`` streams keyed by the data source, the tokenizer and
``val_every``; only step 4 depends on ``seq_len``, so changing it re-uses the cache. Every rank may
call this at once: one builds under a file lock, the others wait and then read. Each file is
written atomically (temporary name, fsync, rename), and ``meta.json``, written last, records
every file's size and SHA-256; a reader checks them and rebuilds an entry that does not match
(truncated, damaged, or missing a file) instead of failing on it. A cache folder that cannot be
written is a :class:`~shardwise.errors.ShardwiseConfigError` (when something must be built).

Memory: a document longer than
:data:`~shardwise.data.tokenizer.LONG_TEXT_CHUNK_CHARS` characters is encoded in pieces cut at
whitespace (:func:`~shardwise.data.tokenizer.split_long_text`; the same tokens as one encode, for
the built-in tokenizers), and each ``encode_batch`` call gets at most ``_ENCODE_BATCH_CHARS``
characters, so peak memory no longer grows with the longest document (a single-line 24 MB file
went from 4.1 GiB to 0.43 GiB of peak RSS: benchmarks/data_memory.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shardwise.data._cache import (
    atomic_save_npy,
    atomic_write_bytes,
    cache_key,
    check_cache_writable,
    file_digest,
    file_lock,
)
from shardwise.data.corpus import corpus_fingerprint, default_cache_dir, load_documents
from shardwise.data.sampler import DistributedSampler, microbatches  # noqa: F401  (re-exported)
from shardwise.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    model_tokenizer_folder,
    split_long_text,
    tokenizer_fingerprint,
)
from shardwise.errors import ShardwiseConfigError, ShardwiseFileError
from shardwise.readers import read_json

_FORMAT = "lm-tokens-v2"  # bump when the cached layout or the split/EOS rules change
_ENTRY_FILES = ("train.npy", "val.npy", "tokenizer.json")  # meta.json records their digests
# Per encode_batch call, at most this many texts and characters: the Rust encoder keeps every
# encoding of a call (ids, offsets, token strings: ~160 bytes per character) until it returns.
_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_CHARS = 1 << 20


@dataclass
class TokenData:
    """Packed token sequences for language modelling.

    Attributes:
        train: ``[n_train, seq_len + 1]`` int64; inputs are ``[:, :-1]``, targets ``[:, 1:]``.
        val: ``[n_val, seq_len + 1]`` int64, same layout.
        tokenizer: the :class:`~shardwise.data.tokenizer.Tokenizer` that made the ids.
        vocab_size: ``tokenizer.vocab_size``; every id is below it (the model's embedding rows).
        stats: counts for logging: documents, train/val documents and tokens, how val was split
            (``"documents"`` or ``"tail"``), the cache folder.
    """

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Tokenizer
    vocab_size: int
    stats: dict = field(default_factory=dict)


def prepare_lm_data(
    data: str | os.PathLike | None,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    seq_len: int = 128,
    val_every: int = 20,
    cache_dir: Path | None = None,
    min_train_sequences: int = 1,
) -> TokenData:
    """Load, split, tokenize and pack a corpus into train/val sequences (cached; see module doc).

    Args:
        data: ``None`` for the embedded default corpus, else a file or folder path (``--data``).
        tokenizer: ``"bpe"``, ``"bytes"`` or a tokenizer ``.json`` path (``--tokenizer``).
        vocab_size: BPE vocabulary size (only used for ``"bpe"``).
        seq_len: tokens per training input; rows hold ``seq_len + 1``.
        val_every: every ``val_every``-th document is validation (must be ≥ 2).
        cache_dir: defaults to :func:`~shardwise.data.corpus.default_cache_dir`.
        min_train_sequences: the train split must give at least this many rows — one global batch.

    Returns:
        :class:`TokenData` with ``train`` ``[n_train, seq_len + 1]`` and ``val`` ``[n_val,
        seq_len + 1]``, both int64.

    Raises:
        ShardwiseConfigError: from loading data or tokenizer (see ``load_documents``,
            ``load_tokenizer``); ``seq_len < 1`` or ``val_every < 2``; or the splits are too short
            for ``seq_len`` (fewer than ``min_train_sequences`` train rows, or no val row).
    """
    if seq_len < 1:
        raise ShardwiseConfigError(f"--seq-len {seq_len} must be at least 1: choose e.g. 128")
    if val_every < 2:
        raise ShardwiseConfigError(
            f"val_every={val_every} would leave no training data: hold out every k-th document "
            "with k >= 2 (default 20)"
        )
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(
        _FORMAT,
        corpus_fingerprint(data),
        tokenizer_fingerprint(tokenizer),
        vocab_size if tokenizer == "bpe" else None,
        val_every,
    )
    entry = cache_dir / "tokens" / key[:24]
    found = _read_entry(entry)
    if not isinstance(found, tuple):  # absent, or damaged: build it (once, under the lock)
        check_cache_writable(cache_dir)  # the lock file lives there too
        with file_lock(entry.with_suffix(".lock")):
            found = _read_entry(entry)  # another rank may have built it meanwhile
            if not isinstance(found, tuple):
                if found is not None:
                    print(f"shardwise: the token cache {entry} is damaged ({found}): rebuilding",
                          file=sys.stderr, flush=True)
                _build_entry(entry, data, tokenizer, vocab_size, val_every, cache_dir)
                found = _read_entry(entry)
        if not isinstance(found, tuple):
            raise ShardwiseConfigError(
                f"the token cache {entry} reads back damaged right after it was written "
                f"({found}): the file system under the cache loses writes: set SHARDWISE_CACHE "
                "to a folder on another disk")
    meta, train_stream, val_stream = found
    if meta["tokenizer"] == "bytes":
        tok: Tokenizer = ByteTokenizer()
    elif model_tokenizer_folder(tokenizer) is not None:  # the folder's special tokens and template
        tok = load_tokenizer(tokenizer, None, 0, cache_dir)
    else:
        tok = HFTokenizer.from_file(entry / "tokenizer.json", name=meta["tokenizer_name"])

    train = _pack(train_stream, seq_len)
    val = _pack(val_stream, seq_len)
    if meta["val_split"] == "documents":
        split = f"val split (documents i with i % {val_every} == {val_every - 1})"
    else:
        split = f"val split (the last 1/{val_every} of the tokens: fewer than {val_every} documents)"
    _check_enough("train split", meta["train_tokens"], seq_len, len(train), min_train_sequences,
                  "one global batch needs", "a smaller --global-batch, ")
    _check_enough(split, meta["val_tokens"], seq_len, len(val), 1, "validation needs", "")
    stats = {k: meta[k] for k in ("documents", "train_documents", "val_documents",
                                  "train_tokens", "val_tokens", "val_split")}
    stats["cache"] = str(entry)
    return TokenData(train=train, val=val, tokenizer=tok, vocab_size=tok.vocab_size, stats=stats)


def _check_enough(
    split: str, tokens: int, seq_len: int, rows: int, need: int, why: str, batch_fix: str
) -> None:
    if rows < need:
        raise ShardwiseConfigError(
            f"--seq-len {seq_len} is longer than the corpus allows: the {split} has {tokens} "
            f"tokens → {rows} sequences of {seq_len + 1}, but {why} {need}: use a shorter "
            f"--seq-len, {batch_fix}or more data (--data)"
        )


def _pack(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """``[n]`` token stream → ``[n // (seq_len + 1), seq_len + 1]`` int64; the remainder is dropped."""
    rows = len(stream) // (seq_len + 1)
    packed = stream[: rows * (seq_len + 1)].astype(np.int64).reshape(rows, seq_len + 1)
    return torch.from_numpy(packed)


def _read_entry(entry: Path) -> tuple[dict, np.ndarray, np.ndarray] | str | None:
    """The cache entry's ``(meta, train stream, val stream)``, verified: ``meta.json`` parses and
    is of this format, and every file in it has the size and SHA-256 that ``meta.json``
    records. ``None`` when there is no entry yet; a short reason (e.g. ``"train.npy has 128 of
    4096 bytes"``) when it is damaged."""
    if not (entry / "meta.json").is_file():
        return None
    try:
        meta = read_json(entry / "meta.json", "meta.json")
    except ShardwiseFileError as err:  # truncated JSON, bad bytes: "meta.json PATH: not valid …"
        return str(err)
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or meta.get("format") != _FORMAT:
        return f"meta.json is not a complete {_FORMAT} record"
    for name in _ENTRY_FILES:
        want, path = files.get(name) or {}, entry / name
        if not path.is_file():
            return f"{name} is missing"
        got = file_digest(path)
        if got["bytes"] != want.get("bytes"):
            return f"{name} has {got['bytes']} of {want.get('bytes')} bytes"
        if got["sha256"] != want.get("sha256"):
            return f"{name} does not match its SHA-256"
    try:
        return meta, np.load(entry / "train.npy"), np.load(entry / "val.npy")
    except (OSError, ValueError) as err:
        return f"a token stream cannot be read: {err}"


def _encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Encode ``docs`` and concatenate them, ``eos_id`` after each: ``[total_tokens]`` int32.

    With a tokenizer whose ``chunk_safe`` is true, a document longer than
    :data:`~shardwise.data.tokenizer.LONG_TEXT_CHUNK_CHARS` is encoded as the pieces of
    :func:`~shardwise.data.tokenizer.split_long_text` (the same tokens); other tokenizers get
    every document whole. Texts go to ``encode_batch`` in groups of at most
    ``_ENCODE_BATCH_DOCS`` texts and ``_ENCODE_BATCH_CHARS`` characters (one longer text alone),
    and each group's ids become one int32 array at once, so peak memory is bounded by a group.
    """
    eos = np.asarray([tok.eos_id], dtype=np.int32)
    chunk = getattr(tok, "chunk_safe", False)
    parts: list[np.ndarray] = []
    batch: list[str] = []
    ends: list[bool] = []  # ends[i]: batch[i] is the last piece of its document (EOS after it)
    chars = 0

    def flush() -> None:
        group = []
        for ids, end in zip(tok.encode_batch(batch), ends):
            group.append(np.asarray(ids, dtype=np.int32))
            if end:
                group.append(eos)
        if group:
            parts.append(np.concatenate(group))
        batch.clear()
        ends.clear()

    for doc in docs:
        pieces = split_long_text(doc) if chunk else [doc]
        for i, piece in enumerate(pieces):
            if batch and (chars + len(piece) > _ENCODE_BATCH_CHARS
                          or len(batch) >= _ENCODE_BATCH_DOCS):
                flush()
                chars = 0
            batch.append(piece)
            ends.append(i == len(pieces) - 1)
            chars += len(piece)
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _build_entry(
    entry: Path, data, tokenizer: str, vocab_size: int, val_every: int, cache_dir: Path
) -> None:
    """Load, split, tokenize and write one cache entry; ``meta.json`` last marks it complete."""
    started = time.perf_counter()
    docs = load_documents(data)
    is_val = [i % val_every == val_every - 1 for i in range(len(docs))]
    train_docs = [d for d, v in zip(docs, is_val) if not v]
    val_docs = [d for d, v in zip(docs, is_val) if v]
    tok = load_tokenizer(tokenizer, train_docs, vocab_size, cache_dir)
    train = _encode_stream(tok, train_docs)
    val = _encode_stream(tok, val_docs)
    val_split = "documents"
    if not val_docs:  # fewer than val_every documents: hold out the tail of the one stream
        cut = len(train) - len(train) // val_every
        train, val, val_split = train[:cut], train[cut:], "tail"

    (entry / "meta.json").unlink(missing_ok=True)  # readers of a damaged entry wait on the lock
    atomic_save_npy(entry / "train.npy", train)
    atomic_save_npy(entry / "val.npy", val)
    tok.save(entry / "tokenizer.json")
    meta = {
        "format": _FORMAT,
        "data": None if data is None else str(Path(data).expanduser().resolve()),
        "tokenizer": "bytes" if isinstance(tok, ByteTokenizer) else "hf",
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "documents": len(docs),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "val_split": val_split,
        "build_seconds": round(time.perf_counter() - started, 3),
        "files": {name: file_digest(entry / name) for name in _ENTRY_FILES},  # read back
    }
    atomic_write_bytes(entry / "meta.json", json.dumps(meta, indent=1).encode())
