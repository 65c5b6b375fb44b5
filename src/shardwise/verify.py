"""``shardwise verify`` and ``shardwise trace``: parity with one process, and every collective.

verify: for each layout that fits the world (or ``--layouts``), each engine and each test model,
train a few AdamW steps (with gradient accumulation and clipping) and compare, at every step, the
loss, every parameter's gradient and every parameter with the single-process reference trained
on the same global batches from the same initialisation. Tolerances are those of
``torch.testing.assert_close`` for fp32 (rtol 1e-5, atol 1e-6). The ledger's gradient bytes are
compared with the formula too. Rank 0 prints the table; exit status 1 on any mismatch.

trace: one step of a layout; rank 0 prints every collective of the step (op, axis, shape, bytes
sent) and the total next to the formula.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from . import comm
from .config import TrainConfig
from .errors import ShardwiseConfigError
from .models import build_model
from .parallel.apply import parallelize
from .parallel.data import dp_grad_bytes_formula
from .topology import Topology
from .train.optim import build_optimizer, build_scheduler
from .train.step import Local, train_step
from .train.workload import RegressionWorkload, SyntheticLMWorkload

RTOL, ATOL = 1e-5, 1e-6
MODELS = ("tiny", "mlp-tiny")
ENGINES = ("explicit", "torch")


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def name(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        return ",".join(parts)


def parse_layout(text: str) -> Layout:
    """``"dp=2"`` or ``"dp=2,tp=1"`` → :class:`Layout`. Raises ShardwiseConfigError."""
    kw = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("dp", "tp", "pp", "zero") or not value.strip().isdigit():
            raise ShardwiseConfigError(f"--layouts {text!r}: write each layout as key=value "
                                       "pairs joined by commas, keys dp, tp, pp, zero (e.g. dp=2)")
        kw[key.strip()] = int(value)
    layout = Layout(**kw)
    if layout.tp > 1 or layout.pp > 1 or layout.zero:
        raise ShardwiseConfigError(f"--layouts {text}: this version verifies data parallelism "
                                   "only (dp=N)")
    return layout


def layouts_that_fit(nproc: int) -> list[Layout]:
    """Every layout implemented so far using at most ``nproc`` ranks (DP: dp = 1 … nproc)."""
    return [Layout(dp=d) for d in range(1, nproc + 1)]


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """(max |a − b|, whether every element satisfies |a − b| ≤ ATOL + RTOL·|b|)."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs()
    return float(diff.max()) if diff.numel() else 0.0, bool((diff <= ATOL + RTOL * b.abs()).all())


def _workload(model: str, seed: int):
    if model.startswith("mlp"):
        return RegressionWorkload(TrainConfig(model=model, seed=seed), num_train=256, num_val=32)
    return SyntheticLMWorkload(seed=seed)


def _make(model_name, work, cfg, wrap=Local):
    """Model (seeded init), its engine ``wrap(model)``, the engine's optimizer and schedule."""
    torch.manual_seed(cfg.seed)
    kw = {"tie_embeddings": cfg.tie_embeddings} if work.kind == "lm" else {}
    model = build_model(model_name, vocab_size=work.vocab_size, **kw)
    engine = wrap(model)
    opt = build_optimizer(engine, cfg)
    return model, engine, opt, build_scheduler(opt, cfg)


