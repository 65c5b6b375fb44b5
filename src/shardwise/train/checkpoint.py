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
                       under, whether the optimizer state is inside, ``finite``, and ``data``
                       (the fingerprint of the training data, :func:`data_fingerprint`)
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
previous complete checkpoint. Incomplete folders alone count as no checkpoint: ``--resume auto``
says so in one warning and starts fresh (a crash during the first save must not block a
restart).

Never a non-finite checkpoint. Before writing, every rank checks its parameters and AdamW state
for NaN/inf and the flags are all-reduced (one all-reduce, shared with the optimizer-shape
check), so every rank agrees: a non-finite state is never written or marked complete, and the
run stops with :class:`DivergedError` naming the last good checkpoint. ``meta.json`` records
``"finite": true``, and ``--keep`` rotation never deletes the newest finite checkpoint.

Failures to write (a full disk, an unwritable folder) become one :class:`CheckpointError` on
every rank that names the folder, the free space and the fix, instead of DCP's or
``torch.save``'s raw errors (``enforce fail at inline_container.cc``); the partial ``.tmp``
folder is removed. :func:`check_checkpoints_writable` catches an unwritable ``checkpoints/``
before the run starts.

The run folder. One run at a time: rank 0 holds an exclusive ``flock`` on ``<out>/run.lock``
(:func:`lock_run_folder`, pid and host written into it) for the life of the run. The data the
run trains on is fingerprinted (:func:`data_fingerprint`: files, sizes, SHA-256 of the token
rows) into ``meta.json``; a resume on other data is refused (:func:`check_same_data`) unless
``--allow-data-change``.

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


def _is_finite(folder: Path) -> bool:
    try:
        return json.loads((Path(folder) / "meta.json").read_text()).get("finite", True) is True
    except (OSError, ValueError):
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


