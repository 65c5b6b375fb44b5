"""Loading a checkpoint into any layout: the model into the plain model before ``parallelize``
(:func:`load_model`, after :func:`check_model_compatible`), the optimizer state, scheduler,
sampler and RNG after it (:func:`restore_training_state`: the engine slices the full-shape state
into this rank's shards, so a checkpoint saved under one layout resumes under any other).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import torch

from .format import CheckpointError, read_meta, set_rng_state

log = logging.getLogger("shardwise")


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
    meta = read_meta(folder)
    check_model_compatible(folder, model, meta)
    with torch.no_grad():
        target = {k: p.detach() for k, p in model.named_parameters()}
        _dcp_load({"model": target}, folder)
    return meta


def checkpoint_weight_stream(folder: Path, model: torch.nn.Module):
    """(parameter name, full-shape :class:`~shardwise.lazy.LazyTensor`) for each parameter of
    the *plain* ``model`` (built on the meta device: shapes only): each reads from the
    checkpoint only the box the engine asks for (one ``dcp.load`` of that box, on this process
    alone: the saved chunks it overlaps), for ``parallelize(..., weights=)``, whose engine keeps
    only its part of each. Raises as :func:`load_model`, before the first tensor."""
    from ..lazy import LazyTensor

    folder = Path(folder)
    check_model_compatible(folder, model, read_meta(folder))
    shapes = [(k, p.shape, p.dtype) for k, p in model.named_parameters()]

    def stream():
        for k, shape, dtype in shapes:
            yield k, LazyTensor.source(shape, dtype, DCPBoxReader(folder, f"model.{k}", shape,
                                                                  dtype), k)

    return stream()


class DCPBoxReader:
    """Reads the box ``[o, o + s)`` of tensor ``key`` (its DCP key, e.g. ``model.norm.weight``)
    of a DCP checkpoint, in ``dtype``: the ``read_fn`` of a :class:`~shardwise.lazy.LazyTensor`.
    DCP reads what a destination's chunk overlaps (its resharding); the destination here is a
    plain tensor of the box that reports the full size and the box as its one chunk (the
    ``__create_chunk_list__`` / ``__get_tensor_shard__`` protocol a DTensor implements).
    Raises :class:`CheckpointError` when the files cannot be read."""

    def __init__(self, folder: Path, key: str, shape, dtype):
        self.folder, self.key, self.shape, self.dtype = folder, key, torch.Size(shape), dtype

    def __call__(self, offsets, sizes) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        box = torch.empty(sizes, dtype=self.dtype)
        if 0 in sizes:
            return box
        if tuple(sizes) == tuple(self.shape):
            _dcp_load({self.key: box}, self.folder)
            return box
        dest = box.view(sizes)  # the same storage; DCP sees the full size and one chunk
        dest.size = lambda *d: self.shape if not d else self.shape[d[0]]
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        dest.__create_chunk_list__ = lambda: [chunk]
        dest.__get_tensor_shard__ = lambda index: box
        _dcp_load({self.key: dest}, self.folder)
        return box


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


def check_optimizer_kind(state: dict[str, dict], optimizer, folder) -> None:
    """Raise :class:`CheckpointError` when the checkpoint's optimizer state is another
    optimizer's than ``optimizer``'s: Muon keeps ``momentum_buffer`` for its matrices, AdamW
    ``exp_avg``/``exp_avg_sq`` (loading one into the other would start the moments from
    nothing, silently). No collective."""
    saved_muon = any("momentum_buffer" in st for st in state.values())
    muon = any(g.get("muon") for g in optimizer.param_groups)
    if saved_muon != muon:
        names = ("--optimizer muon", "--optimizer adamw")
        raise CheckpointError(
            f"checkpoint {folder} holds {'Muon' if saved_muon else 'AdamW'}'s optimizer state, "
            f"but this run uses {'Muon' if muon else 'AdamW'}: resume with "
            f"{names[0] if saved_muon else names[1]}, or start a new run (a new --out, without "
            "--resume)")


OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


def check_saved_optimizer(folder, meta: dict, optimizer: str) -> None:
    """Raise :class:`CheckpointError` when the checkpoint in ``folder`` holds another optimizer's
    state than ``--optimizer optimizer`` would resume, read from its ``meta.json`` (``meta``):
    the saved run's ``config.optimizer`` where ``optimizer_saved``. Files only: the launcher and
    every rank refuse before any collective what :func:`check_optimizer_kind` would refuse only
    after the model is built (issue 51). A checkpoint without that record passes (the state's
    own check still runs)."""
    run = meta.get("config") if isinstance(meta, dict) else None
    saved = run.get("optimizer") if isinstance(run, dict) else None
    if saved not in OPTIMIZER_NAMES or saved == optimizer or not meta.get("optimizer_saved"):
        return
    raise CheckpointError(
        f"--resume: checkpoint {folder} holds {OPTIMIZER_NAMES[saved]}'s optimizer state "
        f"(--optimizer {saved}), but this run uses "
        f"{OPTIMIZER_NAMES.get(optimizer, optimizer)} (--optimizer {optimizer}): resume with "
        f"--optimizer {saved}, or start a new run (a new --out, without --resume)")


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
    meta = read_meta(folder)
    optimizer_restored = False
    if meta.get("optimizer_saved"):
        state = load_full_optimizer_state(folder)
        check_optimizer_kind(state, optimizer, folder)
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
