"""``shardwise train | verify | trace | bench | report`` — the command line.

Run alone, a command that needs several ranks spawns them itself (see :mod:`shardwise.launch`);
under torchrun it uses torchrun's world. Errors in the input print one line that names the
constraint and the fix, and exit with status 2 (under torchrun: the worker's status, the line
printed once per node and written to torchrun's error file, its summary's root cause:
:func:`report_config_error`); a failing worker stops the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from .config import add_config_flags, check_timeout, from_args, validate
from .config.fields import DEFAULT_LAYOUT_RULE
from .errors import ShardwiseConfigError
from .launch import is_worker, spawn, watch_launcher


LEARN = ("collectives", "dp", "fsdp", "tp", "fsdp_tp", "pp")
COLLECTIVES_HELP = ("how comm/ops.py runs the collectives: native (the backend's own), ring, "
                    "tree, or auto (by the α-β model); default native")


# trace's own defaults (a tiny model and batch: one step to look at, not a training run)
TRACE_DEFAULTS = dict(model="tiny", global_batch=8, micro_batch=2, seq_len=16)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise", description="N-D parallel training for "
                                "PyTorch with every collective in sight.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (spawns dp×tp×pp local workers unless "
                       "under torchrun)", description=DEFAULT_LAYOUT_RULE)
    add_config_flags(t)
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("verify", help="parity of every layout and engine with one process")
    v.add_argument("--nproc", type=int, default=4, help="ranks to spawn (default 4)")
    v.add_argument("--layouts", nargs="+", metavar="LAYOUT",
                   help="layouts such as dp=2 (default: every layout that fits --nproc)")
    v.add_argument("--engine", choices=("explicit", "torch", "both"), default="both",
                   help="engines to compare with one process (default both)")
    v.add_argument("--bounded", action="store_true",
                   help="only the compositions of exactly --nproc ranks, a bounded subset "
                        "(for --nproc 8)")
    v.add_argument("--models", default="tiny,mlp-tiny",
                   help="comma-separated test models (default tiny,mlp-tiny)")
    v.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="the optimizer of every case (default adamw; muon: Muon on the hidden "
                        "matrices, the layouts that build it, docs/optimizers.md)")
    v.add_argument("--steps", type=int, default=3, help="training steps per case (default 3)")
    v.add_argument("--micro-batch", type=int, default=2,
                   help="sequences per micro-batch (default 2)")
    v.add_argument("--seed", type=int, default=0, help="seed of the model and data (default 0)")
    v.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout, seconds (default 120)")
    v.add_argument("--collectives", default="native", metavar="native|ring|tree|auto",
                   help=COLLECTIVES_HELP)
    v.add_argument("--check-collectives", choices=("off", "step", "every"), default="step",
                   help="compare collective fingerprints across ranks at each step boundary "
                        "(step, the default), before each collective (every), or not (off)")
    v.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameter storage of every case (default fp32; bf16: against one "
                        "process with the same storage, docs/parity.md §7, a subset of layouts)")
    v.add_argument("--master-dtype", choices=("fp32", "none"), default="fp32",
                   help="with --param-dtype bf16: fp32 master weights (Megatron's recipe, the "
                        "default) or none (the guide's FSDP2 recipe)")
    v.add_argument("--offload", choices=("none", "optimizer", "params"), default="none",
                   help="offload to host memory of every case: the optimizer, or ZeRO-3's "
                        "parameter and gradient shards too (the torch engine: FSDP2's "
                        "CPUOffloadPolicy; default none)")
    v.add_argument("--json", metavar="PATH", nargs="?", const="verify.json",
                   help="write the results as JSON (default path verify.json)")
    v.set_defaults(func=cmd_verify)

    tr = sub.add_parser("trace", help="one step of a layout: every collective vs the formula",
                        description=DEFAULT_LAYOUT_RULE)
    add_config_flags(tr, defaults=TRACE_DEFAULTS)
    tr.add_argument("--rank", default="0", metavar="R|all",
                    help="the rank whose collectives are shown, or all (each in turn); default 0")
    tr.set_defaults(func=cmd_trace)

    le = sub.add_parser("learn", help="the learner's track: one short script per strategy on "
                        "the stacked MLP, every collective a torch.distributed call (README: "
                        "Learn)")
    le.add_argument("name", choices=LEARN, help="the script: src/shardwise/learn/NAME.py")
    le.add_argument("--nproc", type=int, default=0, help="ranks (default 2; fsdp_tp: 4)")
    le.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pp only")
    le.add_argument("--device", default="cpu", help="cpu (gloo) or an accelerator (cpu)")
    le.set_defaults(func=cmd_learn)

    from .tools.plan import add_plan_parser
    from .tools.report import add_report_parser

    add_plan_parser(sub)
    add_report_parser(sub)

    b = sub.add_parser("bench", help="step time of our engines vs PyTorch's, alternating: "
                       "--suite dp (vs DDP, overlap on/off), zero (vs FSDP2), tp (vs DTensor), "
                       "pp (bubble vs formula, vs torch pipelining), collectives (ring/tree "
                       "vs the backend's, nccl-tests style), zero-collectives (ZeRO-2/3, "
                       "--collectives ring vs native), checks (--check-collectives off/step/"
                       "every)")
    b.add_argument("--suite", choices=("dp", "zero", "tp", "pp", "collectives",
                                       "zero-collectives", "checks"), default="dp",
                   help="what to bench (default dp; see above)")
    b.add_argument("--max-mb", type=float, default=64.0, help="collectives suite: the largest "
                   "message, MiB (sizes 1 KiB × 4^k up to it)")
    b.add_argument("--nproc", type=int, default=0, help="ranks (default 2; pp: 4)")
    b.add_argument("--model", default="small", help="model preset (default small)")
    b.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    b.add_argument("--rounds", type=int, default=3, help="A B A B … rounds")
    b.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    b.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per micro-batch (default 8)")
    b.add_argument("--bucket-mb", type=float, default=1.0,
                   help="DP gradient bucket size, MiB (default 1)")
    b.add_argument("--schedule", default="1f1b", help="pp suite: schedule(s), comma-separated "
                   "or 'all'")
    b.add_argument("--microbatches", type=int, default=8, help="pp suite: m")
    b.add_argument("--n-layers", type=int, default=0, help="model layers (default: the "
                   "preset's; pp suite: 8)")
    b.add_argument("--bubble-only", action="store_true", help="pp suite: skip the torch engine")
    b.add_argument("--vocab", type=int, default=0, help="vocabulary size (default 4096; pp "
                   "suite: 256)")
    b.add_argument("--layout", action="append", default=[], metavar="LAYOUT",
                   help="bench this layout (verify's syntax, e.g. dp=2,tp=2,zero=3): explicit "
                   "vs torch engine, alternating; repeat, or use --layouts, for one table")
    b.add_argument("--layouts", nargs="+", default=[], metavar="LAYOUT",
                   help="several layouts at once (same as repeating --layout)")
    b.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="layout bench: compute dtype (bf16 autocast)")
    b.add_argument("--ac", default="none", choices=("none", "selective", "full"),
                   help="layout bench: activation checkpointing, passed to the model")
    b.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="layout bench: dtype of the dp gradient reduction")
    b.add_argument("--timeout", type=float, default=300.0, help="process-group timeout (s)")
    b.add_argument("--collectives", default="native", metavar="native|ring|tree|auto",
                   help=COLLECTIVES_HELP)
    b.add_argument("--out", default="benchmarks/results",
                   help="folder for the results (default benchmarks/results)")
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder of its "
                       "family (Llama, Mistral, Qwen2, Qwen3, GPT-2; an MoE model: Mixtral): "
                       "config.json, model.safetensors (above 2 GiB: 2 GiB files and "
                       "their index, written one at a time), tokenizer files")
    e.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run folder (its latest checkpoint), or a checkpoints/step_N folder")
    e.add_argument("--to", required=True, choices=("hf",), help="output format")
    e.add_argument("out", metavar="OUT", help="new folder to write")
    e.add_argument("--tokenizer", metavar="DIR|FILE.json", default=None,
                   help="ship this tokenizer instead of the run's own: a model folder (its "
                        "tokenizer files, chat template and generation_config.json, whole) or a "
                        "tokenizers .json file")
    e.set_defaults(func=cmd_export)

    d = sub.add_parser("doctor", help="diagnose a run that hung, desynced or lost a rank from "
                       "its flight records (RUN/flight)")
    d.add_argument("run", metavar="RUN", help="a run folder (or its flight folder)")
    d.add_argument("--last", type=int, default=8, help="collectives per rank to show")
    d.set_defaults(func=lambda args, argv: __import__(
        "shardwise.tools.doctor", fromlist=["main"]).main(args.run, args.last))
    return p


def _run_or_spawn(args, argv, nproc: int, work, device: str = "cpu") -> int:
    """Run ``work()`` here if inside a world (or nproc == 1); else spawn ``nproc`` ranks (forked
    from this process on CPU, ``device`` resolved as the workers will:
    :func:`shardwise.topology.resolve_device`; :func:`shardwise.launch.spawn`)."""
    if is_worker() or nproc == 1:
        return _as_worker(work)
    from .topology import resolve_device

    return spawn(argv, nproc, fork=resolve_device(device)[0] == "cpu")


def _as_worker(work) -> int:
    """Run a worker body; turn exceptions into a printed message and a non-zero status."""
    import torch.distributed as dist

    try:
        code = work() or 0
    except ShardwiseConfigError as e:
        code = report_config_error(e)
    except Exception as e:
        traceback.print_exc()
        sys.stderr.flush()
        record_for_torchelastic(e)
        code = 1
    if code and (dist.is_initialized() or os.environ.get("TORCHELASTIC_ERROR_FILE")):
        # exit now: do not wait on peers that may be gone (the launcher stops the rest); and
        # under torchelastic, right after the error file is written, so that the agent's first
        # observed failure (its summary's root cause) is a rank that failed, not one it stopped
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def report_config_error(e: ShardwiseConfigError) -> int:
    """A configuration error: its one line (``shardwise: error: …``) on stderr and in
    torchelastic's error file, no traceback; returns the exit status, 2.

    Under torchrun every rank usually meets the same error (the checks run on every rank before
    any collective), so only the first rank of the node to report a line prints it
    (:func:`_first_to_say`); a rank whose line differs prints its own. Each rank's error file
    holds its line, so torchrun's summary shows it as the root cause ("exitcode : 2"), and
    torchrun itself exits 1, as it does for any failed worker. Under our own launcher
    (``SHARDWISE_LAUNCHER=1``) every rank prints: the launcher shows the failed rank's last
    lines."""
    line = f"shardwise: error: {e}"
    if _first_to_say(line):
        print(line, file=sys.stderr, flush=True)
    record_for_torchelastic(e, line)
    return 2


def _first_to_say(line: str) -> bool:
    """Whether this rank prints ``line``: always, except under torchrun (an error file set and
    not our launcher), where the first rank of this node claims the line in a file beside the
    ranks' log folders (``<log dir>/<run>/attempt_N/shardwise_error_line``, created whole by a
    hard link: atomic) and a later rank with the same line stays quiet."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.environ.get("SHARDWISE_LAUNCHER") == "1":
        return True
    claim = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))),
                         "shardwise_error_line")
    mine = f"{claim}.{os.getpid()}"
    try:
        with open(mine, "w") as f:
            f.write(line)
        try:
            os.link(mine, claim)
            return True
        except FileExistsError:
            with open(claim) as f:
                return f.read() != line
        finally:
            os.unlink(mine)
    except OSError:  # no claim possible: better twice than never
        return True


