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
from .plan_explain import _human

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
    _add_storage_flags(p)
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
                   "per step, as train does (default), or after every micro-batch (a what-if: "
                   "with --what-if)")
    g.add_argument("--what-if", action="store_true",
                   help="also rank layouts shardwise train does not run (yet), priced as "
                   "Megatron-LM, torchtitan or DeepSpeed run them; each says why train refuses "
                   "it")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: also print, per shown layout, the bytes Muon's Newton–Schulz "
                        "gathers add per GPU per step and its FLOPs (docs/optimizers.md)")
    _add_output_flags(p)
    p.set_defaults(func=cmd_plan)
    return p


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """The output and assumption flags of ``plan``."""
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


def _add_storage_flags(p: argparse.ArgumentParser) -> None:
    """The storage and offload flags of ``plan``: train's, searched when unset."""
    s = p.add_argument_group("storage and offload (train's flags; unset = searched)")
    s.add_argument("--dtype", choices=("fp32", "bf16"), help="compute dtype (default: bf16; "
                   "fp32 runs at the fp32 peak)")
    s.add_argument("--param-dtype", choices=("fp32", "bf16"), help="parameter storage")
    s.add_argument("--master-dtype", choices=("fp32", "none"),
                   help="with --param-dtype bf16: fp32 master weights, gradients and Adam state "
                   "(Megatron, 18 B/param) or none (all bf16, the guide's FSDP2 recipe, 8 B)")
    s.add_argument("--offload", choices=("none", "optimizer", "params"),
                   help="optimizer: Adam state, master weights and the step on the host; "
                   "params: the parameter shards too (default: none, or more for a layout "
                   "that does not fit without)")
    s.add_argument("--precision", choices=("fp32", "amp", "bf16", "bf16-pure"),
                   help="shorthand: fp32 = --dtype fp32 --param-dtype fp32; amp = --dtype bf16 "
                   "--param-dtype fp32 (16 B/param); bf16 = --param-dtype bf16 --master-dtype "
                   "fp32; bf16-pure = --param-dtype bf16 --master-dtype none")


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
                 grad_reduce=args.grad_reduce, offload=args.offload)


def _precisions(args) -> list[str]:
    """The storage recipes (keys of :data:`~shardwise.plan.layout.PRECISIONS`) the flags leave:
    ``--precision``, or those of ``--dtype`` / ``--param-dtype`` / ``--master-dtype`` (the
    master dtype matters with bf16 storage only); none given: the searched ones. Raises
    ShardwiseConfigError for a combination no recipe has, or both kinds of flag."""
    from ..plan.layout import SEARCHED_PRECISIONS, STORAGES

    given = [(i, v) for i, v in enumerate((args.dtype, args.param_dtype, args.master_dtype))
             if v is not None]
    if args.precision:
        if given:
            raise ShardwiseConfigError("--precision is shorthand for --dtype, --param-dtype and "
                                       "--master-dtype: give it or them, not both")
        return [args.precision]
    if not given:
        return list(SEARCHED_PRECISIONS)
    keys = [k for k, flags in STORAGES.items()
            if all(flags[i] == v or (i == 2 and flags[1] == "fp32") for i, v in given)]
    if not keys:
        raise ShardwiseConfigError("--param-dtype bf16 computes in bf16 (Precision.stored): "
                                   "drop --dtype fp32, or choose --param-dtype fp32")
    return keys if args.dtype is not None else [k for k in keys if k in SEARCHED_PRECISIONS]


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
        plot_mfu_vs_gpus(model, cluster, counts, batch, args.plot, precision=_precisions(args),
                         assumptions=assume, fixed=_fixed(args))
        print(f"plan: wrote {args.plot} (predicted MFU of {model.name} on {cluster.gpu.name}, "
              f"{len(counts)} GPU counts)")
        if args.gpus is None:
            return 0
    if args.gpus is None:
        raise ShardwiseConfigError("--gpus N is required (the number of GPUs to plan for)")
    from ..plan.search import search

    results = search(model, cluster, args.gpus, batch, _fixed(args), _precisions(args), assume,
                     runnable=not args.what_if)
    shown = results if args.top == 0 else results[:args.top]
    muon = getattr(args, "optimizer", "adamw") == "muon"
    if args.json:
        from ..plan.muon import muon_cost

        fitting = [e for e in results if e.fits]
        rows = [{**e.to_json(), **_train_json(e),
                 **({"muon": muon_cost(model, e.layout)} if muon else {})} for e in shown]
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
        from .plan_explain import explain

        print()
        print(explain(results[0]))
    return 0


