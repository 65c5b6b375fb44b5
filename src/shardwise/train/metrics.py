"""Run outputs on rank 0: ``metrics.jsonl``, TensorBoard events in ``tb/``, ``loss.png``, and
with ``--wandb PROJECT`` the same records in Weights & Biases."""

from __future__ import annotations

import json
from pathlib import Path

from ..readers import read_jsonl


class MetricsLogger:
    """Append one JSON object per logged step to ``out/metrics.jsonl`` and mirror the numeric
    fields to TensorBoard (``out/tb``). A no-op when ``enabled`` is False (ranks other than 0)."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool = True, wandb: str = "",
                 run_config: dict | None = None):
        self.enabled = enabled
        self.path = Path(out) / "metrics.jsonl"
        self._tb = self._wandb = None
        if enabled and wandb:  # --wandb PROJECT: the same records (report/wandb_log.py)
            from ..report.wandb_log import WandbSink

            self._wandb = WandbSink(wandb, out, run_config)
        if enabled:
            self._file = open(self.path, "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(out) / "tb"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, record["step"])
        if self._wandb is not None:
            self._wandb.log(record)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of ``metrics.jsonl``, one per line."""
    return read_jsonl(path, "metrics.jsonl")


def plot_loss(out: Path) -> Path:
    """Draw train loss (and validation loss where logged) against step into ``out/loss.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(out) / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out) / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