def record_for_torchelastic(e: BaseException, line: str | None = None) -> None:
    """Write ``e`` to the error file torchelastic gave this rank (``TORCHELASTIC_ERROR_FILE``,
    set by torchrun and by our own launcher), in the format of torch's ``ErrorHandler`` (which
    ``@record`` uses), so that torchrun's failure summary shows it as the root cause instead of
    ``error_file: <N/A>``: a crash with the rank in the message and its traceback (call it
    inside the ``except`` block: the traceback is the one being handled); a configuration
    error (``line`` given) as that one line and no traceback (the summary prints the message
    where no ``py_callstack`` is recorded). No-op outside torchelastic."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    rank = os.environ.get("RANK", "?")
    info = {"timestamp": str(int(time.time()))}
    if line is None:
        info["py_callstack"] = traceback.format_exc()
    data = {"message": {"message": line or f"{type(e).__name__} on rank {rank}: {e}",
                        "extraInfo": info}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # never hide the failure itself behind ours
        pass


def cmd_train(args, argv) -> int:
    from .tools.report import recorded_since, train_with_report, write_run_report
    from .train.loop import default_out_dir

    cfg = from_args(args)
    if not is_worker():
        validate(cfg)  # fail fast, once, before spawning anything
        if cfg.init_from_hf:  # every HF weight finite: read once, here, not on every rank
            from .interop.hf_import import check_weights_finite

            check_weights_finite(cfg.init_from_hf)
        if cfg.world_size() > 1:
            from .train.workload import load_workload

            load_workload(cfg)  # build the tokenizer/token cache once; raises on bad data
            out = cfg.out or default_out_dir()
            t0 = time.time()
            from .topology import check_local_gpus, resolve_device

            check_local_gpus(cfg.device, cfg.world_size())  # on CUDA: one GPU per rank
            code = spawn([*argv, "--out", out], cfg.world_size(),
                         fork=resolve_device(cfg.device)[0] == "cpu",
                         max_restarts=cfg.max_restarts)
            if code and recorded_since(out, t0):  # rank 0 may have died before its report
                write_run_report(out, quiet=True)
            return code
    # rank 0 writes RUN/report.html at the end, and on a crash what the folder holds
    return _as_worker(lambda: train_with_report(cfg) and 0)


def cmd_verify(args, argv) -> int:
    from .parallel.layout import parse_layout
    from .tools.verify import verify_worker

    if args.nproc < 1:
        raise ShardwiseConfigError(f"--nproc {args.nproc} must be at least 1")
    check_timeout(args.timeout)
    from .comm.algorithms import check_collectives

    check_collectives(args.collectives)
    for s in args.layouts or []:
        lay = parse_layout(s)
        if lay.world > args.nproc:
            raise ShardwiseConfigError(f"layout {s} needs {lay.world} ranks but --nproc is "
                                       f"{args.nproc}: raise --nproc or drop the layout")
    return _run_or_spawn(args, argv, args.nproc, lambda: verify_worker(args))


def cmd_trace(args, argv) -> int:
    from .tools.trace import trace_worker

    cfg = from_args(args, **TRACE_DEFAULTS)
    if cfg.pp > 1:  # enough layers for every stage (and chunk), and batch for the microbatches
        import dataclasses

        from .parallel.pp.schedules import default_chunks

        v = cfg.virtual_stages or default_chunks(cfg.schedule)
        need = cfg.pp * v
        cfg = dataclasses.replace(
            cfg, n_layers=cfg.n_layers or max(need, cfg.model_layers()),
            global_batch=(cfg.global_batch if "global_batch" in vars(args)
                          else max(cfg.global_batch, cfg.dp * (cfg.microbatches or cfg.pp))))
    validate(cfg)
    world = cfg.world_size()
    if args.rank != "all" and not (args.rank.isdigit() and int(args.rank) < world):
        raise ShardwiseConfigError(f"--rank {args.rank}: this layout has ranks 0 … {world - 1}; "
                                   f"give one of them, or all")
    return _run_or_spawn(args, argv, world, lambda: trace_worker(cfg, args.rank), cfg.device)


def cmd_learn(args, argv) -> int:
    """``shardwise learn NAME``: run ``shardwise.learn.NAME.main`` on --nproc ranks."""
    import importlib

    nproc = args.nproc or (4 if args.name == "fsdp_tp" else 2)
    if nproc < 2:
        raise ShardwiseConfigError(f"--nproc {nproc}: a strategy needs at least 2 ranks")
    script = importlib.import_module(f"shardwise.learn.{args.name}")
    if not is_worker():
        script.check(nproc)  # a bad --nproc: one line, exit 2, before anything is spawned
    return _run_or_spawn(args, [*argv, "--nproc", str(nproc)], nproc, lambda: script.main(
        ["--device", args.device, "--schedule", args.schedule]), args.device)


def cmd_export(args, argv) -> int:
    """One process, no process group: read the checkpoint, write the HF folder."""
    from .interop.hf import export_hf

    from .readers import read_json

    out = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer)
    files = ", ".join(sorted(f.name for f in out.iterdir()))  # every file export_hf wrote
    arch = read_json(out / "config.json", "the exported config.json")["architectures"][0]
    print(f"shardwise export: {args.checkpoint} → {out} ({arch}: {files})")
    return 0


def cmd_bench(args, argv) -> int:
    args.layouts = [*args.layout, *args.layouts]
    check_timeout(args.timeout)
    if args.nproc < 0:
        raise ShardwiseConfigError(f"--nproc {args.nproc} must be ≥ 1 ranks (or 0, the default: "
                                   "2, 4 for --suite pp and collectives, or what --layout needs)")
    from .comm.algorithms import check_collectives

    check_collectives(args.collectives)
    if args.layouts:  # the generic layout bench (tools/bench/layouts.py); --suite is ignored
        from .tools.bench.layouts import bench_layouts_worker, check_layouts

        need = check_layouts(args.layouts)  # syntax errors before anything is spawned
        if args.nproc == 0:
            args.nproc = need
            argv = [*argv, "--nproc", str(need)]
        elif args.nproc < need:
            raise ShardwiseConfigError(f"--layout needs {need} ranks but --nproc is "
                                       f"{args.nproc}: raise --nproc or drop the layout")
        args.vocab = args.vocab or 4096
        return _run_or_spawn(args, argv, args.nproc, lambda: bench_layouts_worker(args),
                             getattr(args, "device", "cpu"))
    args.n_layers = args.n_layers or 8  # the suites' defaults
    args.vocab = args.vocab or 256
    if args.nproc == 0:
        args.nproc = 4 if args.suite in ("pp", "collectives") else 2
        argv = [*argv, "--nproc", str(args.nproc)]
    args.pp = args.nproc
    from .tools.bench.suites import SUITES

    worker = SUITES[args.suite]
    return _run_or_spawn(args, argv, args.nproc, lambda: worker(args),
                         getattr(args, "device", "cpu"))


def main(argv: list[str] | None = None) -> int:
    """The entry point. Under torchelastic (torchrun, or our launcher: ``TORCHELASTIC_ERROR_FILE``
    set) wrapped in its ``@record``, so an exception escaping it lands in the error file too
    (those inside a worker are written by :func:`record_for_torchelastic`); elsewhere torch's
    elastic package is not even imported."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    watch_launcher()  # a worker of our launcher dies with it (no-op elsewhere)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report against the subcommand's own usage (its flags), not the top level
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args, argv)
    except ShardwiseConfigError as e:
        return report_config_error(e)
