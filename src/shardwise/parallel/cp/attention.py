"""Context-parallel core attention: ring attention and all-gather attention over the cp axis.

Each cp rank holds its two chunks of every sequence (:mod:`.split`): q, k, v [b, heads, 2c, hd]
with c = s / (2·cp). Causal attention needs every earlier key, so the keys and values must
travel; the queries stay.

**Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3; the zig-zag causal
variant of Megatron-Core / zhuzilin's ring-flash-attention). In n = cp steps, rank i holds the
K/V of rank j = (i − t) mod n at step t, sends it on to rank i + 1 while it computes (the next
block's transfer overlaps the current block's compute), and attends its query chunks to that
block's key chunks: key chunk B is fully visible to query chunk A when B < A, causally when
B = A, invisible when B > A (skipped). The partial outputs merge by the log-sum-exp rule
(online softmax, Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022 §3.1)::

    lse = log(e^lse₁ + e^lse₂),   o = e^(lse₁ − lse) · o₁ + e^(lse₂ − lse) · o₂

Backward recomputes each block's probabilities from the saved final lse (FlashAttention
§3.1.2: P = exp(q·kᵀ/√hd − lse), D = rowsum(dO ∘ O), dS = P ∘ (dO·vᵀ − D)), sends K/V around the
ring again, and sends each block's dK/dV accumulator (fp32) along with it, so that after n
sends the accumulator reaches the block's owner with every rank's contribution.

**All-gather** (Llama 3, Dubey et al. 2024 §3.3.2): all-gather K/V over cp (with GQA they are
h/k times smaller than Q), attend the local queries to the whole sequence under the causal mask
of their positions, and reduce-scatter dK/dV in backward.

Bytes one rank sends per attention layer and micro-batch of b sequences (KV = 2·b·(s/cp)·k·hd
bytes of K and V at the activation dtype, k = kv heads on this rank, i.e. n_kv_heads / tp):

=========  ===========================  =====================================================
method     forward                      backward
=========  ===========================  =====================================================
ring       (n − 1)·KV  (tag cp_kv)      (n − 1)·KV K/V again (cp_kv) + n·KV·4/elem dK/dV in
                                        fp32 (cp_dkv)
allgather  (n−1)/n · n·KV all-gather    (n−1)/n · n·KV reduce-scatter of dK/dV (cp_dkv)
=========  ===========================  =====================================================

**Packed rows** (``--pack``; docs/context-parallel.md §1, packed rows): the core gets a
:class:`~shardwise.models.llama.DocumentMask` whose ``documents`` are, for each local token, the
position where its document starts (:func:`.split.shard_sequence`). Documents are contiguous, so
query t attends key u iff start(t) ≤ u ≤ t: each block is masked from the query starts and the
block's known positions (no ids travel), and a chunk pair that no query's document reaches is
skipped; the blocks still travel, so the bytes are the table's.

Every byte goes through :mod:`shardwise.comm` on the "cp" axis and is booked in the ledger.
GQA: K/V travel with their k heads; each rank repeats them to the h query heads locally and sums
dK/dV back over the h/k query heads of each kv head.
"""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from .split import chunk_ids, zigzag_positions


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: kv heads [b, k, l, hd] → [b, heads, l, hd] (each kv head serves heads/k queries)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA backward: [b, h, l, hd] → [b, k, l, hd], summing each kv head's h/k query heads."""
    b, h, ln, hd = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, ln, hd).sum(2)


