"""One of our checkpoints out to a Hugging Face folder.

Export (``shardwise export --checkpoint DIR --to hf OUT``, :func:`export_hf`) reads one of our
checkpoints (``checkpoints/step_N/``: DCP files with full-shape tensors under ``model.<FQN>``, and
``meta.json`` with the run's config) on one process, renames the tensors, and writes::

    OUT/config.json            LlamaConfig fields (architectures = ["LlamaForCausalLM"]; a MoE
                               model: MixtralConfig fields, ["MixtralForCausalLM"])
    OUT/model.safetensors      fp32 tensors under Hugging Face names (a larger model: several
                               files and model.safetensors.index.json, written one at a time)
    OUT/tokenizer.json         the run's own tokenizer (bytes, a trained BPE, a file) as a
                               `tokenizers` file
    OUT/tokenizer_config.json  PreTrainedTokenizerFast, eos token, model_max_length
    OUT/generation_config.json eos/bos ids

A run whose tokenizer was a model folder's (``--init-from-hf DIR``, ``--tokenizer DIR``) ships
that folder's tokenizer files and ``generation_config.json`` as they are instead (chat template,
BOS, EOS, PAD, the eos list), and ``config.json`` takes its ``bos/eos/pad_token_id`` from the
folder's ``config.json``: :mod:`.hf_tokenizer_copy` (the run folder's copy, made at train start,
is preferred to the folder itself).

The checkpoint is read through :mod:`shardwise.checkpoint` (:func:`read_checkpoint`: its
``COMPLETE`` marker is checked by :func:`~shardwise.checkpoint.verify_checkpoint`, every file's
size and SHA-256), then the DCP files are read on this one process, one weight file's tensors
at a time (lazy tensors: the whole model is never in memory). Names: :mod:`.hf_names`;
config: :mod:`.hf_config`.

Errors: a bad checkpoint raises :class:`~shardwise.checkpoint.CheckpointError`, any other bad
input :class:`~shardwise.errors.ShardwiseConfigError` (its base class), naming the file and the
fix. Nothing here needs a process group.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..data.hf_tokenizer import HFFolderTokenizer
from ..errors import ShardwiseConfigError
from ..lazy import materialize
from ..checkpoint.format import MARKER, CheckpointError, read_meta
from ..checkpoint.verify import verify_checkpoint
from .hf_config import check_hf_exportable, hf_model_overrides, llama_to_hf_config
from .hf_import import check_shapes, model_for
from .hf_names import ours_to_hf
from .hf_tokenizer_copy import (SPECIAL_IDS, run_tokenizer_source, special_token_ids,
                                write_folder_tokenizer)

def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder, its ``checkpoints/`` folder (→ the one ``latest`` names), or a
    ``step_N`` folder → the ``step_N`` folder. Raises CheckpointError saying what is
    there."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--checkpoint {p}: no such folder: give a run folder, its "
                              "checkpoints/ folder or a checkpoints/step_N folder")
    for base in (p, p / "checkpoints"):
        latest = base / "latest"
        if latest.is_file():
            name = latest.read_text().strip()
            if not (base / name).is_dir():
                raise CheckpointError(f"{latest} names {name!r}, which does not exist: "
                                      "pass a complete checkpoints/step_N folder")
            return base / name
    if (p / "meta.json").exists() or (p / ".metadata").exists():
        return p
    raise CheckpointError(f"--checkpoint {p}: no checkpoint there (no meta.json/.metadata, "
                          "no checkpoints/latest): pass a run folder or a checkpoints/step_N "
                          "folder")


_FIX = "use an earlier checkpoints/step_N"  # what every checkpoint error here tells the user


def read_checkpoint(path: str | os.PathLike, lazy: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict, Path]:
    """The model tensors (our FQN → full-shape fp32 tensor), ``meta.json`` and the step folder
    of a checkpoint, read on this one process (``dcp.load(no_dist=True)``; the optimizer state is
    not read). ``lazy``: :class:`~shardwise.lazy.LazyTensor` s instead, each read when asked
    (one ``dcp.load`` of it), after the same checks. Raises CheckpointError naming the file
    when something is missing or corrupt (the ``COMPLETE`` check:
    :func:`~shardwise.checkpoint.verify_checkpoint`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    step = resolve_checkpoint(path)
    corrupt = f"the checkpoint is corrupt: {_FIX}"
    meta = read_meta(step, {"missing": f"the checkpoint is incomplete (its save did not finish): "
                            f"{_FIX}", "unreadable": _FIX, "encoding": corrupt, "syntax": corrupt})
    # the one COMPLETE check (sizes and SHA-256 of every file); a checkpoint written before the
    # marker existed (meta "format" < 2, no COMPLETE) has none to check
    if (step / MARKER).is_file() or meta.get("format", 1) >= 2:
        verify_checkpoint(step, fix=_FIX)
    try:
        md = FileSystemReader(str(step)).read_metadata()
    except Exception as e:  # missing or corrupt .metadata
        raise CheckpointError(f"{step / '.metadata'}: cannot be read ({type(e).__name__}): "
                              "the checkpoint is corrupt or incomplete: use an earlier "
                              "checkpoints/step_N") from None
    state = {}
    for key, tmd in md.state_dict_metadata.items():
        for prefix in ("model.", "model/"):
            if key.startswith(prefix) and hasattr(tmd, "size"):
                state[key] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype,
                                         device="meta" if lazy else None)
    if not state:
        raise CheckpointError(f"{step}: no model tensors in the checkpoint (keys "
                              f"{sorted(md.state_dict_metadata)[:4]}): not a shardwise "
                              "checkpoint")
    _check_storage_files(step, md)
    if lazy:
        from ..checkpoint.load import DCPBoxReader
        from ..lazy import LazyTensor

        return {k.split(".", 1)[1] if k.startswith("model.") else k.split("/", 1)[1]:
                LazyTensor.source(v.shape, v.dtype, DCPBoxReader(step, k, v.shape, v.dtype),
                                  k).float() for k, v in state.items()}, meta, step
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(step), no_dist=True)
    except (Exception, CheckpointException) as e:  # corrupt .distcp: assorted errors, which
        # DCP wraps in CheckpointException (a BaseException whose text holds a traceback)
        inner = next(iter(getattr(e, "failures", {}).values()), e)
        inner = getattr(inner, "exc", inner)
        raise CheckpointError(f"{step}: the tensor files cannot be read "
                              f"({type(inner).__name__}: {str(inner).splitlines()[0][:160]}):"
                              " the checkpoint is corrupt: use an earlier "
                              "checkpoints/step_N") from None
    model = {k.split(".", 1)[1] if k.startswith("model.") else k.split("/", 1)[1]: v.float()
             for k, v in state.items()}
    return model, meta, step


