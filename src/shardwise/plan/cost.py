"""The analytical cost model's estimate: per-GPU memory, step time, tokens/s and MFU of one layout
(:func:`estimate` → :class:`Estimate`), from the memory (:mod:`.memory`), compute
(:mod:`.compute`) and communication (:mod:`.comm`) terms, with the overlap windows that hide
communication under compute, and the HSDP against ZeRO-3 comparison (:func:`hsdp_comparison`).
The layouts and their checks live in :mod:`.layout`. Every formula, with its source, is in
docs/planner.md, "The cost model's formulas".
"""

from __future__ import annotations

import dataclasses
import functools
import math

from .comm import (Collective, _coll, cp_collectives, cp_kv_bytes, dp_collectives, ep_collectives,
                   ep_layer_bytes, ep_tokens, members_per_node)
from .compute import bubble_time, head_seconds, layer_seconds, partition_layers
from .hardware import Cluster
from .layout import PRECISIONS, Assumptions, PlanLayout, check_layout
from .memory import (embedding_activation_bytes, head_activation_bytes, in_flight,
                     layer_activation_bytes, model_state_bytes, stage_param_split, stage_params,
                     stage_tensors, startup_box_elements)
from .models import ModelSpec
from .offload import host_step_seconds, offload_copies, offload_state


@dataclasses.dataclass
class Estimate:
    """Everything :func:`estimate` derives for one layout (bytes, seconds, FLOPs)."""

    model: ModelSpec
    cluster: Cluster
    layout: PlanLayout
    assumptions: Assumptions
    global_batch: int  # sequences per step
    microbatches: int  # m
    stages: list[int]  # layers per pipeline stage
    memory: dict[str, dict[str, float]]  # "first"/"last" → breakdown (bytes)
    mem_bytes_per_gpu: float
    capacity_bytes: float
    fits: bool
    flops: dict[str, float]
    times: dict[str, float]
    comm: list[Collective]
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    details: dict
    host_bytes_per_gpu: float = 0.0  # offload: the model state this GPU keeps in host memory
    host_capacity_bytes: float = 0.0  # host memory per node, less the reserve

    @property
    def tokens(self) -> int:
        return self.global_batch * self.model.seq_len

    def to_json(self) -> dict:
        lay = self.layout
        return {
            "dp": lay.dp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "cp_method": lay.cp_method if lay.cp > 1 else None,
            "ep": lay.ep,
            "tp": lay.tp, "pp": lay.pp, "zero": lay.zero,
            "schedule": lay.schedule if lay.pp > 1 else None,
            "microbatches": self.microbatches, "mfu": self.mfu, "step_time_s": self.step_time_s,
            "mem_bytes_per_gpu": self.mem_bytes_per_gpu, "fits": self.fits,
            "sp": lay.sp, "virtual_stages": lay.chunks,
            "micro_batch_size": lay.micro_batch, "ckpt": lay.ckpt, "precision": lay.precision,
            "tokens_per_s": self.tokens_per_s, "hfu": self.hfu, "grad_reduce": lay.grad_reduce,
            "capacity_bytes": self.capacity_bytes, "offload": lay.offload,
            "host_bytes_per_gpu": self.host_bytes_per_gpu,
            "host_capacity_bytes_per_node": self.host_capacity_bytes,
            "memory": {k: {kk: float(vv) for kk, vv in v.items()} for k, v in
                       self.memory.items()},
            "times_s": dict(self.times),
        }