def _scores(q, k, scale: float, causal: bool, hidden: torch.Tensor | None = None
            ) -> torch.Tensor:
    """q [b, h, c, hd] · kᵀ [b, h, hd, c] · scale, the strict upper triangle at −∞ when
    ``causal`` (a diagonal chunk pair: query and key chunk are the same positions), and where
    ``hidden`` [b, 1, c, c] (bool: another document, :func:`_hidden`) is True."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _hidden(starts: torch.Tensor | None, qa: int, key_chunk: int, c: int):
    """Packed rows: bool [b, 1, c, c], True where query i of this rank's query half ``qa``
    may not attend key j of chunk ``key_chunk`` because j lies before the start of i's document
    (``starts`` [b, 2, c]: :func:`.split.document_starts` at this rank's positions; documents
    are contiguous, so a key at or after the start and not after the query is in the same
    document). None for plain rows."""
    if starts is None:
        return None
    keys = torch.arange(key_chunk * c, (key_chunk + 1) * c, device=starts.device)  # [c]
    return (keys < starts[:, qa].unsqueeze(-1)).unsqueeze(1)  # [b, 1, c, c]


def _pairs(cp: int, me: int, holder: int, reach: list[int] | None = None):
    """(query half, key half, causal) for the chunk pairs rank ``me`` computes with the K/V of
    rank ``holder``: key chunk B against query chunk A when B ≤ A (causal when equal). With
    ``reach`` (packed rows: for each query half, the chunk of the earliest document start among
    its tokens, over the batch) also only when B ≥ reach[half]: a block that no query's
    document reaches is skipped."""
    for qa, a in enumerate(chunk_ids(cp, me)):
        for kb, b in enumerate(chunk_ids(cp, holder)):
            if b <= a and (reach is None or b >= reach[qa]):
                yield qa, kb, a == b


def _packed(mask, c: int):
    """(starts [b, 2, c], reach) of a packed row's mask (a :class:`~shardwise.models.llama.
    DocumentMask` whose ``documents`` are document starts: :func:`.split.shard_sequence`), or
    (None, None) for plain rows. ``reach`` (see :func:`_pairs`) is read to the host once per
    forward (one sync) and shared by every layer through the mask's memo."""
    if mask is None:
        return None, None
    starts = mask.documents.view(mask.documents.shape[0], 2, c)  # [b, 2, c]
    reach = mask.memo(("cp_reach", c),
                      lambda: (starts.amin(dim=(0, 2)) // c).tolist())  # [2] chunk indices
    return starts, reach


def _merge(out, lse, qa, bout, blse):
    """Fold one block's (bout [b, h, c, hd], blse [b, h, c]) into the running (out, lse) of
    query half ``qa`` by the log-sum-exp rule. A row that has seen no visible key yet (lse and
    blse −∞: a packed row's query whose document starts after the block) stays at 0 / −∞."""
    new = torch.logaddexp(lse[:, :, qa], blse)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # exp(−∞ − 0) = 0, not exp(nan)
    out[:, :, qa] = (out[:, :, qa] * torch.exp(lse[:, :, qa] - ref).unsqueeze(-1)
                     + bout * torch.exp(blse - ref).unsqueeze(-1))
    lse[:, :, qa] = new


class _Ring:
    """One ring exchange on the cp axis: send a tensor to rank i + 1 while receiving its
    predecessor's from rank i − 1 (async: compute runs meanwhile); :meth:`wait` returns it."""

    def __init__(self, t: torch.Tensor, topo, tag: str, timings: list | None):
        n, i = topo.size("cp"), topo.index("cp")
        self.buf, self.t0, self.timings = torch.empty_like(t), time.perf_counter(), timings
        self.handles = [comm.send(t, topo, "cp", (i + 1) % n, tag=tag, async_op=True),
                        comm.recv(self.buf, topo, "cp", (i - 1) % n, tag=tag, async_op=True)]

    def wait(self) -> torch.Tensor:
        t_wait = time.perf_counter()
        for h in self.handles:
            h.wait()
        if self.timings is not None:  # (issued → wait called, time blocked in wait)
            end = time.perf_counter()
            self.timings.append((t_wait - self.t0, end - t_wait))
        return self.buf


class _RingAttention(torch.autograd.Function):
    """Ring attention over cp (module docstring): q [b, h, 2c, hd], k, v [b, k, 2c, hd] (this
    rank's two chunks) → out [b, h, 2c, hd], causal over the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, topo, timings, mask=None):
        with torch.autocast(q.device.type, enabled=False):  # the block math in fp32
            return _RingAttention._forward(ctx, q, k, v, topo, timings, mask)

    @staticmethod
    def _forward(ctx, q, k, v, topo, timings, mask):
        n, me = topo.size("cp"), topo.index("cp")
        b, h, length, hd = q.shape
        c, scale = length // 2, 1.0 / math.sqrt(hd)
        starts, reach = _packed(mask, c)  # packed rows: [b, 2, c] and the blocks reached
        qf = q.float().view(b, h, 2, c, hd)
        out = torch.zeros_like(qf)
        lse = torch.full((b, h, 2, c), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # [2, b, k, 2c, hd]: one message per step
        for t in range(n):
            # every block travels, reached or not: the ring is the same for all ranks
            ring = _Ring(kv, topo, "cp_kv", timings) if t < n - 1 else None
            holder = (me - t) % n
            kf, vf = (_expand(x.float(), h).view(b, h, 2, c, hd) for x in kv)
            for qa, kb, causal in _pairs(n, me, holder, reach):
                hidden = _hidden(starts, qa, chunk_ids(n, holder)[kb], c)
                s = _scores(qf[:, :, qa], kf[:, :, kb], scale, causal, hidden)
                blse = torch.logsumexp(s, dim=-1)  # [b, h, c]; −∞ for a row that sees none
                safe = blse.masked_fill(blse == float("-inf"), 0.0)
                bout = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), vf[:, :, kb])
                _merge(out, lse, qa, bout, blse)
            if ring is not None:
                kv = ring.wait()
        out = out.view(b, h, length, hd).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if starts is None else (starts,)))
        ctx.topo, ctx.timings, ctx.reach = topo, timings, reach
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse, *packed = ctx.saved_tensors
        topo, timings, reach = ctx.topo, ctx.timings, ctx.reach
        starts = packed[0] if packed else None
        n, me = topo.size("cp"), topo.index("cp")
        b, h, length, hd = q.shape
        kvh, c, scale = k.shape[1], length // 2, 1.0 / math.sqrt(hd)
        qf = q.float().view(b, h, 2, c, hd)
        do = dout.float().view(b, h, 2, c, hd)
        delta = (do * out.float().view(b, h, 2, c, hd)).sum(-1)  # D = rowsum(dO ∘ O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        dkv_ring = None
        for t in range(n):
            ring = _Ring(kv, topo, "cp_kv", timings) if t < n - 1 else None
            kf, vf = (_expand(x.float(), h).view(b, h, 2, c, hd) for x in kv)
            dk = torch.zeros_like(kf)
            dv = torch.zeros_like(vf)
            holder = (me - t) % n
            for qa, kb, causal in _pairs(n, me, holder, reach):
                hidden = _hidden(starts, qa, chunk_ids(n, holder)[kb], c)
                s = _scores(qf[:, :, qa], kf[:, :, kb], scale, causal, hidden)
                p = torch.exp(s - lse[:, :, qa].unsqueeze(-1))  # the forward's probabilities
                dv[:, :, kb] += torch.matmul(p.transpose(-1, -2), do[:, :, qa])
                ds = p * (torch.matmul(do[:, :, qa], vf[:, :, kb].transpose(-1, -2))
                          - delta[:, :, qa].unsqueeze(-1))
                dq[:, :, qa] += torch.matmul(ds, kf[:, :, kb]) * scale
                dk[:, :, kb] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qa]) * scale
            mine = torch.stack([_fold(dk.view(b, h, length, hd), kvh),
                                _fold(dv.view(b, h, length, hd), kvh)])
            # the accumulator of the block held now arrives from rank i − 1 (t > 0); add ours
            # and pass it on: after n sends it is home, at the block's owner
            acc = mine if dkv_ring is None else dkv_ring.wait() + mine
            dkv_ring = _Ring(acc.contiguous(), topo, "cp_dkv", timings)
            if ring is not None:
                kv = ring.wait()
        dkv = dkv_ring.wait()
        return (dq.view(b, h, length, hd).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None)


class _GatherKV(torch.autograd.Function):
    """All-gather over cp of this rank's K/V [2, b, k, 2c, hd] → [cp, 2, b, k, 2c, hd] (rank
    order); backward reduce-scatters the gradient back to each rank's own K/V."""

    @staticmethod
    def forward(ctx, kv, topo):
        n = topo.size("cp")
        full = torch.empty((n, *kv.shape), dtype=kv.dtype, device=kv.device)
        comm.all_gather(full.view(-1), kv.contiguous().view(-1), topo, "cp", tag="cp_kv")
        ctx.topo = topo
        return full

    @staticmethod
    def backward(ctx, dfull):
        mine = torch.empty(dfull.shape[1:], dtype=dfull.dtype, device=dfull.device)
        comm.reduce_scatter(mine.view(-1), dfull.contiguous().view(-1), ctx.topo, "cp",
                            tag="cp_dkv")
        return mine, None


@functools.lru_cache(maxsize=16)
def _gathered_layout(n: int, me: int, length: int, device, dtype):
    """For the all-gather method, built once per (layout, length, dtype) and shared by every
    layer: the index [s] that puts the gathered rows (rank r's chunks r and 2n−1−r, rank by
    rank) in position order, and the additive causal mask [s/cp, s] (0 or −∞) of this rank's
    query positions against every key position."""
    s = n * length
    order = torch.argsort(torch.cat([zigzag_positions(s, n, r, device) for r in range(n)]))
    mine = zigzag_positions(s, n, me, device)
    visible = mine.unsqueeze(1) >= torch.arange(s, device=device)
    mask = torch.zeros(length, s, dtype=dtype, device=device).masked_fill_(~visible,
                                                                           float("-inf"))
    return order, mask


class ContextParallelAttention(nn.Module):
    """The core attention of one block over cp (replaces :class:`~shardwise.models.llama.
    CoreAttention`): q [b, h, s/cp, hd], k, v [b, k, s/cp, hd] — this rank's two chunks
    (:mod:`.split`), heads as local as TP left them — → [b, h, s/cp, hd], equal to causal
    attention over the whole sequence at these positions. ``method``: "ring" or "allgather".
    ``timings``: when a list, each ring exchange appends (seconds from issue to wait, seconds
    blocked in wait), to show the overlap. No dropout (:func:`.split.validate_cp` refuses it)."""

    def __init__(self, topo, method: str = "ring"):
        super().__init__()
        self.topo, self.method = topo, method
        self.timings: list | None = None

    def forward(self, q, k, v, dropout_p: float = 0.0, mask=None):
        """``mask``: a packed row's :class:`~shardwise.models.llama.DocumentMask`, whose
        ``documents`` [b, s/cp] are the positions where each local token's document starts
        (:func:`.split.shard_sequence` makes them): query t then attends the keys u with
        start(t) ≤ u ≤ t. None: plain causal attention."""
        if dropout_p:
            raise ValueError("context-parallel attention has no dropout (validate_cp)")
        if self.method == "ring":
            if mask is None:
                return _RingAttention.apply(q, k, v, self.topo, self.timings)
            return _RingAttention.apply(q, k, v, self.topo, self.timings, mask)
        return self._allgather(q, k, v, mask)

    def _allgather(self, q, k, v, documents=None):
        n, me = self.topo.size("cp"), self.topo.index("cp")
        b, h, length, hd = q.shape
        full = _GatherKV.apply(torch.stack([k, v]), self.topo)  # [n, 2, b, k, 2c, hd]
        order, mask = _gathered_layout(n, me, length, q.device, q.dtype)
        if documents is not None:  # packed rows: keys before the query's document start too
            keys = torch.arange(n * length, device=q.device)  # [s]
            mask = (mask == 0) & (keys >= documents.documents.unsqueeze(-1)).unsqueeze(1)
            # [b, 1, s/cp, s] bool: causal and in the query's document
        kv = full.permute(1, 2, 3, 0, 4, 5).reshape(2, b, k.shape[1], n * length, hd)
        kv = kv.index_select(3, order)  # [2, b, k, s, hd] in position order
        # the gathered K/V stay at k heads (GQA in the kernel: h/k times less saved)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask,
                                              enable_gqa=kv.shape[2] != h)

    def extra_repr(self) -> str:
        return f"method={self.method}, cp={self.topo.size('cp')}"


def cp_attention_bytes(method: str, cp: int, kv_bytes: float,
                       kv_fp32_bytes: float) -> dict[str, float]:
    """{"cp_kv", "cp_dkv": bytes} one rank sends for one attention layer in one step, forward
    and backward (the module docstring's table). ``kv_bytes``: KV, this rank's K and V over the
    step's micro-batches, 2·Σb·(s/cp)·k·hd·elem at the activation dtype; ``kv_fp32_bytes``: the
    same in fp32 (the ring's dK/dV accumulators). Ring: (n − 1)·KV forward and again backward,
    n sends of the fp32 dK/dV; allgather: the ring bytes of the n·KV gathered tensor each way,
    (n − 1)/n · n·KV."""
    n = cp
    if method == "ring":
        return {"cp_kv": 2.0 * (n - 1) * kv_bytes, "cp_dkv": float(n) * kv_fp32_bytes}
    return {"cp_kv": comm.ring_bytes("all_gather", n * kv_bytes, n),
            "cp_dkv": comm.ring_bytes("reduce_scatter", n * kv_bytes, n)}
