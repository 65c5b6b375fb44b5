"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by fully qualified parameter names.

``checkpoints/step_<N>/`` holds the model and optimizer state (DCP files), and ``meta.json``
(step, sampler position, config). It is written into ``step_<N>.tmp`` and renamed when complete,
then ``checkpoints/latest`` is updated, so a crash mid-save never leaves a folder that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict


def save_checkpoint(out: Path, step: int, model, optimizer, topo, meta: dict) -> Path:
    """Save on every rank of ``topo`` (collective). ``model`` is the plain (unwrapped) module.
    Returns the final folder. Replicated tensors are written once (DCP de-duplicates)."""
    final = Path(out) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    is_writer = topo.index("world") == 0
    if is_writer and tmp.exists():
        shutil.rmtree(tmp)
    with topo.ledger.phase("checkpoint"):
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp),
                 process_group=topo.group("world"))
    if is_writer:  # dcp.save returns on the coordinator after every rank's files are written
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (final.parent / "latest").write_text(final.name + "\n")
    return final
