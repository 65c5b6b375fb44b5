"""Worker for tests/test_pipeline_unequal.py: the explicit pipeline engine on micro-batches of
unequal sizes, every case in one spawned world.

A 2-rank world runs pp=2 × every explicit schedule × micro-batch row counts (3, 3, 2) and
(2, 3, 3). A 4-rank world runs pp=2 × tp=2 (every schedule; 1f1b and zb-h1 also with SP) and one
pp=2 × dp=2 case whose two dp ranks split their rows differently. Each case: a 4-layer tiny
Llama built from seed 0, built through ``parallelize(..., engine="explicit")``, ``STEPS``
AdamW steps of ``train_step`` on rows ``[t·G, (t+1)·G)`` of a synthetic workload (G = 8 per dp
rank) cut into the case's micro-batches. Each member rank writes ``<out>/<case>_rank<r>.pt``
with the loss, grad norm, this stage's full gradients and parameters of every step, the
ledger's bytes per tag, the formula's (:func:`shardwise.formulas.step_bytes_formula`), and its
coordinates.
"""

import sys

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

V, SEQ, N_LAYERS, STEPS, LR = 67, 16, 4, 2, 3e-4
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
SIZES = ((3, 3, 2), (2, 3, 3))


def case_name(pp, dp, tp, sp, schedule, sizes):
    """File-name stem of a case; ``sizes``: one tuple of micro-batch rows per dp rank."""
    split = "_".join("".join(map(str, s)) for s in sizes)
    return f"pp{pp}_dp{dp}_tp{tp}{'_sp' if sp else ''}_{schedule}_mb{split}"


def cases(world: int) -> list[tuple]:
    """(pp, dp, tp, sp, schedule, sizes per dp rank) of the world of ``world`` ranks."""
    if world == 2:
        return [(2, 1, 1, False, s, (sz,)) for s in SCHEDULES for sz in SIZES]
    out = [(2, 1, 2, False, s, (SIZES[0],)) for s in SCHEDULES]
    out += [(2, 1, 2, True, s, (SIZES[1],)) for s in ("1f1b", "zb-h1")]
    out.append((2, 2, 1, False, "1f1b", SIZES))
    return out


def make_work():
    return SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)


def global_rows(step: int, dp: int) -> torch.Tensor:
    """Rows of the global batch of ``step``: 8 per dp rank, consecutive."""
    g = 8 * dp
    return torch.arange(step * g, (step + 1) * g)


def split_rows(batch: dict, sizes) -> list[dict]:
    """``batch`` ({key: [B, ...]}) cut into micro-batches of ``sizes`` rows, in order."""
    parts = {k: t.split(list(sizes)) for k, t in batch.items()}
    return [{k: parts[k][i].contiguous() for k in batch} for i in range(len(sizes))]


def run_case(work, topo, case, out, rank):
    pp, dp, tp, sp, schedule, sizes = case
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, n_layers=N_LAYERS)
    mine = sizes[topo.index("dp")]
    eng = parallelize(model, topo, Layout(pp=pp, dp=dp, tp=tp, sp=sp, schedule=schedule,
                                          microbatches=len(mine)), engine="explicit")
    opt = build_optimizer(eng, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [], "formula": []}
    for t in range(STEPS):
        rows = global_rows(t, dp)
        d = topo.index("dp")
        (local,) = work.batches(rows[8 * d: 8 * (d + 1)], 8)
        res = train_step(eng, split_rows(local, mine), opt, topo, zero_grad=False)
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in eng.named_full_gradients().items()})
        rec["params"].append({n: p.clone() for n, p in eng.named_full_parameters().items()})
        by_tag = {}
        for r in topo.ledger.step_records():
            by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
        rec["bytes"].append(by_tag)
        rec["formula"].append(step_bytes_formula(eng, topo, micro_steps=len(mine),
                                                 sequences=sum(mine), seq_len=SEQ))
    rec["coords"] = {a: topo.index(a) for a in ("pp", "dp", "tp")}
    torch.save(rec, f"{out}/{case_name(*case)}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    work = make_work()
    topos = {}
    for case in cases(world):
        pp, dp, tp = case[:3]
        if (pp, dp, tp) not in topos:  # collective: every rank, same order
            topos[pp, dp, tp] = Topology(pp=pp, dp=dp, tp=tp, ranks=range(pp * dp * tp),
                                         timeout_s=60)
        run_case(work, topos[pp, dp, tp], case, out, rank)
        print(f"rank {rank}: {case_name(*case)} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
