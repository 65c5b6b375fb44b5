"""Compose the strategies over a plain model, in a documented order.

Today: data parallelism only (``--dp N``), through our explicit engine or DDP. Later issues add,
in this order: TP inside each block, the pipeline split, then DP/ZeRO over the dp axis.
"""

from __future__ import annotations

from torch import nn

from .builtin import TorchDataParallel
from .data import DataParallel


def parallelize(model: nn.Module, topo, *, engine: str = "explicit", bucket_mb: float = 25.0,
                overlap: bool = True) -> nn.Module:
    """Return ``model`` wrapped for ``topo``'s layout by ``engine`` ("explicit" | "torch").

    The wrapper has ``.module`` (the plain model), ``sync_gradients(enabled)``,
    ``finish_gradient_sync()`` and ``clip_grad_norm_(max_norm)``. Raises ``ValueError`` for an
    unknown engine."""
    if engine == "explicit":
        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap)
    if engine == "torch":
        return TorchDataParallel(model, topo, bucket_mb=bucket_mb)
    raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
