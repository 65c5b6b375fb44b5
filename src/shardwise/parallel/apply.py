"""Choose and apply the strategy for a layout over a plain model.

One function, :func:`parallelize`, turns a plain model into an :class:`~.engine.Engine` for a
:class:`Layout` on a :class:`~shardwise.topology.Topology`, with our explicit implementation
(``engine="explicit"``) or PyTorch's own (``engine="torch"``):

=========================  ===============================  ==========================================
layout                     explicit                         torch
=========================  ===============================  ==========================================
dp (zero 0)                :mod:`.data` DataParallel         DDP (:mod:`.builtin`)
dp, zero 1/2/3             :mod:`.zero` ZeroDataParallel     ZeroRedundancyOptimizer / FSDP2
tp [+ sp]                  :mod:`.tensor` (Megatron f/g)     DTensor ``parallelize_module``
dp × tp [zero] (2D)        :mod:`.compose`                   FSDP2/DDP + DTensor (:mod:`.compose_torch`)
pp × dp [zero 1] [× tp]    :mod:`.pipeline` runtime          ``torch.distributed.pipelining`` (+ DTensor)
=========================  ===============================  ==========================================

:func:`check_supported` refuses what no engine runs, with a clear error before any collective.
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


def parse_layout(text: str) -> Layout:
    """``"dp=2"``, ``"dp=2,zero=3"``, ``"tp=2,sp"``, ``"pp=4,schedule=1f1b,m=8"`` → Layout.
    Raises ShardwiseConfigError naming the syntax."""
    from .pipeline import SCHEDULES

    kw: dict = {}
    for part in text.split(","):
        key, _, value = (x.strip() for x in part.partition("="))
        if key == "sp" and not value:
            kw["sp"] = True
        elif key in SCHEDULES and not value:
            kw["schedule"] = key
        elif key == "schedule" and value in SCHEDULES:
            kw["schedule"] = value
        elif key in ("dp", "tp", "pp", "zero", "m", "microbatches", "v") and value.isdigit():
            kw[{"m": "microbatches", "v": "virtual_stages"}.get(key, key)] = int(value)
        else:
            raise ShardwiseConfigError(
                f"--layouts {text!r}: write each layout as comma-separated parts: dp=N, tp=N, "
                f"pp=N, zero=Z, sp, a schedule ({', '.join(SCHEDULES)}), m=M (e.g. dp=2,zero=3 "
                "or pp=2,1f1b,m=4)")
    layout = Layout(**kw)
    check_supported(layout)
    return layout


def check_supported(layout: Layout) -> None:
    """Raise :class:`ShardwiseConfigError` (before any collective) for a layout no engine runs.

    * ``sp`` needs tp > 1; ``zero`` needs dp ≥ 2;
    * ZeRO-2/3 with pp > 1 is refused, as DeepSpeed refuses it: the pipeline runs m micro-batches
      per step, so ZeRO-2 would reduce-scatter (or keep full) gradients m times and ZeRO-3 would
      re-gather every stage's parameters for each micro-batch's forward and backward — m× the
      traffic for memory that ZeRO-1 (sharded optimizer state, the large part) already saves.
      Megatron-LM likewise pairs PP only with its distributed optimizer (= ZeRO-1)."""
    if layout.sp and layout.tp == 1:
        raise ShardwiseConfigError("--sp (sequence parallelism) needs --tp > 1: it shards the "
                                   "activations between TP regions over the tp ranks")
    if layout.zero and layout.dp == 1:
        raise ShardwiseConfigError(f"--zero {layout.zero} shards model state over the dp axis, "
                                   "but dp=1: use --dp ≥ 2, or --zero 0")
    if layout.zero >= 2 and layout.pp > 1:
        raise ShardwiseConfigError(
            f"layout {layout.name()}: ZeRO-{layout.zero} does not compose with pipeline "
            "parallelism (each of the m micro-batches would re-shard gradients/re-gather "
            "parameters; DeepSpeed refuses it too): use --zero 1 with --pp, or --pp 1")


def parallelize(model: nn.Module, topo, layout: Layout | None = None, *,
                engine: str = "explicit", bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: bool = True, reshard_after_forward: bool = True,
                layers_per_stage: list[int] | None = None, seed: int = 0,
                reduce_dtype: str = "fp32") -> nn.Module:
    """Return ``model`` wrapped for ``layout`` (default: plain DP over ``topo``'s dp axis) by
    ``engine`` ("explicit" | "torch"). The model may be converted in place (TP replaces modules,
    PP keeps only this rank's stages); use the returned engine's ``.module`` afterwards.

    Composition order (mesh (pp, dp, tp), tp innermost): TP inside each stage, then the
    pipeline split, then DP/ZeRO over the dp axis (``docs/composition.md``).

    ``bucket_mb``/``overlap``: DP gradient buckets; ``prefetch``/``reshard_after_forward``:
    ZeRO-3; ``layers_per_stage``: an explicit pipeline split; ``seed``: TP dropout RNG;
    ``reduce_dtype``: "fp32" | "bf16", the dtype gradients are reduced in over dp.
    Raises :class:`ShardwiseConfigError` for unsupported layouts, ``ValueError`` for an unknown
    engine."""
    if engine not in ("explicit", "torch"):
        raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
    layout = layout or Layout(dp=topo.size("dp"), tp=topo.size("tp"), pp=topo.size("pp"))
    check_supported(layout)
    dp_kw = dict(bucket_mb=bucket_mb, overlap=overlap, prefetch=prefetch,
                 reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype)
    if layout.pp > 1:  # PP (× DP/ZeRO-1) (× TP): the pipeline engines compose the rest
        from .pipeline import build_pipeline

        return build_pipeline(model, topo, layout=layout, engine=engine,
                              layers_per_stage=layers_per_stage, seed=seed, **dp_kw)
    if layout.tp > 1 and layout.dp > 1:  # 2D: TP inside, DP/ZeRO (FSDP) over dp
        if engine == "explicit":
            from .compose import parallelize_2d

            return parallelize_2d(model, topo, layout, seed=seed, **dp_kw)
        from .compose_torch import parallelize_2d_torch

        return parallelize_2d_torch(model, topo, layout, **dp_kw)
    if reduce_dtype != "fp32" and layout.dp > 1:
        _check_reduce_dtype(reduce_dtype)
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
                                    reshard_after_forward=reshard_after_forward, overlap=overlap,
                                    reduce_dtype=reduce_dtype)
        from .zero.torch_zero import TorchZero

        return TorchZero(model, topo, layout.zero, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
    if engine == "explicit":
        from .data import DataParallel

        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap,
                            reduce_dtype=reduce_dtype)
    from .builtin import TorchDataParallel

    return TorchDataParallel(model, topo, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)


def _check_reduce_dtype(reduce_dtype: str) -> None:
    if reduce_dtype not in ("fp32", "bf16"):
        raise ShardwiseConfigError(f"--reduce-dtype {reduce_dtype!r}: choose fp32 or bf16")
