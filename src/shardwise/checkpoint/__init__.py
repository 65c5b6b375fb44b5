"""Checkpoints that survive anything: layout-free, atomic, verified, resumable bit-exactly.

One module per job: :mod:`.format` (folders, the ``COMPLETE`` marker, RNG, rotation, errors),
:mod:`.save` (:class:`Checkpointer`), :mod:`.verify` (the one ``COMPLETE`` check and
``--resume``), :mod:`.load` (model and training state into any layout) and :mod:`.run` (disk
space, the run-folder lock, the data fingerprint).

What one checkpoint holds (``<out>/checkpoints/step_<N>/``):

=====================  ==========================================================================
DCP files              ``model.<FQN>``: every parameter as a tensor of its *full* shape under the
(``.metadata``,        plain model's fully qualified name; ``optimizer.<FQN>.{step,exp_avg,
``__<r>_*.distcp``)    exp_avg_sq}``: AdamW's state in the same full shapes. Written shard by shard
                       with ``torch.distributed.checkpoint`` (DCP): rank r's files hold only the
                       boxes rank r holds (``engine.held_boxes``: ZeRO slices, tp/ep shards, its
                       stage, FSDP2's DTensor shards), each a chunk (offsets, sizes) of the full
                       tensor in ``.metadata``; a box several ranks hold (replicas) is stored
                       once, by one of them. No gather: docs/checkpointing.md, "Shard by shard".
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

Async save (``--async-save``): the boxes this rank holds are copied to CPU memory and
``dcp.save`` writes them in a background thread (``dcp.async_save``'s own staging would copy
them again, into plain tensors without their offsets), over a separate gloo process group (so its collectives never interleave with
the training step's on the main group); rank 0 commits (marker, rename, ``latest``, ``--keep``)
when the write has finished on every rank. The next save, the end of the run and the test kill
hook wait for it first. On CPU/gloo it works as on GPU (gloo is a CPU backend, which async save
requires); the gain on CPU is only the file I/O, since the copy is as costly as the save's own.

Memory: a save holds nothing more than training does, up to one box's copy at a time (DCP
copies a view of a larger buffer before writing it): each rank writes what it holds. A resume
reads, on each rank, only the boxes its layout holds (:func:`checkpoint_weight_stream`), and the
optimizer state in full shapes (:func:`load_full_optimizer_state`), which it then cuts.
"""

from .format import (FORMAT, MARKER, CheckpointError, DivergedError, complete_checkpoints,
                     diverged_message, last_good_checkpoint, list_checkpoints, prune, read_meta,
                     rng_state, set_rng_state)
from .save import Checkpointer, save_checkpoint
from .verify import find_resume_checkpoint, resume_candidate, verify_checkpoint
from .load import (Resumed, check_model_compatible, check_saved_optimizer,
                   checkpoint_weight_stream, load_full_optimizer_state, load_model, model_flags,
                   restore_training_state)
from .run import (LOCK_FILE, RunFolderBusyError, check_checkpoints_writable, check_disk_space,
                  check_same_data, checkpoint_bytes_estimate, data_fingerprint, lock_run_folder)

__all__ = ["FORMAT", "LOCK_FILE", "MARKER", "Checkpointer", "CheckpointError", "DivergedError",
           "Resumed", "RunFolderBusyError", "check_checkpoints_writable", "check_disk_space",
           "check_model_compatible", "check_same_data", "check_saved_optimizer",
           "checkpoint_bytes_estimate",
           "complete_checkpoints", "data_fingerprint", "diverged_message", "find_resume_checkpoint",
           "checkpoint_weight_stream", "last_good_checkpoint", "list_checkpoints",
           "load_full_optimizer_state", "load_model",
           "lock_run_folder", "model_flags", "prune", "read_meta", "restore_training_state",
           "resume_candidate", "rng_state",
           "save_checkpoint", "set_rng_state", "verify_checkpoint"]
