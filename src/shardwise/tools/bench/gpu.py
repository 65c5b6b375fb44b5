"""The one-GPU benchmark behind ``benchmarks/gpu.sh``: correctness subset, tokens/s and MFU,
peak memory against the formula and the planner, in one call.

``python -m shardwise.tools.bench.gpu OUT [--cpu-dry-run] [--budget-s S]``

1. ``pytest -m gpu tests/test_gpu_path.py`` (a world of one rank on the device: NCCL process
   group, compiled vs eager, bf16 vs fp32 after 20 steps, explicit vs torch engine at dp = 1,
   fused vs for-loop AdamW); its summary goes into ``gpu.json`` under ``"tests"``.
2. For each model × ``--compile`` off/on × ``--ac none``/``selective`` (:data:`FULL`): one
   process, one device, the model built on the device from one seed, our explicit engine at
   dp = 1 (:func:`~shardwise.parallel.apply.parallelize`), AdamW (fused on CUDA), random
   tokens (:class:`~shardwise.train.workload.SyntheticLMWorkload`), ``warmup`` steps untimed
   (the compile happens there), then ``steps`` timed ones; tokens/s and MFU at the median
   step (MFU: :func:`shardwise.flops.step_flops` — 6·N + 12·L·d·s per token — over the
   datasheet's dense peak, 989 TFLOP/s bf16 for an H200: :func:`shardwise.flops.peak_flops`).
3. Peak memory over the timed steps (``max_memory_allocated``) against the model-state formula
   16Ψ (fp32 weights, gradients and AdamW moments, ZeRO paper §3.1) plus the explicit DP
   engine's gradient buckets (4Ψ: it keeps them at dp = 1 too) plus the planner's activation
   bytes (:func:`shardwise.train.device.activation_estimate`), and against the planner's whole
   per-GPU estimate (with ``grad_bucket_copy``).
4. The planner's prediction for the same run (:func:`shardwise.plan.cost.estimate`: one H200,
   dp = 1, the run's micro-batch, ``--ac``, precision "amp" — our bf16 autocast with fp32 master
   state): step time, tokens/s, MFU, memory, next to the measurement.

Writes ``OUT/gpu.json`` and ``OUT/gpu.md`` (the Markdown table), and prints the table.
``--cpu-dry-run``: the same code path on CPU with the tiny model (:data:`DRY`): fp32 (bf16
autocast on CPU is slow and not what is measured), a short sequence, two timed steps, gloo,
the gpu tests' CPU variants; no device memory exists there, so its fields are null.
A run that fails is recorded with its error and the others go on; runs left when the time
budget (``--budget-s``, default 390 s of the 8 minutes) is spent are recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]  # the checkout (src/shardwise/tools/bench/gpu.py)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one invocation measures: ``models`` as (preset, vocabulary, micro-batch,
    overrides), at ``seq_len`` in ``dtype``, each with ``compile`` × ``ac``; ``warmup`` untimed
    and ``steps`` timed optimizer steps per run; ``device`` "cuda" or "cpu"."""

    models: tuple
    seq_len: int
    dtype: str
    compile: tuple = (False, True)
    ac: tuple = ("none", "selective")
    warmup: int = 3
    steps: int = 6
    device: str = "cuda"


# H200: llama-1b (1.10 B, V 32,000; the target, so first) and small (3.95 M at V 4096) at seq
# 2048, bf16. Micro-batch: llama-1b 8 × 2048 = 16,384 tokens a step (fp32 state 17.7 GB + the
# planner's ~30 GB of activations without AC, within 141 GB; ~0.25 s a step at 50 % MFU);
# small 16 × 2048. Eight runs of 3 + 8 steps, four of them compiling (~1 min each, cold), fit
# the 8 minutes with the tests (~2 min).
FULL = Plan(models=(("llama-1b", 32000, 8, {"tie_embeddings": False}),
                    ("small", 4096, 16, {"max_seq_len": 2048})),
            seq_len=2048, dtype="bf16", warmup=3, steps=8)