def _check_storage_files(step: Path, md) -> None:
    """Every byte range the DCP metadata promises must exist: names a missing or truncated
    ``.distcp`` file (a crash mid-copy, a full disk) instead of a deep unpickling error."""
    need: dict[str, int] = {}
    for info in getattr(md, "storage_data", {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            need[path] = max(need.get(path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = step / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {step / '.metadata'}): the "
                                  "checkpoint is incomplete: use an earlier "
                                  "checkpoints/step_N")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f}: truncated ({f.stat().st_size} of {size} bytes): the "
                                  "checkpoint is corrupt: use an earlier checkpoints/step_N")


def checkpoint_model_config(state: dict[str, torch.Tensor], meta: dict):
    """The LlamaConfig (a MoEConfig for a mixture of experts) a checkpoint was trained with:
    ``meta["model_config"]`` when the run recorded it, else the run config's preset +
    ``n_layers`` + ``tie_embeddings`` (+ the ``--init-from-hf`` folder's architecture), with the
    vocabulary read off the embedding. Raises ShardwiseConfigError for a model that is not
    Llama-style, or when the tensors do not fit that config (listing them)."""
    from ..models import MOE_PRESETS, PRESETS, LlamaConfig, MoEConfig, preset_config

    run = meta.get("config", {})
    if "model_config" in meta:
        mc = meta["model_config"] or {}
        try:
            cfg = (MoEConfig if "n_experts" in mc else LlamaConfig)(**mc)
        except TypeError as e:  # e.g. the regression MLP's config
            raise ShardwiseConfigError(f"the checkpoint's model ({e}) is not a Llama-style "
                                       "model: only the Llama and MoE models export to "
                                       "HF") from None
    else:
        name = run.get("model", "")
        if name not in PRESETS and name not in MOE_PRESETS:
            raise ShardwiseConfigError(f"the checkpoint's model {name!r} is not a Llama preset: "
                                       "only the Llama models (tiny/small/base) and the MoE "
                                       "ones export to HF")
        if "tok_embeddings.weight" not in state:
            raise ShardwiseConfigError("the checkpoint has no tok_embeddings.weight (a pipeline "
                                       "checkpoint missing a stage?): cannot export")
        over = {"vocab_size": state["tok_embeddings.weight"].shape[0],
                "tie_embeddings": run.get("tie_embeddings", True)}
        if run.get("n_layers"):
            over["n_layers"] = run["n_layers"]
        if run.get("init_from_hf") and Path(run["init_from_hf"]).is_dir():
            over.update({k: v for k, v in hf_model_overrides(run["init_from_hf"]).items()
                         if k != "vocab_size"})
        cfg = preset_config(name, **over)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_for(cfg).named_parameters()}
    check_shapes({k: tuple(v.shape) for k, v in state.items()}, expected,
                 ("checkpoint", "config"), "the checkpoint's tensors do not fit its model config",
                 "was it written by another version or edited?")
    return cfg


