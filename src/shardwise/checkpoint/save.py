"""Writing checkpoints: :class:`Checkpointer` (shard by shard into full-shape tensors, atomic
``.tmp`` → rename, never a non-finite state, optional async save over its own gloo group,
``--keep`` rotation) and
:func:`save_checkpoint` for one-off saves. The format: :mod:`shardwise.checkpoint.format`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from .. import comm
from .format import (FORMAT, CheckpointError, DivergedError, _write_marker, diverged_message,
                     last_good_checkpoint, prune, rng_state)

log = logging.getLogger("shardwise")


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

        Shard by shard: each rank writes the boxes it holds (``engine.held_boxes(optimizer)``:
        views, no gather, no copy) as chunks of the full-shape tensors (:func:`dcp_state`); a
        box several ranks hold is written once (DCP's ``dedup_save_plans``). Collective only
        for the flags below and DCP's plan exchange (ledger phase ``checkpoint``). Optimizer
        state that is not in its parameter's shape is saved without it (``meta.json:
        "optimizer_saved": false``, with a warning) rather than with wrong shapes.

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
            try:
                boxes, bad = engine.held_boxes(optimizer), None
            except ValueError as e:  # optimizer state not in its parameter's shape
                boxes, bad = engine.held_boxes(), str(e)
            nonfinite = [b.key for b in boxes
                         if b.tensor.is_floating_point() and not bool(torch.isfinite(b.tensor).all())]
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
            if not with_optim:
                if self.is_writer:
                    log.warning(f"checkpoint step {step}: {type(engine).__name__}'s optimizer "
                                f"state is not in its parameters' shapes ({bad or 'on another rank'}"
                                "): saving the model without the optimizer state; a resume "
                                "restarts AdamW's moments")
                boxes = [b for b in boxes if b.key.startswith("model.")]
            if self.async_save:  # a private copy: training goes on mutating the live tensors
                boxes = [b._replace(tensor=b.tensor.to("cpu", copy=True)) for b in boxes]
            state = dcp_state(boxes)
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
                    dcp.save(state, checkpoint_id=str(tmp), process_group=topo.group("world"),
                             planner=_planner(), storage_writer=_writer(tmp))
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
        # async: the boxes were copied above; DCP writes them in a background thread over the
        # private group (dcp.async_save's own staging would copy again, into plain tensors)
        fut = _writer_thread().submit(dcp.save, state, checkpoint_id=str(tmp),
                                      process_group=self._pg, planner=_planner(),
                                      storage_writer=_writer(tmp))
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


_WRITER = []


def _writer_thread():
    """The one background thread async saves write in (one save at a time: :meth:`wait`)."""
    if not _WRITER:
        from concurrent.futures import ThreadPoolExecutor

        _WRITER.append(ThreadPoolExecutor(1, thread_name_prefix="shardwise-ckpt"))
    return _WRITER[0]


def _planner():
    """DCP's default planner: it merges every rank's boxes into one metadata file and writes
    a box that several ranks list (replicas) once, on one of them (``dedup_save_plans``)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner()


def _writer(path):
    """DCP's file writer, each rank's boxes cut into files of at most its largest box's bytes
    (several files per rank, ``__<rank>_<i>_0.distcp``; DCP's metadata names each chunk's
    file, so the load side is unchanged).

    Why: DCP's writer (torch 2.13 ``filesystem._write_files_from_queue``) keeps every tensor it
    wrote to a file (``tensor_dict``, one per key, for its safetensors branch) until the file is
    closed, and the tensor it writes is a copy wherever the box is a view into a larger buffer
    (a ZeRO slice, a flat range cut into rows: ``clone``) or on a device (``.cpu()``). In one
    file per rank, the copies of all its keys lived at once: up to the rank's whole state (the
    save's overshoot of benchmarks/README.md, "the guide's recipe with offload"). One file per
    bucket of ≤ the largest box's bytes bounds the copies alive at once by one box (two while
    the next file's first copy is made and the last file's is released)."""
    import dataclasses
    import math

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    def nbytes(item) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return 0
        td = item.tensor_data
        return math.prod(td.chunk.sizes) * torch.empty((), dtype=td.properties.dtype).element_size()

    class BoundedWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            cap = max((nbytes(i) for i in plan.items), default=0)
            buckets, size = [], cap + 1
            for item in plan.items:
                if size + nbytes(item) > cap:
                    buckets.append([])
                    size = 0
                buckets[-1].append(item)
                size += nbytes(item)
            prefix, results = plan.storage_data, []
            for i, items in enumerate(buckets):
                sub = dataclasses.replace(plan, items=items, storage_data=dataclasses.replace(
                    prefix, prefix=f"{prefix.prefix}{i}_"))
                results += super().write_data(sub, planner).wait()
            done = Future()
            done.set_result(results)
            return done

    return BoundedWriter(str(path))


def dcp_state(boxes: list) -> dict:
    """``{checkpoint key: tensor}`` for ``dcp.save``: each key's boxes (:class:`~shardwise.
    parallel.boxes.Box`) as chunks of one full-shape tensor. The value is a placeholder tensor
    that answers DCP's two questions as a DTensor does (the ``_Checkpointable`` protocol):
    ``__create_write_items__`` (one write item per box: its offsets, sizes and the full size)
    and ``__get_tensor_shard__`` (the box's values, a view). The load side reads it as any
    DCP checkpoint (:mod:`.load`: DCP assembles whatever box a reader asks for)."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                      WriteItemType)

    by_key: dict[str, dict] = {}
    for b in boxes:
        by_key.setdefault(b.key, {})[tuple(b.offsets)] = b
    state = {}
    for key, held in by_key.items():
        items = [WriteItem(index=MetadataIndex(key, torch.Size(off)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                          sizes=b.tensor.size()),
                               properties=TensorProperties.create_from_tensor(b.tensor),
                               size=torch.Size(b.shape)))
                 for off, b in held.items()]
        holder = torch.empty(0)
        holder.__create_write_items__ = lambda fqn, obj, items=items: items
        holder.__get_tensor_shard__ = (lambda index, held=held:
                                       held[tuple(index.offset)].tensor)
        state[key] = holder
    return state


# --------------------------------------------------------------------------- finding / checking


def save_checkpoint(out: Path, step: int, engine, optimizer, topo, meta: dict) -> Path:
    """One synchronous save (collective) of ``step`` into ``out/checkpoints`` with ``meta``
    merged into ``meta.json``: :meth:`Checkpointer.save` for callers outside the training loop."""
    return Checkpointer(out, topo).save(step, engine, optimizer, extra_meta=meta)