def reference_run(model_name, work, cfg, global_batch, micro_batch, steps):
    """Single process: per step (loss, {name: grad}, {name: param}) on the same global batches."""
    model, engine, opt, sched = _make(model_name, work, cfg)
    sampler = work.sampler(global_batch, 1, 0, cfg.seed)
    out = []
    for _ in range(steps):
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro_batch), opt,
                         max_norm=cfg.grad_clip, scheduler=sched, zero_grad=False)
        out.append((res.loss, res.grad_norm,
                    {n: p.grad.clone() for n, p in model.named_parameters()},
                    {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def run_case(model_name, work, layout, engine_name, topo, cfg, ref, micro_batch, steps) -> dict:
    """Train ``steps`` steps on ``topo`` and compare each with ``ref``; returns max diffs."""
    model, engine, opt, sched = _make(model_name, work, cfg,
                                      lambda m: parallelize(m, topo, engine=engine_name))
    global_batch = micro_batch * 2 * layout.dp  # two micro-steps per rank: accumulation
    sampler = work.sampler(global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "ok": True, "bytes_dev": 0.0}
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(steps):
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro_batch), opt,
                         topo, max_norm=cfg.grad_clip, scheduler=sched, zero_grad=False)
        loss_ref, _, grads_ref, params_ref = ref[step]
        d, ok = _compare(torch.tensor(res.loss), torch.tensor(loss_ref))
        worst["loss"], worst["ok"] = max(worst["loss"], d), worst["ok"] and ok
        for key, mine, theirs in (("grad", engine.named_full_gradients(), grads_ref),
                                  ("param", engine.named_full_parameters(), params_ref)):
            for name, t in mine.items():  # this rank's stage: every parameter, full shape
                d, ok = _compare(t, theirs[name])
                worst[key], worst["ok"] = max(worst[key], d), worst["ok"] and ok
        formula = dp_grad_bytes_formula(grad_bytes, layout.dp)
        if formula:  # every step, not just the last
            dev = abs(topo.ledger.step_bytes("grad") / formula - 1.0)
            worst["bytes_dev"] = max(worst["bytes_dev"], dev)
    return worst


def verify_worker(args) -> int:
    """Run every case on this rank; rank 0 prints the table and writes the JSON."""
    import torch.distributed as dist

    from .topology import init_distributed

    init_distributed("cpu", args.timeout)
    world = dist.get_world_size()
    layouts = ([parse_layout(s) for s in args.layouts] if args.layouts
               else layouts_that_fit(world))
    for lay in layouts:
        if lay.world > world:
            raise ShardwiseConfigError(f"layout {lay.name()} needs {lay.world} ranks but verify "
                                       f"runs {world}: raise --nproc or drop the layout")
    everyone = Topology(dp=world, timeout_s=args.timeout)
    # lr 3e-4: Adam divides each element by its own RMS, so for gradients near zero the
    # round-off of a different summation order (~1e-9) becomes a visible update; at this lr it
    # stays below atol. Gradients themselves are compared strictly at every step.
    cfg = TrainConfig(model="tiny", lr=3e-4, warmup_steps=1, steps=args.steps, grad_clip=0.5,
                      seed=args.seed)
    models = args.models.split(",")
    engines = ENGINES if args.engine == "both" else (args.engine,)
    rows = []
    for model_name in models:
        work = _workload(model_name, cfg.seed)
        refs = {}
        for lay in layouts:
            topo = Topology(lay.pp, lay.dp, lay.tp, ranks=range(lay.world),
                            timeout_s=args.timeout)
            for eng in engines:
                if topo.member:
                    key = lay.dp
                    if key not in refs:
                        refs[key] = reference_run(model_name, work, cfg, args.micro_batch * 2 *
                                                  lay.dp, args.micro_batch, args.steps)
                    r = run_case(model_name, work, lay, eng, topo, cfg, refs[key],
                                 args.micro_batch, args.steps)
                    vec = torch.tensor([r["loss"], r["grad"], r["param"], float(not r["ok"]),
                                        r["bytes_dev"]], dtype=torch.float64)
                else:
                    vec = torch.zeros(5, dtype=torch.float64)
                with everyone.ledger.phase("verify"):
                    comm.all_reduce(vec, everyone, "world", op="max")
                ratio_dev = float(vec[4])
                rows.append({"layout": lay.name(), "engine": eng, "model": model_name,
                             "max_loss_diff": float(vec[0]), "max_grad_diff": float(vec[1]),
                             "max_param_diff": float(vec[2]),
                             "ledger_vs_formula_max_deviation": ratio_dev,
                             "pass": bool(vec[3] == 0) and ratio_dev < 1e-9})
    ok = all(r["pass"] for r in rows)
    if dist.get_rank() == 0:
        print(format_table(rows, args.steps))
        print(f"verify: {sum(r['pass'] for r in rows)}/{len(rows)} passed "
              f"(rtol {RTOL:g}, atol {ATOL:g}, {args.steps} AdamW steps each)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rtol": RTOL, "atol": ATOL, "steps": args.steps, "cases": rows,
                           "pass": ok}, f, indent=2)
    sys.stdout.flush()
    # only rank 0 reports the verdict: a non-zero exit elsewhere would look like a crash
    return 0 if ok or dist.get_rank() != 0 else 1


