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
call this at once: one builds under a file lock, the others wait and then read.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shardwise.data._cache import atomic_save_npy, atomic_write_bytes, cache_key, file_lock
from shardwise.data.corpus import corpus_fingerprint, default_cache_dir, load_documents
from shardwise.data.sampler import DistributedSampler, microbatches  # noqa: F401  (re-exported)
from shardwise.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)
from shardwise.errors import ShardwiseConfigError

_FORMAT = "lm-tokens-v1"  # bump when the cached layout or the split/EOS rules change
_ENCODE_CHUNK_DOCS = 512  # documents per encode_batch call: bounds peak memory on big corpora


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
    if not (entry / "meta.json").exists():
        with file_lock(entry.with_suffix(".lock")):
            if not (entry / "meta.json").exists():  # another rank may have built it meanwhile
                _build_entry(entry, data, tokenizer, vocab_size, val_every, cache_dir)
    meta = json.loads((entry / "meta.json").read_text())
    if meta["tokenizer"] == "bytes":
        tok: Tokenizer = ByteTokenizer()
    else:
        tok = HFTokenizer.from_file(entry / "tokenizer.json", name=meta["tokenizer_name"])

    train = _pack(np.load(entry / "train.npy"), seq_len)
    val = _pack(np.load(entry / "val.npy"), seq_len)
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


def _encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Encode ``docs`` and concatenate them, ``eos_id`` after each: ``[total_tokens]`` int32."""
    parts = []
    for start in range(0, len(docs), _ENCODE_CHUNK_DOCS):
        for ids in tok.encode_batch(docs[start : start + _ENCODE_CHUNK_DOCS]):
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.asarray([tok.eos_id], dtype=np.int32))
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
    }
    atomic_write_bytes(entry / "meta.json", json.dumps(meta, indent=1).encode())
