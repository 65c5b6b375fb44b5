"""Choose and apply the strategy for a layout over a plain model.

One function, :func:`parallelize`, turns a plain model into an :class:`~.engine.Engine` for a
:class:`Layout` on a :class:`~shardwise.topology.Topology`, with our explicit implementation
(``engine="explicit"``) or PyTorch's own (``engine="torch"``):

=======================  ===========================  =======================================
layout                   explicit                     torch
=======================  ===========================  =======================================
dp (zero 0)              :mod:`.dp` DataParallel    DDP (:mod:`.dp.ddp`)
dp, zero 1/2/3           :mod:`.zero`                 ZeroRedundancyOptimizer / FSDP2
tp [+ sp]                :mod:`.tp` (Megatron f/g)    DTensor ``parallelize_module``
dp × tp [zero] (2D)      :mod:`.compose`              DTensor + FSDP2 (:mod:`.compose_torch`)
pp × dp [zero 1] [× tp]  :mod:`.pp` runtime     ``torch.distributed.pipelining``
=======================  ===========================  =======================================

dp × tp on either engine is one :class:`~.model.ParallelModel` of the tp part and the dp part.

:meth:`~.layout.Layout.check`, the one validator, refuses what no engine runs, with a clear error
on every rank before any collective. ``Layout``, ``parse_layout`` and ``check_supported`` live in
:mod:`.layout` and are re-exported here.
"""

from __future__ import annotations

from torch import nn

from .layout import Layout, check_supported, parse_layout

__all__ = ["Layout", "check_supported", "parallelize", "parse_layout"]


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
    Raises :class:`ShardwiseConfigError` for unsupported layouts (:meth:`Layout.check`, on every
    rank before any collective), ``ValueError`` for an unknown engine."""
    if engine not in ("explicit", "torch"):
        raise ValueError(f"unknown engine {engine!r}: choose explicit or torch")
    layout = layout or Layout(dp=topo.size("dp"), tp=topo.size("tp"), pp=topo.size("pp"))
    layout.check(model=model, topo=topo, engine=engine, reduce_dtype=reduce_dtype)
    dp_kw = dict(bucket_mb=bucket_mb, overlap=overlap, prefetch=prefetch,
                 reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype)
    if layout.pp > 1:  # PP (× DP/ZeRO-1) (× TP): the pipeline engines compose the rest
        from .pp import build_pipeline

        return build_pipeline(model, topo, layout=layout, engine=engine,
                              layers_per_stage=layers_per_stage, seed=seed, **dp_kw)
    if layout.tp > 1 and layout.dp > 1:  # 2D: TP inside, DP/ZeRO (FSDP) over dp
        if engine == "explicit":
            from .compose import parallelize_2d

            return parallelize_2d(model, topo, layout, seed=seed, **dp_kw)
        from .compose_torch import parallelize_2d_torch

        return parallelize_2d_torch(model, topo, layout, **dp_kw)
    if layout.tp > 1:
        if engine == "explicit":
            from .tp import parallelize_tensor

            return parallelize_tensor(model, topo, sp=layout.sp, seed=seed)
        from .tp import parallelize_tensor_dtensor

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
        from .dp import DataParallel

        return DataParallel(model, topo, bucket_mb=bucket_mb, overlap=overlap,
                            reduce_dtype=reduce_dtype)
    from .dp import TorchDataParallel

    return TorchDataParallel(model, topo, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)

