"""Where a rank's *position* lives (:meth:`~shardwise.comm.fingerprint.CollectiveChecks._position`:
its last collective, where it waits, its point-to-point counts): a small memory-mapped file per
rank under the local launcher, the store otherwise.

On gloo a rank publishes its position twice per collective (before launching it, and when its wait
returns), so that a rank killed at any instant (gloo's SIGABRT on a size mismatch, a SIGKILL)
leaves where it was. As a store ``set`` each publication cost ~11 µs of the rank's CPU and ~15 µs
of the store server's (measured on localhost: ~50 µs of CPU per collective; ~7 % of the ranks'
CPU in ``shardwise verify --nproc 4``, and 1.6 s of the server's). Under the local launcher
(:func:`shardwise.launch.spawn`) every rank runs on its host, so the launcher hands the ranks a
folder (``SHARDWISE_DIAG_DIR``, in its temporary folder, removed when the run ends) and each rank
writes its position into a file there, mapped in memory: a copy into the page cache, no system
call, kept by the kernel when the process dies, as a sent ``set`` was. The topology's first rank
names the folder in the store (``posdir`` under the checks' prefix), and every reader (the
launcher after a failure, a rank that lost a peer or waited past ``--hang-after``) reads each
rank's file and its store key and takes the later (``t``). Under torchrun (ranks on several hosts,
no such folder) positions stay in the store.

The file: an 8-byte publication count n, then two slots of :data:`SLOT` bytes, each a 4-byte
length and the JSON text. Publication n fills slot n % 2, then writes n: a process killed while
writing a slot leaves the count on the previous, complete one.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

DIR_ENV = "SHARDWISE_DIAG_DIR"  # the launcher's folder of position files
DIR_KEY = "posdir"  # its name in the store, under the checks' prefix (set by the first rank)
SLOT = 1 << 16  # bytes per slot; a longer position goes to the store
_COUNT, _LEN = struct.Struct("<Q"), struct.Struct("<I")
_BASE = mmap.PAGESIZE  # the slots start on the page after the count


def path(folder: str, prefix: str, rank: int) -> str:
    """The file of ``rank``'s position for the topology whose checks use store ``prefix``."""
    return os.path.join(folder, f"{prefix.strip('/').replace('/', '_')}_rank{rank}.pos")


class PositionFile:
    """One rank's position file, mapped for writing (see the module docstring)."""

    def __init__(self, file: str):
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _BASE + 2 * SLOT)  # sparse: only the pages written take memory
            self._map = mmap.mmap(fd, _BASE + 2 * SLOT)
        finally:
            os.close(fd)
        self._n = 0

    @classmethod
    def open(cls, prefix: str, rank: int) -> "PositionFile | None":
        """The file for ``rank`` in the launcher's folder, or None (no folder: not under the
        local launcher; or it cannot be written)."""
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return None
        try:
            return cls(path(folder, prefix, rank))
        except OSError:
            return None

    def write(self, text: str) -> bool:
        """Publish ``text`` (the position's JSON); False when it does not fit a slot."""
        data = text.encode()
        if len(data) > SLOT - _LEN.size:
            return False
        n = self._n + 1
        off = _BASE + (n % 2) * SLOT
        self._map[off:off + _LEN.size + len(data)] = _LEN.pack(len(data)) + data
        self._map[:_COUNT.size] = _COUNT.pack(n)
        self._n = n
        return True


def read(file: str) -> dict | None:
    """The last complete position in ``file``, or None (no file, nothing published)."""
    try:
        with open(file, "rb") as f:
            buf = f.read()
    except OSError:
        return None
    if len(buf) < _BASE + 2 * SLOT:
        return None
    (n,) = _COUNT.unpack_from(buf)
    for k in (n, n - 1) if n else ():  # the current slot; the other if it is torn
        off = _BASE + (k % 2) * SLOT
        (length,) = _LEN.unpack_from(buf, off)
        try:
            return json.loads(buf[off + _LEN.size:off + _LEN.size + length])
        except ValueError:
            continue
    return None


def read_positions(store, prefix: str, ranks) -> dict:
    """Rank → its last published position, for the ``ranks`` of the topology whose checks use
    ``prefix`` (``store``: the store under that prefix): its file in the folder the store names
    (:data:`DIR_KEY`), or its store key ``pos/{r}``, whichever was written later."""
    keys = [f"pos/{r}" for r in ranks]
    have = [k for k in keys if store.check([k])]
    out = {}
    for v in (store.multi_get(have) if have else []):
        pos = json.loads(v)
        out[pos["rank"]] = pos
    folder = store.get(DIR_KEY).decode() if store.check([DIR_KEY]) else None
    for r in ranks if folder else ():
        pos = read(path(folder, prefix, r))
        if pos is not None and pos.get("t", 0) >= out.get(r, {}).get("t", 0):
            out[r] = pos
    return {r: out[r] for r in ranks if r in out}


__all__ = ["DIR_ENV", "DIR_KEY", "SLOT", "PositionFile", "path", "read", "read_positions"]
