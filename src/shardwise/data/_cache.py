"""Build-once cache entries that several ranks may ask for at the same moment.

Every rank calls ``prepare_lm_data`` at start-up. The first to take the lock builds the entry; the
others block on the lock, then find the entry complete and only read it. Files are written to a
temporary name and moved into place with ``os.replace`` (atomic on POSIX), so a reader never sees
half a file, even one from a builder that was killed mid-write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to ``path`` atomically (temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as handle:
        np.save(handle, array)
    os.replace(tmp, path)
