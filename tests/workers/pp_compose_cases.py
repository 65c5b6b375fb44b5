"""Worker for tests/test_pipeline_compose.py: pipeline compositions in one spawned 8-rank world.

Cases (pp, dp, tp, sp, zero, schedule, m, engine) on a 4-layer tiny Llama (d 32, 4 heads, 2 kv
heads, vocab 67 — no tp pads it away, tied embeddings), 3 AdamW steps with binding clipping:
pp=2×tp=2 (1f1b, with and without SP), pp=2×dp=2 ZeRO-1, pp=2×dp=2×tp=2 (1f1b,
interleaved-1f1b, SP + ZeRO-1), explicit engine; pp=2×tp=2 and 3D (SP + ZeRO-1) with the torch
engine; the V schedules: zbv pp=2×tp=2 (both engines), dualpipev 3D (SP + ZeRO-1, explicit).
Sub-topologies over ranks 0..w−1, created by every rank in the same order. Plus one step of
pp=2×dp=2 (ZeRO-0 and ZeRO-1) with the dp gradient reduction in bf16.

Each member rank writes ``<out>/<case>_rank<r>.pt``: loss, grad norm, every gradient of its stage
gathered to full shape at each step, the evaluation loss sum of the initial model, the ledger's
bytes per tag and the engine's formula per tag at each step, its coordinates, the full-shape
optimizer state after the last step (and again after loading it back), and the final full
parameters.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.precision import Precision
from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, MICRO, MAX_NORM, LR, N_LAYERS, SEQ, V = 3, 2, 0.3, 1e-4, 4, 16, 67
EVAL_ROWS = 4  # evaluation batch: the first 4 training rows
TIMEOUT = 600  # seconds, process groups

# (pp, dp, tp, sp, zero, schedule, m, engine)
CASES = [
    (2, 1, 2, False, 0, "1f1b", 4, "explicit"),
    (2, 1, 2, True, 0, "1f1b", 4, "explicit"),
    (2, 2, 1, False, 1, "1f1b", 4, "explicit"),
    (2, 2, 2, False, 0, "1f1b", 4, "explicit"),
    (2, 2, 2, False, 0, "interleaved-1f1b", 4, "explicit"),
    (2, 2, 2, True, 1, "1f1b", 4, "explicit"),
    (2, 1, 2, False, 0, "1f1b", 4, "torch"),
    (2, 2, 2, True, 1, "1f1b", 4, "torch"),
    (2, 1, 2, False, 0, "zbv", 4, "explicit"),
    (2, 2, 2, True, 1, "dualpipev", 4, "explicit"),
    (2, 1, 2, False, 0, "zbv", 4, "torch"),
]


# ``make test-slow``'s cases (a world whose output folder's name has "slow"): PP×TP with and
# without SP and without dp under 1F1B and zbv (PP×TP without SP is composed again in the kept
# interleaved 3D case, with its hand count of the TP bytes; a V schedule with TP in the kept
# dualpipev 3D case and the torch engine's zbv PP×TP; SP in the kept 3D cases), PP×DP×TP
# without ZeRO under 1F1B and with SP + ZeRO-1 under 1F1B (each composed again in a kept case:
# 1F1B with dp and ZeRO-1 in PP×DP, SP + ZeRO-1 3D under dualpipev and under the torch engine,
# interleaved 3D), the torch engine's PP×TP without dp or SP (kept: the torch engine's 3D and
# zbv PP×TP)
SLOW = [(2, 1, 2, False, 0, "1f1b", 4, "explicit"), (2, 1, 2, True, 0, "1f1b", 4, "explicit"),
        (2, 2, 2, False, 0, "1f1b", 4, "explicit"), (2, 2, 2, True, 1, "1f1b", 4, "explicit"),
        (2, 1, 2, False, 0, "1f1b", 4, "torch"), (2, 1, 2, False, 0, "zbv", 4, "explicit")]


def case_name(pp, dp, tp, sp, zero, schedule, m, engine):
    return (f"pp{pp}_dp{dp}_tp{tp}{'_sp' if sp else ''}_zero{zero}_{schedule}_m{m}_{engine}")


def run_case(work, topo, case, out, rank):
    pp, dp, tp, sp, zero, schedule, m, engine = case
    cfg = TrainConfig(model="tiny", lr=LR, weight_decay=0.1)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, n_layers=N_LAYERS, tie_embeddings=True)
    layout = Layout(pp=pp, dp=dp, tp=tp, sp=sp, zero=zero, schedule=schedule, microbatches=m)
    eng = parallelize(model, topo, layout, engine=engine)
    opt = build_optimizer(eng, cfg)
    sampler = work.sampler(MICRO * m * dp, dp, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [], "formula": [],
           "coords": dict(topo.coords)}
    with torch.no_grad():  # evaluation path: one forward through the stages, before training
        rec["eval"] = float(eng.loss_sum_and_count(
            work.batches(torch.arange(EVAL_ROWS), EVAL_ROWS)[0])[0])
    for _ in range(STEPS):
        res = train_step(eng, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
                         max_norm=MAX_NORM, zero_grad=False)
        by_tag = {}
        for r in topo.ledger.step_records():
            by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
        rec["bytes"].append(by_tag)
        rec["formula"].append(step_bytes_formula(eng, topo, micro_steps=m, sequences=MICRO * m,
                                                 seq_len=SEQ))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in eng.named_full_gradients().items()})
        rec["params"].append({n: t.clone() for n, t in eng.named_full_parameters().items()})
    if not (engine == "torch" and zero):  # ZeroRedundancyOptimizer: refused (zero/stage_zero1.py)
        state = eng.full_optimizer_state(opt)
        rec["opt_state"] = state
        eng.load_full_optimizer_state(opt, state)  # round trip through this rank's shards
        rec["opt_state_reloaded"] = eng.full_optimizer_state(opt)
    torch.save(rec, f"{out}/{case_name(*case)}_rank{rank}.pt")


BF16_CASES = [(2, 2, 1, False, 0, "1f1b", 4, "explicit"),
              (2, 2, 1, False, 1, "1f1b", 4, "explicit")]


def run_bf16_reduce(work, topo, case, out, rank):
    """One step with ``reduce_dtype="bf16"``: the dp reduction travels in bf16."""
    pp, dp, tp, sp, zero, schedule, m, engine = case
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, n_layers=N_LAYERS, tie_embeddings=True)
    layout = Layout(pp=pp, dp=dp, tp=tp, sp=sp, zero=zero, schedule=schedule, microbatches=m)
    eng = parallelize(model, topo, layout, engine=engine,
                      precision=Precision.of(reduce="bf16"))
    opt = build_optimizer(eng, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))
    sampler = work.sampler(MICRO * m * dp, dp, topo.index("dp"), seed=0)
    train_step(eng, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
               max_norm=MAX_NORM, zero_grad=False)
    by_tag = {}
    for r in topo.ledger.step_records():
        by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
    rec = {"bytes": by_tag, "coords": dict(topo.coords),
           "formula": step_bytes_formula(eng, topo, micro_steps=m, sequences=MICRO * m,
                                         seq_len=SEQ),
           "grads": {n: g.clone() for n, g in eng.named_full_gradients().items()},
           "grad_dtypes": sorted({r.dtype for r in topo.ledger.step_records()
                                  if r.tag == "grad"})}
    torch.save(rec, f"{out}/bf16_{case_name(*case)}_rank{rank}.pt")


def main(out: str) -> None:
    # generous timeouts: ranks outside a sub-topology wait in its next collective while its
    # members train (2 shared CPU cores, other tests running)
    init_distributed("cpu", timeout_s=TIMEOUT)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)
    topos = {}
    for case in CASES:  # all created up front: collective, every rank, same order
        pp, dp, tp = case[:3]
        if (pp, dp, tp) not in topos:
            topos[pp, dp, tp] = Topology(pp=pp, dp=dp, tp=tp, ranks=range(pp * dp * tp),
                                         timeout_s=TIMEOUT)
    slow = "slow" in Path(out).name
    for case in CASES:
        topo = topos[case[:3]]
        if topo.member and (case in SLOW) == slow:
            run_case(work, topo, case, out, rank)
    for case in BF16_CASES if not slow else ():
        topo = topos[case[:3]]
        if topo.member:
            run_bf16_reduce(work, topo, case, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