def estimate(model: ModelSpec, cluster: Cluster, layout: PlanLayout, global_batch: int,
             assumptions: Assumptions = Assumptions()) -> Estimate:
    """Memory, time and MFU of ``layout`` training ``model`` on ``cluster`` with ``global_batch``
    sequences of ``model.seq_len`` tokens per optimizer step. Raises ShardwiseConfigError for an
    invalid layout (:func:`check_layout`). Formulas: the module docstring."""
    A, lay, M, C = assumptions, layout, model, cluster
    m = check_layout(M, C, lay, global_batch)
    prec = PRECISIONS[lay.precision]
    t, p, v, cp, ep = lay.tp, lay.pp, lay.chunks, lay.cp, lay.ep
    shard = lay.dp_shard * cp  # the ranks ZeRO shards over: dp·cp, or S·cp with HSDP
    # tokens of one micro-batch on this rank: b sequences, s/cp tokens of each (context
    # parallelism splits every sequence; every activation is per token, so all of them ÷ cp)
    a, s, tokens_mb = prec.act, M.seq_len, lay.micro_batch * (M.seq_len // lay.cp)
    peak = C.gpu.bf16_flops if prec.compute == "bf16" else C.gpu.fp32_flops
    kinds = (False, True) if M.is_moe else (False,)  # dense layers, MoE layers

    # FLOPs per token, per kind of layer (an MoE layer: its active weights), per model and ckpt
    layer_model, layer_hw, head_flops, model_flops_token, hw_flops_token = \
        _flops_per_token(M, lay.ckpt)
    n_moe = M.n_moe_layers
    # seconds per token of a layer and of the head; the stages (cached per model, pp, head cost)
    lsec = {moe: layer_seconds(M, lay, C.gpu, A, moe=moe) for moe in kinds}
    hsec = head_seconds(M, lay, C.gpu, A)
    mean_layer = ((M.n_layers - n_moe) * lsec[False]["total"]
                  + n_moe * lsec.get(True, lsec[False])["total"]) / M.n_layers
    stages, starts, moe_in, stage_shapes = _pipeline_stages(M, p, round(hsec / mean_layer, 6))
    stages, moe_in = list(stages), list(moe_in)

    # memory of the first and the last stage
    capacity = C.gpu.hbm_bytes * (1 - A.memory_reserve)
    per_layer = {moe: layer_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, ckpt=lay.ckpt,
                                             act_bytes=a, moe=moe) for moe in kinds}
    transient = (max(layer_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, ckpt="none",
                                            act_bytes=a, moe=moe) for moe in kinds)
                 if lay.ckpt == "full" else 0.0)
    kv = cp_kv_bytes(M, lay) if cp > 1 else 0.0
    # all-gather CP: attention's backward needs the gathered K/V of the whole sequence,
    # [b, s, k/t, hd] · 2 = cp·KV per layer, kept instead of the local K/V the layer formula
    # counts (nothing else needs those: the projections keep their inputs, RoPE is linear):
    # (cp − 1)·KV more per layer, with the layer's activations (or, under full recomputation,
    # by the one layer recomputed at a time)
    gathered = (cp - 1) * kv if cp > 1 and lay.cp_method == "allgather" else 0.0
    if lay.ckpt == "full":
        transient += gathered
    else:
        per_layer = {moe: x + gathered for moe, x in per_layer.items()}
    flight = in_flight(lay.schedule, p, m, v)
    # ZeRO-3 gathers two layers at a time: the largest layer this rank gathers (an MoE layer
    # holds its router whole, its E/ep experts ÷ etp; layer 0 is always an MoE layer)
    gathered_layer = M.layer_params() / t
    if M.is_moe:
        moe_layer = sum(stage_param_split(M, 1, tp=t, first=False, last=False, pp=2, ep=ep,
                                          sp=lay.sp))
        gathered_layer = moe_layer if M.moe_every == 1 else max(gathered_layer, moe_layer)
    memory = {}
    for where, i, first, last in (("first", 0, True, p == 1), ("last", p - 1, p == 1, True)):
        layers = stages[i]
        split = stage_param_split(M, layers, tp=t, first=first, last=last, pp=p,
                                  start=starts[i], ep=ep, sp=lay.sp)
        tensors = stage_tensors(M, layers, first=first, last=last, pp=p, start=starts[i])
        full_grads = lay.grad_reduce == "step" and m > 1
        dense_split = split[0] + (split[1] if ep == 1 else 0.0)
        st = model_state_bytes(dense_split, tensors, lay.zero, shard, prec, full_grads)
        if ep > 1:  # expert weights: E/ep per rank, ZeRO over the S·cp/ep ranks that share them
            ex = model_state_bytes(split[1], 0, lay.zero, shard // ep, prec, full_grads)
            st = {key: st[key] + ex[key] for key in st}
        # offload: the optimizer state (and with "params" the parameter share) in host memory
        st, host = offload_state(st, lay.offload, prec, _updated(lay, split, shard))
        k = flight if first else 1.0
        act = k * ((layers - moe_in[i]) * per_layer[False]
                   + moe_in[i] * per_layer.get(True, 0.0)) + transient
        if first:
            act += k * embedding_activation_bytes(M, tokens_mb)
        if last:
            act += head_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, act_bytes=a)
        buf = 0.0
        if lay.zero == 3:
            buf += (prec.param + prec.grad) * 2 * gathered_layer
        elif lay.offload == "params":  # two layers' parameters copied up from the host at a time
            buf += prec.param * 2 * gathered_layer
        if p > 1:
            buf += 2 * a * tokens_mb * M.d_model / t
        if cp > 1:  # one layer at a time: ring receive + send blocks (K/V, fp32 dK/dV);
            # all-gather: the gradient of the gathered K/V before its reduce-scatter
            buf += 2 * kv + 2 * kv * 4 / a if lay.cp_method == "ring" else cp * kv
        if ep > 1 and moe_in[i]:  # one MoE layer's receive buffer of dispatched rows
            buf += ep_tokens(M, lay) * M.top_k * M.d_model * a
        params = split[0] + split[1]
        if A.grad_bucket_copy and lay.zero < 2:
            buf += prec.grad * params
        # start-up, built on meta: what the rank holds (its gradient buffers too: shardwise's
        # ZeRO allocates them with its flat buffers) + one box in flight, read as fp32 on the
        # host; the host holds only that box (+ the import floor, not modelled)
        box = 4.0 * startup_box_elements(M, tp=t, ep=ep, sp=lay.sp)
        memory[where] = {"params_count": params, "expert_params_count": split[1], **st,
                         "activations": act, "buffers": buf,
                         "total": st["params"] + st["grads"] + st["optimizer"] + act + buf,
                         "startup_device": st["params"] + (st["grads"] if lay.zero else 0.0)
                         + box, "startup_host": box,
                         **{f"host_{key}": v for key, v in host.items()},
                         "host": sum(host.values())}
        if p == 1:
            memory["last"] = memory["first"]
            break
    mem = max(memory["first"]["total"], memory["last"]["total"])
    host_gpu = max(memory["first"]["host"], memory["last"]["host"])
    host_capacity = C.host_bytes * (1 - A.memory_reserve)
    host_fits = host_gpu * min(C.gpus_per_node, lay.world) <= host_capacity

    # compute, TP and EP time per micro-batch on each stage; the slowest sets the pace
    act_size = a * tokens_mb * M.d_model  # [b, s/cp, d] activation, bytes
    tp_ops = ("all_gather", "reduce_scatter") if lay.sp else ("all_reduce",)
    # all-reduce equivalents of act_size per layer: attention's f/g pair and the MLP's, forward
    # and backward; an MoE layer's experts with SP move k copies (Megatron-Core's gather of the
    # dispatched rows over tp), the shared experts one more pair, and without SP the whole MoE
    # feed-forward needs none (shardwise's engine: one f/g pair per MoE block); full
    # recomputation repeats the forward half
    units = {False: 4.0, True: (2.0 + (2.0 * M.top_k + (2.0 if M.n_shared_experts else 0.0))
                                * (lay.sp and t > 1))}
    recompute = 1.5 if lay.ckpt == "full" else 1.0
    comm: list[Collective] = []

    def tp_time(layers, moes, first, last):
        if t == 1:
            return 0.0, []
        out = []
        count = recompute * ((layers - moes) * units[False] + moes * units[True])
        for op in tp_ops:
            out.append(_coll(C, lay, "tp", op, "act", act_size, count, A,
                             "layers: f/g of attention and MLP, forward + backward"))
        if first:
            out.append(_coll(C, lay, "tp", "reduce_scatter" if lay.sp else "all_reduce",
                             "act", act_size, 1, A, "vocabulary-parallel embedding (forward)"))
        if last:
            for op in (("all_gather", "reduce_scatter") if lay.sp else ("all_reduce",)):
                out.append(_coll(C, lay, "tp", op, "act", act_size, 1, A,
                                 "output layer input (forward gather / backward reduce)"))
        return sum(c.seconds for c in out), out

    # one layer's attention core for this micro-batch on this rank, without recomputation:
    # the window the ring's transfers hide under
    recompute_core = lay.ckpt == "full" or (lay.ckpt == "selective" and not M.flash_attention)
    t_core = tokens_mb * lsec[False]["core"] / (4 / 3 if recompute_core else 1.0)
    shapes = []  # stages of the same (layers, MoE layers, first, last) cost the same: the
    # first stage of each such shape (:func:`_pipeline_stages`), in stage order
    for (layers, moes, first, last), i in stage_shapes:
        comp = tokens_mb * ((layers - moes) * lsec[False]["total"]
                            + moes * lsec.get(True, lsec[False])["total"]
                            + (hsec if last else 0.0))
        if not A.grad_accum_fused:  # every micro-batch's weight gradients: + into .grad
            comp += (prec.wgrad_bytes * stage_params(M, layers, tp=t, first=first, last=last,
                                                     pp=p, start=starts[i], ep=ep, sp=lay.sp)
                     / C.gpu.hbm_bandwidth)
        t_tp, colls = tp_time(layers, moes, first, last)
        cp_colls = cp_collectives(M, lay, C, A, t_core, layers)
        t_cp = sum(c.exposed for c in cp_colls)
        ep_colls = ep_collectives(M, lay, C, A, moes)
        t_ep = sum(c.exposed for c in ep_colls)
        shapes.append((comp + t_tp + t_cp + t_ep, comp, t_tp, colls, i, t_cp, cp_colls,
                       t_ep, ep_colls))
    (t_mb, t_comp, t_tp, tp_colls, crit, t_cp, cp_colls, t_ep,
     ep_colls) = max(shapes, key=lambda x: x[0])
    for c in tp_colls + cp_colls + ep_colls:
        c.count *= m
        c.wire *= m
        c.seconds *= m
        c.exposed = c.exposed * m if c.axis == "cp" else c.seconds
    comm += tp_colls + cp_colls + ep_colls
    bubble = bubble_time(lay.schedule, p, t_mb, v, m)
    pipeline = m * t_mb + bubble

    # DP/ZeRO: the critical stage's parameters; overlap windows (module docstring)
    dense_crit, expert_crit = stage_param_split(M, stages[crit], tp=t, first=crit == 0,
                                                last=crit == p - 1, pp=p, start=starts[crit],
                                                ep=ep, sp=lay.sp)
    params_crit = dense_crit + expert_crit
    dp_colls = dp_collectives(lay, dense_crit, prec, m, C, A, expert_params=expert_crit)
    t_f, t_b = t_mb / 3, 2 * t_mb / 3
    # dense and expert gradients, and HSDP's shard all-reduce after them, share a window
    grads = [c for c in dp_colls if c.tag in ("grad", "grad_replicate")]
    gathers = [c for c in dp_colls if c.tag == "param"]
    for c in dp_colls:
        if c.tag in ("loss", "grad_norm"):
            c.exposed = c.seconds
    if lay.zero == 3:  # per micro-batch: one gather under forward, one (+ RS) under backward
        one_ag = sum(c.seconds / c.count for c in gathers)
        _share(gathers, m * (max(0.0, one_ag - t_f) + max(0.0, one_ag - t_b)))
        _share(grads, _grad_exposed(grads, max(0.0, t_b - one_ag)))
    else:  # the gradients under the backward of the micro-batch(es) they follow; zero 1/2's
        # param all-gather under the next step's first forward
        if grads:
            _share(grads, _grad_exposed(grads, t_b))
        if gathers:
            _share(gathers, max(0.0, sum(c.seconds for c in gathers) - t_f))
    comm += dp_colls
    dp_exposed = sum(c.exposed for c in dp_colls)

    pp_exposed = 0.0
    if p > 1:
        size = a * tokens_mb * M.d_model / t
        sends = 2 * m * v  # a middle rank: one forward and one backward send per chunk
        c = _coll(C, lay, "pp", "send", "act", size, sends, A,
                  "activations forward and gradients backward at every stage boundary")
        c.exposed = 2 * (p - 1) * c.seconds / sends if A.p2p_overlap else c.seconds
        pp_exposed = c.exposed
        comm.append(c)

    opt_params = _updated(lay, (dense_crit, expert_crit), shard)  # its ZeRO shard
    if lay.offload == "none":
        t_opt = prec.adam_bytes * opt_params / C.gpu.hbm_bandwidth
    else:  # the step on the host (.offload), its copies over the host link
        t_opt = host_step_seconds(prec, opt_params, C)
    held = opt_params if lay.zero == 3 else params_crit
    copies = offload_copies(lay, prec, opt_params, held, m, C, A)
    comm += copies
    t_off = sum(c.exposed for c in copies)
    step = pipeline + dp_exposed + pp_exposed + t_opt + t_off
    step_tokens = global_batch * s
    model_flops = step_tokens * model_flops_token
    hw_flops = step_tokens * hw_flops_token
    world = lay.world
    mfu = model_flops / (step * world * C.gpu.bf16_flops)
    hfu = hw_flops / (step * world * C.gpu.bf16_flops)
    times = {"compute": m * t_comp, "tp": m * t_tp, "cp_exposed": m * t_cp,
             "ep_exposed": m * t_ep, "bubble": bubble, "dp_exposed": dp_exposed,
             "pp_exposed": pp_exposed, "optimizer": t_opt, "offload": t_off, "step": step}
    flops = {"model_per_token": model_flops_token, "layer_model_per_token": layer_model[False],
             "layer_hw_per_token": layer_hw[False], "head_per_token": head_flops,
             "model_per_step": model_flops, "hw_per_step": hw_flops}
    if M.is_moe:
        flops.update(moe_layer_model_per_token=layer_model[True],
                     moe_layer_hw_per_token=layer_hw[True])
    details = {"t_mb": t_mb, "t_comp_mb": t_comp, "t_tp_mb": t_tp, "t_cp_mb": t_cp,
               "t_ep_mb": t_ep, "t_core_layer": t_core, "cp_kv_bytes": kv,
               "cp_gathered": gathered, "critical_stage": crit, "moe_layers_per_stage": moe_in,
               "in_flight": flight, "act_per_layer": per_layer[False],
               "act_per_moe_layer": per_layer.get(True, 0.0), "transient": transient,
               "layer_seconds": lsec[False], "moe_layer_seconds": lsec.get(True),
               "head_seconds": hsec, "peak": peak, "act_size": act_size,
               "ep_bytes_layer": ep_layer_bytes(M, lay), "opt_params": opt_params,
               "params_crit": params_crit, "expert_params_crit": expert_crit}
    return Estimate(M, C, lay, A, global_batch, m, stages, memory, mem, capacity,
                    mem <= capacity and host_fits, flops, times, comm, step, step_tokens / step,
                    mfu, hfu, details, host_gpu, host_capacity)


