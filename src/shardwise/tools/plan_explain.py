"""``shardwise plan --explain``: the formulas of one estimate with its numbers plugged in
(:func:`explain`; the HSDP part :func:`_explain_hsdp`). Split from :mod:`.plan` (its table and
flags) by job.
"""

from __future__ import annotations

def explain(e) -> str:
    """The formulas of one estimate with its numbers plugged in (units in the text)."""
    from ..plan.layout import PRECISIONS
    from ..plan.memory import in_flight, layer_activation_bytes

    M, C, lay, A, d = e.model, e.cluster, e.layout, e.assumptions, e.details
    prec = PRECISIONS[lay.precision]
    t, p, n, b, s, cp = lay.tp, lay.pp, lay.dp, lay.micro_batch, M.seq_len, lay.cp
    v = lay.chunks
    f = e.flops
    out = [f"explain: {lay.name()}  ({M.name} on {lay.world:,} × {C.gpu.name})", ""]
    out.append("FLOPs per token (model FLOPs: 6·N + 12·L·d·s; PaLM App. B, Korthikanti App. A)")
    if M.is_moe:
        Lm, mats = M.n_moe_layers, M.n_mlp_mats
        dense = (f"({M.n_layers - Lm})·(2d² + 2d·kvd + {mats}·d·f) + " if Lm < M.n_layers
                 else "")
        out.append(f"  N (active) = {dense}L_m·(2d² + 2d·kvd + d·E + (k + n_shared)·{mats}·d·f_e)"
                   f" + V·d, L_m = {Lm}, E = {M.n_experts}, k = {M.top_k}, n_shared = "
                   f"{M.n_shared_experts}, f_e = {M.expert_ff}: {M.matmul_params():,}")
        out.append(f"  parameters: {M.num_params():,} total (memory), {M.num_active_params():,} "
                   "active (FLOPs)")
    else:
        out.append(f"  N = L·(2d² + 2d·kvd + {M.n_mlp_mats}·d·f) + V·d = {M.matmul_params():,}")
    out.append(f"  6·N + 12·L·d·s = 6·{M.matmul_params():,} + 12·{M.n_layers}·{M.d_model}·{s} "
               f"= {f['model_per_token']:.4g}")
    out.append(f"  per step: {e.tokens:,} tokens × {f['model_per_token']:.4g} = "
               f"{f['model_per_step']:.4g} FLOPs")
    out.append("")
    out.append(f"Batch: G = {e.global_batch:,} sequences; m = G/(dp·b) = {e.global_batch:,}/"
               f"({n}·{b}) = {e.microbatches} micro-batches per step and replica")
    out.append(f"Pipeline: {p} stage(s), layers per stage {_stages(e.stages)}"
               + (f", schedule {lay.schedule}" + (f", v = {v}" if v > 1 else "") if p > 1
                  else ""))
    out.append("")
    out.append("Memory per GPU (ZeRO §5.1; Korthikanti §4)")
    for where in ("first", "last") if p > 1 else ("first",):
        mem = e.memory[where]
        label = "first stage" if p > 1 and where == "first" else (
            "last stage" if p > 1 else "every GPU")
        out.append(f"  {label}: Ψ_s = {mem['params_count']:,.0f} parameters on this GPU")
        sh = {0: "", 1: "K/dp", 2: "(G+K)/dp", 3: "(P+G+K)/dp"}[lay.zero]
        R, S = lay.dp_replicate, lay.dp_shard
        if R > 1:  # HSDP: ZeRO over the shard group, the R groups replicate it
            sh = sh.replace("dp", f"(S·cp) = ÷{S * cp}" if cp > 1 else f"S = ÷{S}")
            sh += f"; HSDP dp = R × S = {R} × {S}: the states ×{R} of ZeRO over all of dp"
        elif cp > 1:
            sh = sh.replace("dp", f"(dp·cp) = ÷{n * cp}")
        if lay.ep > 1 and mem.get("expert_params_count"):
            grp = "S·cp/ep" if R > 1 else "dp·cp/ep"
            out.append(f"    of them experts: L_m·E·{M.n_mlp_mats}·d·f_e/(ep·etp) = "
                       f"{mem['expert_params_count']:,.0f} (E/ep = {M.n_experts // lay.ep} per "
                       f"layer), their ZeRO shards over {grp} = {S * cp // lay.ep} ranks")
        out.append(f"    zero {lay.zero}{' (' + sh + ')' if sh else ''}, P={prec.param} "
                   f"G={prec.grad} K={prec.optim} B/param: params {_human(mem['params'])} + "
                   f"grads {_human(mem['grads'])} + optimizer {_human(mem['optimizer'])}")
        out.append(f"    activations {_human(mem['activations'])}, buffers "
                   f"{_human(mem['buffers'])} → total {_human(mem['total'])}")
        if lay.offload != "none":
            out.append(f"    offload {lay.offload}: on the host params "
                       f"{_human(mem['host_params'])} + gradient shard "
                       f"{_human(mem['host_grads'])} + optimizer {_human(mem['host_optimizer'])}"
                       f" = {_human(mem['host'])} (counted on the device above: 0 for what "
                       "moved)")
        out.append(f"    start-up (built on meta, filled box by box): params"
                   f"{' + grads' if lay.zero else ''} + one box of 4 B × "
                   f"{mem['startup_host'] / 4:,.0f} → device {_human(mem['startup_device'])}, "
                   f"host {_human(mem['startup_host'])} + the import floor")
    tokens_mb = b * s // cp
    none = layer_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, ckpt="none",
                                  act_bytes=prec.act)
    toks = f"{b}·{s}/{cp}" if cp > 1 else f"{b}·{s}"
    kind = "a dense layer" if M.is_moe else "per layer"
    out.append(f"  activations {kind} per micro-batch ({toks} tokens, a = {prec.act} B, "
               f"t = {t}{', SP' if lay.sp else ''}): {_human(d['act_per_layer'])} "
               f"(ckpt={lay.ckpt}; without checkpointing {_human(none)})")
    held = in_flight(lay.schedule, p, e.microbatches, v)
    out.append(f"  micro-batches in flight on the first stage: {held:.3g}"
               + (" = min(m, p)·(1 + (p−1)/(p·v))" if p > 1 and lay.schedule ==
                  "interleaved-1f1b" else " = min(m, p)" if p > 1 and lay.schedule != "gpipe"
                  else " = m" if p > 1 else ""))
    if cp > 1:
        out.append(f"  cp = {cp}: every activation per token, so ÷ {cp}; KV = 2·b·(s/cp)·"
                   f"(k/t)·hd·a = 2·{b}·{s // cp}·{M.n_kv_heads // t}·{M.head_dim}·{prec.act} "
                   f"= {_human(d['cp_kv_bytes'])} per layer"
                   + (f"; all-gather keeps the gathered K/V, (cp−1)·KV = "
                      f"{_human(d['cp_gathered'])} more per layer" if d["cp_gathered"] else ""))
    if M.is_moe:
        out.append(f"  an MoE layer keeps {_human(d['act_per_moe_layer'])} per micro-batch (router "
                   f"probabilities, k = {M.top_k} dispatched copies, the experts' intermediates "
                   "and outputs); MoE layers per stage: "
                   f"{_stages(d['moe_layers_per_stage'])}")
    out.append(f"  fits: {_human(e.mem_bytes_per_gpu)} ≤ {_human(e.capacity_bytes)}"
               + (f", host {min(C.gpus_per_node, lay.world)} × "
                  f"{_human(e.host_bytes_per_gpu)} per node ≤ "
                  f"{_human(e.host_capacity_bytes)}" if lay.offload != "none" else "")
               + f"? {'yes' if e.fits else 'NO'}")
    out.append("")
    ls = d["layer_seconds"]
    out.append(f"Compute per micro-batch on the slowest stage (stage {d['critical_stage']})")
    kind = "a dense layer" if M.is_moe else "a layer"
    out.append(f"  {kind}, per token: dense {ls['dense'] * 1e9:,.2f} ns (GEMMs at "
               f"{A.gemm_efficiency:.1%} of {d['peak'] / 1e12:,.0f} TFLOP/s) + attention core "
               f"{ls['core'] * 1e9:,.2f} ns + element-wise {ls['elementwise'] * 1e9:,.2f} ns")
    if M.is_moe:
        ms = d["moe_layer_seconds"]
        out.append(f"  an MoE layer, per token: dense {ms['dense'] * 1e9:,.2f} ns (attention ÷ tp, "
                   f"router + shared + top-{M.top_k} experts ÷ etp) + attention core "
                   f"{ms['core'] * 1e9:,.2f} ns + element-wise {ms['elementwise'] * 1e9:,.2f} ns")
    cp_part = (f" + CP exposed {d['t_cp_mb'] * 1e3:,.2f} ms" if cp > 1 else "")
    if lay.ep > 1:
        cp_part += f" + EP {d['t_ep_mb'] * 1e3:,.2f} ms"
    out.append(f"  t_compute = {d['t_comp_mb'] * 1e3:,.2f} ms; TP collectives (exposed) "
               f"{d['t_tp_mb'] * 1e3:,.2f} ms{cp_part} → t_mb = {d['t_mb'] * 1e3:,.2f} ms")
    if cp > 1:
        how = ("ring: each K/V send hides under one block's attention, t_core/cp per step "
               "(forward a third of t_core, backward two thirds); the last dK/dV send exposed"
               if lay.cp_method == "ring" else
               "all-gather of K/V before attention and reduce-scatter of dK/dV after it, "
               "exposed (Llama 3 §3.3.2)")
        out.append(f"  CP {lay.cp_method} over {cp} ranks: attention core of one layer "
                   f"t_core = {d['t_core_layer'] * 1e3:,.3f} ms per micro-batch; {how}")
    if lay.ep > 1:
        from ..plan.comm import ep_tokens

        eb = d["ep_bytes_layer"]
        out.append(f"  EP over {lay.ep} ranks (uniform routing): T = b·(s/cp)/etp = "
                   f"{ep_tokens(M, lay):,.0f} tokens per micro-batch, each all-to-all moves "
                   f"(ep−1)/ep·T·k·d·a; per MoE layer dispatch {_human(eb['ep_dispatch'])} + "
                   f"combine {_human(eb['ep_combine'])} (forward + backward), exposed")
    out.append("")
    out.append("Communication per step (bytes sent per GPU by the ring formulas; seconds = "
               "steps·latency + bytes/(bw·link efficiency))")
    width = max([5] + [len(c.axis) for c in e.comm])
    for c in e.comm:
        out.append(f"  {c.axis:<{width}} {c.op:<14} {c.tag:<11} n={c.n:<5} "
                   f"S={c.size / 2**20:>10,.1f} "
                   f"MiB ×{c.count:>7,.0f}: {c.wire / 1e9:>9,.2f} GB sent, {c.seconds:>8.3f} s, "
                   f"exposed {c.exposed:.3f} s  [{c.link}] {c.note}")
    out.append("")
    if lay.dp_replicate > 1:
        out += _explain_hsdp(e) + [""]
    T = e.times
    bub = {"gpipe": "(p−1)·t_mb", "1f1b": "(p−1)·t_mb", "interleaved-1f1b": "(p−1)·t_mb/v",
           "zb-h1": "(p−1)·t_mb/3"}.get(lay.schedule, "")
    out.append("Step time")
    cp_sum = f" + CP {T['cp_exposed']:.3f}" if cp > 1 else ""
    cp_sum += f" + EP {T['ep_exposed']:.3f}" if lay.ep > 1 else ""
    out.append(f"  m·t_mb = {e.microbatches}·{d['t_mb'] * 1e3:,.2f} ms = "
               f"{T['compute'] + T['tp'] + T['cp_exposed'] + T['ep_exposed']:.3f} s (compute "
               f"{T['compute']:.3f} + TP {T['tp']:.3f}{cp_sum})")
    if p > 1:
        out.append(f"  bubble = {bub if e.microbatches >= p else '(p−1)·t_mb (m < p)'} = "
                   f"{T['bubble']:.3f} s")
    where = (f" on the host ({prec.adam_bytes} B/param at "
             f"{C.host_mem_bw / C.gpus_per_node / 1e9:,.1f} GB/s per GPU)"
             if lay.offload != "none" else "")
    copies = (f" + host copies {T['offload']:.3f} s (over "
              f"{C.gpu.pcie_bandwidth / 1e9:,.0f} GB/s × {A.link_efficiency:.0%})"
              if lay.offload != "none" else "")
    out.append(f"  + DP exposed {T['dp_exposed']:.3f} s + PP exposed {T['pp_exposed']:.3f} s + "
               f"optimizer{where} {T['optimizer']:.3f} s{copies} = {e.step_time_s:.3f} s")
    out.append(f"  tokens/s = {e.tokens:,} / {e.step_time_s:.3f} = {e.tokens_per_s:,.0f} "
               f"({e.tokens_per_s / lay.world:,.0f} per GPU)")
    out.append(f"  MFU = {f['model_per_step']:.4g} / ({e.step_time_s:.3f} s · {lay.world:,} · "
               f"{C.gpu.bf16_flops / 1e12:,.0f} TFLOP/s) = {e.mfu:.1%}   (HFU {e.hfu:.1%})")
    return "\n".join(out)