# ------------------------------------------------------------------------------- tokenizers

def byte_tokenizer_json():
    """Our :class:`~shardwise.data.ByteTokenizer` (ids 0..255 = UTF-8 bytes, 256 = EOS) as a
    ``tokenizers.Tokenizer``: a byte-level BPE with no merges whose vocabulary puts byte ``b``
    at id ``b`` (GPT-2's byte→unicode alphabet), then ``<|endoftext|>`` at 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's reversible byte → printable-unicode map (Radford et al. 2019, encoder.py)
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _tokenizer_from_run(run: dict, step: Path):
    """The tokenizer a run trained with (:func:`~.hf_tokenizer_copy.run_tokenizer_source`): a
    model folder's (the run folder's ``tokenizer/`` copy, else the folder the run config names:
    an :class:`~shardwise.data.hf_tokenizer.HFFolderTokenizer`), else a ``tokenizer.json`` saved
    beside the checkpoint, else our own rebuilt from the run config (bytes, a tokenizer file, or
    the cached BPE of its data)."""
    from ..data.tokenizer import ByteTokenizer, load_tokenizer

    spec, folder = run_tokenizer_source(run, step)
    if folder is not None:
        return load_tokenizer(str(folder), None, 0, Path("."))
    for cand in (step / "tokenizer.json", step.parent.parent / "tokenizer.json"):
        if cand.is_file():
            return load_tokenizer(str(cand), None, 0, Path("."))
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json"):
        return load_tokenizer(spec, None, 0, Path("."))
    if run.get("task") == "sft":
        from ..data.sft import prepare_sft_data

        return prepare_sft_data(run["data"], spec, run.get("vocab_size", 4096),
                                run.get("seq_len", 128)).tokenizer
    from ..data import prepare_lm_data

    return prepare_lm_data(run.get("data") or None, spec, run.get("vocab_size", 4096),
                           run.get("seq_len", 128)).tokenizer


def write_tokenizer_files(tok, out: Path, max_len: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (PreTrainedTokenizerFast) for ``tok``."""
    from ..data.tokenizer import ByteTokenizer

    text = byte_tokenizer_json().to_str() if isinstance(tok, ByteTokenizer) else tok.to_str()
    (out / "tokenizer.json").write_text(text)
    eos = json.loads(text)
    eos_tok = next((a["content"] for a in eos.get("added_tokens", [])
                    if a.get("id") == tok.eos_id), "<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_tok, "bos_token": eos_tok,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False}, indent=2))


# ----------------------------------------------------------------------------------- export

MAX_SHARD_BYTES = 2 * 2**30  # a weight file's size above which export writes several


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike,
              tokenizer: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a LlamaForCausalLM folder ``out`` from one of our checkpoints (see module doc); a
    MixtralForCausalLM folder when the checkpoint's model is a mixture of experts.

    The tensors are read lazily and written one weight file at a time: ``model.safetensors``
    when the model's fp32 bytes fit ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors``
    files of at most that size (a tensor larger than it gets a file of its own) and
    ``model.safetensors.index.json``, as ``save_pretrained`` shards; so the process holds one
    file's tensors at a time, never the whole model.

    ``tokenizer``: a tokenizer to ship instead of the run's own: a model folder (or its
    ``tokenizer.json`` beside a ``tokenizer_config.json``), whose files are copied whole, or a
    ``tokenizers`` ``.json``. The folder is written as ``out.tmp`` and renamed when complete.
    Returns ``out``. Raises ShardwiseConfigError for an existing non-empty ``out``, a
    missing/corrupt checkpoint, a non-Llama model, or a tokenizer that cannot be found."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardwiseConfigError(f"export: {out} already exists and is not empty: choose a "
                                   "new output folder or remove it")
    state, meta, step = read_checkpoint(checkpoint, lazy=True)
    cfg = checkpoint_model_config(state, meta)
    check_hf_exportable(cfg)  # before anything is written
    run = meta.get("config", {})
    try:
        if tokenizer:
            from ..data.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer, None, 0, Path("."))
        else:
            tok = _tokenizer_from_run(run, step)
    except ShardwiseConfigError as e:
        raise ShardwiseConfigError(f"export: could not rebuild the run's tokenizer ({e}): pass "
                                   "--tokenizer DIR|FILE.json") from None
    if tok.vocab_size > cfg.vocab_size:
        raise ShardwiseConfigError(f"export: the tokenizer has {tok.vocab_size} ids but the model "
                                   f"only {cfg.vocab_size} embeddings: pass the run's own "
                                   "--tokenizer")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ShardwiseConfigError("export --to hf needs safetensors: pip install "
                                   "'shardwise[hf]'") from None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ShardwiseConfigError(f"export: cannot create {tmp} ({e.strerror}): choose a "
                                   "writable output folder") from None
    try:
        _write_weights(ours_to_hf(state, cfg), tmp, max_shard_bytes, save_file)
        hf_config = llama_to_hf_config(cfg, tok.eos_id)
        if isinstance(tok, HFFolderTokenizer):  # a model folder's: its files whole, its ids
            ids = special_token_ids(tok.folder, tok)
            for key in SPECIAL_IDS:  # the folder's, not our one EOS
                hf_config.pop(key, None)
            hf_config.update(ids)
            write_folder_tokenizer(tok.folder, tmp, ids)
        else:  # our own tokenizer: its tokenizer.json, one EOS (also BOS)
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id}, indent=2))
            write_tokenizer_files(tok, tmp, cfg.max_seq_len)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial folder would keep the space
        if not isinstance(e, (OSError, _safetensor_error())):
            raise
        # a full disk, a quota, a lost mount: one line, not safetensors' traceback
        raise ShardwiseConfigError(
            f"export: writing {tmp} failed ({_write_problem(e)}); the partial folder was "
            f"removed: free space there (the model's weights alone take "
            f"{_weight_bytes(state) / 2**20:,.1f} MiB) or export to another OUT") from None
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out


