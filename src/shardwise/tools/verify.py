"""``shardwise verify``: parity of every layout and engine with one process.

For each layout that fits the world (or ``--layouts``), each engine and each test model, train a
few AdamW steps (with gradient accumulation or pipeline microbatches, and clipping) and compare,
at every step, the loss, the gradient norm, every (gathered) gradient and every parameter with
the single-process reference of :mod:`shardwise.parity` (plain PyTorch, the same global batches
from the same initialisation), by that module's one rule: losses, norms and gradients within
rtol 1e-5 / atol 1e-6 of the reference evaluated at the run's own parameters, parameters within
the AdamW bound derived from the measured gradient errors; and the ledger's bytes with the
layout's formula. Rank 0 prints the table and the rule; exit status 1 on any mismatch. A case
that fails or hangs (a collective times out after ``--timeout`` s) fails on its own: the ranks
agree on each case's outcome through the rendezvous store (not the process groups, which a
timed-out collective leaves unusable), and after a failure every rank builds a fresh world (new
process groups under a new store prefix) before the next case.

``--param-dtype bf16 [--master-dtype fp32|none] [--offload optimizer]``: a subset of layouts
with that storage, each against one process with the same storage by docs/parity.md §7's rule
for it (bitwise, step 1 within §2's rule, or ledger only; :mod:`.verify_storage`), ledger =
formula with the offload copies; without these flags nothing changes.

The layout syntax (``dp=2,zero=3`` …) is :func:`shardwise.parallel.apply.parse_layout`'s.
``shardwise trace`` (one step's collectives) is :mod:`shardwise.tools.trace`; it builds its run
with :func:`verify_workload` and :func:`build_case` from here.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from .. import comm, parity, parity_muon
from ..config import TrainConfig
from ..errors import ShardwiseConfigError
from ..formulas import step_bytes_formula
from ..models import build_model
from ..parallel.apply import parallelize
from ..parallel.layout import Layout, parse_layout
from ..parallel.model import Local
from ..parallel.pp.schedules import min_microbatches
from ..topology import Topology
from ..train.optim import build_optimizer, build_scheduler, lr_multiplier
from ..train.step import train_step
from ..train.workload import RegressionWorkload, SyntheticLMWorkload
from .verify_layouts import layouts_that_fit, step_traffic, storage_layouts
from .verify_storage import RULE as STORAGE_RULE
from .verify_storage import (micro_batches, run_storage_case, storage_applies, storage_of,
                             storage_row)

RTOL, ATOL = parity.RTOL, parity.ATOL
MODELS = ("tiny", "mlp-tiny")
ENGINES = ("explicit", "torch")

# The verify models: the `tiny` Llama widened to 8 heads / 4 kv heads (tp ∈ {2, 4}), vocab 67 (no
# small degree divides it); `mlp-tiny` with d_ff 33 (flat shards need padding); `moe-tiny` as
# `tiny` with 8 experts (ep ≤ 8); each as deep as its layout needs (:func:`layers_for`).
MODEL_OVERRIDES = {"tiny": dict(n_heads=8, n_kv_heads=4), "mlp-tiny": dict(d_ff=33),
                   "moe-tiny": dict(n_heads=8, n_kv_heads=4, n_experts=8)}
# tp > 1 splits the MLP's hidden units: d_ff 36 (tp ∈ {2, 4} divide it; a tp shard's 610 or 313
# elements per block still need padding over dp)
MLP_TP_OVERRIDES = {"d_ff": 36}


def overrides_for(model: str, layout: Layout) -> dict:
    """The model overrides of a verify case: :data:`MODEL_OVERRIDES`, the MLP's TP width
    (:data:`MLP_TP_OVERRIDES`) when tp > 1, and :func:`layers_for` the layout."""
    ov = dict(MODEL_OVERRIDES.get(model, {}))
    if model.startswith("mlp") and layout.tp > 1:
        ov |= MLP_TP_OVERRIDES
    return ov | {"n_layers": layers_for(layout)}


# Two blocks: ZeRO has several units and a block boundary to cross, and activation checkpointing
# and the pipeline's stage split something to split; more blocks repeat the same code (4 → 2
# cut verify's CPU time by a third, issue 34).
MIN_LAYERS = 2


def layers_for(layout: Layout) -> int:
    """Layers of verify's test models under ``layout``: :data:`MIN_LAYERS`, or one per pipeline
    stage where there are more (pp × virtual stages: pp = 4 with interleaved 1F1B needs 8). Each
    layout runs the smallest model that still gives every stage (and every chunk) blocks of its
    own; the reference is built with the same depth."""
    if layout.pp == 1:
        return MIN_LAYERS
    v = layout.chunks
    return max(MIN_LAYERS, layout.pp * v)


def applies(layout: Layout, model: str, engine: str = "explicit",
            optimizer: str = "adamw", storage=None) -> bool:
    """TP splits attention heads and CP sequences: Llama models only. CP runs on the explicit
    engine only on CPU (PyTorch's ``context_parallel`` has no CPU kernel: validate_cp). EP
    needs a mixture-of-experts model and the explicit engine; an MoE model is refused with SP
    and CP (:func:`~shardwise.parallel.ep.validate_ep`). Muon: the layouts
    :func:`~shardwise.config.checks.check_optimizer` accepts. A pipeline's ZeRO-2/3 and HSDP:
    where :meth:`~shardwise.parallel.layout.Layout.check` accepts them for ``engine`` (the
    explicit engine; not the torch engine's pipeline). ``storage`` (precision, offload) other
    than fp32 without offload: where :func:`~shardwise.parallel.storage.check_storage` accepts
    it (:mod:`.verify_storage`)."""
    from ..config.checks import check_optimizer

    try:
        check_optimizer(optimizer, engine=engine, tp=layout.tp, pp=layout.pp, zero=layout.zero)
        if layout.pp > 1 and (layout.zero >= 2 or layout.dp_replicate > 1):
            layout.check(engine=engine)
    except ShardwiseConfigError:
        return False
    if storage is not None and not storage_applies(layout, engine, storage):
        return False
    moe = model.startswith("moe")
    if (layout.cp > 1 or layout.ep > 1) and engine != "explicit":
        return False
    if layout.ep > 1 and not moe or moe and (layout.sp or layout.cp > 1):
        return False
    if moe and engine != "explicit" and (layout.tp > 1 or layout.pp > 1):
        return False
    # the MLP: TP on whole models without SP (validate_tp); no sequence for CP
    return not (model.startswith("mlp") and (layout.cp > 1 or layout.tp > 1 and
                                             (layout.sp or layout.pp > 1)))


CP_SEQ_LEN = 64  # verify's sequences under cp: 2·cp chunks of ≥ 8 tokens for cp ≤ 4


def verify_workload(model: str, seed: int, overrides: dict | None = None,
                    seq_len: int = 16):
    """The data of a verify case: the synthetic regression task (256 training rows) for
    ``mlp*`` models, else random token sequences of ``seq_len`` tokens
    (:class:`SyntheticLMWorkload`; :data:`CP_SEQ_LEN` for cp layouts)."""
    if model.startswith("mlp"):
        return RegressionWorkload(TrainConfig(model=model, seed=seed), num_train=256, num_val=32,
                                  overrides=overrides)
    return SyntheticLMWorkload(seed=seed, seq_len=seq_len)


def _build(model_name, work, cfg, overrides: dict | None = None):
    """The test model with its seeded initialisation (the run's and the reference's)."""
    torch.manual_seed(cfg.seed)
    kw = {"tie_embeddings": cfg.tie_embeddings} if work.kind == "lm" else {}
    return build_model(model_name, vocab_size=work.vocab_size, **kw, **(overrides or {}))


def build_case(model_name, work, cfg, wrap=Local, overrides: dict | None = None):
    """Model (seeded init), its engine ``wrap(model)``, the engine's optimizer and schedule."""
    model = _build(model_name, work, cfg, overrides)
    engine = wrap(model)
    opt = build_optimizer(engine, cfg)
    return model, engine, opt, build_scheduler(opt, cfg)


def reference_run(model_name, work, cfg, global_batch, steps, overrides=None) -> dict:
    """The single-process reference of :func:`shardwise.parity.reference_run` (plain PyTorch;
    ``cfg.optimizer == "muon"``: :func:`shardwise.parity_muon.reference_run_muon`) on the same
    global batches, learning rates and clip as the runs."""
    sampler = work.sampler(global_batch, 1, 0, cfg.seed)
    batches = [work.batches(sampler.next_local_batch(), global_batch)[0] for _ in range(steps)]
    lrs = [cfg.lr * lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
           for s in range(steps)]
    run = (parity_muon.reference_run_muon if cfg.optimizer == "muon" else parity.reference_run)
    return run(_build(model_name, work, cfg, overrides), batches, lrs=lrs,
                                weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                                eps=1e-8, max_norm=cfg.grad_clip)


def _whole_model(params: dict, ref_params: dict, topo: Topology) -> dict:
    """Every parameter of the model from each pipeline stage's ``params`` (full shape over dp
    and tp): the sum over pp of each stage's values at their place, divided by the number of
    stages that hold the name. Shapes and order come from ``ref_params``. Booked under phase
    "verify", outside the step's bytes."""
    like = next(iter(params.values()))
    names = list(ref_params)
    held = torch.tensor([float(n in params) for n in names], dtype=like.dtype)
    flat = torch.cat([params[n].detach().reshape(-1) if n in params
                      else like.new_zeros(ref_params[n].numel()) for n in names] + [held])
    with topo.ledger.phase("verify"):
        comm.all_reduce(flat, topo, "pp")
    counts = flat[-len(names):]
    values = flat[:-len(names)].split([ref_params[n].numel() for n in names])
    return {n: (v / counts[i]).reshape(ref_params[n].shape)
            for i, (n, v) in enumerate(zip(names, values))}


def run_case(model_name, work, layout, engine_name, topo, cfg, ref, micro_batch, n_micro,
             steps, overrides=None) -> tuple[parity.ParityReport, float, dict]:
    """Train ``steps`` steps of ``layout`` on ``topo`` and compare them with ``ref`` by
    :func:`shardwise.parity.compare` (loss, grad norm, every gathered gradient and parameter
    this rank's stage holds), and the ledger's bytes against
    :func:`shardwise.formulas.step_bytes_formula`. Returns (the report, the ledger's worst
    |measured / formula − 1| over the steps, this rank's traffic: :func:`step_traffic` of the
    last step and the losses of every step)."""
    model, engine, opt, sched = build_case(
        model_name, work, cfg, lambda m: parallelize(m, topo, layout, engine=engine_name,
                                                     seed=cfg.seed), overrides=overrides)
    global_batch = micro_batch * n_micro * layout.dp
    sampler = work.sampler(global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    bytes_dev = 0.0
    mine = {"loss": [], "grad_norm": [], "grads": [], "params": [], "params_full": []}
    seq_len = work.data.train.shape[1] - 1 if work.kind == "lm" else 1
    for step in range(steps):
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro_batch), opt,
                         topo, max_norm=cfg.grad_clip, scheduler=sched, zero_grad=False)
        formula = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                     sequences=global_batch // layout.dp, seq_len=seq_len)
        measured = topo.ledger.step_bytes()
        if formula["total"] or measured:  # every step, not just the last
            bytes_dev = max(bytes_dev, abs(measured / formula["total"] - 1.0)
                            if formula["total"] else 1.0)
        # this rank's stage, full shape over dp and tp; copies (some engines return the live
        # tensors, which the next steps change)
        params = {n: t.detach().clone() for n, t in engine.named_full_parameters().items()}
        mine["loss"].append(res.loss)
        mine["grad_norm"].append(res.grad_norm)
        mine["grads"].append({n: g.detach().clone()
                              for n, g in engine.named_full_gradients().items()})
        mine["params"].append(params)
        mine["params_full"].append(_whole_model(params, ref["params"][0], topo)
                                   if layout.pp > 1 else params)
    traffic = {"bytes": step_traffic(topo.ledger), "losses": [float(x) for x in mine["loss"]]}
    return parity.compare(mine, ref, all_names=layout.pp == 1), bytes_dev, traffic


def _collect_traffic(store, key: str, traffic: dict, world: int, timeout_s: float) -> dict:
    """Every rank's :func:`run_case` traffic of one case, through the rendezvous ``store`` (not
    a collective: ``comm`` stays the only place collectives are issued). Each rank sets
    ``key/<rank>``; rank 0 returns {"losses": its own, "bytes": summed over the ranks}; the
    others return {}. Every rank calls it, a failed one with {} (rank 0 waits up to
    ``timeout_s`` + 60 s, as :func:`_agree`: a rank stuck in a collective gets here once its own
    timeout fires)."""
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()
    store.set(f"{key}/{rank}", json.dumps(traffic))
    if rank != 0:
        return {}
    store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s + 60))
    total: dict[str, float] = {}
    for r in range(world):
        for k, b in json.loads(store.get(f"{key}/{r}")).get("bytes", {}).items():
            total[k] = total.get(k, 0.0) + b
    return {"losses": traffic.get("losses", []), "bytes": dict(sorted(total.items()))}


