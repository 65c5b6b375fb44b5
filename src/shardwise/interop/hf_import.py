"""Hugging Face weights into shardwise's plain model (``shardwise train --init-from-hf DIR``,
:func:`load_hf_weights`): reads a folder's ``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` into the *plain* model before
``parallelize``, so any layout starts from it; :func:`check_weight_files` is the cheap pre-flight
``config.validate`` runs before any collective. Names: :mod:`.hf_names`; config: :mod:`.hf_config`.

**What loading refuses** (issue 50), so that a folder that cannot mean what it would train as
fails at start-up, in one line naming the file, the tensor and the fix:

* a tensor that is not a float (fp32, bf16, fp16, fp64): integers, booleans and fp8 are
  quantized or packed weights whose values mean nothing without their scales and layout.
  Read off the safetensors header (no data) by :func:`check_weight_files`; a
  ``pytorch_model.bin`` when it is loaded;
* a NaN or ±inf in any weight, which would otherwise end as "training diverged" after the first
  step. ``shardwise train`` run alone scans every tensor once, one at a time, before it spawns
  a worker (:func:`check_weights_finite`); and every rank checks each box it reads of a
  tensor while it materialises its part (:class:`_SliceReader`, :func:`read_hf_weights`), so a
  torchrun launch refuses with the same line.

Errors: every bad folder raises :class:`~shardwise.errors.ShardwiseConfigError` naming the file
and the fix. Nothing here needs a process group.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ShardwiseConfigError
from ..readers import read_json
from .hf_config import _is_moe, hf_to_llama_config, read_hf_config
from .hf_names import hf_to_ours

# safetensors' names of the float dtypes a weight may be stored in (read as fp32); every other
# (I8, U8, I32, BOOL, F8_E4M3 …) holds quantized or packed values
FLOAT_DTYPES = {"F16": "fp16", "BF16": "bf16", "F32": "fp32", "F64": "fp64"}
_TORCH_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def refuse_dtype(path, name: str, dtype) -> None:
    """Raise the one-line refusal of tensor ``name`` of file ``path`` stored as ``dtype``."""
    raise ShardwiseConfigError(f"{path}: tensor {name} is stored as {dtype}, not a float: "
                               "quantized checkpoints are not supported: give a float "
                               "(fp32/bf16/fp16) checkpoint")


def check_finite(t: torch.Tensor, path, name: str) -> None:
    """Raise ShardwiseConfigError unless every value of ``t`` (tensor ``name`` of file ``path``,
    or a box of it) is finite. The message is the same whichever box holds the NaN, so the
    launcher's scan and a rank's read refuse with one line."""
    if not bool(torch.isfinite(t).all()):
        raise ShardwiseConfigError(
            f"{path}: tensor {name} holds NaN or inf values: training from it would only end in "
            "'training diverged': give a checkpoint whose weights are all finite (the file is "
            "damaged, or the run that wrote it had diverged)")


def _checked(t: torch.Tensor, path, name: str) -> torch.Tensor:
    """``t`` as fp32, after refusing a non-float dtype or a non-finite value."""
    if t.dtype not in _TORCH_FLOATS:
        refuse_dtype(path, name, t.dtype)
    check_finite(t, path, name)
    return t.float()


def _load_whole(f: Path) -> dict[str, torch.Tensor]:
    """Every tensor of weight file ``f`` (``.safetensors`` or a torch pickle, weights_only)."""
    if not f.is_file():
        raise ShardwiseConfigError(f"{f}: listed in the index but missing: copy the whole "
                                   "model folder")
    try:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(f))
        try:  # mapped: a tensor's pages are read when it is used
            return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (pre-zip) pickle cannot be mapped
            return torch.load(f, map_location="cpu", weights_only=True)
    except ImportError:
        raise ShardwiseConfigError("reading .safetensors needs the safetensors package: "
                                   "pip install 'shardwise[hf]'") from None
    except Exception as e:  # truncated or corrupt file: the libraries raise various types
        raise ShardwiseConfigError(f"{f}: cannot be read ({type(e).__name__}: {e}): the file "
                                   "is corrupt or truncated; copy it again") from None


def read_hf_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder as fp32 CPU tensors: ``model.safetensors``, the shards listed
    in ``model.safetensors.index.json``, or ``pytorch_model.bin`` (loaded weights_only).
    Raises ShardwiseConfigError for a tensor that is not a float or holds a NaN or inf."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        out.update({k: _checked(v, f, k) for k, v in _load_whole(f).items()})
    return out


def check_weights_finite(folder: str | os.PathLike) -> None:
    """Read every tensor of the HF folder once, one at a time (memory: the largest tensor; a
    ``pytorch_model.bin`` is memory-mapped, not read whole), and raise ShardwiseConfigError
    naming the first that holds a NaN or inf (or, in a ``pytorch_model.bin``, is not a float).
    ``shardwise train`` run alone calls it before it spawns any worker; the ranks check only
    what they read (:class:`_SliceReader`)."""
    for f in weight_files(folder):
        if f.suffix != ".safetensors":
            for k, v in _load_whole(f).items():
                _checked(v, f, k)
            continue
        from safetensors import safe_open

        try:
            handle = safe_open(str(f), "pt")
        except Exception as e:  # SafetensorError: truncated or not a safetensors file
            raise ShardwiseConfigError(f"{f}: cannot be read ({e}): the file is corrupt or "
                                       "truncated; copy it again") from None
        with handle:
            for k in handle.keys():
                check_finite(handle.get_tensor(k), f, k)


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of a HF folder (see :func:`read_hf_weights`); ShardwiseConfigError when
    there are none. Cheap: reads at most the index."""
    folder = Path(folder)
    single, index, pt = (folder / "model.safetensors", folder / "model.safetensors.index.json",
                         folder / "pytorch_model.bin")
    files: list[Path]
    if single.is_file():
        files = [single]
    elif index.is_file():
        data = read_json(index, "--init-from-hf", "re-save the model with save_pretrained")
        try:
            shards = sorted(set(data["weight_map"].values()))
        except (KeyError, AttributeError, TypeError) as e:
            raise ShardwiseConfigError(f"{index}: not a safetensors index ({e}): re-save the "
                                       "model with save_pretrained") from None
        files = [folder / s for s in shards]
    elif pt.is_file():
        files = [pt]
    else:
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: no weights (model.safetensors, model.safetensors.index.json "
            "or pytorch_model.bin): save the model with save_pretrained into that folder")
    return files