# the shapes of tests/workers/gpu_cases.py (V 67, 4 × 32 tokens), so that inductor's graph cache
# can serve the dry run's compiles from the tests' (the dry run proves the path, not a speed)
DRY = Plan(models=(("tiny", 67, 4, {}),), seq_len=32, dtype="fp32", warmup=1, steps=2,
           device="cpu")


def run_tests(out: Path, device: str) -> dict:
    """``pytest -m gpu tests/test_gpu_path.py`` on ``device``: {"passed", "failed", "skipped",
    "returncode", "seconds", "tail", "cases"} (the JUnit XML is kept in ``out``). Where this
    Python has no pytest (the device is offline), :func:`run_tests_without_pytest`."""
    import importlib.util
    import xml.etree.ElementTree as ET

    if importlib.util.find_spec("pytest") is None:
        return run_tests_without_pytest(out, device)

    xml = out / "pytest_gpu.xml"
    env = {**os.environ, "SHARDWISE_GPU_TEST_DEVICE": device,
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:xdist",
                        "-p", "no:cacheprovider", f"--junitxml={xml}",
                        str(ROOT / "tests/test_gpu_path.py")], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = {"returncode": p.returncode, "seconds": time.perf_counter() - t0,
           "tail": p.stdout[-3000:], "passed": 0, "failed": 0, "skipped": 0, "cases": {},
           "runner": "pytest"}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            res["cases"][case.get("name")] = ("failed" if bad else
                                              "skipped" if skipped else "passed")
        for v in res["cases"].values():
            res[v] += 1
    return res


