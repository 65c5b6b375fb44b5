"""The run folder's safety around checkpoints: the disk-space and writability checks before a run
(:func:`check_disk_space`, :func:`check_checkpoints_writable`), one run per folder
(:func:`lock_run_folder`), and the training data's fingerprint that a resume must match
(:func:`data_fingerprint`, :func:`check_same_data`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from ..errors import ShardwiseConfigError
from .format import CheckpointError

log = logging.getLogger("shardwise")


def checkpoint_bytes_estimate(n_params: int, keep: int, bytes_per_value: int = 4) -> int:
    """Disk bytes the run's checkpoints need at most: parameters + AdamW's two moments (3 fp32
    values per parameter) for each kept checkpoint, plus the one being written
    (``keep`` = 0, keep all, is counted as 1 + the one being written: a lower bound)."""
    return 3 * bytes_per_value * n_params * (max(keep, 1) + 1)


def check_disk_space(out: str, need_bytes: int) -> None:
    """Raise :class:`ShardwiseConfigError` when the file system of ``out`` (its nearest existing
    ancestor) has fewer than ``need_bytes`` free bytes."""
    anc = Path(out).absolute()
    while not anc.exists():
        anc = anc.parent
    free = shutil.disk_usage(anc).free
    if free < need_bytes:
        raise ShardwiseConfigError(
            f"--out {out}: only {free / 2**20:,.1f} MiB free on its file system, but the run's "
            f"checkpoints need about {need_bytes / 2**20:,.1f} MiB (parameters + AdamW state, "
            "per kept checkpoint + the one being written): free space, lower --keep, or choose "
            "another --out")


def check_checkpoints_writable(out: str, rank: int = 0) -> None:
    """Raise :class:`CheckpointError` unless ``<out>/checkpoints`` (when it exists) is a folder
    this process can create a checkpoint folder and a file in: tried with a probe folder that is
    removed again (permission bits do not tell for root or read-only mounts). Files only: call
    it on every rank before any collective (each rank writes its own shard there)."""
    root = Path(out) / "checkpoints"
    if not root.exists():
        return  # created by the first save; --out itself was probed by validate
    if not root.is_dir():
        raise CheckpointError(f"{root} is a file, not a folder, so no checkpoint can be written "
                              "there: move the file away or choose another --out")
    probe = root / f".write-test-{os.getpid()}-{rank}.tmp"
    try:
        probe.mkdir()
        (probe / "probe").write_bytes(b"")
    except OSError as e:
        raise CheckpointError(f"{root} is not writable by this process ({e.strerror or e}): "
                              "fix its permissions (e.g. chmod u+w) or choose another "
                              "--out") from None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


LOCK_FILE = "run.lock"  # in the run folder: JSON {"pid", "host", "started"} of the holder


class RunFolderBusyError(ShardwiseConfigError):
    """Another run holds the run folder's lock (:func:`lock_run_folder`); the message names its
    pid and host."""


def lock_run_folder(out: str) -> tuple[object | None, str | None]:
    """Take the run folder's exclusive lock: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on
    ``<out>/run.lock`` (created, with ``out``, if missing), then write this process's pid, host
    and start time into it. Call on rank 0 (or a launcher) before anything is written.

    Returns:
        ``(handle, None)``: keep ``handle`` open for the life of the run; closing it, or the
        process ending in any way (SIGKILL included), releases the lock. ``(None, message)``:
        another process holds it, and the message (for a :class:`RunFolderBusyError`) names
        that run's pid and host and the fix; returned, not raised, so the caller can tell the
        other ranks first. ``(None, None)``: the file system cannot lock (a warning is logged);
        the run goes on unguarded.
    """
    import fcntl
    import socket
    import time

    path = Path(out) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")  # never truncate before holding the lock: it names the holder
    except OSError as e:
        return None, (f"--out {out}: cannot create its lock file {path} ({e.strerror or e}): "
                      "choose a writable --out")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        text = f.read()
        f.close()
        try:
            who = json.loads(text)
            holder = f"pid {who['pid']} on host {who['host']}, started {who['started']}"
        except (ValueError, KeyError, TypeError):
            holder = "pid and host not yet written"
        return None, (f"--out {out} is in use by another run ({holder}; lock {path}): wait for "
                      "it to finish or stop it, or choose another --out")
    except OSError as e:  # e.g. ENOLCK on a network file system without locking
        f.close()
        log.warning(f"--out {out}: cannot lock {path} ({e.strerror or e}): a second run in this "
                    "folder would not be refused")
        return None, None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    f.flush()
    return f, None


# ---------------------------------------------------------------------------- data fingerprint

_LISTED_FILES = 20  # data files listed by name in the fingerprint (all are counted)


def data_fingerprint(work, data: str = "") -> dict:
    """What the run trains on, for ``meta.json`` ``"data"``: ``source`` (``data``, or the
    embedded corpus / synthetic set), ``files`` and ``bytes`` (count and total size of the data
    files), ``listing`` (``[path, bytes]`` of the first 20 files), ``rows`` (training sequences)
    and ``sha256`` of the training and validation rows exactly as the model sees them (tokens,
    SFT labels; the regression tensors). Reads the files' sizes only; hashing ~100 MB of rows
    takes ~0.05 s. Identical on every rank (same files, same tokens).

    Args:
        work: a workload of :mod:`shardwise.train.workload` (``data.train``/``data.val``
            tensors, or ``train``/``val`` dicts of tensors).
        data: ``--data`` ("" = the embedded default corpus).
    """
    h = hashlib.sha256()
    tensors = []
    src = getattr(work, "data", None)
    if src is not None and hasattr(src, "train"):
        tensors = [src.train, src.val, getattr(src, "train_labels", None),
                   getattr(src, "val_labels", None)]
    else:  # the regression workload: dicts of tensors
        for split in (getattr(work, "train", {}), getattr(work, "val", {})):
            tensors += [split[k] for k in sorted(split)]
    for t in tensors:
        if t is not None:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().numpy())
    fp = {"source": data or ("embedded stdlib corpus" if getattr(work, "kind", "") == "lm"
                             else "synthetic"),
          "rows": int(work.num_train), "sha256": h.hexdigest()}
    if getattr(work, "kind", "") == "lm":
        from ..data import source_files

        files = [(str(p), p.stat().st_size) for p in source_files(data or None)]
        fp.update(files=len(files), bytes=sum(b for _, b in files),
                  listing=[list(f) for f in files[:_LISTED_FILES]] if data else [])
    return fp


def check_same_data(folder: Path, meta: dict, fingerprint: dict, config: dict | None = None,
                    allow: bool = False, warn=None) -> None:
    """Compare this run's :func:`data_fingerprint` with the one saved in checkpoint ``folder``
    (``meta`` = its ``meta.json``; a checkpoint without one is not checked). ``config``: this
    run's config as a dict, to name the flags the rows depend on that changed. Files only, so
    it runs on every rank before any collective.

    Raises:
        CheckpointError: the training rows differ (the message says how: sequence count, files,
            sizes, flags) and ``allow`` (``--allow-data-change``) is False; with ``allow`` it is
            a ``warn(message)`` instead.
    """
    saved = meta.get("data")
    if not saved or saved.get("sha256") == fingerprint.get("sha256"):
        return
    diffs = []
    if saved.get("rows") != fingerprint.get("rows"):
        diffs.append(f"{saved.get('rows')} training sequences then, {fingerprint.get('rows')} "
                     "now")
    if (saved.get("files"), saved.get("bytes")) != (fingerprint.get("files"),
                                                    fingerprint.get("bytes")):
        diffs.append(f"{saved.get('files')} file(s) of {saved.get('bytes')} bytes then, "
                     f"{fingerprint.get('files')} of {fingerprint.get('bytes')} now")
    then = {p: b for p, b in saved.get("listing", [])}
    now = {p: b for p, b in fingerprint.get("listing", [])}
    changed = [f"{p} {then[p]} → {now[p]} bytes" for p in then if p in now and then[p] != now[p]]
    changed += [f"{p} gone" for p in then if p not in now]
    changed += [f"{p} new" for p in now if p not in then]
    if changed:
        diffs.append(", ".join(changed[:4]) + (" …" if len(changed) > 4 else ""))
    if not diffs:
        diffs.append("same files and sizes, other contents")
    run, mine = meta.get("config", {}), config or {}
    flags = [f"--{k.replace('_', '-')} {run[k]!r} → {mine[k]!r}"
             for k in ("data", "tokenizer", "seq_len", "vocab_size", "task")
             if k in run and k in mine and run[k] != mine[k]]
    if flags:
        diffs.append("flags: " + ", ".join(flags))
    msg = (f"checkpoint {folder} was saved while training on other data (source "
           f"{saved.get('source')!r}; token rows SHA-256 {str(saved.get('sha256'))[:12]}… then, "
           f"{str(fingerprint.get('sha256'))[:12]}… now; {'; '.join(diffs)})")
    if allow:
        (warn or log.warning)(f"{msg}: --allow-data-change given, training on the new data")
        return
    raise CheckpointError(f"{msg}: resume with the same --data, --tokenizer and --seq-len, or "
                          "pass --allow-data-change to train on the new data on purpose")