def _safetensor_error() -> type[Exception]:
    """safetensors' own error class (a failed write of its Rust writer, e.g. on a full disk,
    arrives as ``SafetensorError: Error while serializing: I/O error: No space left …``)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # an older safetensors: its writer raised OSError
        return OSError
    return SafetensorError


def _write_problem(e: Exception) -> str:
    """What went wrong, in one line: the OS's words (``No space left on device``), else the
    first line of the library's message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _weight_bytes(state: dict) -> int:
    """The fp32 bytes export writes for ``state``'s tensors (lazy or plain)."""
    return sum(4 * math.prod(getattr(t, "shape", ())) for t in state.values())


def _write_weights(hf: dict, folder: Path, max_shard_bytes: int, save_file) -> None:
    """The tensors of ``hf`` (HF name → lazy or plain tensor) into ``folder``: files planned from
    the shapes (in order, a new file when the next tensor would pass ``max_shard_bytes``), each
    file's tensors read, written and dropped before the next file's are read."""
    files: list[list[str]] = [[]]
    size = 0
    for name, t in hf.items():
        nbytes = 4 * math.prod(t.shape)
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    n = len(files)
    paths = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    for path, names in zip(paths, files):
        part = {k: materialize(hf[k]).float().contiguous() for k in names}
        save_file(part, str(folder / path), metadata={"format": "pt"})
        del part
    if n > 1:
        total = sum(4 * math.prod(t.shape) for t in hf.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: p for p, names in zip(paths, files) for k in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