class Checkpointer:
    """Saves checkpoints of one run: ``save`` on every rank of ``topo`` (collective).

    Args:
        out: the run folder; checkpoints go to ``out/checkpoints/step_<N>``.
        topo: the run's :class:`~shardwise.topology.Topology` (all its ranks save together).
        keep: after each save, delete all but the ``keep`` newest complete checkpoints (0: all).
        async_save: write with ``dcp.async_save`` in the background (see the module docstring).
            Creates one more gloo process group here, so construct it on every rank together.
        data: the run's :func:`data_fingerprint`, stored as ``meta.json`` ``"data"`` in every
            checkpoint (checked on resume by :func:`check_same_data`).
        resumed_from: the checkpoint the run resumed from: the last good one until this run
            commits its own (named by :class:`DivergedError`).
    """

    def __init__(self, out, topo, keep: int = 0, async_save: bool = False,
                 data: dict | None = None, resumed_from: Path | None = None):
        self.root = Path(out) / "checkpoints"
        self.topo = topo
        self.keep = keep
        self.async_save = async_save
        self.data = data
        self.resumed_from = resumed_from
        self.is_writer = topo.index("world") == 0
        self._pending: tuple | None = None  # (future, committer thread or None, final folder)
        self._error: list[BaseException] = []
        self._pg = None
        if async_save:
            import torch.distributed as dist

            # a separate CPU group: the background writer's collectives never interleave with
            # the step's collectives on the main groups
            self._pg = dist.new_group(topo.ranks, backend="gloo")

    def last_good(self) -> Path | None:
        """The newest finite complete checkpoint of this run folder, or the one the run resumed
        from (:func:`last_good_checkpoint`). Files only; call :meth:`wait` first with async
        saves."""
        return last_good_checkpoint(self.root, self.resumed_from)

    def save(self, step: int, engine, optimizer, *, scheduler=None, sampler=None,
             extra_meta: dict | None = None) -> Path:
        """Write checkpoint ``step`` (collective over ``topo``'s world). Returns the final folder
        (with ``async_save``, it exists once :meth:`wait` returns).

        Gathers ``engine.named_full_parameters()`` and ``engine.full_optimizer_state`` (both
        collective for sharded engines; ledger phase ``checkpoint``). An engine whose optimizer
        state does not come back in full parameter shape is saved without it
        (``meta.json: "optimizer_saved": false``, with a warning) rather than with wrong shapes.

        Raises (on every rank alike):
            DivergedError: a parameter or optimizer tensor on some rank is NaN/inf: nothing is
                written (the message names the last good checkpoint).
            CheckpointError: the files cannot be written (full disk, unwritable folder): the
                message names the folder, the free space and the fix.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

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
            nonfinite = [k for k, v in model.items() if not bool(torch.isfinite(v).all())]
            nonfinite += [f"optimizer.{k}.{n}" for k, st in optim.items() for n, v in st.items()
                          if torch.is_tensor(v) and v.is_floating_point()
                          and not bool(torch.isfinite(v).all())]
            # every rank must agree whether the optimizer state goes in, and whether any rank's
            # state is non-finite (then nobody writes): one all-reduce of both flags
            flag = torch.tensor([1.0 if bad else 0.0, 1.0 if nonfinite else 0.0],
                                device=topo.device)
            comm.all_reduce(flag, topo, "world", op="max", tag="checkpoint")
            if flag[1].item() != 0.0:
                what = (f"the state to checkpoint ({len(nonfinite)} tensors on this rank, e.g. "
                        f"{nonfinite[:2]})" if nonfinite else
                        "the state to checkpoint (on another rank)")
                raise DivergedError(diverged_message(step, what, self.last_good()) +
                                    f" (step_{step} was not saved)")
            with_optim = flag[0].item() == 0.0
            if not with_optim and self.is_writer:
                log.warning(f"checkpoint step {step}: {type(engine).__name__}.full_optimizer_state "
                            "does not return full-shape state (e.g. "
                            f"{bad[:2] or 'on another rank'}): saving the model without the "
                            "optimizer state; a resume restarts AdamW's moments")
            state = {"model": model}
            if with_optim:
                state["optimizer"] = optim
            failed = None
            if self.is_writer:  # a stale .tmp of an interrupted save of the same step
                try:
                    if tmp.exists():
                        shutil.rmtree(tmp)
                    (tmp / "rng").mkdir(parents=True)
                except OSError as e:
                    failed = self._write_failed(step, tmp, e)
            # the folder exists (or why not: every rank raises the same error)
            failed = comm.broadcast_object((str(tmp), failed), topo, "world",
                                           tag="checkpoint")[1]
            if failed:
                raise CheckpointError(failed)
        try:
            torch.save(rng_state(), tmp / "rng" / f"rank_{topo.index('world')}.pt")
        except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's inline_container.cc
            raise CheckpointError(self._write_failed(step, tmp, e)) from None
        meta = {"format": FORMAT, "step": step, "optimizer_saved": with_optim, "finite": True,
                "world_size": topo.world_size, "layout": topo.describe(),
                **({"sampler": sampler.state_dict()} if sampler is not None else {}),
                **({"scheduler": scheduler.state_dict()} if scheduler is not None else {}),
                **({"data": self.data} if self.data is not None else {}),
                **(extra_meta or {})}
        if not self.async_save:
            with topo.ledger.phase("checkpoint"):
                try:
                    dcp.save(state, checkpoint_id=str(tmp), process_group=topo.group("world"))
                except (Exception, CheckpointException) as e:  # DCP raises on every rank alike
                    raise CheckpointError(self._write_failed(step, tmp, e)) from None
                # dcp.save returns on the coordinator after every rank's files are written
                failed = None
                if self.is_writer:
                    try:
                        self._commit(tmp, final, step, meta)
                    except OSError as e:
                        failed = self._write_failed(step, tmp, e)
                failed = comm.broadcast_object((final.name, failed), topo, "world",
                                               tag="checkpoint")[1]  # committed (or not)
                if failed:
                    raise CheckpointError(failed)
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

    def _write_failed(self, step: int, tmp: Path, e: BaseException) -> str:
        """The one-line message for a save that could not write ``tmp`` (after removing what it
        wrote, rank 0, to give the space back): the cause, the free space, the fix."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException) and e.failures:  # the first rank's own error
            e = next(iter(e.failures.values()))[0]
        cause = " ".join(str(e).split())[:200] or type(e).__name__
        anc = self.root
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        try:
            free = f"{shutil.disk_usage(anc).free / 2**20:,.1f} MiB free on its file system"
        except OSError:
            free = "free space unknown"
        last = self.last_good()
        then = (f"resume with --resume {last}" if last is not None
                else "start the run again")
        return (f"checkpoint step {step}: cannot write {tmp} ({type(e).__name__}: {cause}); "
                f"{free}: the disk may be full or the folder not writable: free space (or "
                f"lower --keep), fix the folder's permissions or choose another --out, then "
                f"{then}")

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
            from torch.distributed.checkpoint.api import CheckpointException

            fut, thread, final = self._pending
            self._pending = None
            step, tmp = int(final.name.split("_")[1]), final.with_name(final.name + ".tmp")
            try:
                fut.result()
            except (Exception, CheckpointException) as e:
                raise CheckpointError(self._write_failed(step, tmp, e)) from None
            if thread is not None:
                thread.join()
            if self._error:
                e = self._error.pop()
                if isinstance(e, (OSError, RuntimeError, CheckpointException)):
                    raise CheckpointError(self._write_failed(step, tmp, e)) from None
                raise e
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


