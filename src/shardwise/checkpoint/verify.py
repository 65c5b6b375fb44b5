"""Reading a checkpoint back safely: :func:`verify_checkpoint` (the one ``COMPLETE`` check: every
file's size and SHA-256 against the marker) and :func:`find_resume_checkpoint` (``--resume
auto|PATH``: newest complete checkpoint first, an incomplete or corrupt one named and skipped).
"""

from __future__ import annotations

from pathlib import Path

from ..readers import read_json
from .format import (_STEP_RE, MARKER, CheckpointError, _sha256, complete_checkpoints,
                     list_checkpoints, read_meta)


def verify_checkpoint(folder: Path, fix: str | None = None) -> dict:
    """Check ``folder`` against its completion marker: every recorded file present, with its
    size and SHA-256. Returns the parsed ``meta.json``.

    ``fix``: what each message tells the user to do instead (default: resume from an earlier
    checkpoint, noting that ``--resume auto`` skips a corrupt one; ``shardwise export`` passes
    its own).

    Raises:
        CheckpointError: no marker (an interrupted save), a missing, truncated or corrupted file
            (named), or an unreadable ``meta.json``.
    """
    folder = Path(folder)
    marker = folder / MARKER
    early = fix or "resume from an earlier checkpoint"
    skip = fix or "resume from an earlier checkpoint (--resume auto skips this one)"
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {folder} has no completion marker ({MARKER}): its save "
                              f"did not finish; {early}")
    record = read_json(marker, "completion marker", early, error=CheckpointError)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"completion marker {marker}: no \"files\" table: {early}")
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {folder} is corrupt: {p} is missing; {skip}")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder} is corrupt: {p} has {size} bytes but {want['bytes']} were "
                f"written ({'truncated' if size < want['bytes'] else 'grown'}); {skip}")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder} is corrupt: {p} does not match the SHA-256 recorded when it "
                f"was written; {skip}")
    return read_meta(folder, early)


def find_resume_checkpoint(spec: str, out: str, warn=None) -> Path | None:
    """Resolve ``--resume`` to one verified checkpoint folder, reading files only (no collective).

    ``spec``: ``"auto"`` — the newest complete, intact checkpoint in ``<out>/checkpoints``, or
    None when there is none yet (start fresh): folders without their completion marker (a save
    interrupted by a crash, e.g. ``step_5.tmp``) count as none, said in one ``warn`` line; a
    ``step_<N>`` folder — that one; a run folder or its ``checkpoints/`` folder — the newest
    complete, intact one there. Folders without their marker and corrupt ones are skipped with
    a ``warn(message)`` naming them.

    Raises:
        CheckpointError: a named step folder is incomplete or corrupt; a folder holds complete
            checkpoints but none is intact; a run folder holds no complete checkpoint; ``spec``
            does not exist.
    """
    warn = warn or (lambda msg: None)
    if spec == "auto":
        root = Path(out) / "checkpoints"
        if not list_checkpoints(root):
            return None
        if not complete_checkpoints(root):  # only interrupted saves: nothing to resume
            names = ", ".join(p.name for _, p in list_checkpoints(root))
            warn(f"--resume auto: {root} holds only incomplete checkpoints ({names}: saves "
                 f"interrupted before their {MARKER} marker), which count as none: starting "
                 "fresh")
            return None
    else:
        p = Path(spec)
        if not p.exists():
            raise CheckpointError(f"--resume {spec}: no such folder: give a checkpoints/step_N "
                                  "folder, a run folder, or auto")
        if (p / MARKER).exists() or (p / ".metadata").exists() or _STEP_RE.match(p.name):
            verify_checkpoint(p)
            return p
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        if not list_checkpoints(root):
            raise CheckpointError(f"--resume {spec}: no checkpoints/step_N folders there: give "
                                  "a checkpoints/step_N folder, a run folder, or auto")
        if not complete_checkpoints(root):
            raise CheckpointError(f"--resume {spec}: {root} holds only incomplete checkpoints "
                                  f"({', '.join(q.name for _, q in list_checkpoints(root))}: "
                                  f"no {MARKER} marker, their saves were interrupted): start "
                                  "fresh (drop --resume) or give another checkpoint")
    problems = []
    for _, folder in list_checkpoints(root):
        try:
            verify_checkpoint(folder)
        except CheckpointError as e:
            warn(f"skipping {folder}: {e}")
            problems.append(str(e))
            continue
        return folder
    raise CheckpointError(f"--resume {spec}: none of the {len(problems)} checkpoints in {root} "
                          f"is usable (newest: {problems[0]}); remove the folder to start fresh")


def resume_candidate(spec: str, out: str | None) -> Path | None:
    """The checkpoint folder ``--resume spec`` would try first (:func:`find_resume_checkpoint`'s
    order), from the folder names and markers alone: nothing verified, nothing hashed, so the
    launcher's validation can read its ``meta.json`` cheaply. None when there is none (or the
    spec does not exist: :func:`find_resume_checkpoint` names that)."""
    if spec == "auto":
        if not out:
            return None
        root = Path(out) / "checkpoints"
    else:
        p = Path(spec)
        if not p.exists():
            return None
        if (p / MARKER).exists() or (p / ".metadata").exists() or _STEP_RE.match(p.name):
            return p
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    done = complete_checkpoints(root)
    return done[0][1] if done else None
