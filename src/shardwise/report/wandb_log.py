"""``shardwise train --wandb PROJECT``: mirror each ``metrics.jsonl`` record to Weights & Biases.

The same per-step fields as ``metrics.jsonl`` (loss, lr, grad_norm, tokens, tokens_per_s,
step_time_s, tflops, mfu, comm_bytes, the per-axis ``comm_<axis>_bytes``, mem_*_bytes,
val_loss, MoE fields), at ``step`` = the optimizer step; lists are left out. Rank 0 only.

Offline unless the user configured wandb (:func:`wandb_mode`): nothing leaves the machine
unless they asked for it; ``wandb sync RUN/wandb/offline-run-*`` uploads later. Needs the
optional extra: ``pip install -e ".[wandb]"``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ShardwiseConfigError


def wandb_mode(env: dict | None = None, netrc: Path | None = None) -> str:
    """``WANDB_MODE`` when the user set it; else "online" when an API key is configured
    (``WANDB_API_KEY``, or an ``api.wandb.ai`` entry in ``~/.netrc``, where ``wandb login``
    puts it); else "offline"."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(env.get("NETRC") or Path.home() / ".netrc") if netrc is None else netrc
    try:
        if "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def require_wandb():
    """The ``wandb`` module, or a ShardwiseConfigError naming the extra to install."""
    try:
        import wandb
    except ImportError as e:
        raise ShardwiseConfigError(
            f"--wandb needs the wandb package ({e}): pip install -e \".[wandb]\" (or drop "
            "--wandb; metrics.jsonl and tb/ are written either way)") from e
    return wandb


class WandbSink:
    """One wandb run for the run folder ``out`` (``dir=out``, name = the folder's name)."""

    def __init__(self, project: str, out, config: dict | None = None):
        wandb = require_wandb()
        self.mode = wandb_mode()
        self.run = wandb.init(project=project, name=Path(out).name,
                              dir=os.environ.get("WANDB_DIR") or str(out), config=config or {},
                              mode=self.mode, reinit=True)
        # once, at the start: a crashed run's records are there too (close repeats it only if
        # it changed; it was printed at both ends, the same line twice: issue 51)
        self.said = self.where()
        print(self.said, flush=True)

    def log(self, record: dict) -> None:
        fields = {k: v for k, v in record.items() if k != "step"
                  and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if fields:
            self.run.log(fields, step=int(record["step"]))

    def where(self) -> str:
        """One line saying where the run went: the offline folder and the command that uploads
        it, or the online run's page."""
        if self.mode == "offline":
            folder = Path(self.run.dir).parent  # RUN/wandb/offline-run-…/files → its run folder
            return (f"wandb: offline run in {folder} (upload it with: wandb sync {folder}; "
                    "WANDB_MODE=online to log live)")
        return f"wandb: run at {getattr(self.run, 'url', None) or self.run.dir}"

    def close(self) -> None:
        line = self.where()
        self.run.finish()
        if line != self.said:
            print(line, flush=True)