def check_weight_files(folder: str | os.PathLike, cfg=None) -> None:
    """Cheap pre-flight (headers only) for ``--init-from-hf``, run by ``config.validate`` before
    any collective: the weight files exist, every ``.safetensors`` header covers its file (a
    truncated copy fails here, on every rank, instead of after the process group exists), and,
    given our LlamaConfig or MoEConfig ``cfg``, the tensor names and shapes fit it. A tensor
    stored as anything but a float (an int8 or fp8 quantized checkpoint) is refused here, from
    the header's dtype (:data:`FLOAT_DTYPES`)."""
    shapes: dict[str, tuple] = {}
    for f in weight_files(folder):
        if not f.is_file():
            raise ShardwiseConfigError(f"{f}: listed in the index but missing: copy the whole "
                                       "model folder")
        if f.suffix != ".safetensors":
            continue
        try:
            from safetensors import safe_open
        except ImportError:
            raise ShardwiseConfigError("reading .safetensors needs the safetensors package: "
                                       "pip install 'shardwise[hf]'") from None
        try:
            with safe_open(str(f), "pt") as handle:
                slices = {k: handle.get_slice(k) for k in handle.keys()}
                dtypes = {k: s.get_dtype() for k, s in slices.items()}
                shapes.update({k: tuple(s.get_shape()) for k, s in slices.items()})
        except Exception as e:  # SafetensorError: truncated or not a safetensors file
            raise ShardwiseConfigError(f"{f}: cannot be read ({e}): the file is corrupt or "
                                       "truncated; copy it again") from None
        for k in sorted(dtypes):
            if dtypes[k] not in FLOAT_DTYPES:
                refuse_dtype(f, k, dtypes[k])
    if cfg is None or not shapes:
        return
    # the names and shapes as the weights would load: meta tensors through the same renaming
    # (and Mixtral's expert stacking) that load_hf_weights applies
    got = {k: tuple(v.shape) for k, v in hf_to_ours(
        {k: torch.empty(v, device="meta") for k, v in shapes.items()}, cfg,
        source=str(folder)).items()}
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_for(cfg).state_dict().items()}
    check_shapes(got, expected, ("file", "config.json"),
                 f"{folder}: the weights do not fit its config.json",
                 "config.json and the weights must come from the same save_pretrained")


def check_shapes(got: dict, expected: dict, sides: tuple[str, str], what: str, fix: str) -> None:
    """Raise ShardwiseConfigError when the tensors ``got`` (name → shape) differ from
    ``expected`` in names or shapes: ``WHAT (N mismatched: ['NAME: SIDE0 SHAPE vs SIDE1 SHAPE',
    …]): FIX``, the first 6 by name; a tensor on one side only shows ``missing``/``absent``."""
    bad = [f"{k}: {sides[0]} {got.get(k, 'missing')} vs {sides[1]} {expected.get(k, 'absent')}"
           for k in sorted(set(expected) | set(got)) if got.get(k) != expected.get(k)]
    if bad:
        raise ShardwiseConfigError(f"{what} ({len(bad)} mismatched: {bad[:6]}): {fix}")


def model_for(cfg):
    """Our plain model of config ``cfg``: :class:`~shardwise.models.MoELlama` for a MoEConfig,
    else :class:`~shardwise.models.Llama` (on the current default device)."""
    from ..models import Llama, MoELlama

    return MoELlama(cfg) if _is_moe(cfg) else Llama(cfg)


