"""Communication of one layout: which link each parallel axis spans (:func:`axis_link`), the time
of one collective on it (:func:`collective_seconds`: ring steps × (latency + bytes / bandwidth)),
and the collectives of a step per dimension, each a :class:`Collective`: data parallel and ZeRO
(:func:`dp_collectives`, :func:`dp_step_bytes`), context parallel (:func:`cp_collectives`) and
expert parallel (:func:`ep_collectives`). Bytes per rank are the ledger's
(:func:`shardwise.comm.ledger.ring_bytes`). Formulas and sources: docs/planner.md, "The cost
model's formulas" (communication).
"""

from __future__ import annotations

import dataclasses
import functools

from ..comm.ledger import ring_bytes
from ..errors import ShardwiseConfigError
from ..parallel.cp import cp_attention_bytes
from .hardware import Cluster
from .layout import PRECISIONS, Assumptions, PlanLayout, Precision
from .memory import etp
from .models import ModelSpec


@dataclasses.dataclass
class Collective:
    """One kind of collective in a step: ``count`` calls of ``op`` on a buffer of ``size``
    bytes over ``n`` ranks of ``axis``; ``wire`` = bytes this rank sends for all of them;
    ``seconds`` = time of all of them; ``exposed`` = the part not hidden under compute."""

    axis: str
    op: str
    tag: str
    size: float
    n: int
    count: float
    wire: float = 0.0
    seconds: float = 0.0
    exposed: float = 0.0
    link: str = ""
    note: str = ""


def axis_link(cluster: Cluster, layout: PlanLayout, axis: str) -> tuple[float, float, str]:
    """(bandwidth bytes/s per GPU, latency s, description) of the groups along ``axis`` ("tp",
    "cp", "dp", "pp", or "dp_cp": the flattened data axis of dp × cp) on the rank grid
    (pp, dp, cp, tp), TP innermost and CP next: ranks r = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i,
    filled node by node. A group inside one node uses NVLink; one that spans nodes with k members
    per node gets min(intra, k·inter) (k rings side by side, one per NIC). So cp traffic stays on
    NVLink while tp·cp ≤ GPUs per node and crosses nodes beyond.

    Expert parallelism rides on the data line (dp × cp flattened, stride tp), as
    :class:`shardwise.topology.Topology` builds it and Megatron-Core's tp-cp-ep-dp-pp order
    places it: "ep", ``ep`` consecutive ranks of the line (stride tp; on NVLink while
    tp·ep ≤ GPUs per node); "edp", the S·cp/ep ranks of a shard group that hold the same
    experts (stride tp·ep; S = dp without HSDP).

    HSDP (``dp_replicate`` R > 1) splits dp into (dp_replicate, dp_shard), replicas outer — the
    mesh (pp, dp_replicate, dp_shard, cp, tp) of torchtitan and FSDP2, whose flat dp index
    r_i·S + s_i is the dp index above, so every other axis is unchanged: "dp_shard", the S
    ranks of a shard group (stride tp·cp); "dp_shard_cp", the S·cp ranks ZeRO shards over
    (stride tp: torchtitan's ``dp_shard_cp``); "dp_replicate", the R ranks that hold the same
    shard (stride tp·cp·S). The shard group is on NVLink while S·cp·tp ≤ GPUs per node."""
    return _axis_group(cluster, layout, axis)[1:]


def axis_size(layout: PlanLayout, axis: str) -> int:
    """Ranks in one group along ``axis`` (the axes of :func:`axis_link`)."""
    return _axis_geometry(layout.tp, layout.cp, layout.dp, layout.pp, axis, layout.ep,
                          layout.dp_replicate)[0]


