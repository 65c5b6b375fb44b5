"""Checkpoints that survive anything: layout-free, atomic, verified, resumable bit-exactly.

What one checkpoint holds (``<out>/checkpoints/step_<N>/``):

=====================  ==========================================================================
DCP files              ``model.<FQN>``: every parameter in its *full* shape under the plain
(``.metadata``,        model's fully qualified name (``engine.named_full_parameters()``: shards
``__r_0.distcp``)      gathered over dp/tp; a pipeline stage contributes its own FQNs);
                       ``optimizer.<FQN>.{step,exp_avg,exp_avg_sq}``: AdamW's state in the same
                       full shape (``engine.full_optimizer_state``). Written with
                       ``torch.distributed.checkpoint`` (DCP): every rank writes its own file and
                       DCP de-duplicates replicated tensors, so each tensor is stored once.
``rng/rank_<r>.pt``    rank r's RNG states: python ``random``, numpy, torch CPU (and CUDA)
``meta.json``          ``step``, sampler position, LR-scheduler state, tokens seen, validation
                       losses so far, the run config, the model config, the layout it was saved
                       under, whether the optimizer state is inside
``COMPLETE``           the completion marker, written last: size and SHA-256 of every other file
=====================  ==========================================================================

Nothing in it depends on the layout (keys are FQNs, shapes are full), so a checkpoint saved under
one layout loads under any other: the model goes into the plain model *before* ``parallelize``
(:func:`load_model`), and the optimizer state is sliced into this rank's shards after it by
``engine.load_full_optimizer_state`` (:func:`restore_training_state`).

Atomicity. A save writes into ``step_<N>.tmp``; rank 0 then writes ``meta.json``, the marker,
renames the folder to ``step_<N>`` (``os.replace``, atomic on POSIX) and only then rewrites
``checkpoints/latest``. A crash at any point leaves either no ``step_<N>`` or a complete one.
Resuming (:func:`find_resume_checkpoint`) scans the ``step_*`` folders newest first, skips (with
a warning naming it) any folder without its marker, and re-hashes the files of the one it picks:
a truncated or corrupted file is reported by name, and ``--resume auto`` falls back to the
previous complete checkpoint.

Async save (``--async-save``): ``dcp.async_save`` copies the state to CPU memory and writes it in
a background thread, over a separate gloo process group (so its collectives never interleave with
the training step's on the main group); rank 0 commits (marker, rename, ``latest``, ``--keep``)
when the write has finished on every rank. The next save, the end of the run and the test kill
hook wait for it first. On CPU/gloo it works as on GPU (gloo is a CPU backend, which async save
requires); the gain on CPU is only the file I/O, since the copy is as costly as the save's own.

Memory: the full-shape form means every rank holds, during a save or a resume, the full tensors of
its stage (model and AdamW state, ~3× the parameter bytes). That suits the models this project
trains on CPU; sharded (DTensor) checkpoints would avoid it for models that do not fit one rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import comm
from ..errors import ShardwiseConfigError

log = logging.getLogger("shardwise")

MARKER = "COMPLETE"  # JSON: {"step", "files": {relative path: {"bytes", "sha256"}}}
FORMAT = 2  # meta.json "format": 2 = optimizer in full-shape FQN form, RNG, scheduler, marker
_STEP_RE = re.compile(r"^step_(\d+)(\.tmp)?$")


class CheckpointError(ShardwiseConfigError):
    """A checkpoint that cannot be used: incomplete, corrupt, or for another model. The message
    names the folder or file and what to do instead."""


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
    """Delete all but the ``keep`` newest complete checkpoints (``keep`` = 0: keep all).
    Returns the deleted folders."""
    if keep <= 0:
        return []
    gone = [p for _, p in complete_checkpoints(root)[keep:]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


class Checkpointer:
    """Saves checkpoints of one run: ``save`` on every rank of ``topo`` (collective).

    Args:
        out: the run folder; checkpoints go to ``out/checkpoints/step_<N>``.
        topo: the run's :class:`~shardwise.topology.Topology` (all its ranks save together).
        keep: after each save, delete all but the ``keep`` newest complete checkpoints (0: all).
        async_save: write with ``dcp.async_save`` in the background (see the module docstring).
            Creates one more gloo process group here, so construct it on every rank together.
    """

    def __init__(self, out, topo, keep: int = 0, async_save: bool = False):
        self.root = Path(out) / "checkpoints"
        self.topo = topo
        self.keep = keep
        self.async_save = async_save
        self.is_writer = topo.index("world") == 0
        self._pending: tuple | None = None  # (future, committer thread or None, final folder)
        self._error: list[BaseException] = []
        self._pg = None
        if async_save:
            import torch.distributed as dist

            # a separate CPU group: the background writer's collectives never interleave with
            # the step's collectives on the main groups
            self._pg = dist.new_group(topo.ranks, backend="gloo")

    def save(self, step: int, engine, optimizer, *, scheduler=None, sampler=None,
             extra_meta: dict | None = None) -> Path:
        """Write checkpoint ``step`` (collective over ``topo``'s world). Returns the final folder
        (with ``async_save``, it exists once :meth:`wait` returns).

        Gathers ``engine.named_full_parameters()`` and ``engine.full_optimizer_state`` (both
        collective for sharded engines; ledger phase ``checkpoint``). An engine whose optimizer
        state does not come back in full parameter shape is saved without it
        (``meta.json: "optimizer_saved": false``, with a warning) rather than with wrong shapes.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        topo = self.topo
        final = self.root / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        with topo.ledger.phase("checkpoint"):
            model = {k: v.detach() for k, v in engine.named_full_parameters().items()}
            optim = engine.full_optimizer_state(optimizer)
            bad = [k for k, st in optim.items() for n, v in st.items()
                   if torch.is_tensor(v) and v.dim() > 0 and (k not in model or
                                                              v.shape != model[k].shape)]
            # every rank must agree whether the optimizer state goes in
            flag = torch.tensor([1.0 if bad else 0.0], device=topo.device)
            comm.all_reduce(flag, topo, "world", op="max", tag="checkpoint")
            with_optim = flag.item() == 0.0
            if not with_optim and self.is_writer:
                log.warning(f"checkpoint step {step}: {type(engine).__name__}.full_optimizer_state "
                            "does not return full-shape state (e.g. "
                            f"{bad[:2] or 'on another rank'}): saving the model without the "
                            "optimizer state; a resume restarts AdamW's moments")
            state = {"model": model}
            if with_optim:
                state["optimizer"] = optim
            if self.is_writer:  # a stale .tmp of an interrupted save of the same step
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "rng").mkdir(parents=True)
            comm.broadcast_object(str(tmp), topo, "world", tag="checkpoint")  # the folder exists
        torch.save(rng_state(), tmp / "rng" / f"rank_{topo.index('world')}.pt")
        meta = {"format": FORMAT, "step": step, "optimizer_saved": with_optim,
                "world_size": topo.world_size, "layout": topo.describe(),
                **({"sampler": sampler.state_dict()} if sampler is not None else {}),
                **({"scheduler": scheduler.state_dict()} if scheduler is not None else {}),
                **(extra_meta or {})}
        if not self.async_save:
            with topo.ledger.phase("checkpoint"):
                dcp.save(state, checkpoint_id=str(tmp), process_group=topo.group("world"))
                # dcp.save returns on the coordinator after every rank's files are written
                if self.is_writer:
                    self._commit(tmp, final, step, meta)
                comm.broadcast_object(final.name, topo, "world", tag="checkpoint")  # committed
            return final
        # async: stage a private copy (training goes on mutating the live tensors)
        state = _clone(state)
        fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
        thread = None
        if self.is_writer:
            def commit():
                try:
                    fut.result()  # rank 0: every rank's files and .metadata are written
                    self._commit(tmp, final, step, meta)
                except BaseException as e:  # surfaced by wait()
                    self._error.append(e)

            thread = threading.Thread(target=commit, name=f"commit step_{step}", daemon=True)
            thread.start()
        self._pending = (fut, thread, final)
        return final

    def _commit(self, tmp: Path, final: Path, step: int, meta: dict) -> None:
        """Rank 0, after every rank wrote: meta.json, the marker, rename, ``latest``, prune."""
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _write_marker(tmp, step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = self.root / "latest"
        (self.root / "latest.tmp").write_text(final.name + "\n")
        os.replace(self.root / "latest.tmp", latest)
        for p in prune(self.root, self.keep):
            log.info(f"  --keep {self.keep}: deleted {p}")

    def wait(self, barrier: bool = False) -> None:
        """Block until the pending async save is written and committed (no-op otherwise).
        ``barrier``: also make every rank wait until rank 0 has committed (collective)."""
        if self._pending is not None:
            fut, thread, final = self._pending
            self._pending = None
            fut.result()
            if thread is not None:
                thread.join()
            if self._error:
                raise self._error.pop()
            if barrier:
                with self.topo.ledger.phase("checkpoint"):
                    comm.broadcast_object(final.name, self.topo, "world", tag="checkpoint")

    def close(self) -> None:
        """Wait for the pending save; release the async group."""
        self.wait(barrier=True)
        if self._pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._pg)
            self._pg = None


