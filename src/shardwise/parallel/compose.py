"""dp × tp with the explicit engine: Megatron TP inside each dp replica, DP or ZeRO-1/2/3 over the
dp axis of the local TP shards, composed by :class:`~.model.ParallelModel`.

The mesh is (pp = 1, dp, tp) with tp innermost: rank (i, j) holds tp shard j and trains on dp
slice i. TP and DP are both linear in the gradient, so they compose without interaction: DP/ZeRO
acts on this rank's Ψ_tp ≈ Ψ/tp local elements as on a whole model over the n = dp ranks of its
column (ZeRO paper §7; the torchtitan order: TP first, FSDP over the dp mesh dimension). Math,
bytes per tag and the pitfalls (norm counting, SP partial gradients, RNG, init):
docs/composition.md, "FSDP + TP".
"""

from __future__ import annotations

from torch import nn

from .dp import DataParallel
from .model import ParallelModel
from .tp import parallelize_tensor
from .zero import ZeroDataParallel


def parallelize_2d(model: nn.Module, topo, layout, *, seed: int = 0, bucket_mb: float = 25.0,
                   overlap: bool = True, prefetch: bool = True, reshard_after_forward: bool = True,
                   reduce_dtype: str = "fp32") -> ParallelModel:
    """Convert the plain Llama ``model`` for ``layout`` (dp ≥ 2, tp ≥ 2, zero ∈ {0..3}, sp) on
    ``topo`` (mesh (pp=1, dp, tp)) and return its :class:`~.model.ParallelModel`.

    Order: (1) checks — :class:`ShardwiseConfigError` before any collective for a layout or
    topology that does not match, a non-Llama model, a tp that does not divide the heads, a bad
    zero stage or reduce dtype; (2) TP: :func:`~.tp.parallelize_tensor` (broadcast over tp,
    cut shards, ``seed`` seeds :class:`~.tp.TPRNG`); (3) over dp: DataParallel
    (``bucket_mb``, ``overlap``) or ZeroDataParallel (``prefetch``, ``reshard_after_forward``,
    ``overlap``), both reducing gradients in ``reduce_dtype``."""
    layout.check(model=model, topo=topo, reduce_dtype=reduce_dtype, composition="dp×tp")
    tp = parallelize_tensor(model, topo, sp=layout.sp, seed=seed)
    if layout.zero:
        dp = ZeroDataParallel(tp.module, topo, layout.zero, prefetch=prefetch,
                              reshard_after_forward=reshard_after_forward, overlap=overlap,
                              reduce_dtype=reduce_dtype)
    else:
        dp = DataParallel(tp.module, topo, bucket_mb=bucket_mb, overlap=overlap,
                          reduce_dtype=reduce_dtype)
    return ParallelModel(tp, dp, topo)


__all__ = ["parallelize_2d"]