def _explain_hsdp(e) -> list[str]:
    """The HSDP part of :func:`explain`: its per-axis byte formulas with this layout's numbers,
    and its inter-node bytes against ZeRO-3 over all of dp (:func:`cost.hsdp_comparison`)."""
    from ..plan.comm import axis_link
    from ..plan.cost import hsdp_comparison
    from ..plan.layout import PRECISIONS

    C, lay, d = e.cluster, e.layout, e.details
    prec = PRECISIONS[lay.precision]
    R, S, cp, t, m = lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, e.microbatches
    ax = "dp_shard" if cp == 1 else "dp_shard_cp"
    sh = S * cp
    s_sym = "S" if cp == 1 else "S'"
    shard_link = axis_link(C, lay, ax)[2]
    rep_link = axis_link(C, lay, "dp_replicate")[2]
    out = [f"HSDP (PyTorch FSDP hybrid sharding, Zhao et al. 2023 §3.2.3): dp = R × S = {R} × "
           f"{S}; ZeRO-{lay.zero} over the shard group of "
           + (f"S' = S·cp = {sh}" if cp > 1 else f"S = {S}")
           + f" ranks ({sh}·tp = {sh * t} GPUs, {shard_link}), the R = {R} replicas "
           f"{rep_link}"]
    experts = lay.ep > 1 and d["expert_params_crit"] > 0
    psi = d["params_crit"] - (d["expert_params_crit"] if experts else 0.0)
    f = f"({sh}−1)/{sh}"
    out.append(f"  per step on this GPU: Ψ_s = {psi:,.0f} parameters, G_c = {prec.grad_comm} B, "
               f"P = {prec.param} B, m = {m}"
               + (" (the dense ones; the experts' reduce-scatter and all-gathers over edp and "
                  "their shard's all-reduce over the replicas: the table above)" if experts
                  else ""))

    def wire(axis, tag):  # the dense parameters' collectives (not the experts')
        return sum(c.wire for c in e.comm if c.axis == axis and c.tag == tag
                   and "of the experts" not in c.note)

    rs_m = "m·" if lay.zero >= 2 and lay.grad_reduce == "micro" and m > 1 else ""
    ag = {1: "", 2: "", 3: "2·m·"}[lay.zero]
    out.append(f"    reduce-scatter of the gradients in the shard group  {rs_m}({s_sym}−1)/{s_sym}"
               f"·G_c·Ψ_s = {rs_m}{f}·{prec.grad_comm}·Ψ_s = {wire(ax, 'grad') / 1e9:,.2f} GB "
               f"[{shard_link}]")
    out.append(f"    all-reduce of the 1/{s_sym} shard over the replicas  2(R−1)/R·G_c·Ψ_s/{s_sym}"
               f" = 2·{R - 1}/{R}·{prec.grad_comm}·Ψ_s/{sh} = "
               f"{wire('dp_replicate', 'grad_replicate') / 1e9:,.2f} GB [{rep_link}]")
    out.append(f"    all-gathers of the parameters in the shard group  {ag}({s_sym}−1)/{s_sym}"
               "·P·Ψ_s"
               f" = {ag}{f}·{prec.param}·Ψ_s = {wire(ax, 'param') / 1e9:,.2f} GB "
               f"[{shard_link}]")
    cmp = hsdp_comparison(e)
    out.append("  inter-node bytes per GPU and step (every collective whose group spans nodes; "
               "in brackets the data-parallel axes'):")
    labels = {"hsdp": f"HSDP R × S = {R} × {S}", "zero3": f"ZeRO-3 over all dp = {lay.dp}",
              "same_stage": f"ZeRO-{lay.zero} over all dp = {lay.dp}"}
    for key in ("hsdp", "zero3", "same_stage"):
        if key not in cmp:
            continue
        r = cmp[key]
        out.append(f"    {labels[key]:<26} {r['inter_node_bytes'] / 1e9:>10,.2f} GB "
                   f"({r['inter_node_dp_bytes'] / 1e9:,.2f} GB); model state "
                   f"{_human(r['model_state_bytes'])}, {_human(r['mem_bytes_per_gpu'])} per GPU"
                   f"{'' if r['fits'] else ' (does not fit)'}; DP exposed "
                   f"{r['dp_exposed_s']:.3f} s, step {r['step_time_s']:.3f} s, MFU "
                   f"{r['mfu']:.1%}  [{r['layout']}]")

    def times(x):
        return "∞" if x == float("inf") else "—" if x is None else f"{x:,.1f}×"

    h, z = cmp["hsdp"], cmp["zero3"]
    out.append(f"  → HSDP sends {times(cmp['saving'])} fewer bytes across nodes than ZeRO-3 over "
               f"all of dp ({times(cmp['saving_dp'])} on the data-parallel axes), for "
               f"{h['model_state_bytes'] / z['model_state_bytes']:,.2f}× its model state per "
               "GPU")
    return out


def _stages(stages) -> str:
    if len(set(stages)) == 1:
        return f"{stages[0]} × {len(stages)}"
    return ", ".join(str(x) for x in stages) if len(stages) <= 8 else (
        f"{stages[0]}, {stages[1]}, …, {stages[-2]}, {stages[-1]}")


def _human(x: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (B, KiB, MiB, GiB, TiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"
