"""Worker for tests/test_pipeline_zero.py: ZeRO-2/3 and HSDP inside pipeline stages, every case
of one world size in one spawned world.

Cases (pp, dp, dp_replicate, tp, sp, zero, schedule, m, reshard_after_forward[, engine]: default
explicit) on a 4-layer tiny Llama (d 32, vocab 67, tied embeddings), one evaluation, then 3 AdamW
steps with binding clipping. 4 ranks: pp=2 × dp=2 with ZeRO-2 (1f1b, interleaved-1f1b, zb-h1)
and ZeRO-3 (1f1b with and without reshard_after_forward, interleaved-1f1b), and the torch
engine's ZeRO-2/3 (1f1b, interleaved-1f1b). 8 ranks: HSDP pp=2 × dp=4 (dp_replicate 2) with ZeRO-1,
2, 3, and pp=2 × dp=2 × tp=2 with SP and ZeRO-3; the torch engine's HSDP with ZeRO-3 (1f1b) and
ZeRO-1 (interleaved-1f1b, run as FSDP2's ZeRO-2). Sub-topologies created by every rank in the
same order.

Each member rank writes ``<out>/<case>_rank<r>.pt``: per step the loss, the grad norm, every
gradient and parameter of its stage in full shape, the ledger's bytes by tag and by (tag, axis),
the engine's formula by tag; its coordinates, its stage's parameter shapes by module (the hand
count's units), and the full-shape optimizer state after the last step (and after loading it
back).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, MICRO, MAX_NORM, LR, N_LAYERS, SEQ, V = 3, 2, 0.3, 1e-4, 4, 16, 67
TIMEOUT = 600

# (pp, dp, dp_replicate, tp, sp, zero, schedule, m, reshard_after_forward)
CASES = {
    4: [(2, 2, 1, 1, False, 2, "1f1b", 4, True),
        (2, 2, 1, 1, False, 3, "1f1b", 4, True),
        (2, 2, 1, 1, False, 3, "1f1b", 4, False),
        (2, 2, 1, 1, False, 3, "interleaved-1f1b", 4, True),
        (2, 2, 1, 1, False, 2, "interleaved-1f1b", 4, True),
        (2, 2, 1, 1, False, 2, "zb-h1", 4, True),
        (2, 2, 1, 1, False, 2, "1f1b", 4, True, "torch"),
        (2, 2, 1, 1, False, 3, "1f1b", 4, True, "torch"),
        (2, 2, 1, 1, False, 3, "interleaved-1f1b", 4, True, "torch"),
        (2, 2, 1, 1, False, 2, "interleaved-1f1b", 4, True, "torch")],
    8: [(2, 4, 2, 1, False, 1, "1f1b", 4, True),
        (2, 4, 2, 1, False, 2, "interleaved-1f1b", 4, True),
        (2, 4, 2, 1, False, 3, "1f1b", 4, True),
        (2, 2, 1, 2, True, 3, "1f1b", 4, True),
        (2, 4, 2, 1, False, 3, "1f1b", 4, True, "torch"),
        (2, 4, 2, 1, False, 1, "interleaved-1f1b", 4, True, "torch")],
}
# ``make test-slow``'s 4-rank cases (a 4-rank world whose output folder's name has "slow"): each
# stage × engine and each schedule × engine stays in ``make test`` — explicit ZeRO-2 under
# interleaved-1f1b and zb-h1, ZeRO-3 under 1F1B (with and without reshard_after_forward); torch
# ZeRO-3 under 1F1B, ZeRO-2 under interleaved-1f1b
SLOW4 = [(2, 2, 1, 1, False, 2, "1f1b", 4, True),
         (2, 2, 1, 1, False, 3, "interleaved-1f1b", 4, True),
         (2, 2, 1, 1, False, 2, "1f1b", 4, True, "torch"),
         (2, 2, 1, 1, False, 3, "interleaved-1f1b", 4, True, "torch")]


def case_name(pp, dp, rep, tp, sp, zero, schedule, m, raf, engine="explicit"):
    return (f"pp{pp}_dp{dp}{f'r{rep}' if rep > 1 else ''}_tp{tp}{'_sp' if sp else ''}"
            f"_zero{zero}_{schedule}_m{m}{'' if raf else '_noraf'}_{engine}")


def run_case(work, topo, case, out, rank):
    pp, dp, rep, tp, sp, zero, schedule, m, raf, engine = (*case, "explicit")[:10]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, n_layers=N_LAYERS, tie_embeddings=True)
    layout = Layout(pp=pp, dp=dp, dp_replicate=rep, tp=tp, sp=sp, zero=zero, schedule=schedule,
                    microbatches=m)
    eng = parallelize(model, topo, layout, engine=engine, reshard_after_forward=raf)
    opt = build_optimizer(eng, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))
    sampler = work.sampler(MICRO * m * dp, dp, topo.index("dp"), seed=0)
    with torch.no_grad():  # an evaluation first: what it gathers must not change the ledger
        eng.loss_sum_and_count(work.batches(torch.arange(4), 4)[0])
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [], "by_axis": [],
           "formula": [], "coords": dict(topo.coords),
           "shapes": {n: tuple(p.shape) for n, p in eng.module.named_parameters()}}
    for _ in range(STEPS):
        res = train_step(eng, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
                         max_norm=MAX_NORM, zero_grad=False)
        by_tag, by_axis = {}, {}
        for r in topo.ledger.step_records():
            by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
            by_axis[r.tag, r.axis] = by_axis.get((r.tag, r.axis), 0.0) + r.wire_bytes
        rec["bytes"].append(by_tag)
        rec["by_axis"].append(by_axis)
        rec["formula"].append(step_bytes_formula(eng, topo, micro_steps=m, sequences=MICRO * m,
                                                 seq_len=SEQ))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in eng.named_full_gradients().items()})
        rec["params"].append({n: t.clone() for n, t in eng.named_full_parameters().items()})
    state = eng.full_optimizer_state(opt)
    rec["opt_state"] = state
    eng.load_full_optimizer_state(opt, state)
    rec["opt_state_reloaded"] = eng.full_optimizer_state(opt)
    torch.save(rec, f"{out}/{case_name(*case)}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=TIMEOUT)
    world = dist.get_world_size()
    work = SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)
    topos = {}
    for case in CASES[world]:  # all created up front: collective, every rank, same order
        pp, dp, rep, tp = case[:4]
        if (pp, dp, rep, tp) not in topos:
            topos[pp, dp, rep, tp] = Topology(pp=pp, dp=dp, tp=tp, dp_replicate=rep,
                                              ranks=range(pp * dp * tp), timeout_s=TIMEOUT)
    slow = "slow" in Path(out).name
    for case in CASES[world]:
        topo = topos[case[:4]]
        if topo.member and (world == 8 or (case in SLOW4) == slow):
            run_case(work, topo, case, out, dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
