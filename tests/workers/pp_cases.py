"""Worker for tests/test_pipeline_parity.py: every pipeline case in one spawned 4-rank world.

Cases: pp ∈ {2, 4} × schedule ∈ {gpipe, 1f1b, interleaved-1f1b, zb-h1} × m ∈ {pp, 2·pp, an odd
m ≥ pp} × engine ∈ {explicit, torch}, on an 8-layer tiny Llama with tied embeddings, 3 AdamW
steps with clipping; the V schedules (zbv, dualpipev) at pp ∈ {2, 4} with V_MS's m, both
engines; plus pp=2 × dp=2 (explicit 1f1b, torch zb-h1, explicit zbv, torch dualpipev), an
untied model (also under zbv), an explicit layers-per-stage split, and the stacked MLP
(mlp-tiny, pp=2, both engines; zbv explicit). Each member rank writes ``<out>/<case>_rank<r>.pt`` with the loss, grad
norm, this stage's gradients (plain-model names) of every step, the final parameters, the
ledger's bytes per tag, and the peak number of microbatches holding activations. One traced
step of pp=4 1f1b m=8 is written as a PNG + Chrome trace (``trace_pipeline``).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.tools.trace import trace_pipeline
from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import RegressionWorkload, SyntheticLMWorkload

STEPS, MICRO, MAX_NORM, LR, N_LAYERS = 3, 2, 0.3, 3e-4, 8
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
ODD_M = {2: 3, 4: 5}
# the V schedules' m: zbv below 2p−1 (part of the order dropped) and from it; dualpipev ≥ 2p
V_MS = {("zbv", 2): (2, 3), ("zbv", 4): (4, 8), ("dualpipev", 2): (4, 5),
        ("dualpipev", 4): (8,)}
EVAL_ROWS = 4  # evaluation batch: the first 4 training rows


def case_name(pp, dp, schedule, m, engine, extra=""):
    return f"pp{pp}_dp{dp}_{schedule}_m{m}_{engine}{extra}"


def cases():
    """(pp, dp, schedule, m, engine, model overrides, layers_per_stage)."""
    out = []
    for pp in (2, 4):
        for schedule in SCHEDULES:
            for m in (pp, 2 * pp, ODD_M[pp]):
                for engine in ("explicit", "torch"):
                    out.append((pp, 1, schedule, m, engine, {}, None))
    for (schedule, pp), ms in V_MS.items():
        for m in ms:
            for engine in ("explicit", "torch"):
                out.append((pp, 1, schedule, m, engine, {}, None))
    out.append((2, 2, "1f1b", 2, "explicit", {}, None))
    out.append((2, 2, "zb-h1", 3, "torch", {}, None))
    out.append((2, 2, "zbv", 3, "explicit", {}, None))
    out.append((2, 2, "dualpipev", 4, "torch", {}, None))
    out.append((2, 1, "zb-h1", 3, "explicit", {"tie_embeddings": False}, None))
    out.append((2, 1, "zbv", 2, "explicit", {"tie_embeddings": False}, None))
    out.append((4, 1, "1f1b", 4, "explicit", {}, [3, 2, 2, 1]))
    for engine in ("explicit", "torch"):
        out.append((2, 1, "1f1b", 2, engine, {"model": "mlp-tiny"}, None))
    out.append((2, 1, "zbv", 2, "explicit", {"model": "mlp-tiny"}, None))
    # every rank seeds its own model (seed = rank): the stages must still start as pp index 0's
    out.append((4, 1, "1f1b", 4, "explicit", {"seed": "rank"}, None))
    out.append((2, 1, "zb-h1", 2, "torch", {"seed": "rank"}, None))
    return out


def is_slow(case) -> bool:
    """``make test-slow``'s cases (run by a world whose output folder's name has "slow"). ``make
    test`` keeps, for the explicit engine (whose activation counts and ledger bytes are checked
    at each m), every schedule at each kind of m: at pp=4 m = pp and the odd m (and the V
    schedules' m's), at pp=2 m = 2·pp (but zbv, whose pp=2 m's run in the kept extra cases: dp=2
    at m=3, untied and mlp-tiny at m=2); for the torch engine, every schedule at pp=4 at one m
    (the first of V_MS's for the V schedules, else 2·pp). The torch engine's pp=2 runs in the
    kept extras (dp=2 zb-h1 and dualpipev, mlp-tiny 1f1b, per-rank seeds zb-h1). The extra
    cases (dp=2, untied, explicit split, mlp-tiny, per-rank seeds) all stay."""
    pp, dp, schedule, m, engine, overrides, lps = case
    if dp != 1 or overrides or lps is not None:
        return False
    first = V_MS[schedule, pp][0] if (schedule, pp) in V_MS else 2 * pp
    if pp == 4:
        if engine == "torch":
            return m != first
        return schedule in SCHEDULES and m == 2 * pp
    return engine == "torch" or m != first or schedule == "zbv"


def run_case(work, topo, pp, dp, schedule, m, engine, overrides, lps, out, rank):
    cfg = TrainConfig(model="tiny", lr=LR, weight_decay=0.1)
    overrides = dict(overrides)
    seed = overrides.pop("seed", None)
    torch.manual_seed(rank if seed == "rank" else 0)
    if overrides.get("model") == "mlp-tiny":
        model = build_model("mlp-tiny")
        work = RegressionWorkload(TrainConfig(model="mlp-tiny"), num_train=64, num_val=8)
    else:
        model = build_model("tiny", vocab_size=67, n_layers=N_LAYERS,
                            **{"tie_embeddings": True, **overrides})
    eng = parallelize(model, topo, Layout(pp=pp, dp=dp, schedule=schedule, microbatches=m),
                      engine=engine, layers_per_stage=lps)
    opt = build_optimizer(eng, cfg)
    sampler = work.sampler(MICRO * m * dp, dp, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [], "peak_alive": []}
    with torch.no_grad():  # evaluation path: one forward through the stages, before training
        rec["eval"] = [t.clone() for t in eng.loss_sum_and_count(
            work.batches(torch.arange(EVAL_ROWS), EVAL_ROWS)[0])]
    for _ in range(STEPS):
        res = train_step(eng, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
                         max_norm=MAX_NORM, zero_grad=False)
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in eng.named_full_gradients().items()})
        rec["params"].append({n: t.clone() for n, t in eng.named_full_parameters().items()})
        by_tag = {}
        for r in topo.ledger.step_records():
            by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
        rec["bytes"].append(by_tag)
        rec["peak_alive"].append(eng.peak_alive)
    rec["pp_index"] = topo.index("pp")
    name = case_name(pp, dp, schedule, m, engine, _suffix(overrides, lps, seed))
    torch.save(rec, f"{out}/{name}_rank{rank}.pt")


def _suffix(overrides, lps, seed=None):
    """File-name suffix of the extra cases (untied model, explicit split, per-rank seeds)."""
    seed = seed or overrides.get("seed")
    overrides = {k: v for k, v in overrides.items() if k != "seed"}
    return ("_" + overrides["model"] if "model" in overrides
            else "_untied" if overrides else "") + ("_lps" if lps else "") + \
        ("_seed_per_rank" if seed == "rank" else "")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    topos = {}
    slow = "slow" in Path(out).name
    for pp, dp, schedule, m, engine, overrides, lps in cases():
        if is_slow((pp, dp, schedule, m, engine, overrides, lps)) != slow:
            continue
        if (pp, dp) not in topos:  # collective: every rank, same order
            topos[pp, dp] = Topology(pp=pp, dp=dp, ranks=range(pp * dp), timeout_s=60)
        topo = topos[pp, dp]
        if topo.member:
            run_case(work, topo, pp, dp, schedule, m, engine, overrides, lps, out, rank)
    if slow:
        dist.barrier()
        dist.destroy_process_group()
        return
    # one traced real step: pp=4, 1f1b, m=8 → PNG + Chrome trace
    topo = topos[4, 1]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, n_layers=N_LAYERS)
    eng = parallelize(model, topo, Layout(pp=4, schedule="1f1b", microbatches=8))
    opt = build_optimizer(eng, TrainConfig(model="tiny", lr=LR))
    sampler = work.sampler(MICRO * 8, 1, 0, seed=0)
    train_step(eng, work.batches(sampler.next_local_batch(), MICRO), opt, topo, max_norm=1.0)
    info = trace_pipeline(eng, topo, out, name="trace_pp4_1f1b_m8")
    if info is not None:
        torch.save({k: v for k, v in info.items() if k != "events"}
                   | {"n_events": len(info["events"])}, f"{out}/trace_info.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