def _axis_group(cluster: Cluster, layout: PlanLayout, axis: str) -> tuple[int, float, float, str]:
    """(ranks n, bandwidth bytes/s, latency s, description) of the groups along ``axis``:
    :func:`axis_size` and :func:`axis_link` in one cached look-up (:func:`_axis_link`), since
    every collective needs both: a search builds about 17 collectives per layout, over a
    million for Llama 3 405B on 8,192 GPUs, on a few hundred distinct groups."""
    c = cluster  # the cache key: the link numbers only (hashing the whole Cluster is slow)
    return _axis_link(c.gpus_per_node, c.intra_bw, c.inter_bw, c.intra_latency,
                      c.inter_latency, layout.tp, layout.cp, layout.dp, layout.pp, axis,
                      layout.ep, layout.dp_replicate)


def _axis_geometry(tp: int, cp: int, dp: int, pp: int, axis: str, ep: int = 1,
                   dpr: int = 1) -> tuple[int, int]:
    """(ranks in the group, stride between them on the rank grid) of ``axis``."""
    ds = dp // dpr  # the shard group's dp ranks (all of dp without HSDP)
    n = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "ep": ep,
         "edp": ds * cp // ep, "dp_shard": ds, "dp_shard_cp": ds * cp,
         "dp_replicate": dpr}[axis]
    stride = {"tp": 1, "cp": tp, "dp": tp * cp, "pp": tp * cp * dp, "dp_cp": tp, "ep": tp,
              "edp": tp * ep, "dp_shard": tp * cp, "dp_shard_cp": tp,
              "dp_replicate": tp * cp * ds}[axis]
    return n, stride


