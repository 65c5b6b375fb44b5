"""The textbook model: stacked two-matmul MLP blocks on a synthetic regression task.

Each block is the unit the JAX scaling book (ch. 5, "How to Parallelize a Transformer for
Training") analyses: ``x ← x + W_out · gelu(W_in · x)`` with W_in: D → F and W_out: F → D.
The task is regression onto a fixed random "teacher" of the same shape, so every layout can be
tested on a model whose FLOPs and bytes are easy to count by hand.

Batches are dicts ``{"inputs": [b, D] float, "targets": [b, D] float}``; the loss is the sum of
squared errors, counted per element (see :func:`mse_loss`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .ac import CheckpointedBlock


@dataclasses.dataclass
class MLPConfig:
    d_model: int = 32
    d_ff: int = 64
    n_layers: int = 2
    init_std: float = 0.1

    def num_params(self) -> int:
        return self.n_layers * (2 * self.d_model * self.d_ff + self.d_ff + self.d_model)


class MLPBlock(CheckpointedBlock, nn.Module):
    """x [b, D] → x + W_out(gelu(W_in x)) [b, D]. ``ac_mode``: see :mod:`.ac`."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.run(self._body, x)

    def _body(self, x):
        return x + self.w_out(F.gelu(self.w_in(x)))


class StackedMLP(nn.Module):
    """``n_layers`` residual MLP blocks. inputs [b, D] → predictions [b, D]."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.n_layers))
        with torch.no_grad():
            for p in self.parameters():
                nn.init.normal_(p, 0.0, cfg.init_std)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mse_loss(pred: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared errors, number of elements) for pred/targets [b, D]."""
    return F.mse_loss(pred.float(), targets.float(), reduction="sum"), torch.tensor(targets.numel())


def regression_data(cfg: MLPConfig, num_samples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic regression set: inputs ~ N(0, 1) [N, D], targets = teacher(inputs) [N, D] with a
    fixed random teacher StackedMLP (seeded separately from the student)."""
    g = torch.Generator().manual_seed(seed + 1234)
    inputs = torch.randn(num_samples, cfg.d_model, generator=g)
    teacher_cfg = dataclasses.replace(cfg, init_std=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 4321)
        teacher = StackedMLP(teacher_cfg)
    with torch.no_grad():
        targets = teacher(inputs)
    return {"inputs": inputs, "targets": targets}
