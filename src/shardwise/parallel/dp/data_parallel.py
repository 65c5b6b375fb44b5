"""Data parallelism (DP) with explicit, bucketed, overlapped gradient all-reduce.

Every dp rank holds the full model and a disjoint slice of the global batch. The loss of a step
is the token-weighted mean over the *global* batch,

    L = (1/T) Σ_r Σ_{t ∈ batch_r} ℓ_t,      T = Σ_r T_r  (tokens with a label, all ranks),

so each rank back-propagates its own token-loss sum divided by the global T, and the gradients
are **summed** over dp (all_reduce SUM). A mean of per-rank means weights the tokens wrongly
whenever the T_r differ.

What moves over dp per optimizer step (n = dp degree, Ψ parameters of b bytes each):

* one all_reduce of the gradients, split into buckets (:class:`GradBuckets`), tag ``grad``,
  once per step whatever the accumulation: 2(n−1)/n · Ψ·b bytes sent per rank (ring all-reduce;
  ZeRO paper, Rajbhandari et al. 2019 §7.1 "Data Parallel Communication Volume"; JAX scaling
  book ch. 5, "Data parallelism"). With ``precision.reduce_dtype`` "bf16" b = 2
  (:func:`~shardwise.precision.reduce_torch_dtype`).
* one all_reduce of the step's token count T before the forward (8 bytes), tag "loss"
* (bookkeeping in the train loop: one all_reduce of the summed loss for logging, tag "loss")

Derivation, worked numbers and pitfalls: docs/data-parallel.md.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ... import comm
from ..sync import Sync
from ...precision import FP32, Precision
from ..params import (Held, broadcast_replicas, grad_of, local, norm_bytes, reduce_groups,
                      set_grad_)

class _Bucket:
    """Consecutive parameters (in backward order) whose gradients travel in one flat buffer
    of ``dtype`` (the reduce dtype; the parameters' own dtype when None)."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype | None = None):
        self.params = params
        shards = [local(p) for p in params]  # DTensor parameters: this rank's shard
        self.buffer = torch.zeros(sum(t.numel() for t in shards), dtype=dtype or params[0].dtype,
                                  device=shards[0].device)
        self.views, offset = [], 0
        for t in shards:
            self.views.append(self.buffer[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        self.ready = 0
        self.handle = None


# Buckets are launched strictly in index order on every rank (a bucket that completes early
# waits for its predecessors): collectives on one group are matched by call order, so ranks whose
# gradients arrive in different orders must still issue the same sequence of all-reduces.


class GradBuckets:
    """DP's gradient sync, an object any engine holds: the gradients of ``params`` summed over
    ``topo``'s "dp" axis by bucketed all-reduces (SUM: each rank's loss was already divided by
    the global token count). Tag ``grad``.

    ``bucket_mb``: bucket size in MB (2**20 bytes); parameters are grouped into buckets in
    reverse order, roughly the order backward makes their gradients ready. ``overlap=True``:
    post-accumulate-grad hooks count arrivals and launch each bucket's all-reduce asynchronously
    as soon as its gradients are complete, while backward continues on earlier layers (Li et al.
    2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", §3.2);
    ``overlap=False``: every bucket is launched in :meth:`finish` (no hooks: a pipeline's zb-h1
    writes ``.grad`` by hand, where hooks do not fire). ``precision.reduce_dtype``: "fp32" |
    "bf16", the dtype the buckets hold and move (cast back after;
    :func:`~shardwise.precision.reduce_torch_dtype`). Gradients are read through
    :func:`.params.local` (the PyTorch pipeline's DTensor shards)."""

    def __init__(self, params: list[nn.Parameter], topo, *, bucket_mb: float = 25.0,
                 overlap: bool = True, precision: Precision = FP32, axis: str | None = None):
        rdtype = precision.reduce_torch
        self.topo, self.overlap = topo, overlap
        self.axis = axis or topo.data_axis  # "edp" for expert weights under expert parallelism
        self.enabled = True
        cap = max(1, int(bucket_mb * 2**20))
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed(params):  # ≈ the order gradients become ready in backward
            t = local(p)
            if current and (size + t.numel() * t.element_size() > cap
                            or p.dtype != current[0].dtype):
                self.buckets.append(_Bucket(current, rdtype))
                current, size = [], 0
            current.append(p)
            size += t.numel() * t.element_size()
        if current:
            self.buckets.append(_Bucket(current, rdtype))
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next = 0  # index of the next bucket to launch
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        """Inside ``sync_gradients(False)`` backward only accumulates locally (no collectives):
        with M micro-batches the first M−1 only accumulate in ``.grad`` and one all-reduce of
        the sum follows the last (syncing every micro-step would move M× the bytes)."""
        prev, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = prev

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.enabled:
            return
        self._bucket_of[p].ready += 1
        while (self._next < len(self.buckets)
               and self.buckets[self._next].ready == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            g = grad_of(p)  # bf16 storage: the fp32 main gradient (..storage)
            if g is None:  # unused on this rank: contributes zeros
                view.zero_()
            else:
                view.copy_(local(g))  # casts to the reduce dtype (bf16: rounds)
        bucket.handle = comm.all_reduce(bucket.buffer, self.topo, self.axis, tag="grad",
                                        async_op=True)

    def finish(self) -> None:
        """Launch any bucket not yet launched (unused parameters, ``overlap=False``), wait for all,
        and copy the summed gradients back into each ``param.grad``."""
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            for p, view in zip(bucket.params, bucket.views):
                set_grad_(p, view)  # casts back from the reduce dtype
            bucket.handle, bucket.ready = None, 0
        self._next = 0

    def grad_bytes(self) -> int:
        """Bytes of gradients one all-reduce round moves (in the reduce dtype)."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def bytes_formula(self) -> float:
        """Bytes this rank sends per step: :func:`dp_grad_bytes_formula` over this axis."""
        return dp_grad_bytes_formula(self.grad_bytes(), self.topo.size(self.axis))


class GradSync:
    """The gradient sums of a model, one :class:`GradBuckets` per reduction group
    (:func:`~..params.reduce_groups`: the axis each parameter's placement names — the data
    axis, or "edp" for expert shards). Same interface as one :class:`GradBuckets`."""

    def __init__(self, params: list[nn.Parameter], topo, **kw):
        self.parts = [GradBuckets(g.items, topo, axis=g.axis, **kw)
                      for g in reduce_groups(params, topo)]

    @property
    def buckets(self) -> list[_Bucket]:
        return [b for part in self.parts for b in part.buckets]

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.sync_gradients(enabled))
            yield

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def grad_bytes(self) -> int:
        return sum(part.grad_bytes() for part in self.parts)

    def bytes_formula(self) -> float:
        """Σ over the parts of 2(n−1)/n · their gradient bytes (n: each part's group)."""
        return sum(part.bytes_formula() for part in self.parts)


class DataParallel(Sync):
    """Explicit DP over ``topo``'s data axis (expert shards: over "edp", :class:`GradSync`) of
    ``module``'s gradients: a plain gradient sync, which :func:`~..apply.parallelize` puts into
    a :class:`~..model.ParallelModel` (the forward is the plain model's).

    Parameters are broadcast from dp index 0 at construction (so replicas start identical even
    if the seeds differ). Gradients are summed over dp by :class:`GradBuckets` (``bucket_mb``,
    ``overlap``, ``precision.reduce_dtype``); the engine calls :meth:`finish_gradient_sync` after
    the last backward of a step. Raises :class:`ShardwiseConfigError` for another reduce dtype
    (before any collective)."""

    def __init__(self, module: nn.Module, topo, bucket_mb: float = 25.0, overlap: bool = True,
                 precision: Precision = FP32):
        precision.reduce_torch  # checked before any collective
        super().__init__(module, topo)
        self.overlap, self.precision = overlap, precision
        params = [p for p in module.parameters() if p.requires_grad]
        with topo.ledger.phase("init"):  # replicas identical from the start
            broadcast_replicas(params, topo)
        self.grad_sync = GradSync(params, topo, bucket_mb=bucket_mb, overlap=overlap,
                                  precision=precision)

    @property
    def buckets(self) -> list[_Bucket]:
        return self.grad_sync.buckets

    def sync_gradients(self, enabled: bool):
        return self.grad_sync.sync_gradients(enabled)

    def finish_gradient_sync(self) -> None:
        self.grad_sync.finish()

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """{"grad": bytes} this rank sends per step: :func:`dp_grad_bytes_formula` of the
        gradients *in the reduce dtype* (bf16: half of fp32), whatever ``micro_steps`` (one
        all-reduce per step) and the compute dtype (autocast leaves gradients fp32); plus
        ``"grad_norm"`` where the norm's fp64 scalar crosses an axis other than tp (tp's own
        formula counts that one): the axes are derived from the held gradients
        (:meth:`..params.Held.norm_axes`; e.g. "ep" when expert shards differ across it)."""
        out = {"grad": self.grad_sync.bytes_formula()}
        axes = [a for a in Held([], self.sliced).norm_axes(self.topo) if a != "tp"]
        if norm_bytes(axes, self.topo):  # absent when the scalar crosses no other axis
            out["grad_norm"] = norm_bytes(axes, self.topo)
        return out

    def memory_formula(self) -> dict[str, float]:
        """:func:`dp_memory_formula` of this replica; with Muon its matrices keep one 4-byte
        momentum buffer instead of AdamW's two moments (:mod:`..muon`)."""
        out = dp_memory_formula(sum(p.numel() for p in dict.fromkeys(self.module.parameters())))
        if self._muon:
            out["optimizer"] -= 4 * sum(p.numel() for p in dict.fromkeys(self._muon[1]))
            out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out


def dp_memory_formula(psi: int) -> dict[str, float]:
    """Model-state bytes of a replica of Ψ parameters with fp32 AdamW: 4Ψ parameters, 4Ψ
    gradients, 8Ψ optimizer state (ZeRO paper §3.1)."""
    return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi, "total": 16 * psi}


def dp_grad_bytes_formula(grad_bytes: float, n: int) -> float:
    """Bytes each rank sends to all-reduce ``grad_bytes`` of gradients over ``n`` dp ranks:
    2(n−1)/n · grad_bytes (ring all-reduce; ZeRO paper §7.1; scaling book ch. 5)."""
    return 2 * (n - 1) / n * grad_bytes