def _read_metadata(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # the marker's hashes passed, so this is not a shardwise checkpoint
        raise CheckpointError(f"{folder / '.metadata'}: cannot be read ({type(e).__name__}: "
                              f"{e}): not a torch.distributed.checkpoint folder") from None


def _entries(md, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}


def model_flags(run: dict) -> dict[str, str]:
    """The flags that decide a run's model shapes, ``{flag: value}`` ("" for a switch), from its
    config (a :class:`~shardwise.config.TrainConfig` as a dict, e.g. ``meta.json``'s). The
    vocabulary comes from the tokenizer: ``--vocab-size`` counts only when a BPE tokenizer is
    trained (``--tokenizer bpe`` without ``--init-from-hf``); ``bytes`` always has 257 ids and a
    tokenizer file its own."""
    flags = {"--model": str(run.get("model"))}
    if run.get("n_layers"):
        flags["--n-layers"] = str(run["n_layers"])
    if run.get("init_from_hf"):
        flags["--init-from-hf"] = str(run["init_from_hf"])
    flags["--tokenizer"] = str(run.get("tokenizer"))
    if run.get("tokenizer") == "bpe" and not run.get("init_from_hf"):
        flags["--vocab-size"] = str(run.get("vocab_size"))
    if not run.get("tie_embeddings", True):
        flags["--no-tie-embeddings"] = ""
    return flags


def _flag_value(flags: dict[str, str], key: str) -> str:
    """How a flag of :func:`model_flags` reads in a message: its value, "given" for a switch,
    "not given" when absent."""
    return {None: "not given", "": "given"}.get(flags.get(key), flags.get(key))


def check_model_compatible(folder: Path, model: torch.nn.Module, meta: dict | None = None,
                           current: dict | None = None) -> None:
    """Raise :class:`CheckpointError` listing every mismatched key and shape when the checkpoint
    in ``folder`` was saved from a model of another shape than ``model`` (plain, unparallelized).
    The message names the saved run's model flags (:func:`model_flags` of ``meta``'s config)
    and, given ``current`` (this run's config as a dict), the ones this run changed. Reads the
    DCP metadata only."""
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
        then = model_flags(run)
        hint = f" (it was saved with {' '.join(f'{k} {v}'.strip() for k, v in then.items())}"
        if current:
            now = model_flags(current)
            changed = [f"{k} ({_flag_value(now, k)} here, {_flag_value(then, k)} in the "
                       f"checkpoint's run)" for k in dict.fromkeys([*then, *now])
                       if then.get(k) != now.get(k)]
            if changed:
                hint += "; this run differs in " + "; ".join(changed)
        hint += ")"
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
    than it was saved with keeps its seeded RNG on the new ranks). A ``--lr`` other than the
    checkpoint's is honoured: the schedule keeps its position and scales to the new peak (the
    way to continue after a divergence). No collective of its own (an engine's
    ``load_full_optimizer_state`` may have one)."""
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
        base = list(scheduler.base_lrs)  # this run's --lr
        scheduler.load_state_dict(meta["scheduler"])
        if list(scheduler.base_lrs) != base:  # --lr changed on resume (e.g. after a divergence):
            log.info(f"--lr {base[0]:g} differs from the checkpoint's {scheduler.base_lrs[0]:g}: "
                     "the schedule goes on from its step with the new --lr")
            scheduler.base_lrs = base  # the schedule's position is kept, its peak is the new one
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # get_lr() outside step()
                scheduler._last_lr = list(scheduler.get_lr())
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


def save_checkpoint(out: Path, step: int, engine, optimizer, topo, meta: dict) -> Path:
    """One synchronous save (collective) of ``step`` into ``out/checkpoints`` with ``meta``
    merged into ``meta.json``: :meth:`Checkpointer.save` for callers outside the training loop."""
    return Checkpointer(out, topo).save(step, engine, optimizer, extra_meta=meta)
