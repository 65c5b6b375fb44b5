"""Build-once cache entries that several ranks may ask for at the same moment.

Every rank calls ``prepare_lm_data`` at start-up. The first to take the lock builds the entry; the
others block on the lock, then find the entry complete and only read it. Files are written to a
temporary name, flushed to disk (``fsync``) and moved into place with ``os.replace`` (atomic on
POSIX), so a reader never sees half a file, even one from a builder that was killed mid-write.
A file can still arrive damaged (a copied or synced cache, a full disk on a file system without
ordered writes): readers check each file's size and SHA-256 against what the builder recorded
(:func:`file_digest`) and rebuild the entry on a mismatch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shardwise.errors import ShardwiseConfigError


def cache_key(*parts: object) -> str:
    """A hex digest of ``parts`` (anything ``json.dumps`` can write, e.g. str, int, lists)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if absent) for the ``with`` body.

    The lock belongs to the open file, so it also excludes other threads of this process, and the
    OS drops it if the holder dies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{id(path)}.tmp")


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator:
    """An open binary file at a temporary name that becomes ``path`` (fsync, then
    ``os.replace``) when the body ends without an exception; removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    with _atomic_file(path) as handle:
        handle.write(data)


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to ``path`` atomically (temporary file, fsync, then ``os.replace``)."""
    with _atomic_file(path) as handle:
        np.save(handle, array)


def file_digest(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path`` (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def check_cache_writable(folder: Path) -> None:
    """Raise :class:`ShardwiseConfigError` unless the cache ``folder`` is (or can be created as)
    a folder this process can write in: creates it and writes and removes a probe file, because
    permission bits do not tell everything (root writes through them; read-only mounts).

    Raises:
        ShardwiseConfigError: a path component is a regular file, or the probe write fails; the
            message names the folder and ``SHARDWISE_CACHE``.
    """
    folder = Path(folder).absolute()
    fix = ("set SHARDWISE_CACHE to a writable folder (it holds the trained tokenizers and token "
           "streams)")
    anc = folder
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ShardwiseConfigError(f"the shardwise cache folder {folder} cannot be created: {anc} "
                                   f"is a file, not a folder: {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ShardwiseConfigError(f"the shardwise cache folder {folder} is not writable "
                                   f"({e.strerror or e}): {fix}, or fix its permissions") from None