def _clone(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- finding / checking

def verify_checkpoint(folder: Path) -> dict:
    """Check ``folder`` against its completion marker: every recorded file present, with its
    size and SHA-256. Returns the parsed ``meta.json``.

    Raises:
        CheckpointError: no marker (an interrupted save), a missing, truncated or corrupted file
            (named), or an unreadable ``meta.json``.
    """
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {folder} has no completion marker ({MARKER}): its save "
                              "did not finish; resume from an earlier checkpoint")
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable completion marker ({e}); resume from an "
                              "earlier checkpoint") from None
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {folder} is corrupt: {p} is missing; resume from "
                                  "an earlier checkpoint (--resume auto skips this one)")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder} is corrupt: {p} has {size} bytes but {want['bytes']} were "
                f"written ({'truncated' if size < want['bytes'] else 'grown'}); resume from an "
                "earlier checkpoint (--resume auto skips this one)")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder} is corrupt: {p} does not match the SHA-256 recorded when it "
                "was written; resume from an earlier checkpoint (--resume auto skips this one)")
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable ({e}); resume from an earlier "
                              "checkpoint") from None


def find_resume_checkpoint(spec: str, out: str, warn=None) -> Path | None:
    """Resolve ``--resume`` to one verified checkpoint folder, reading files only (no collective).

    ``spec``: ``"auto"`` — the newest complete, intact checkpoint in ``<out>/checkpoints``, or
    None when there is none yet (start fresh); a ``step_<N>`` folder — that one; a run folder or
    its ``checkpoints/`` folder — the newest complete, intact one there. Folders without their
    marker and corrupt ones are skipped with a ``warn(message)`` naming them.

    Raises:
        CheckpointError: a named step folder is incomplete or corrupt; a folder holds
            checkpoints but none is usable; ``spec`` does not exist.
    """
    warn = warn or (lambda msg: None)
    if spec == "auto":
        root = Path(out) / "checkpoints"
        if not list_checkpoints(root):
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


