"""``shardwise plan``: the best layouts of a model on a cluster, ranked by predicted MFU.

::

    shardwise plan --model llama3-70b --gpus 64 --gpu h100-sxm --global-batch-tokens 4M
    shardwise plan … --explain          # the formulas of the best layout with the numbers in
    shardwise plan … --json             # {"layouts": [{dp, tp, pp, zero, schedule, microbatches,
                                        #   mfu, step_time_s, mem_bytes_per_gpu, fits, …}, …]}
    shardwise plan --model mixtral-8x7b --gpus 64 --global-batch-tokens 1M  # MoE: ep searched
    shardwise plan … --tp 8 --pp 16     # fix dimensions (--dp --dp-replicate --cp --cp-method
                                        #   --ep --tp --pp --zero --schedule --microbatches
                                        #   --micro-batch --virtual-stages --ckpt)
    shardwise plan … --pp 4 --zero 3 --dp-replicate 2 --explain  # HSDP vs ZeRO-3 over all of dp
    shardwise plan --model llama3-70b --gpu h100-sxm --plot mfu.png   # MFU vs GPUs per family
    shardwise plan --validate           # predicted vs published MFU of large runs

Wiring (in ``shardwise/cli.py``)::

    from .tools.plan import add_plan_parser
    add_plan_parser(sub)

``add_plan_parser`` registers ``plan`` with ``set_defaults(func=cmd_plan)``;
``cmd_plan(args, argv)`` returns an exit status and raises :class:`~shardwise.errors.ShardwiseConfigError` on bad input
(the caller prints it and exits 2). ``python -m shardwise.tools.plan …`` runs it on its own.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ShardwiseConfigError

GiB = 2**30


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="rank layouts of a model on a GPU cluster by predicted MFU",
        description="Rank every layout (dp × cp × tp × pp, expert parallelism for MoE models, "
        "ZeRO stage, pipeline schedule, "
        "micro-batch, activation checkpointing) of a model on a cluster by the MFU the "
        "analytical cost model predicts, with per-GPU memory. See docs/planner.md.")
    p.add_argument("--model", default="llama3-8b",
                   help="preset (llama3-8b, llama3-70b, llama3-405b, gpt3-175b, …, the MoE "
                   "mixtral-8x7b, mixtral-8x22b, dbrx, llama4-scout, llama4-maverick, or our "
                   "tiny/small/base, moe-tiny/moe-small) or a FILE.toml of ModelSpec fields "
                   "(default llama3-8b)")
    p.add_argument("--gpus", type=int, help="number of GPUs (required unless --plot or "
                   "--validate)")
    p.add_argument("--gpu", default="h100-sxm", help="GPU preset: a100-sxm-80gb, h100-sxm, "
                   "h200-sxm, b200 (default h100-sxm)")
    p.add_argument("--cluster", metavar="FILE.toml", help="custom GPU and cluster (replaces "
                   "--gpu)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    p.add_argument("--global-batch-tokens", default="4M",
                   help="tokens per optimizer step, e.g. 4M (= 4·2^20), 512K, 4194304 "
                   "(default 4M)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--precision", choices=("bf16", "amp", "fp32"), default="bf16",
                   help="bf16: bf16 weights, fp32 gradients and Adam (18 B/param); amp: fp32 "
                   "weights, bf16 compute (16 B/param); fp32 (default bf16)")
    g = p.add_argument_group("layout (fix a dimension; unset = searched)")
    g.add_argument("--dp", type=int, help="fix the data-parallel degree (default: searched)")
    g.add_argument("--dp-replicate", type=int, metavar="R",
                   help="HSDP: dp = R × S, ZeRO shards over the S ranks (× cp) of a shard "
                   "group and the R groups replicate it (needs --zero ≥ 1; 1 = ZeRO over all "
                   "of dp; default: searched, the shard group filling a node)")
    g.add_argument("--cp", type=int, help="context parallelism: ranks that split every "
                   "sequence (Llama-style models; seq divisible by 2·cp)")
    g.add_argument("--cp-method", choices=("ring", "allgather"),
                   help="cp > 1: K/V around a ring under attention, or all-gathered (Llama 3)")
    g.add_argument("--ep", type=int, help="expert parallelism (MoE models): ranks of the data "
                   "axes (dp × cp) that share out the experts; divides dp·cp and n_experts")
    g.add_argument("--tp", type=int, help="fix the tensor-parallel degree (default: searched)")
    g.add_argument("--pp", type=int, help="fix the pipeline degree (default: searched)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="fix the ZeRO stage (default: searched)")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when tp > 1)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"),
                   help="fix the pipeline schedule (default: searched)")
    g.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank "
                   "(interleaved-1f1b)")
    g.add_argument("--microbatches", type=int, help="micro-batches per step and replica (m)")
    g.add_argument("--micro-batch", type=int, help="sequences per micro-batch (b)")
    g.add_argument("--ckpt", choices=("none", "selective", "full"),
                   help="activation checkpointing")
    g.add_argument("--grad-reduce", choices=("step", "micro"),
                   help="zero 2/3 with several micro-batches: reduce-scatter gradients once "
                   "per step (full local gradients held) or after every micro-batch")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: also print, per shown layout, the bytes Muon's Newton–Schulz "
                        "gathers add per GPU per step and its FLOPs (docs/optimizers.md)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="layouts to show (0 = all; default 10)")
    o.add_argument("--explain", action="store_true", help="the formulas of the best layout "
                   "with the numbers plugged in")
    o.add_argument("--json", action="store_true", help="print JSON (best first)")
    o.add_argument("--plot", metavar="PATH.png", help="plot predicted MFU against the number "
                   "of GPUs, one line per strategy family")
    o.add_argument("--plot-gpus", default="8,16,32,64,128,256,512,1024,2048,4096",
                   help="GPU counts for --plot (comma-separated)")
    o.add_argument("--validate", action="store_true", help="predicted vs published MFU of "
                   "the large runs in docs/planner.md")
    a = p.add_argument_group("assumptions (docs/planner.md)")
    a.add_argument("--gemm-efficiency", type=float, help="fraction of peak the dense matmuls "
                   "sustain (default 0.676)")
    a.add_argument("--link-efficiency", type=float, help="fraction of link bandwidth "
                   "collectives reach (default 0.8)")
    a.add_argument("--memory-reserve", type=float, help="fraction of HBM kept free "
                   "(default 0.1)")
    p.set_defaults(func=cmd_plan)
    return p


def _assumptions(args):
    from ..plan.layout import Assumptions

    kw = {}
    for key, name in (("gemm_efficiency", "--gemm-efficiency"),
                      ("link_efficiency", "--link-efficiency"),
                      ("memory_reserve", "--memory-reserve")):
        v = getattr(args, key, None)
        if v is None:
            continue
        if key == "memory_reserve" and not 0 <= v < 1:
            raise ShardwiseConfigError(f"{name} {v} must be in [0, 1)")
        if key != "memory_reserve" and not 0 < v <= 1:
            raise ShardwiseConfigError(f"{name} {v} must be in (0, 1]")
        kw[key] = v
    return Assumptions(**kw)


def _setup(args):
    import dataclasses

    from ..plan.hardware import get_cluster, load_cluster
    from ..plan.models import get_model
    from ..plan.search import global_batch_sequences, parse_tokens

    model = get_model(args.model)
    if args.seq_len is not None:
        if args.seq_len < 1:
            raise ShardwiseConfigError(f"--seq-len {args.seq_len} must be at least 1")
        model = dataclasses.replace(model, seq_len=args.seq_len)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ShardwiseConfigError(f"--gpus-per-node {args.gpus_per_node} must be ≥ 1")
    if args.cluster:
        cluster = load_cluster(args.cluster)
        if args.gpus_per_node:
            cluster = dataclasses.replace(cluster, gpus_per_node=args.gpus_per_node, name="")
    else:
        cluster = get_cluster(args.gpu, args.gpus_per_node)
    tokens = parse_tokens(args.global_batch_tokens)
    return model, cluster, tokens, global_batch_sequences(tokens, model.seq_len)


def _fixed(args):
    from ..plan.search import Fixed

    return Fixed(dp=args.dp, dp_replicate=args.dp_replicate, cp=args.cp,
                 cp_method=args.cp_method, ep=args.ep, tp=args.tp,
                 pp=args.pp,
                 zero=args.zero, sp=args.sp,
                 schedule=args.schedule, virtual_stages=args.virtual_stages,
                 microbatches=args.microbatches, micro_batch=args.micro_batch, ckpt=args.ckpt,
                 grad_reduce=args.grad_reduce)


def cmd_plan(args, argv=None) -> int:
    """Run ``shardwise plan``. Returns 0; raises ShardwiseConfigError on bad input."""
    if args.validate:
        return _validate(args)
    model, cluster, tokens, batch = _setup(args)
    assume = _assumptions(args)
    if args.top < 0:
        raise ShardwiseConfigError(f"--top {args.top} must be ≥ 0 (0 = all)")
    if args.plot:
        from ..plan.plot import plot_mfu_vs_gpus

        counts = _parse_counts(args.plot_gpus) if args.gpus is None else sorted(
            set(_parse_counts(args.plot_gpus)) | {args.gpus})
        plot_mfu_vs_gpus(model, cluster, counts, batch, args.plot, precision=args.precision,
                         assumptions=assume, fixed=_fixed(args))
        print(f"plan: wrote {args.plot} (predicted MFU of {model.name} on {cluster.gpu.name}, "
              f"{len(counts)} GPU counts)")
        if args.gpus is None:
            return 0
    if args.gpus is None:
        raise ShardwiseConfigError("--gpus N is required (the number of GPUs to plan for)")
    from ..plan.search import search

    results = search(model, cluster, args.gpus, batch, _fixed(args), args.precision, assume)
    shown = results if args.top == 0 else results[:args.top]
    muon = getattr(args, "optimizer", "adamw") == "muon"
    if args.json:
        from ..plan.muon import muon_cost

        fitting = [e for e in results if e.fits]
        rows = [{**e.to_json(), **({"muon": muon_cost(model, e.layout)} if muon else {})}
                for e in shown]
        json.dump({"model": model.name, "gpu": cluster.gpu.name, "gpus": args.gpus,
                   "global_batch_tokens": tokens, "seq_len": model.seq_len,
                   "evaluated": len(results), "fitting": len(fitting),
                   "layouts": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(format_table(results, model, cluster, args.gpus, tokens, args.top))
    if muon:
        print()
        print(muon_lines(shown[:5], model, cluster))
    if args.explain:
        print()
        print(explain(results[0]))
    return 0


def muon_lines(estimates, model, cluster) -> str:
    """``--optimizer muon``: per layout, what Muon adds per GPU per step — the bytes its gathers
    send over dp and tp, and Newton–Schulz's FLOPs with their seconds at the GPU's fp32 peak
    (:func:`shardwise.plan.muon.muon_cost`). Not (yet) part of the estimate's step time."""
    from ..plan.muon import muon_cost

    lines = ["Muon (Newton–Schulz needs whole matrices; AdamW on the rest): per GPU per step"]
    for e in estimates:
        c = muon_cost(model, e.layout)
        lines.append(f"  {e.layout.name():<40} +{_human(c['dp'])} over dp, "
                     f"+{_human(c['tp'])} over tp; NS {c['ns_flops'] / 1e12:.3f} TFLOP "
                     f"= {c['ns_flops'] / cluster.gpu.fp32_flops * 1e3:.1f} ms at fp32 peak "
                     f"(step {e.step_time_s * 1e3:.0f} ms with AdamW)")
    return "\n".join(lines)