def format_table(rows: list[dict], steps: int) -> str:
    head = (f"{'layout':<12} {'engine':<9} {'model':<9} {'max loss diff':>14} "
            f"{'max grad diff':>14} {'max param diff':>15} {'bytes/formula':>14}  pass")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layout']:<12} {r['engine']:<9} {r['model']:<9} "
                     f"{r['max_loss_diff']:>14.2e} {r['max_grad_diff']:>14.2e} "
                     f"{r['max_param_diff']:>15.2e} "
                     f"{1 + r['ledger_vs_formula_max_deviation']:>14.4f}  "
                     f"{'yes' if r['pass'] else 'NO'}")
    return "\n".join(lines)


def trace_worker(cfg: TrainConfig) -> int:
    """One training step of ``cfg``'s layout on synthetic data; rank 0 prints every collective."""
    import torch.distributed as dist

    from .config import validate
    from .topology import init_distributed

    validate(cfg, int(__import__("os").environ.get("WORLD_SIZE", "1")))
    init_distributed(cfg.device, cfg.timeout)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, device=cfg.device, timeout_s=cfg.timeout)
    work = (_workload(cfg.model, cfg.seed) if cfg.model.startswith("mlp")
            else SyntheticLMWorkload(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                     num_train=cfg.global_batch, num_val=1, seed=cfg.seed))
    model, engine, opt, sched = _make(
        cfg.model, work, cfg, lambda m: parallelize(m.to(topo.device), topo, engine=cfg.engine,
                                                    bucket_mb=cfg.bucket_mb, overlap=cfg.overlap))
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    train_step(engine, work.batches(sampler.next_local_batch(), cfg.micro_batch), opt, topo,
               max_norm=cfg.grad_clip, scheduler=sched)
    recs = topo.ledger.step_records()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n = topo.size("dp")
    formula = dp_grad_bytes_formula(grad_bytes, n)
    measured = sum(r.wire_bytes for r in recs if r.tag == "grad")
    if dist.get_rank() == 0:
        print(f"trace: one step of {cfg.model} ({sum(p.numel() for p in model.parameters()):,} "
              f"parameters, {grad_bytes:,} gradient bytes), {topo.describe()}, "
              f"engine={cfg.engine}")
        print(f"{'#':>3} {'op':<15} {'axis':<5} {'n':>2} {'tag':<5} {'dtype':<8} {'shape':<14} "
              f"{'S bytes':>12} {'sent bytes':>13} {'ms':>8}")
        for i, r in enumerate(recs):
            print(f"{i:>3} {r.op:<15} {r.axis:<5} {r.group_size:>2} {r.tag:<5} {r.dtype:<8} "
                  f"{str(list(r.shape)):<14} {r.size_bytes:>12,} {r.wire_bytes:>13,.1f} "
                  f"{r.seconds * 1e3:>8.2f}")
        other = sum(r.wire_bytes for r in recs if r.tag != "grad")
        print(f"gradient sync: ledger {measured:,.1f} bytes sent per rank; formula 2(n−1)/n × "
              f"{grad_bytes:,} = {formula:,.1f}; ratio "
              f"{measured / formula if formula else float('nan'):.4f}")
        print(f"loss bookkeeping (token count + loss, fp64 scalars): {other:,.1f} bytes")
    return 0