def _read_metadata(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # the marker's hashes passed, so this is not a shardwise checkpoint
        raise CheckpointError(f"{folder / '.metadata'}: cannot be read ({type(e).__name__}: "
                              f"{e}): not a torch.distributed.checkpoint folder") from None


def _entries(md, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}


def check_model_compatible(folder: Path, model: torch.nn.Module, meta: dict | None = None) -> None:
    """Raise :class:`CheckpointError` listing every mismatched key and shape when the checkpoint
    in ``folder`` was saved from a model of another shape than ``model`` (plain, unparallelized).
    Reads the DCP metadata only."""
    saved = {k: tuple(v.size) for k, v in _entries(_read_metadata(folder), "model.").items()
             if hasattr(v, "size")}
    mine = {k: tuple(p.shape) for k, p in model.named_parameters()}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = [f"{k}: {list(saved[k])} in the checkpoint vs {list(mine[k])} in this model"
              for k in sorted(set(mine) & set(saved)) if saved[k] != mine[k]]
    if not (missing or extra or shapes):
        return
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} shape(s) differ: " + "; ".join(shapes[:8]) +
                     (" …" if len(shapes) > 8 else ""))
    if missing:
        parts.append(f"{len(missing)} parameter(s) of this model are not in the checkpoint: "
                     f"{missing[:8]}" + (" …" if len(missing) > 8 else ""))
    if extra:
        parts.append(f"{len(extra)} checkpoint parameter(s) are not in this model: {extra[:8]}"
                     + (" …" if len(extra) > 8 else ""))
    run = (meta or {}).get("config", {})
    hint = ""
    if run:
        flags = [f"--model {run.get('model')}"]
        if run.get("n_layers"):
            flags.append(f"--n-layers {run['n_layers']}")
        flags += [f"--tokenizer {run.get('tokenizer')}", f"--vocab-size {run.get('vocab_size')}"]
        if not run.get("tie_embeddings", True):
            flags.append("--no-tie-embeddings")
        hint = f" (it was saved with {' '.join(flags)})"
    raise CheckpointError(f"checkpoint {folder} was saved from another model configuration: "
                          + "; ".join(parts) + f": resume with the saved run's model flags{hint}")