def _agree(store, key: str, error: str, world: int, timeout_s: float) -> list[str]:
    """Every rank's outcome of one case, through the rendezvous ``store`` (not a process group:
    after a timed-out collective the groups are unusable). This rank sets ``key/<rank>`` to
    ``error`` ("" when it passed); all ranks wait for all keys (up to ``timeout_s`` + 60 s: a
    rank stuck in a collective reports once its own timeout fires). Returns the non-empty
    errors as "rank r: …"."""
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()
    store.set(f"{key}/{rank}", error or "ok")
    keys = [f"{key}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s + 60))
    out = []
    for r, k in enumerate(keys):
        v = store.get(k).decode(errors="replace")
        if v != "ok":
            out.append(f"rank {r}: {v}")
    return out


def _fresh_world(store, attempt: int, timeout_s: float) -> None:
    """Replace the default process group (and with it every subgroup) by a new one whose keys
    live under ``verify/world<attempt>/`` of ``store``. Collective over the world."""
    import datetime

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"verify/world{attempt}/", store),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _test_hang(name: str, timeout_s: float) -> None:
    """Test hook: ``SHARDWISE_TEST_HANG_CASE="<layout> <engine> <model>"`` makes rank 0 of that
    case sleep past the timeout and then fail, as a rank stuck in a hung collective would."""
    import torch.distributed as dist

    if os.environ.get("SHARDWISE_TEST_HANG_CASE") == name and dist.get_rank() == 0:
        time.sleep(timeout_s + 2)
        raise RuntimeError(f"test hook: rank 0 hung in {name} for {timeout_s + 2:g} s")