def _updated(lay: PlanLayout, split: tuple[float, float], shard: int) -> float:
    """Parameters this GPU's optimizer updates, of a stage holding ``split`` = (dense, expert)
    parameters: its ZeRO shard (dense ÷ S·cp = ``shard``, experts ÷ S·cp/ep), all of them
    without ZeRO."""
    dense, expert = split
    if lay.ep == 1:
        dense, expert = dense + expert, 0.0
    if not lay.zero:
        return dense + expert
    return dense / shard + (expert / (shard // lay.ep) if expert else 0.0)


@functools.lru_cache(maxsize=256)
def _flops_per_token(M: ModelSpec, ckpt: str):
    """(layer_model, layer_hw, head, model, hw): FLOPs per token of one layer, by kind of layer
    ({False: dense, True: MoE (its active weights)}, MoE models only), without and with
    recomputation (``ckpt``), of the output layer, and of the whole model without and with
    recomputation. Cached: they depend on the model and ``ckpt`` only, and a search asks for
    them once per layout (the dicts are shared: read them, do not change them)."""
    s = M.seq_len
    kinds = (False, True) if M.is_moe else (False,)  # dense layers, MoE layers
    extra = {"none": 0.0, "selective": 0.0 if M.flash_attention else 4 * M.d_model * s,
             "full": 4 * M.d_model * s}[ckpt]
    layer_model = {moe: 6 * M.layer_active_matmul_params(moe) + 12 * M.d_model * s
                   for moe in kinds}
    layer_hw = {moe: layer_model[moe] + extra
                + (2 * M.layer_active_matmul_params(moe) if ckpt == "full" else 0.0)
                for moe in kinds}
    n_moe = M.n_moe_layers
    head_flops = 6 * M.vocab_size * M.d_model
    model_flops_token = ((M.n_layers - n_moe) * layer_model[False]
                         + n_moe * layer_model.get(True, 0.0) + head_flops)
    hw_flops_token = ((M.n_layers - n_moe) * layer_hw[False] + n_moe * layer_hw.get(True, 0.0)
                      + head_flops)
    return layer_model, layer_hw, head_flops, model_flops_token, hw_flops_token


@functools.lru_cache(maxsize=1024)
def _pipeline_stages(model: ModelSpec, p: int, head_cost: float):
    """(stages, starts, moe_in, shapes) of ``model`` over ``p`` pipeline stages, the last also
    running the output layer (``head_cost`` layers' worth, :func:`partition_layers`): layers
    per stage, each stage's first layer, its MoE layers, and ((layers, MoE layers, first,
    last), i) for the first stage i of each distinct shape, in stage order (stages of one shape
    cost the same). Tuples, cached: every layout of a search with the same pp and head cost
    shares them, and rebuilding them (O(p²) for the starts) per layout was a large part of the
    search's time."""
    stages = partition_layers(model.n_layers, p, head_cost)
    starts = [sum(stages[:i]) for i in range(p)]
    moe_in = [model.moe_layers_in(starts[i], stages[i]) for i in range(p)]
    shapes: dict = {}
    for i, layers in enumerate(stages):
        shapes.setdefault((layers, moe_in[i], i == 0, i == p - 1), i)
    return tuple(stages), tuple(starts), tuple(moe_in), tuple(shapes.items())


DP_AXES = ("dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp")


def inter_node_bytes(e: Estimate) -> dict[str, float]:
    """{axis: bytes} that leave one GPU's node through its NIC per step, for the collectives
    of ``e`` whose group spans nodes (:func:`axis_link`). A ring collective over a group with k
    members per node sends ``wire`` bytes per rank (the ledger's number); the model runs k rings
    side by side, each leaving the node once, one per NIC, so a node's k GPUs send k·wire, of
    which the k boundary hops — ``wire`` in all, ``wire/k`` per NIC — leave it (the time model's
    ``wire/(k·inter)`` is the same count). With one member per node (HSDP's replicas; a dp group
    at tp·cp = GPUs per node) every byte a rank sends leaves its node."""
    out: dict[str, float] = {}
    for c in e.comm:
        if c.axis == "host":  # offload's copies over the host link stay in the node
            continue
        k = members_per_node(e.cluster, e.layout, c.axis)
        if k:
            out[c.axis] = out.get(c.axis, 0.0) + c.wire / k
    return out


def hsdp_comparison(e: Estimate) -> dict:
    """HSDP against ZeRO over all of dp, for one HSDP estimate ``e`` (``dp_replicate`` > 1):
    the same model, cluster, batch and every other degree, re-estimated with dp_replicate = 1
    at ZeRO-3 ("zero3") and, when ``e`` is ZeRO-1/2, at its own stage ("same_stage"). Returns
    {"hsdp" | "zero3" [| "same_stage"]: {"layout", "inter_node_bytes" (all axes, per GPU and
    step), "inter_node_dp_bytes" (the data-parallel axes, :data:`DP_AXES`), "by_axis",
    "model_state_bytes" (parameters + gradients + optimizer of the peak stage), "mem_bytes_per_gpu",
    "fits", "step_time_s", "dp_exposed_s", "mfu"}, "saving": zero3 / hsdp inter-node bytes,
    "saving_dp": the same on the data-parallel axes} (a ratio is ``math.inf`` when HSDP sends
    nothing across nodes, None when neither does). Raises ValueError for a layout without
    HSDP."""
    lay = e.layout
    if lay.dp_replicate == 1:
        raise ValueError("hsdp_comparison: the layout has dp_replicate = 1 (no HSDP)")
    refs = {"zero3": dataclasses.replace(lay, dp_replicate=1, zero=3)}
    if lay.zero != 3:
        refs["same_stage"] = dataclasses.replace(lay, dp_replicate=1)
    rows = {"hsdp": e}
    for key, ref in refs.items():
        rows[key] = estimate(e.model, e.cluster, ref, e.global_batch, e.assumptions)
    out: dict = {}
    for key, x in rows.items():
        by_axis = inter_node_bytes(x)
        peak = max(x.memory.values(), key=lambda mem: mem["total"])
        out[key] = {"layout": x.layout.name(), "inter_node_bytes": sum(by_axis.values()),
                    "inter_node_dp_bytes": sum(v for k, v in by_axis.items() if k in DP_AXES),
                    "by_axis": by_axis,
                    "model_state_bytes": peak["params"] + peak["grads"] + peak["optimizer"],
                    "mem_bytes_per_gpu": x.mem_bytes_per_gpu, "fits": x.fits,
                    "step_time_s": x.step_time_s, "dp_exposed_s": x.times["dp_exposed"],
                    "mfu": x.mfu}

    def ratio(ref, own):
        if own == 0:
            return None if ref == 0 else math.inf
        return ref / own

    out["saving"] = ratio(out["zero3"]["inter_node_bytes"], out["hsdp"]["inter_node_bytes"])
    out["saving_dp"] = ratio(out["zero3"]["inter_node_dp_bytes"],
                             out["hsdp"]["inter_node_dp_bytes"])
    return out


def _grad_exposed(grads: list[Collective], window: float) -> float:
    """Exposed seconds of the gradient collectives of a step, each micro-batch's under the
    ``window`` of its backward: those called once per micro-batch (count > 1: ZeRO-2/3's
    reduce-scatter with ``grad_reduce="micro"``) run under every backward, those called once
    (the reduction after accumulating, HSDP's all-reduce over the replicas) under the last
    one's, after that micro-batch's own."""
    every = [c for c in grads if c.count > 1]
    k = max((c.count for c in every), default=1)
    per = sum(c.seconds / c.count for c in every)
    once = sum(c.seconds for c in grads if c.count <= 1)
    return (k - 1) * max(0.0, per - window) + max(0.0, per + once - window)


def _share(colls: list[Collective], exposed: float) -> None:
    """Spread ``exposed`` seconds over collectives that run in one overlap window, in
    proportion to their time."""
    total = sum(c.seconds for c in colls)
    for c in colls:
        c.exposed = exposed * c.seconds / total if total else 0.0
