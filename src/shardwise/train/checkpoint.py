"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by fully qualified parameter names.

``checkpoints/step_<N>/`` holds the model (full-shape tensors under the plain model's FQNs,
whatever the layout: shards are gathered first) and, for replicated-parameter engines (DP), the
optimizer state (DCP files), and ``meta.json`` (step, sampler position, config, what was saved). It is written into ``step_<N>.tmp`` and renamed when complete,
then ``checkpoints/latest`` is updated, so a crash mid-save never leaves a folder that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict


def save_checkpoint(out: Path, step: int, engine, optimizer, topo, meta: dict) -> Path:
    """Save on every rank of ``topo`` (collective). Returns the final folder.

    Model: ``engine.named_full_parameters()`` (gathered over dp/tp shards; a pipeline stage
    contributes its own FQNs), written once per FQN (DCP de-duplicates replicated tensors).
    Optimizer: saved in FQN form for engines whose optimizer holds full, replicated parameters
    (plain DP, DDP); sharded optimizer state (ZeRO, TP, PP) is not saved yet (``meta.json`` says
    ``"optimizer_saved": false``)."""
    from ..parallel.builtin import TorchDataParallel
    from ..parallel.data import DataParallel

    final = Path(out) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    with topo.ledger.phase("checkpoint"):
        state = {"model": {k: v.detach() for k, v in engine.named_full_parameters().items()}}
    with_optim = isinstance(engine, (DataParallel, TorchDataParallel))
    if with_optim:
        _, state["optimizer"] = get_state_dict(engine.module, optimizer)
    is_writer = topo.index("world") == 0
    if is_writer and tmp.exists():
        shutil.rmtree(tmp)
    with topo.ledger.phase("checkpoint"):
        dcp.save(state, checkpoint_id=str(tmp), process_group=topo.group("world"))
    if is_writer:  # dcp.save returns on the coordinator after every rank's files are written
        meta = {"step": step, "optimizer_saved": with_optim, **meta}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (final.parent / "latest").write_text(final.name + "\n")
    return final