def verify_worker(args) -> int:
    """Run every case on this rank; rank 0 prints the table and writes the JSON."""
    import torch.distributed as dist

    from ..topology import init_distributed

    init_distributed("cpu", args.timeout)
    world = dist.get_world_size()
    storage = storage_of(args)  # --param-dtype / --master-dtype / --offload: .verify_storage
    layouts = list(dict.fromkeys([parse_layout(s) for s in args.layouts] if args.layouts
                                 else storage_layouts(world) if storage
                                 else layouts_that_fit(world, args.bounded)))  # each once
    for lay in layouts:
        if lay.world > world:
            raise ShardwiseConfigError(f"layout {lay.name()} needs {lay.world} ranks but verify "
                                       f"runs {world}: raise --nproc or drop the layout")
    checks = getattr(args, "check_collectives", "step")  # --check-collectives
    everyone = Topology(dp=world, timeout_s=args.timeout, check_collectives=checks)
    store = dist.distributed_c10d._get_default_store()  # outlives a rebuilt world (a reference)
    n_case, attempt = 0, 0
    # lr 3e-4: Adam divides each element by its own RMS, so for gradients near zero the
    # round-off of a different summation order (~1e-9) becomes a visible update; at this lr it
    # stays below atol. Gradients themselves are compared strictly at every step.
    optimizer = getattr(args, "optimizer", "adamw")  # --optimizer
    cfg = TrainConfig(model="tiny", lr=3e-4, warmup_steps=1, steps=args.steps, grad_clip=0.5,
                      seed=args.seed, optimizer=optimizer)
    engines = ENGINES if args.engine == "both" else (args.engine,)
    if optimizer != "adamw" and dist.get_rank() == 0:  # say which cases the optimizer skips
        from ..config.checks import check_optimizer

        for lay in layouts:
            for eng in engines:
                try:
                    check_optimizer(optimizer, engine=eng, tp=lay.tp, pp=lay.pp, zero=lay.zero)
                except ShardwiseConfigError as e:
                    print(f"verify: {lay.name()} {eng}: not run: {e}", flush=True)
    rows = []
    worst_bound = (0.0, "")
    topos: dict[tuple[int, int, int, int], Topology] = {}
    for model_name in args.models.split(","):
        works, refs = {}, {}
        for lay in layouts:
            if not any(applies(lay, model_name, eng, optimizer, storage) for eng in engines):
                continue
            ov = overrides_for(model_name, lay)
            width = {k: v for k, v in ov.items() if k != "n_layers"}  # the data's model
            wkey = (lay.cp > 1, tuple(sorted(width.items())))
            if wkey not in works:
                works[wkey] = verify_workload(model_name, cfg.seed, width,
                                              *([CP_SEQ_LEN] if lay.cp > 1 else []))
            work = works[wkey]
            shape = (lay.pp, lay.dp, lay.tp, lay.cp, lay.ep, lay.dp_replicate)
            if shape not in topos:  # process groups are created once per grid shape
                topos[shape] = Topology(*shape[:3], cp=lay.cp, ep=lay.ep,
                                        dp_replicate=lay.dp_replicate,
                                        ranks=range(lay.world),
                                        timeout_s=args.timeout, collectives=args.collectives,
                                        check_collectives=checks)
            topo = topos[shape]
            # micro-batches per rank: the pipeline's m, else two (gradient accumulation)
            n_micro = lay.microbatches or (min_microbatches(lay.schedule, lay.pp)
                                           if lay.pp > 1 else 2)
            n_micro = micro_batches(lay, n_micro) if storage else n_micro
            global_batch = args.micro_batch * n_micro * lay.dp
            for eng in engines:
                if not applies(lay, model_name, eng, optimizer, storage):
                    continue
                t0 = time.perf_counter()
                name, error = f"{lay.name()} {eng} {model_name}", ""
                vec = torch.zeros(10, dtype=torch.float64)
                traffic: dict = {}
                r = None
                if topo.member:
                    try:
                        if storage:  # bf16 storage / offload: .verify_storage's rules
                            vec, traffic, _ = run_storage_case(
                                lambda wrap: build_case(model_name, work, cfg, wrap, ov), work,
                                lay, eng, topo, cfg, args.micro_batch, n_micro, args.steps,
                                storage, model_name)
                        else:
                            key = (ov["n_layers"], global_batch, wkey)
                            if key not in refs:
                                refs[key] = reference_run(model_name, work, cfg, global_batch,
                                                          args.steps, ov)
                            _test_hang(name, args.timeout)
                            r, bytes_dev, traffic = run_case(model_name, work, lay, eng, topo,
                                                             cfg, refs[key], args.micro_batch,
                                                             n_micro, args.steps, ov)
                    except Exception as e:  # noqa: BLE001 - the case fails, the others run
                        error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    if r is not None:
                        for line in r.failures[:3]:  # what failed, from the rank that saw it
                            print(f"verify: {name}: {line}", flush=True)
                        if r.max_param_bound > worst_bound[0]:
                            worst_bound = (r.max_param_bound, f"{name}: {r.worst_param}")
                        vec = torch.tensor([r.max_loss_diff, r.max_grad_diff,
                                            r.max_param_diff, float(not r.ok), bytes_dev,
                                            r.param_bound_ratio, r.max_norm_diff,
                                            r.max_param_bound, r.tol_ratio, r.drift_ratio],
                                           dtype=torch.float64)
                n_case += 1
                traffic = _collect_traffic(store, f"verify/case{n_case}/traffic", traffic,
                                           world, args.timeout)
                errors = _agree(store, f"verify/case{n_case}", error, world, args.timeout)
                if errors:  # this case failed on its own; the next one gets a fresh world
                    if dist.get_rank() == 0:
                        print(f"verify: {name}: FAILED: {errors[0]}"
                              + (f" (and {len(errors) - 1} more rank(s))"
                                 if len(errors) > 1 else ""), flush=True)
                    attempt += 1
                    _fresh_world(store, attempt, args.timeout)
                    topos.clear()
                    everyone = Topology(dp=world, timeout_s=args.timeout,
                                        check_collectives=checks)
                    topo = topos[shape] = Topology(*shape[:3], cp=lay.cp, ep=lay.ep,
                                                   dp_replicate=lay.dp_replicate,
                                                   ranks=range(lay.world),
                                                   timeout_s=args.timeout,
                                                   collectives=args.collectives,
                                                   check_collectives=checks)
                    nan = float("nan")
                    rows.append({"layout": lay.name(), "engine": eng, "model": model_name,
                                 "max_loss_diff": nan, "max_grad_diff": nan,
                                 "max_grad_norm_diff": nan, "diff_over_tolerance": nan,
                                 "max_param_diff": nan, "param_diff_over_bound": nan,
                                 "max_adamw_bound": nan, "loss_drift_over_bound": nan,
                                 "ledger_vs_formula_max_deviation": nan,
                                 "seconds": time.perf_counter() - t0, "pass": False,
                                 "error": errors[0]})
                    continue
                with everyone.ledger.phase("verify"):
                    comm.all_reduce(vec, everyone, "world", op="max")
                ratio_dev = float(vec[4])
                rows.append(storage_row(lay, storage, {
                             "layout": lay.name(), "engine": eng, "model": model_name,
                             "max_loss_diff": float(vec[0]), "max_grad_diff": float(vec[1]),
                             "max_grad_norm_diff": float(vec[6]),
                             "diff_over_tolerance": float(vec[8]),
                             "max_param_diff": float(vec[2]),
                             "param_diff_over_bound": float(vec[5]),
                             "max_adamw_bound": float(vec[7]),
                             "loss_drift_over_bound": float(vec[9]),
                             "ledger_vs_formula_max_deviation": ratio_dev,
                             "seconds": time.perf_counter() - t0,
                             "pass": bool(vec[3] == 0) and ratio_dev < 1e-9,
                             # rank 0's losses; last step's wire bytes summed over the ranks
                             "losses": traffic.get("losses", []),
                             "bytes_per_tag": traffic.get("bytes", {})}))
    ok = all(r["pass"] for r in rows)
    if dist.get_rank() == 0:
        print(format_table(rows, args.steps))
        rule = (STORAGE_RULE if storage else parity_muon.RULE if optimizer == "muon"
                else parity.RULE)
        print(f"rule: {rule}")
        if worst_bound[1]:
            print(f"largest AdamW term of a parameter bound (rank 0): {worst_bound[0]:.3g}, "
                  f"{worst_bound[1]}")
        print(f"verify: {sum(r['pass'] for r in rows)}/{len(rows)} passed "
              f"(rtol {RTOL:g}, atol {ATOL:g}, {args.steps} "
              f"{'Muon' if optimizer == 'muon' else 'AdamW'} steps each, "
              f"--collectives {args.collectives})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rtol": RTOL, "atol": ATOL, "optimizer": optimizer,
                           "rule": rule, **({"storage": {
                               "param_dtype": storage[0].param_dtype,
                               "master_dtype": storage[0].master_dtype or "none",
                               "offload": storage[1]}} if storage else {}),
                           "steps": args.steps, "collectives": args.collectives,
                           "cases": rows, "pass": ok}, f, indent=2)
    sys.stdout.flush()
    # only rank 0 reports the verdict: a non-zero exit elsewhere would look like a crash
    return 0 if ok or dist.get_rank() != 0 else 1


