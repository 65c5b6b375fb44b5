"""Choose and apply the strategy for a layout over a plain model.

One function, :func:`parallelize`, turns a plain model into an :class:`~.engine.Engine` for a
:class:`Layout` on a :class:`~shardwise.topology.Topology`, with our explicit implementation
(``engine="explicit"``) or PyTorch's own (``engine="torch"``):

===============================  ================================  ================================
layout                           explicit                          torch
===============================  ================================  ================================
dp (zero 0)                      :mod:`.data` DataParallel          DDP (:mod:`.builtin`)
dp, zero 1/2/3                   :mod:`.zero` ZeroDataParallel      ZeroRedundancyOptimizer / FSDP2
tp [+ sp]                        :mod:`.tensor` (Megatron f/g)      DTensor ``parallelize_module``
pp [× dp]                        :mod:`.pipeline` runtime           ``torch.distributed.pipelining``
===============================  ================================  ================================

Compositions beyond these (FSDP+TP, PP×TP, 3D) are issue #6; :func:`check_supported` refuses
them with a clear error before any collective.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..errors import ShardwiseConfigError


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: degrees, ZeRO stage, sequence parallelism, pipeline schedule.
    ``microbatches`` = 0: decided by the batch (global batch / (dp × micro-batch));
    ``virtual_stages`` = 0: the schedule's default (2 for interleaved-1f1b, else 1)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def name(self) -> str:
        """Compact, e.g. ``"dp=2,zero=3"``, ``"tp=2,sp"``, ``"pp=4,1f1b,m=8"``."""
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp") if getattr(self, k) > 1]
        parts = parts or ["dp=1"]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule)
            if self.microbatches:
                parts.append(f"m={self.microbatches}")
        return ",".join(parts)

    @classmethod
    def from_config(cls, cfg) -> "Layout":
        return cls(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, zero=cfg.zero, sp=cfg.sp,
                   schedule=cfg.schedule, microbatches=cfg.microbatches,
                   virtual_stages=getattr(cfg, "virtual_stages", 0))


def check_supported(layout: Layout) -> None:
    """Raise :class:`ShardwiseConfigError` if ``layout`` combines strategies not composed yet."""
    if layout.sp and layout.tp == 1:
        raise ShardwiseConfigError("--sp (sequence parallelism) needs --tp > 1: it shards the "
                                   "activations between TP regions over the tp ranks")
    combos = [name for name, on in (("tp", layout.tp > 1), ("pp", layout.pp > 1),
                                    ("zero", layout.zero > 0)) if on]
    if layout.tp > 1 and (layout.dp > 1 or layout.pp > 1):
        raise ShardwiseConfigError(
            f"layout {layout.name()}: tensor parallelism does not compose with dp/pp in this "
            "version (composition is planned): use --tp N alone, or --dp/--pp without --tp")
    if len(combos) > 1:
        raise ShardwiseConfigError(
            f"layout {layout.name()}: {' + '.join(combos)} do not compose in this version "
            "(composition is planned): use one of them at a time (pp may be combined with dp)")
    if layout.zero and layout.dp == 1:
        raise ShardwiseConfigError(f"--zero {layout.zero} shards model state over the dp axis, "
                                   "but dp=1: use --dp ≥ 2, or --zero 0")


def parallelize(model: nn.Module, topo, layout: Layout | None = None, *,
                engine: str = "explicit", bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                layers_per_stage: list[int] | None = None, seed: int = 0) -> nn.Module:
    """Return ``model`` wrapped for ``layout`` (default: plain DP over ``topo``'s dp axis) by
    ``engine`` ("explicit" | "torch"). The model may be converted in place (TP replaces modules,
    PP keeps only this rank's stages); use the returned engine's ``.module`` afterwards.

    ``bucket_mb``/``overlap``: DP gradient buckets; ``prefetch``/``reshard_after_forward``:
    ZeRO-3; ``layers_per_stage``: an explicit pipeline split; ``seed``: TP dropout RNG.
    Raises :class:`ShardwiseConfigError` for unsupported layouts, ``ValueError`` for an unknown
    engine."""
    if engine not in ("explicit", "torch"):
        raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
    layout = layout or Layout(dp=topo.size("dp"), tp=topo.size("tp"), pp=topo.size("pp"))
    check_supported(layout)
    if layout.pp > 1:
        from .pipeline import build_pipeline

        return build_pipeline(model, topo, engine=engine, schedule=layout.schedule,
                              microbatches=layout.microbatches or None,
                              virtual_stages=layout.virtual_stages or None,
                              layers_per_stage=layers_per_stage)
    if layout.tp > 1:
        if engine == "explicit":
            from .tensor import parallelize_tensor

            return parallelize_tensor(model, topo, sp=layout.sp, seed=seed)
        from .dtensor_tp import parallelize_tensor_dtensor

        return parallelize_tensor_dtensor(model, topo, sp=layout.sp)
    if layout.zero:
        if engine == "explicit":
            from .zero import ZeroDataParallel

            return ZeroDataParallel(model, topo, layout.zero, prefetch=prefetch,
                                    reshard_after_forward=reshard_after_forward, overlap=overlap)
        from .fsdp import TorchZero

        return TorchZero(model, topo, layout.zero, bucket_mb=bucket_mb)
    if engine == "explicit":
        from .data import DataParallel

        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap)
    from .builtin import TorchDataParallel

    return TorchDataParallel(model, topo, bucket_mb=bucket_mb)
