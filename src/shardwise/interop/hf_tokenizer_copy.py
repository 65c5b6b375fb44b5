"""A model folder's tokenizer, carried whole from training to ``shardwise export --to hf``.

A run whose tokenizer is a model folder's (``--init-from-hf DIR`` with the default ``--tokenizer
bpe``, or ``--tokenizer DIR``: :class:`~shardwise.data.hf_tokenizer.HFFolderTokenizer`) trained
on that folder's ids, special tokens and chat template. Its export must ship those same files:
a tokenizer rebuilt from ``tokenizer.json`` alone loses the chat template (``apply_chat_template``
raises) and names one token for both BOS and EOS. So:

* **at train start** rank 0 copies the folder's tokenizer files into ``RUN/tokenizer/``
  (:func:`save_run_tokenizer`): those of
  :data:`~shardwise.data.hf_tokenizer.TOKENIZER_FILES` present, ``generation_config.json`` (the
  eos list ``generate`` stops on) and ``config.json`` (whose ``bos/eos/pad_token_id`` export
  writes). Written as ``tokenizer.tmp`` and renamed, so a crash leaves the old copy or the new
  one, never half of one. A few files (a real Llama 3 ``tokenizer.json`` is ~9 MB); a resumed run
  whose copy is already identical writes nothing. A run whose tokenizer is not a folder's removes
  a copy an earlier run left in the folder;
* **at export** (:func:`run_tokenizer_source`) that copy is preferred, then the folder the run
  config names; :func:`write_folder_tokenizer` copies its tokenizer files and
  ``generation_config.json`` as they are, and :func:`special_token_ids` gives ``config.json``'s
  ``bos/eos/pad_token_id`` from the folder's own ``config.json``.

So the source folder may be gone or changed by the time the run is exported. The run's own
tokenizers (bytes, a trained BPE, a bare ``tokenizer.json``) keep export's own files
(:func:`~.hf_export.write_tokenizer_files`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..data.hf_tokenizer import TOKENIZER_FILES, HFFolderTokenizer, is_tokenizer_folder
from ..errors import ShardwiseConfigError, ShardwiseFileError
from ..readers import read_json

RUN_COPY = "tokenizer"  # RUN/tokenizer/: the copy made at train start
# what export ships as is (config.json is not among them: export writes its own)
SHIPPED = (*TOKENIZER_FILES, "generation_config.json")
COPIED = (*SHIPPED, "config.json")  # what the run folder keeps
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _present(folder: Path, names) -> list[str]:
    return [n for n in names if (folder / n).is_file()]


def save_run_tokenizer(tok, out: str | os.PathLike) -> Path | None:
    """Rank 0, at train start: copy ``tok``'s folder's files (:data:`COPIED`) into
    ``out/tokenizer/`` when ``tok`` is a model folder's tokenizer, else remove a copy an earlier
    run left there. Returns the copy, or None."""
    dst = Path(out) / RUN_COPY
    if not isinstance(tok, HFFolderTokenizer):
        if dst.is_dir():
            shutil.rmtree(dst)  # another run's: export must not ship it for this one
        return None
    src = tok.folder
    names = _present(src, COPIED)
    if dst.is_dir() and sorted(p.name for p in dst.iterdir()) == sorted(names) and all(
            (dst / n).read_bytes() == (src / n).read_bytes() for n in names):
        return dst  # a resumed run: the same files already
    tmp, old = dst.with_name(RUN_COPY + ".tmp"), dst.with_name(RUN_COPY + ".old")
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    for n in names:
        shutil.copyfile(src / n, tmp / n)
    if dst.exists():  # the old copy out of the way first: a folder cannot replace a folder
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old.exists():
        shutil.rmtree(old)
    return dst


def run_tokenizer_source(run: dict, step: Path) -> tuple[str, Path | None]:
    """What export loads as the run's tokenizer: ``(spec, folder)``. ``folder`` is the model
    folder whose files it ships (the run folder's copy when the run made one, else the folder the
    run config names), None when the tokenizer is the run's own (``spec``: ``bytes``, ``bpe``, a
    ``.json`` file), as ``train.workload.tokenizer_spec`` resolved it.

    Raises ShardwiseConfigError when the run's tokenizer was a folder that is gone and the run
    folder holds no copy (a run of an earlier version)."""
    spec, init = run.get("tokenizer") or "bpe", run.get("init_from_hf") or ""
    from_init = spec == "bpe" and bool(init)
    if from_init:  # the default tokenizer with --init-from-hf DIR: the folder's own
        spec = init
    if spec in ("bytes", "bpe"):
        return spec, None
    copy = step.parent.parent / RUN_COPY  # step = RUN/checkpoints/step_N
    if is_tokenizer_folder(copy):
        return spec, copy
    from ..data.tokenizer import model_tokenizer_folder

    folder = model_tokenizer_folder(spec)
    if folder is not None:
        return spec, folder
    if from_init and Path(init).is_dir():  # an older run: a BPE trained beside a folder
        return "bpe", None                  # without a tokenizer
    if from_init or not spec.endswith(".json"):
        raise ShardwiseConfigError(
            f"the run trained with the tokenizer of {spec}, which is gone or holds no tokenizer "
            f"now, and the run folder has no {RUN_COPY}/ copy of it: pass --tokenizer DIR, a "
            "folder with the model's tokenizer files")
    return spec, None


def special_token_ids(folder: Path, tok: HFFolderTokenizer) -> dict:
    """``config.json``'s ``bos/eos/pad_token_id`` for an export whose tokenizer is ``folder``'s:
    those the folder's own ``config.json`` holds, as they are (an eos list stays a list; a key
    it lacks stays out); a folder without one (a tokenizer alone): the tokenizer's BOS, EOS and
    PAD (None where it has none). Raises ShardwiseConfigError for a ``config.json`` that is not
    a JSON object."""
    f = folder / "config.json"
    if not f.is_file():
        return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                "pad_token_id": tok.hf.pad_token_id}
    try:
        src = read_json(f, "the tokenizer folder's config.json")
    except ShardwiseFileError as e:
        raise ShardwiseConfigError(f"{f}: {e}: fix or remove it") from None
    if not isinstance(src, dict):
        raise ShardwiseConfigError(f"{f} is not a JSON object: fix or remove it")
    return {k: src[k] for k in SPECIAL_IDS if k in src}


def write_folder_tokenizer(folder: Path, out: Path, ids: dict) -> list[str]:
    """Copy ``folder``'s tokenizer files and ``generation_config.json`` (:data:`SHIPPED`) into
    ``out`` as they are; a folder without ``generation_config.json`` gets one with ``ids``'s
    bos/eos/pad. Returns the names written."""
    names = _present(folder, SHIPPED)
    for n in names:
        shutil.copyfile(folder / n, out / n)
    if "generation_config.json" not in names:
        import json

        (out / "generation_config.json").write_text(json.dumps(
            {k: v for k, v in ids.items() if v is not None}, indent=2))
        names.append("generation_config.json")
    return names
