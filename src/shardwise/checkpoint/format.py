"""The checkpoint format on disk: the folder names (``step_<N>``, ``step_<N>.tmp``), the completion
marker (:data:`MARKER`: size and SHA-256 of every other file, written last), the RNG states, the
listing, rotation (:func:`prune`) and the errors (:class:`CheckpointError`,
:class:`DivergedError`). What a checkpoint holds and why: :mod:`shardwise.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ..errors import ShardwiseConfigError
from ..readers import read_json


MARKER = "COMPLETE"  # JSON: {"step", "files": {relative path: {"bytes", "sha256"}}}
FORMAT = 2  # meta.json "format": 2 = optimizer in full-shape FQN form, RNG, scheduler, marker
_STEP_RE = re.compile(r"^step_(\d+)(\.tmp)?$")


class CheckpointError(ShardwiseConfigError):
    """A checkpoint that cannot be used: incomplete, corrupt, or for another model. The message
    names the folder or file and what to do instead."""


class DivergedError(ShardwiseConfigError):
    """Training went non-finite (loss, gradient norm, parameters or AdamW state are NaN/inf).
    The message names the step and the last good checkpoint to resume from."""


def last_good_checkpoint(root: Path, fallback: Path | None = None) -> Path | None:
    """The newest complete checkpoint in ``root`` that is finite (every checkpoint this module
    commits is; one whose ``meta.json`` says ``"finite": false`` is passed over), else
    ``fallback`` (e.g. the checkpoint the run resumed from, outside ``root``)."""
    for _, p in complete_checkpoints(root):
        if _is_finite(p):
            return p
    return fallback


def diverged_message(step: int, what: str, last_good: Path | None) -> str:
    """The one-line message of :class:`DivergedError`: ``what`` went non-finite at ``step``."""
    if last_good is None:
        where = ("no checkpoint was saved before it: start again with a lower --lr or a "
                 "--grad-clip (e.g. 1.0)")
    else:
        where = (f"the last good checkpoint is {last_good}: resume from it (--resume "
                 f"{last_good}) with a lower --lr or a --grad-clip (e.g. 1.0), or check the data")
    return f"training diverged at step {step}: {what} is not finite; {where}"


def read_meta(folder: Path, fix: str | dict = "") -> dict:
    """The checkpoint's ``meta.json``, or :class:`CheckpointError` naming it (missing,
    unreadable or not valid JSON) with ``fix`` (a string, or one per problem:
    :mod:`shardwise.readers`)."""
    return read_json(Path(folder) / "meta.json", "checkpoint", fix, error=CheckpointError)


def _is_finite(folder: Path) -> bool:
    try:
        return read_meta(folder).get("finite", True) is True
    except CheckpointError:
        return False


# ------------------------------------------------------------------------------------ saving

def rng_state() -> dict:
    """This process's RNG states: python ``random``, numpy's global, torch CPU, CUDA (if any)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """The inverse of :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(folder: Path, step: int) -> None:
    """Hash every file of ``folder`` (all ranks' files: call after the save finished everywhere)
    into ``folder/COMPLETE``, written last (via a temporary name + rename)."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in (MARKER, MARKER + ".tmp"):
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, folder / MARKER)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_<N>`` / ``step_<N>.tmp`` folder in ``root``, newest
    first (a complete folder before a ``.tmp`` of the same step)."""
    root = Path(root)
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), bool(m.group(2)), p))
    found.sort(key=lambda t: (-t[0], t[1]))
    return [(s, p) for s, _, p in found]


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The folders of :func:`list_checkpoints` that carry their completion marker."""
    return [(s, p) for s, p in list_checkpoints(root)
            if not p.name.endswith(".tmp") and (p / MARKER).is_file()]


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (``keep`` = 0: keep all), but
    never the newest finite one (:func:`last_good_checkpoint`), even when it is older than
    the ``keep`` newest. Returns the deleted folders."""
    if keep <= 0:
        return []
    complete = [p for _, p in complete_checkpoints(root)]
    good = last_good_checkpoint(root)
    gone = [p for p in complete[keep:] if p != good]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