def run_tests_without_pytest(out: Path, device: str) -> dict:
    """The same tests without pytest: tests/test_gpu_path.py imported with a stand-in
    ``pytest`` module (marks and fixtures as plain decorators, ``parametrize`` expanded,
    ``importorskip``/``skip`` as a skip), each ``test_*`` called with the ``cases`` fixture's
    value and a fresh ``tmp_path``. Same result dict as :func:`run_tests`."""
    import importlib.util
    import tempfile
    import types

    class Skip(Exception):
        pass

    def importorskip(name):
        try:
            return __import__(name)
        except ImportError:
            raise Skip(f"no {name}") from None

    def skip(reason=""):
        raise Skip(reason)

    def parametrize(names, values):
        def deco(fn):
            fn._params = [v if isinstance(v, tuple) else (v,) for v in values]
            return fn
        return deco

    class Mark:
        def __getattr__(self, name):
            return parametrize if name == "parametrize" else (lambda *a, **k: (lambda f: f))

    shim = types.ModuleType("pytest")
    shim.mark, shim.importorskip, shim.skip = Mark(), importorskip, skip
    shim.fixture = lambda *a, **k: (lambda f: f)
    t0 = time.perf_counter()
    res = {"returncode": 0, "passed": 0, "failed": 0, "skipped": 0, "cases": {},
           "runner": "without pytest (tools/bench/gpu.py)", "tail": ""}
    os.environ["SHARDWISE_GPU_TEST_DEVICE"] = device
    saved = sys.modules.get("pytest")
    sys.modules["pytest"] = shim
    try:
        spec = importlib.util.spec_from_file_location("test_gpu_path",
                                                      ROOT / "tests/test_gpu_path.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        factory = types.SimpleNamespace(mktemp=lambda n: Path(tempfile.mkdtemp(n, dir=out)))
        try:
            cases = mod.cases(factory)
        except BaseException as e:  # the worker failed: every test that needs it fails
            cases, res["tail"] = None, f"cases: {type(e).__name__}: {e}"[-3000:]
        for name in sorted(n for n in dir(mod) if n.startswith("test_")):
            fn = getattr(mod, name)
            for params in getattr(fn, "_params", [()]):
                label = name + (f"[{'-'.join(map(str, params))}]" if params else "")
                argnames = fn.__code__.co_varnames[:fn.__code__.co_argcount]
                kw = {"tmp_path": Path(tempfile.mkdtemp("tmp", dir=out))}
                args = [cases if a == "cases" else kw[a] for a in argnames[:1]
                        if a in ("cases", "tmp_path")] + list(params)
                try:
                    if "cases" in argnames and cases is None:
                        raise RuntimeError("the cases worker failed")
                    fn(*args)
                    res["cases"][label] = "passed"
                except Skip:
                    res["cases"][label] = "skipped"
                except BaseException as e:
                    res["cases"][label] = "failed"
                    res["tail"] += f"\n{label}: {type(e).__name__}: {e}"[:1000]
    finally:
        if saved is None:
            sys.modules.pop("pytest", None)
        else:
            sys.modules["pytest"] = saved
    for v in res["cases"].values():
        res[v] += 1
    res["returncode"] = int(res["failed"] > 0)
    res["seconds"] = time.perf_counter() - t0
    return res


def planner_prediction(model_cfg, seq_len: int, micro_batch: int, ac: str, dtype: str,
                       compiled: bool) -> dict:
    """The planner's estimate of this one-GPU run on an H200 (module docstring, item 4)."""
    from ...plan.cost import estimate
    from ...plan.layout import Assumptions, PlanLayout
    from ...plan.hardware import get_cluster
    from ...plan.models import from_llama_config

    spec = from_llama_config(model_cfg, seq_len=seq_len, name="bench",
                             kernels="fused" if compiled else "eager")
    layout = PlanLayout(dp=1, micro_batch=micro_batch, ckpt=ac,
                        precision="amp" if dtype == "bf16" else "fp32")
    # our explicit DP engine keeps its gradient buckets even at dp = 1: a second copy of the
    # gradients (the planner's grad_bucket_copy)
    e = estimate(spec, get_cluster("h200", gpus_per_node=1), layout, micro_batch,
                 Assumptions(grad_bucket_copy=True))
    return {"gpu": "h200-sxm", "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu, "mem_bytes_per_gpu": e.mem_bytes_per_gpu}


def run_one(topo, plan: Plan, model: str, vocab: int, micro: int, overrides: dict,
            compiled: bool, ac: str) -> dict:
    """One configuration (module docstring, items 2-4); frees its model and optimizer."""
    from ...flops import mfu, peak_flops, step_flops
    from ...models import build_model, set_activation_checkpointing
    from ...models.compile import compile_blocks
    from ...parallel.apply import Layout, parallelize
    from ...parallel.dp.data_parallel import dp_memory_formula
    from ...train.device import accelerator_type, activation_estimate, attention_line
    from ...train.optim import adamw_impl_of, build_optimizer
    from ...train.step import train_step
    from ...train.workload import SyntheticLMWorkload
    from ...config import TrainConfig

    dev = topo.device
    kind = accelerator_type(dev)
    mod = getattr(torch, kind) if kind else None
    torch.compiler.reset()  # each run compiles for its own shapes (no dynamic-shape reuse)
    torch.manual_seed(0)
    with torch.device(dev):
        net = build_model(model, vocab_size=vocab, **overrides)
    model_cfg = net.config
    n_params = sum(p.numel() for p in net.parameters())
    set_activation_checkpointing(net, ac)
    engine = parallelize(net, topo, Layout())
    if compiled:
        compile_blocks(engine.module)
    cfg = TrainConfig(model=model, lr=3e-4, warmup_steps=1)
    opt = build_optimizer(engine, cfg)
    work = SyntheticLMWorkload(vocab_size=vocab, seq_len=plan.seq_len,
                               num_train=micro * (plan.warmup + plan.steps), num_val=1)
    sampler = work.sampler(micro, 1, 0, 0)
    flops = step_flops(model_cfg, micro, plan.seq_len)
    peak, peak_src = peak_flops(dev, plan.dtype)
    times, first = [], None
    for i in range(plan.warmup + plan.steps):
        if i == plan.warmup and mod is not None:  # the timed steps' peak only
            mod.synchronize()
            mod.reset_peak_memory_stats(dev)
        batch = work.batches(sampler.next_local_batch(), micro)
        if mod is not None:
            mod.synchronize()
        t0 = time.perf_counter()
        res = train_step(engine, batch, opt, topo, max_norm=1.0, dtype=plan.dtype)
        if mod is not None:
            mod.synchronize()  # (train_step's loss .item() syncs too)
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        if i >= plan.warmup:
            times.append(dt)
    med = statistics.median(times)
    from torch._dynamo.utils import counters  # graphs dynamo compiled in this run (reset above)

    graphs = int(counters["stats"].get("unique_graphs", 0))
    peak_alloc = mod.max_memory_allocated(dev) if mod else None
    reserved = mod.memory_reserved(dev) if mod else None
    state = dp_memory_formula(n_params)["total"]
    buckets = sum(b.buffer.numel() * b.buffer.element_size()
                  for b in getattr(getattr(engine, "grad_sync", engine), "buckets", []))  # explicit DP
    act = activation_estimate(model_cfg, micro_batch=micro, seq_len=plan.seq_len, ac=ac,
                              dtype=plan.dtype, compiled=compiled)
    pred = planner_prediction(model_cfg, plan.seq_len, micro, ac, plan.dtype, compiled)
    rec = {
        "model": model, "params": n_params, "vocab": vocab, "seq_len": plan.seq_len,
        "micro_batch": micro, "tokens_per_step": micro * plan.seq_len, "dtype": plan.dtype,
        "compile": compiled, "ac": ac, "warmup_steps": plan.warmup, "timed_steps": plan.steps,
        "first_step_s": first, "median_step_s": med, "step_times_s": times,
        "tokens_per_s": micro * plan.seq_len / med, "tflops": flops / med / 1e12,
        "mfu": mfu(flops, med, peak, 1), "peak_tflops": peak / 1e12, "peak_source": peak_src,
        "final_loss": res.loss, "compiled_graphs": graphs,
        "attention": (attention_line(model_cfg, device=dev, dtype=plan.dtype, micro_batch=micro,
                                     seq_len=plan.seq_len) or "").strip(),
        "adamw": adamw_impl_of(engine.module),
        "peak_allocated_bytes": peak_alloc, "reserved_bytes": reserved,
        "model_state_formula_bytes": state, "gradient_bucket_bytes": buckets,
        "activation_estimate_bytes": act,
        "formula_peak_bytes": state + buckets + act if act is not None else None,
        "planner": pred,
    }
    if peak_alloc:
        rec["peak_vs_formula"] = peak_alloc / rec["formula_peak_bytes"]
        rec["peak_vs_planner"] = peak_alloc / pred["mem_bytes_per_gpu"]
    del engine, opt, net
    if mod is not None:
        mod.empty_cache()
    return rec


def _gb(x) -> str | None:
    return None if x is None else f"{x / 1e9:.3g}"


COLUMNS = [
    ("model", "---", lambda r: r["model"]),
    ("compile", "---", lambda r: "yes" if r["compile"] else "no"),
    ("ac", "---", lambda r: r["ac"]),
    ("tokens/s", "---:", lambda r: f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else None),
    ("MFU", "---:", lambda r: f"{r['mfu']:.1%}" if "mfu" in r else r.get("status")),
    ("planner MFU", "---:", lambda r: f"{r['planner']['mfu']:.1%}" if "planner" in r else None),
    ("step (ms)", "---:", lambda r: f"{r['median_step_s'] * 1e3:.1f}"
     if "median_step_s" in r else None),
    ("planner step (ms)", "---:", lambda r: f"{r['planner']['step_time_s'] * 1e3:.3g}"
     if "planner" in r else None),
    ("first step (s)", "---:", lambda r: f"{r['first_step_s']:.1f}" if "first_step_s" in r
     else None),
    ("peak GB", "---:", lambda r: _gb(r.get("peak_allocated_bytes")) or "n/a"),
    ("formula GB", "---:", lambda r: _gb(r.get("formula_peak_bytes"))),
    ("planner GB", "---:", lambda r: _gb(r["planner"]["mem_bytes_per_gpu"])
     if "planner" in r else None),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.tools.bench.gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for gpu.json, gpu.md and the test report")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the same path on CPU with the tiny model (module docstring)")
    ap.add_argument("--budget-s", type=float, default=390.0,
                    help="start no run after this many seconds (default 390 of the 8 minutes: "
                    "a run takes ≤ ~70 s)")
    ap.add_argument("--skip-tests", action="store_true", help="measure only")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = DRY if args.cpu_dry_run else FULL
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu bench: no CUDA device visible to this torch; use --cpu-dry-run",
              file=sys.stderr)
        return 2
    os.environ.pop("WORLD_SIZE", None)  # a world of one in this process
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "python": platform.python_version(),
              "device": plan.device, "dry_run": args.cpu_dry_run,
              "device_name": (torch.cuda.get_device_name(0) if plan.device == "cuda"
                              else platform.processor() or platform.machine()),
              "plan": dataclasses.asdict(plan),
              "targets": {"model": "llama-1b", "mfu_eager": 0.40, "mfu_compile": 0.50,
                          "peak_within_planner": 0.10, "peak_tflops_bf16": 989.0}}
    if not args.skip_tests:
        report["tests"] = run_tests(out, plan.device)
        print(f"gpu tests: {report['tests']['passed']} passed, {report['tests']['failed']} "
              f"failed ({report['tests']['seconds']:.0f} s)", flush=True)
    from ...topology import Topology, init_distributed

    init_distributed(plan.device, 300)
    topo = Topology(1, 1, 1, device=plan.device, timeout_s=300)
    report["backend"] = torch.distributed.get_backend()
    runs = []
    for model, vocab, micro, over in plan.models:
        for ac in plan.ac:
            for compiled in plan.compile:
                key = {"model": model, "compile": compiled, "ac": ac}
                if time.perf_counter() - t_start > args.budget_s:
                    runs.append({**key, "status": "skipped (time budget)"})
                    continue
                t0 = time.perf_counter()
                try:
                    rec = run_one(topo, plan, model, vocab, micro, over, compiled, ac)
                    rec["status"] = "ok"
                except Exception as e:  # recorded; the other runs go on
                    rec = {**key, "status": f"error: {type(e).__name__}: {e}"[:300],
                           "traceback": traceback.format_exc()[-3000:]}
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                rec["wall_s"] = time.perf_counter() - t0
                runs.append(rec)
                print(f"  {model} compile={compiled} ac={ac}: {rec['status']}"
                      + (f", {rec['tokens_per_s']:,.0f} tok/s, MFU {rec['mfu']:.1%}"
                         if rec["status"] == "ok" else "")
                      + f" ({rec['wall_s']:.0f} s)", flush=True)
    report["runs"] = runs
    report["wall_s"] = time.perf_counter() - t_start
    from .harness import markdown_table

    what = ("CPU dry run: tiny model, not a measurement of a GPU" if args.cpu_dry_run
            else "one GPU")
    title = (f"GPU benchmark, {report['date']}, torch {report['torch']}, "
             f"{report['device_name']} ({what})")
    md = f"{title}\n\n{markdown_table(runs, COLUMNS)}\n"
    if "tests" in report:
        md += (f"\ncorrectness subset (pytest -m gpu): {report['tests']['passed']} passed, "
               f"{report['tests']['failed']} failed\n")
    (out / "gpu.md").write_text(md)
    (out / "gpu.json").write_text(json.dumps(report, indent=2, default=str))
    print(md, flush=True)
    torch.distributed.destroy_process_group()
    ok = all(r["status"] == "ok" for r in runs) and report.get("tests", {}).get("failed", 0) == 0
    return 0 if ok and report.get("tests", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