def members_per_node(cluster: Cluster, layout: PlanLayout, axis: str) -> int:
    """k: the members of rank 0's group along ``axis`` on its node — 0 when the whole group is
    inside one node (:func:`axis_link`'s placement)."""
    n, stride = _axis_geometry(layout.tp, layout.cp, layout.dp, layout.pp, axis, layout.ep,
                               layout.dp_replicate)
    gpn = cluster.gpus_per_node
    return 0 if (n - 1) * stride < gpn else min(n, -(-gpn // stride))


@functools.lru_cache(maxsize=8192)
def _axis_link(gpn: int, intra_bw: float, inter_bw: float, intra_lat: float, inter_lat: float,
               tp: int, cp: int, dp: int, pp: int, axis: str, ep: int = 1, dpr: int = 1):
    """:func:`_axis_group` from plain numbers (cached on them)."""
    n, stride = _axis_geometry(tp, cp, dp, pp, axis, ep, dpr)
    if (n - 1) * stride < gpn:  # the group of rank 0: ranks 0, stride, …, (n−1)·stride
        return n, intra_bw, intra_lat, "intra-node"
    k = min(n, -(-gpn // stride))  # members on node 0
    return n, min(intra_bw, k * inter_bw), inter_lat, f"inter-node ({k}/node)"


_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
          "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
          "send": lambda n: 1}


@functools.lru_cache(maxsize=8192)
def collective_seconds(op: str, size: float, n: int, bw: float, latency: float,
                       efficiency: float) -> tuple[float, float]:
    """(bytes sent per rank, seconds) of one ring collective: ring steps · latency + bytes /
    (bw · efficiency). Bytes are :func:`shardwise.comm.ledger.ring_bytes`. Cached: a pure
    function of numbers (equal arguments give equal floats), called for every collective of
    every layout a search estimates, on a few hundred distinct buffers and groups."""
    wire = ring_bytes(op, size, n) if op != "send" else float(size)
    if op != "send" and n <= 1:
        return 0.0, 0.0
    return wire, _STEPS[op](n) * latency + wire / (bw * efficiency)


def _coll(cluster, layout, axis, op, tag, size, count, assume, note=""):
    n, bw, lat, where = _axis_group(cluster, layout, axis)
    wire, sec = collective_seconds(op, size, n, bw, lat, assume.link_efficiency)
    return Collective(axis, op, tag, size, n, count, wire * count, sec * count, 0.0, where, note)


def dp_collectives(layout: PlanLayout, params: float, prec: Precision, m: int, cluster: Cluster,
                   assume: Assumptions, regathered: float | None = None,
                   expert_params: float = 0.0) -> list[Collective]:
    """The dp-axis collectives of one optimizer step for a GPU holding ``params`` parameters
    (see the module docstring), over dp × cp: parameters are replicated over cp, so gradients
    are summed and ZeRO shards over the flattened (dp, cp) group ("dp_cp", torchtitan's
    ``dp_shard_cp``). ``regathered``: parameters zero 3 gathers again before backward
    (default all of them; shardwise's ZeRO engine keeps its root unit gathered).
    ``expert_params``: routed-expert parameters on this GPU; with ep > 1 their gradients are
    summed (and ZeRO shards them) over the expert-data-parallel group "edp" of dp·cp/ep ranks
    that hold the same experts, the same collectives under the same tags ("grad", "param") as
    the dense ones, as shardwise's DP engine books them; with ep = 1 they are dense
    parameters.

    HSDP (``layout.dp_replicate`` R > 1, ZeRO ≥ 1; PyTorch FSDP, Zhao et al. 2023 §3.2.3
    "hybrid sharding"; torchtitan's and FSDP2's 2-D mesh): ZeRO runs over the shard group
    ("dp_shard", or "dp_shard_cp" with cp > 1: S·cp ranks; the experts' over "edp", S·cp/ep
    ranks) exactly as over all of dp·cp without HSDP — the gradient reduce-scatter and the
    parameter all-gathers span the shard group only — and one all-reduce of this rank's
    gradient shard (1/(S·cp) of Ψ) over the R replicas ("dp_replicate", tag
    "grad_replicate", as shardwise's HSDP engines book it) follows
    the reduce-scatter, once per step (with ``grad_reduce="micro"`` the shard accumulates over
    the micro-batches and is all-reduced after the last: FSDP2's
    ``set_requires_all_reduce(False)`` on the others, pytorch/pytorch#126166). The global norm
    sums the squares over the shard group (the replicas hold the same shard); the loss and
    token count are summed over every data rank. ``exposed`` is filled in by
    :func:`estimate`."""
    z, R = layout.zero, layout.dp_replicate
    whole = "dp" if layout.cp == 1 else "dp_cp"  # every data rank (parameters replicated on cp)
    if R == 1:
        ax, rep = whole, None
    else:
        if z == 0:
            raise ShardwiseConfigError(f"dp_replicate={R} needs ZeRO ≥ 1 (with zero 0 every "
                                       "rank holds everything: plain DP)")
        ax, rep = ("dp_shard" if layout.cp == 1 else "dp_shard_cp"), "dp_replicate"
    if layout.ep == 1:
        params, expert_params = params + expert_params, 0.0
    groups = [(ax, params, params if regathered is None else regathered)]
    if expert_params:
        groups.append(("edp", expert_params, expert_params))
    rs_count = m if z >= 2 and layout.grad_reduce == "micro" else 1
    rs_note = ("gradients, after every micro-batch" if rs_count > 1 else
               "gradients, once per step")
    out = [_coll(cluster, layout, whole, "all_reduce", "loss", 8, 2, assume,
                 "token count before the forward, loss sum after the step (fp64)")]
    for axis, psi, again in groups:
        g, w = prec.grad_comm * psi, prec.param * psi
        what = "" if axis != "edp" else " of the experts (over the ranks holding the same ones)"
        if rep:
            what += " in the shard group"
        if z == 0:
            out.append(_coll(cluster, layout, axis, "all_reduce", "grad", g, 1, assume,
                             "gradients" + what + ", once per step"))
            continue
        out.append(_coll(cluster, layout, axis, "reduce_scatter", "grad", g, rs_count, assume,
                         rs_note.replace("gradients", "gradients" + what)))
        if rep:
            out.append(_coll(cluster, layout, rep, "all_reduce", "grad_replicate",
                             g / axis_size(layout, axis), 1, assume,
                             "the gradient shard" + (" of the experts" if axis == "edp"
                                                     else "")
                             + " over the replicas, once per step"))
        if z < 3:
            out.append(_coll(cluster, layout, axis, "all_gather", "param", w, 1, assume,
                             "updated parameters" + what + ", once per step"))
        else:
            c = _coll(cluster, layout, axis, "all_gather", "param", w, m, assume,
                      "parameters" + what + " before every micro-batch's forward and backward")
            if again:
                back = _coll(cluster, layout, axis, "all_gather", "param",
                             prec.param * again, m, assume)
                c.wire += back.wire
                c.seconds += back.seconds
                c.count += m
            out.append(c)
    if z:
        out.append(_coll(cluster, layout, ax, "all_reduce", "grad_norm", 8, 1, assume,
                         "sum of squares of the gradient shards, for the global norm (fp64)"))
    elif expert_params:  # each ep rank holds other experts: their squares summed over ep
        out.append(_coll(cluster, layout, "ep", "all_reduce", "grad_norm", 8, 1, assume,
                         "sum of squares of the expert gradients over ep, for the norm (fp64)"))
    return out


def cp_kv_bytes(model: ModelSpec, layout: PlanLayout) -> float:
    """KV: bytes of one rank's K and V for one layer and one micro-batch, at the activation
    dtype: ``2·b·(s/cp)·k·hd·a`` with k = n_kv_heads/tp (GQA: only the kv heads travel) and a
    the activation bytes of ``layout.precision``. The unit of the formulas of
    :mod:`shardwise.parallel.cp.attention` (its module docstring)."""
    a = PRECISIONS[layout.precision].act
    return (2.0 * layout.micro_batch * (model.seq_len // layout.cp)
            * (model.n_kv_heads // layout.tp) * model.head_dim * a)


def cp_layer_bytes(model: ModelSpec, layout: PlanLayout) -> dict[str, float]:
    """{"cp_kv", "cp_dkv": bytes} one rank sends over cp for one layer and one micro-batch,
    forward + backward (no recomputation): :func:`shardwise.parallel.cp.cp_attention_bytes`
    with KV = :func:`cp_kv_bytes`, the formula the ledger checks at 1.0000 for our engine.
    Ring: ``cp_kv`` = 2(cp−1)·KV (K/V around the ring forward, again backward), ``cp_dkv`` =
    cp·KV·4/a (the fp32 dK/dV accumulators); allgather: (cp−1)·KV each (the all-gather of K/V
    forward, the reduce-scatter of dK/dV backward). Empty when cp = 1."""
    if layout.cp == 1:
        return {}
    kv = cp_kv_bytes(model, layout)
    a = PRECISIONS[layout.precision].act
    return cp_attention_bytes(layout.cp_method, layout.cp, kv, kv * 4 / a)


def cp_collectives(model: ModelSpec, layout: PlanLayout, cluster: Cluster, assume: Assumptions,
                   t_core: float, layers: int) -> list[Collective]:
    """The cp-axis traffic of one micro-batch through ``layers`` layers, with ``exposed`` the
    part on the critical path; ``t_core``: seconds of one layer's attention core for this
    micro-batch on this rank, forward + backward, without recomputation (a third forward, two
    thirds backward, as its FLOPs 4·d·s and 8·d·s per token split).

    Ring (our engine; Liu et al. 2023 §3): cp steps per pass, each step's attention is 1/cp of
    the pass (the zig-zag split gives every step the same causal work, 2 chunk pairs), and the
    next block's transfer runs under it. Forward: cp − 1 sends of KV, each exposed only by what
    exceeds one step's forward, ``(cp−1)·max(0, t_kv − t_f/cp)``. Backward: cp − 1 steps send
    K/V and the fp32 dK/dV accumulator together under one step's backward, and the last dK/dV
    send (back to its owner) is exposed: ``(cp−1)·max(0, t_kv + t_dkv − t_b/cp) + t_dkv``.
    All-gather (Llama 3 §3.3.2): the K/V all-gather runs before the attention that needs it and
    the dK/dV reduce-scatter after its backward, both exposed. Full recomputation runs the
    forward's traffic again in backward (the recomputed forward attention needs K/V again)."""
    if layout.cp == 1 or layers == 0:
        return []
    n, A = layout.cp, assume
    kv = cp_kv_bytes(model, layout)
    a = PRECISIONS[layout.precision].act
    again = 2 if layout.ckpt == "full" else 1  # forward passes per micro-batch
    per = layers * again
    t_f, t_b = t_core / 3, 2 * t_core / 3
    if layout.cp_method == "ring":
        kvc = _coll(cluster, layout, "cp", "send", "cp_kv", kv, (n - 1) * (per + layers), A,
                    "K/V to the next cp rank, forward and again backward, under attention")
        dkv = _coll(cluster, layout, "cp", "send", "cp_dkv", kv * 4 / a, n * layers, A,
                    "fp32 dK/dV accumulators around the ring (backward); the last exposed")
        one_kv, one_dkv = kvc.seconds / kvc.count, dkv.seconds / dkv.count
        fwd = (n - 1) * max(0.0, one_kv - t_f / n)
        bwd = (n - 1) * max(0.0, one_kv + one_dkv - t_b / n) + one_dkv
        # split the exposed time between the two tags in proportion to their bytes
        exposed = per * fwd + layers * bwd
        share = kvc.wire / (kvc.wire + dkv.wire)
        kvc.exposed, dkv.exposed = exposed * share, exposed * (1 - share)
        return [kvc, dkv]
    ag = _coll(cluster, layout, "cp", "all_gather", "cp_kv", n * kv, per, A,
               "K/V of the whole sequence before attention (exposed)")
    rs = _coll(cluster, layout, "cp", "reduce_scatter", "cp_dkv", n * kv, layers, A,
               "dK/dV back to their owners after attention's backward (exposed)")
    ag.exposed, rs.exposed = ag.seconds, rs.seconds
    return [ag, rs]


def ep_tokens(model: ModelSpec, layout: PlanLayout) -> float:
    """T: tokens of one micro-batch whose routed copies this rank dispatches, b·(s/cp)/etp (with
    SP each tp rank routes its s/t share; without it every tp rank routes all of them)."""
    return layout.micro_batch * (model.seq_len // layout.cp) / etp(layout.tp, layout.sp)


def ep_layer_bytes(model: ModelSpec, layout: PlanLayout) -> dict[str, float]:
    """{"ep_dispatch", "ep_combine", "ep_counts": bytes} one rank sends over ep for one MoE
    layer and one micro-batch, forward + backward (no recomputation), under uniform routing —
    the expectation when every expert receives T·k/E of each rank's copies (a balanced router;
    Megatron-Bridge's MoE benchmarks force it): of the T·k copies a rank routes, (ep−1)/ep go
    to other ranks, and as many arrive from them. With a row of d·a bytes:

    * ``ep_dispatch`` = 2 · (ep−1)/ep · T·k·d·a: the dispatch forward, and its gradient (the
      reverse all-to-all) backward;
    * ``ep_combine`` = the same: the combine forward, its gradient backward;
    * ``ep_counts`` = (ep−1)/ep · E · 8: the all-to-all of the int64 routing counts, forward.

    These are the terms of :func:`shardwise.parallel.ep.ep_bytes_formula` (the engine's
    formula from the step's actual routing, which its ledger equals at 1.0000) with its S_i =
    R_i = (ep−1)/ep · T·k. Skewed routing moves more on the ranks that hold popular experts;
    not modelled. Empty when ep = 1 or the model is dense."""
    if layout.ep == 1 or not model.is_moe:
        return {}
    ep, a = layout.ep, PRECISIONS[layout.precision].act
    rows = (ep - 1) / ep * ep_tokens(model, layout) * model.top_k
    return {"ep_dispatch": 2 * rows * model.d_model * a,
            "ep_combine": 2 * rows * model.d_model * a,
            "ep_counts": (ep - 1) / ep * model.n_experts * 8}


def ep_collectives(model: ModelSpec, layout: PlanLayout, cluster: Cluster, assume: Assumptions,
                   moe_layers: int) -> list[Collective]:
    """The ep-axis all-to-alls of one micro-batch through ``moe_layers`` MoE layers (buffer
    S = T·k·d·a, :func:`ep_tokens`; each sends (ep−1)/ep·S, :func:`ep_layer_bytes`): per layer
    a dispatch and a combine forward and both again backward, plus the routing counts' all-to-all
    forward; full recomputation runs the forward's three again. Time: (ep−1) steps of latency +
    bytes over the link the ep group spans (:func:`axis_link`). All exposed: the dispatch sits
    between the router and the experts and the combine between the experts and the residual,
    with nothing of the same layer to hide under — Megatron-Core overlapped them only from v0.14
    (2025-09, batch-level overlap of two micro-batches; DeepSeek-V3's DualPipe, §3.2.1, does
    the same), which this model does not assume."""
    if layout.ep == 1 or not model.is_moe or moe_layers == 0:
        return []
    a = PRECISIONS[layout.precision].act
    size = ep_tokens(model, layout) * model.top_k * model.d_model * a
    again = 1 if layout.ckpt == "full" else 0
    out = [_coll(cluster, layout, "ep", "all_to_all", "ep_dispatch", size,
                 (2 + again) * moe_layers, assume,
                 "routed token copies to their experts' ranks, forward and backward (exposed)"),
           _coll(cluster, layout, "ep", "all_to_all", "ep_combine", size,
                 (2 + again) * moe_layers, assume,
                 "expert outputs back to their tokens' ranks, forward and backward (exposed)"),
           _coll(cluster, layout, "ep", "all_to_all", "ep_counts", model.n_experts * 8,
                 (1 + again) * moe_layers, assume, "routing counts before the dispatch (int64)")]
    for c in out:
        c.exposed = c.seconds
    return out


def dp_step_bytes(model: ModelSpec, layout: PlanLayout, *, m: int = 1, params: float | None = None,
                  regathered: float | None = None, by_axis: bool = False) -> dict:
    """Bytes one rank sends on the dp axis per optimizer step, by ledger tag ("grad", "param",
    "grad_norm", "loss"), for pp = tp = 1 (the whole model on every rank): the number the ledger
    books. ``params`` overrides Ψ (an engine whose flat buffers are padded to a multiple of dp
    sends the padded count); ``regathered`` as in :func:`dp_collectives`. Zero 0:
    ``grad = 2(n−1)/n · G_c·Ψ``, ``loss = 2 · 2(n−1)/n · 8``; zero 1/2: reduce-scatter + all-gather,
    (n−1)/n each, plus one fp64 all-reduce for the gradient norm; zero 3: the all-gathers per
    micro-batch. With ep > 1 a rank's E/ep experts go over "edp" (:func:`dp_collectives`), under
    the same tags. HSDP (``dp_replicate`` R > 1, S = dp/R, cp = 1): "grad" is the
    reduce-scatter over S, (S−1)/S·G_c·Ψ, "grad_replicate" the all-reduce of the shard over
    R, 2(R−1)/R·G_c·Ψ/S (:func:`shardwise.parallel.zero.formulas.hsdp_replicate_bytes`, the
    engines' tag); "param" the all-gathers over S only. ``by_axis``: {axis: {tag: bytes}}
    instead (axes "dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp", "ep"), the
    per-axis numbers a ledger that books the mesh's axes compares with. Link speeds do not
    enter (bytes only)."""
    from .hardware import get_cluster

    if layout.tp != 1 or layout.pp != 1:
        raise ValueError("dp_step_bytes: the whole model per rank only (tp = pp = 1)")
    prec = PRECISIONS[layout.precision]
    psi = model.num_params() if params is None else params
    experts = 0.0
    if params is None and layout.ep > 1:  # a rank's share of the experts, reduced over edp
        psi -= model.num_expert_params()
        experts = model.num_expert_params() / layout.ep
    out: dict = {}
    for c in dp_collectives(layout, psi, prec, m, get_cluster("h100-sxm"), Assumptions(),
                            regathered, expert_params=experts):
        into = out.setdefault(c.axis, {}) if by_axis else out
        into[c.tag] = into.get(c.tag, 0.0) + c.wire
    return out


# ---------------------------------------------------------------------------------------------
# the estimate