def load_model(folder: Path, model: torch.nn.Module) -> dict:
    """Load the checkpoint's full-shape weights into the *plain* ``model`` (before
    ``parallelize``), in place, on this process alone (``dcp.load(no_dist=True)``, no
    collective). Returns ``meta.json``.

    Raises:
        CheckpointError: another model configuration (:func:`check_model_compatible`), or a
            file DCP cannot read.
    """
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    check_model_compatible(folder, model, meta)
    with torch.no_grad():
        target = {k: p.detach() for k, p in model.named_parameters()}
        _dcp_load({"model": target}, folder)
    return meta


def _dcp_load(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {folder}: the DCP files cannot be read "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}); "
                              "resume from an earlier checkpoint") from None


def load_full_optimizer_state(folder: Path) -> dict[str, dict]:
    """``{FQN: {"step", "exp_avg", "exp_avg_sq"}}`` (full shapes) of every parameter in the
    checkpoint, read on this process alone (no collective)."""
    md = _read_metadata(folder)
    template: dict[str, dict] = {}
    for key, v in _entries(md, "optimizer.").items():
        fqn, name = key.rsplit(".", 1)
        template.setdefault(fqn, {})[name] = (torch.empty(tuple(v.size), dtype=v.properties.dtype)
                                              if hasattr(v, "size") else None)
    if template:
        _dcp_load({"optimizer": template}, folder)
    return template


@dataclasses.dataclass
class Resumed:
    """What :func:`restore_training_state` restored: the step to continue after, and the run's
    bookkeeping from ``meta.json``."""

    step: int
    tokens_seen: int
    val_losses: list
    optimizer_restored: bool
    rng_restored: bool
    meta: dict


def restore_training_state(folder: Path, engine, optimizer, *, scheduler=None, sampler=None,
                           rank: int = 0) -> Resumed:
    """After ``parallelize``: the optimizer state (full shapes → this rank's shards via
    ``engine.load_full_optimizer_state``), the LR scheduler, the sampler position, and this
    rank's RNG states (when the checkpoint has a file for ``rank``; a run resumed on more ranks
    than it was saved with keeps its seeded RNG on the new ranks). No collective of its own
    (an engine's ``load_full_optimizer_state`` may have one)."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    optimizer_restored = False
    if meta.get("optimizer_saved"):
        state = load_full_optimizer_state(folder)
        try:
            engine.load_full_optimizer_state(optimizer, state)
        except KeyError as e:
            raise CheckpointError(f"checkpoint {folder}: {e.args[0]}: it holds the optimizer "
                                  "state of another model") from None
        optimizer_restored = True
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
        # LambdaLR.load_state_dict restores the counters but not the groups' current lr
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    if sampler is not None and "sampler" in meta:
        sampler.load_state_dict(meta["sampler"])
    rng_file = folder / "rng" / f"rank_{rank}.pt"
    rng_restored = rng_file.is_file()
    if rng_restored:
        set_rng_state(torch.load(rng_file, weights_only=False))
    return Resumed(step=int(meta["step"]), tokens_seen=int(meta.get("tokens_seen", 0)),
                   val_losses=[tuple(v) for v in meta.get("val_losses", [])],
                   optimizer_restored=optimizer_restored, rng_restored=rng_restored, meta=meta)


# ------------------------------------------------------------------------------- output folder

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


def save_checkpoint(out: Path, step: int, engine, optimizer, topo, meta: dict) -> Path:
    """One synchronous save (collective) of ``step`` into ``out/checkpoints`` with ``meta``
    merged into ``meta.json``: :meth:`Checkpointer.save` for callers outside the training loop."""
    return Checkpointer(out, topo).save(step, engine, optimizer, extra_meta=meta)