def _parse_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ShardwiseConfigError(f"--plot-gpus {text!r}: give comma-separated integers, "
                                   "e.g. 8,64,512") from None
    if not counts or counts[0] < 1:
        raise ShardwiseConfigError(f"--plot-gpus {text!r}: give positive GPU counts")
    return counts


def _validate(args) -> int:
    from ..plan.published import validation_rows

    rows = validation_rows(_assumptions(args))
    if args.json:
        json.dump({"runs": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'run':<18} {'GPUs':>6} {'seq':>7} {'published':>9} {'predicted':>9} {'diff':>6} "
          f"{'GiB/GPU':>8}  layout chosen")
    for r in rows:
        mark = "" if r["independent"] else "  (calibration source)"
        print(f"{r['run']:<18} {r['gpus']:>6} {r['seq_len']:>7} {100 * r['published']:>8.1f}% "
              f"{100 * r['predicted']:>8.1f}% {r['diff_points']:>+6.1f} "
              f"{_gib(r['mem_bytes_per_gpu']):>8}  {r['layout']}{mark}")
    return 0


def _gib(x: float) -> str:
    return f"{x / GiB:,.1f}"


def _human(x: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (B, KiB, MiB, GiB, TiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def format_table(results, model, cluster, gpus, tokens, top=10) -> str:
    """The human-readable ranking: best fitting layouts, then the best that do not fit."""
    fit = [e for e in results if e.fits]
    nofit = [e for e in results if not e.fits]
    e0 = results[0]
    A = e0.assumptions
    lines = [
        f"plan: {model.describe()}",
        f"  on {gpus:,} × {cluster.describe()}",
        f"  global batch {tokens:,} tokens = {e0.global_batch:,} sequences × {model.seq_len}; "
        f"{len(results):,} layouts evaluated, {len(fit):,} fit in "
        f"{_gib(e0.capacity_bytes)} GiB per GPU (HBM − {A.memory_reserve:.0%} reserve)",
        f"  assumptions: dense GEMMs at {A.gemm_efficiency:.1%} of peak, flash attention at "
        f"{cluster.gpu.flash_efficiency:.0%}, links at {A.link_efficiency:.0%}; TP "
        "collectives exposed, DP/ZeRO overlapped with backward, CP ring under attention, CP "
        "all-gather exposed" + (", EP all-to-alls exposed, uniform routing" if model.is_moe
                                else "") + " (docs/planner.md)",
        "",
    ]
    moe = model.is_moe
    hsdp_shown = []  # set by row(): the legend line of an HSDP dp column
    head = (f"{'#':>3} {'dp':>5} {'cp':>5} " + (f"{'ep':>3} " if moe else "")
            + f"{'tp':>5} {'pp':>3} {'zero':>5} {'schedule':<21} "
            f"{'b':>2} "
            f"{'m':>4} {'ckpt':<9} {'MFU':>6} {'step s':>8} {'tok/s/GPU':>10} "
            f"{'GiB/GPU':>8}  params+grads+optim+act+buf GiB")
    lines.append(head)

    def row(i, e):
        lay, mem = e.layout, e.memory["first" if e.memory["first"]["total"] >=
                                      e.memory["last"]["total"] else "last"]
        sched = "-" if lay.pp == 1 else (lay.schedule + (f" v={lay.chunks}"
                                                          if lay.chunks > 1 else ""))
        tp = f"{lay.tp}{'+sp' if lay.sp else ''}"
        zero = f"{lay.zero}{'/mb' if lay.zero >= 2 and lay.grad_reduce == 'micro' else ''}"
        parts = "+".join(_gib(mem[k]) for k in ("params", "grads", "optimizer", "activations",
                                                 "buffers"))
        cp = f"{lay.cp}{'ag' if lay.cp > 1 and lay.cp_method == 'allgather' else ''}"
        ep = f"{lay.ep:>3} " if moe else ""
        dp = f"{lay.dp_replicate}×{lay.dp_shard}" if lay.dp_replicate > 1 else f"{lay.dp}"
        if lay.dp_replicate > 1:
            hsdp_shown.append(i)
        return (f"{i:>3} {dp:>5} {cp:>5} {ep}{tp:>5} {lay.pp:>3} {zero:>5} {sched:<21} "
                f"{lay.micro_batch:>2} {e.microbatches:>4} {lay.ckpt:<9} {e.mfu:>6.1%} "
                f"{e.step_time_s:>8.2f} {e.tokens_per_s / lay.world:>10,.0f} "
                f"{_gib(e.mem_bytes_per_gpu):>8}  {parts}")

    for i, e in enumerate(fit if top == 0 else fit[:top], 1):
        lines.append(row(i, e))
    if not fit:
        lines.append("  (no layout fits: see below; try more GPUs, --ckpt full, or --zero 3)")
    if nofit:
        # the ones that would beat the best fitting layout, closest to fitting first
        better = sorted((e for e in nofit if not fit or e.mfu > fit[0].mfu),
                        key=lambda e: e.mem_bytes_per_gpu)
        lines.append("")
        if better:
            lines.append(f"do not fit (> {_gib(e0.capacity_bytes)} GiB per GPU) but would beat "
                         "#1, least memory first:")
        else:
            lines.append(f"do not fit (> {_gib(e0.capacity_bytes)} GiB per GPU), best MFU "
                         "first:")
        for i, e in enumerate((better or nofit)[:5], 1):
            lines.append(row(i, e))
    if hsdp_shown:
        lines.insert(4, "  dp R×S: HSDP, R replicas of a ZeRO shard group of S data ranks (× cp)")
    return "\n".join(lines)


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
    out.append(f"  fits: {_human(e.mem_bytes_per_gpu)} ≤ {_human(e.capacity_bytes)}? "
               f"{'yes' if e.fits else 'NO'}")
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
    out.append(f"  + DP exposed {T['dp_exposed']:.3f} s + PP exposed {T['pp_exposed']:.3f} s + "
               f"optimizer {T['optimizer']:.3f} s = {e.step_time_s:.3f} s")
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


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.tools.plan …``: the plan command on its own (exit 2 on bad input)."""
    parser = argparse.ArgumentParser(prog="shardwise")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        argv = ["plan", *argv]
    args = parser.parse_args(argv)
    try:
        return args.func(args, argv)
    except ShardwiseConfigError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
