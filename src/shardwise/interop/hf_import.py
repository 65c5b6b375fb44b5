"""Hugging Face weights into shardwise's plain model (``shardwise train --init-from-hf DIR``,
:func:`load_hf_weights`): reads a folder's ``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` into the *plain* model before
``parallelize``, so any layout starts from it; :func:`check_weight_files` is the cheap pre-flight
``config.validate`` runs before any collective. Names: :mod:`.hf_names`; config: :mod:`.hf_config`.

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

def read_hf_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder as fp32 CPU tensors: ``model.safetensors``, the shards listed
    in ``model.safetensors.index.json``, or ``pytorch_model.bin`` (loaded weights_only)."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        if not f.is_file():
            raise ShardwiseConfigError(f"{f}: listed in the index but missing: copy the whole "
                                       "model folder")
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except ImportError:
            raise ShardwiseConfigError("reading .safetensors needs the safetensors package: "
                                       "pip install 'shardwise[hf]'") from None
        except Exception as e:  # truncated or corrupt file: the libraries raise various types
            raise ShardwiseConfigError(f"{f}: cannot be read ({type(e).__name__}: {e}): the file "
                                       "is corrupt or truncated; copy it again") from None
        out.update({k: v.float() for k, v in part.items()})
    return out


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
    given our LlamaConfig or MoEConfig ``cfg``, the tensor names and shapes fit it."""
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
                shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except Exception as e:  # SafetensorError: truncated or not a safetensors file
            raise ShardwiseConfigError(f"{f}: cannot be read ({e}): the file is corrupt or "
                                       "truncated; copy it again") from None
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
                shape = handle.get_slice(k).get_shape()
                hf[k] = LazyTensor.source(shape, torch.float32, _SliceReader(f, k), k)
    yield from hf_to_ours(hf, cfg, source=str(folder)).items()


class _SliceReader:
    """Reads the box ``[o, o + s)`` of tensor ``key`` of a ``.safetensors`` file as fp32 (the
    file mapped only during the read)."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    def __call__(self, offsets, sizes) -> torch.Tensor:
        from safetensors import safe_open

        if 0 in sizes:
            return torch.empty(sizes, dtype=torch.float32)
        with safe_open(str(self.path), "pt") as handle:
            if not sizes:
                return handle.get_tensor(self.key).float()
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            return handle.get_slice(self.key)[box].float().contiguous()


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