def train_line(e) -> str:
    """The ``shardwise train`` flags that run estimate ``e``'s layout
    (:func:`~shardwise.plan.layout.train_flags`), or, for a what-if layout, why train refuses
    it (:func:`~shardwise.plan.layout.check_train`)."""
    from ..plan.layout import check_train, train_flags

    try:
        check_train(e.model, e.layout, e.global_batch)
    except ShardwiseConfigError as why:
        return f"train refuses it: {why}"
    return "train " + " ".join(train_flags(e.layout, e.global_batch, e.model.seq_len))


def _train_json(e) -> dict:
    """The JSON row's storage flags and ``train_flags`` (None for a layout train refuses)."""
    from ..plan.layout import STORAGES

    line = train_line(e)
    dtype, param, master = STORAGES[e.layout.precision]
    return {"dtype": dtype, "param_dtype": param, "master_dtype": master,
            "train_flags": line[len("train "):] if line.startswith("train ") else None}


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
        f"{_gib(e0.capacity_bytes)} GiB per GPU (HBM − {A.memory_reserve:.0%} reserve) and, "
        f"offloaded, {_gib(e0.host_capacity_bytes)} GiB of host memory per node",
        f"  assumptions: dense GEMMs at {A.gemm_efficiency:.1%} of peak, flash attention at "
        f"{cluster.gpu.flash_efficiency:.0%}, links at {A.link_efficiency:.0%}; TP "
        "collectives exposed, DP/ZeRO overlapped with backward, CP ring under attention, CP "
        "all-gather exposed" + (", EP all-to-alls exposed, uniform routing" if model.is_moe
                                else "") + "; offload: host copies exposed, the optimizer "
        "step at host DRAM bandwidth (docs/planner.md)",
        "  storage: amp = fp32 parameters, bf16 compute (16 B/param); bf16 = bf16 parameters, "
        "fp32 master (18 B); bf16-pure = all bf16 (8 B). Under each row, the train flags that "
        "run it",
        "",
    ]
    moe = model.is_moe
    hsdp_shown = []  # set by row(): the legend line of an HSDP dp column
    head = (f"{'#':>3} {'dp':>5} {'cp':>5} " + (f"{'ep':>3} " if moe else "")
            + f"{'tp':>5} {'pp':>3} {'zero':>5} {'schedule':<21} "
            f"{'b':>2} "
            f"{'m':>4} {'ckpt':<9} {'storage':<9} {'offload':<9} {'MFU':>6} {'step s':>8} "
            f"{'tok/s/GPU':>10} {'GiB/GPU':>8} {'host':>6}  params+grads+optim+act+buf GiB")
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
                f"{lay.micro_batch:>2} {e.microbatches:>4} {lay.ckpt:<9} {lay.precision:<9} "
                f"{lay.offload:<9} {e.mfu:>6.1%} "
                f"{e.step_time_s:>8.2f} {e.tokens_per_s / lay.world:>10,.0f} "
                f"{_gib(e.mem_bytes_per_gpu):>8} {_gib(e.host_bytes_per_gpu):>6}  {parts}\n"
                f"      {train_line(e)}")

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
        lines.insert(5, "  dp R×S: HSDP, R replicas of a ZeRO shard group of S data ranks (× cp)")
    return "\n".join(lines)


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