def hf_weight_stream(model, folder: str | os.PathLike):
    """(our parameter name, full-shape fp32 tensor) for every tensor of the HF folder, through
    the same renaming as :func:`load_hf_weights`: for a model built on the meta device, whose
    engine keeps only its part of each (``parallelize(..., weights=)``). From ``.safetensors``
    files each is a :class:`~shardwise.lazy.LazyTensor` that reads only the box asked for
    (``safe_open(...).get_slice``: a rank reads its tp/ep shard, its ZeRO-3 rows, nothing of
    another stage's layers); GPT-2's transposed ``Conv1D`` weights and fused ``c_attn`` and
    Mixtral's per-expert tensors are cut and stacked lazily too, so they read no more. A
    ``pytorch_model.bin`` is loaded whole (plain tensors). The checks of
    :func:`load_hf_weights` run first (ShardwiseConfigError)."""
    cfg = _check_kind(model, folder)
    files = weight_files(folder)
    if any(f.suffix != ".safetensors" for f in files):
        yield from hf_to_ours(read_hf_weights(folder), cfg, source=str(folder)).items()
        return
    from safetensors import safe_open

    from ..lazy import LazyTensor

    hf = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for k in handle.keys():
                part = handle.get_slice(k)
                if part.get_dtype() not in FLOAT_DTYPES:
                    refuse_dtype(f, k, part.get_dtype())
                hf[k] = LazyTensor.source(part.get_shape(), torch.float32, _SliceReader(f, k), k)
    yield from hf_to_ours(hf, cfg, source=str(folder)).items()


class _SliceReader:
    """Reads the box ``[o, o + s)`` of tensor ``key`` of a ``.safetensors`` file as fp32 (the
    file mapped only during the read). Every value read is checked finite
    (:func:`check_finite`): the rank that reads a NaN refuses, naming the file and the tensor,
    before its first step."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    def __call__(self, offsets, sizes) -> torch.Tensor:
        from safetensors import safe_open

        if 0 in sizes:
            return torch.empty(sizes, dtype=torch.float32)
        with safe_open(str(self.path), "pt") as handle:
            if not sizes:
                t = handle.get_tensor(self.key).float()
            else:
                box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                t = handle.get_slice(self.key)[box].float().contiguous()
        check_finite(t, self.path, self.key)
        return t


def _check_kind(model, folder):
    """The folder's config as ours, after checking ``model`` is of its kind and family."""
    from ..models import MoELlama

    cfg = hf_to_llama_config(read_hf_config(folder), source=f"{folder}/config.json")
    if _is_moe(cfg) != isinstance(model, MoELlama):
        arch, have, need = (("MixtralForCausalLM", "a dense Llama", "a MoE") if _is_moe(cfg)
                            else ("LlamaForCausalLM", "a MoELlama", "a dense"))
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: its config.json is a {arch} but the model built is "
            f"{have}: build {need} model from the folder's overrides (hf_model_kind, "
            "hf_model_overrides)")
    if getattr(model, "config", cfg).family != cfg.family:
        raise ShardwiseConfigError(
            f"--init-from-hf {folder}: its config.json is a {cfg.family} model but the model "
            f"built is a {model.config.family} one: build the model from the folder's "
            "overrides (hf_model_overrides)")
    return cfg


@torch.no_grad()
def load_hf_weights(model, folder: str | os.PathLike) -> None:
    """Copy the HF Llama or Mixtral folder's weights into our plain ``model`` (in place, before
    ``parallelize``). The architecture must match (build the model with
    :func:`hf_model_overrides`; a MoE preset for a Mixtral folder); raises ShardwiseConfigError
    when the model is of the other kind, or listing missing/unexpected names and shape
    mismatches."""
    cfg = _check_kind(model, folder)
    ours = hf_to_ours(read_hf_weights(folder), cfg, source=str(folder))
    _copy_into(model, ours, str(folder))


def _copy_into(model, state: dict[str, torch.Tensor], source: str) -> None:
    target = model.state_dict()
    missing = sorted(set(target) - set(state))
    extra = sorted(set(state) - set(target))
    shapes = [f"{k}: {tuple(state[k].shape)} vs model {tuple(target[k].shape)}"
              for k in target if k in state and state[k].shape != target[k].shape]
    if missing or extra or shapes:
        parts = ([f"missing {missing[:6]}"] if missing else []) + \
                ([f"unexpected {extra[:6]}"] if extra else []) + \
                ([f"shape mismatch {shapes[:6]}"] if shapes else [])
        raise ShardwiseConfigError(f"{source}: weights do not fit the model ({'; '.join(parts)}): "
                                   "the model config and the weights must come from the same "
                                   "checkpoint")
    for k, t in target.items():
        t.copy_(state[k].to(t.dtype))