def format_table(rows: list[dict], steps: int) -> str:
    w = max([28] + [len(r["layout"]) + 1 for r in rows])
    head = (f"{'layout':<{w}} {'engine':<9} {'model':<9} {'max loss diff':>14} "
            f"{'max grad diff':>14} {'diff/tol':>9} {'max param diff':>15} {'param/bound':>12} "
            f"{'bytes/formula':>14}  pass" + ("   rule" if any("rule" in r for r in rows) else ""))
    # diff/tol: the largest |Δ| / (atol + rtol·|ref|) over losses, norms and gradients;
    # param/bound: the largest |Δp| / (atol + rtol·|p| + AdamW bound); both ≤ 1 pass
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layout']:<{w}} {r['engine']:<9} {r['model']:<9} "
                     f"{r['max_loss_diff']:>14.2e} {r['max_grad_diff']:>14.2e} "
                     f"{r['diff_over_tolerance']:>9.3f} {r['max_param_diff']:>15.2e} "
                     f"{r['param_diff_over_bound']:>12.3f} "
                     f"{1 + r['ledger_vs_formula_max_deviation']:>14.4f}  "
                     f"{'yes' if r['pass'] else 'NO'}" + (f"   {r['rule']}" if "rule" in r else ""))
    return "\n".join(lines)
