"""Worker for tests/test_dpo.py: DPO in many layouts inside one spawned 4-rank world.

Cases (pp, dp, tp, zero, schedule, m, micro, engine) on a 4-layer tiny Llama (d 32, vocab 67,
tied embeddings) with synthetic preference pairs (:class:`~shardwise.train.dpo.
SyntheticDPOWorkload`), 3 AdamW steps with binding clipping: the policy and its frozen reference
built by :func:`~shardwise.train.dpo.build_reference` in the same layout, the reference pass
(:meth:`~shardwise.train.dpo.DPOReference.with_reference`) and the ordinary
:func:`~shardwise.train.step.train_step`, as the training loop runs them.

Each member rank writes ``<out>/<case>_rank<r>.pt``: per step the loss, grad norm, every
gradient of its stage gathered to full shape, the parameters after the step and the step's DPO
metrics; the validation loss and metrics of the initial model; the reference's parameter bytes.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.dpo import (DPOReference, SyntheticDPOWorkload, build_reference,
                                 reference_copy)
from shardwise.train.loop import eval_shard
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

STEPS, MAX_NORM, LR, N_LAYERS, SEQ, V, BETA = 3, 0.3, 3e-3, 4, 16, 67, 0.5
VAL_PAIRS = 3  # odd: the dp=2 ranks get 2 and 1 pairs (a padding forward on one)
TIMEOUT = 600

# (pp, dp, tp, zero, schedule, m, micro rows, engine)
CASES = [
    (1, 2, 1, 0, "1f1b", 1, 4, "explicit"),
    (1, 2, 1, 1, "1f1b", 2, 2, "explicit"),
    (1, 2, 1, 3, "1f1b", 1, 4, "explicit"),
    (1, 4, 1, 3, "1f1b", 1, 2, "explicit"),
    (1, 1, 2, 0, "1f1b", 2, 4, "explicit"),
    (1, 2, 2, 1, "1f1b", 1, 4, "explicit"),
    (2, 1, 1, 0, "1f1b", 2, 2, "explicit"),
    (2, 1, 1, 0, "interleaved-1f1b", 4, 2, "explicit"),
    (2, 1, 2, 0, "1f1b", 2, 2, "explicit"),
    (2, 2, 1, 1, "1f1b", 2, 2, "explicit"),
    (1, 2, 1, 0, "1f1b", 1, 4, "torch"),
    (1, 2, 1, 3, "1f1b", 1, 4, "torch"),
]
# ``make test-slow``'s cases (a world whose output folder's name has "slow"), each layout composed
# again in a kept one: dp alone (dp × tp, pp × dp, torch DDP), ZeRO-3 at dp=2 (kept at dp=4), tp
# alone (dp × tp, pp × tp), pp alone under 1F1B (pp × tp, pp × dp)
SLOW = [(1, 2, 1, 0, "1f1b", 1, 4, "explicit"), (1, 2, 1, 3, "1f1b", 1, 4, "explicit"),
        (1, 1, 2, 0, "1f1b", 2, 4, "explicit"), (2, 1, 1, 0, "1f1b", 2, 2, "explicit")]


def case_name(pp, dp, tp, zero, schedule, m, micro, engine):
    return f"pp{pp}_dp{dp}_tp{tp}_zero{zero}_{schedule}_m{m}_b{micro}_{engine}"


def global_batch(case) -> int:
    pp, dp, tp, zero, schedule, m, micro, engine = case
    return micro * m * dp


def make_work() -> SyntheticDPOWorkload:
    return SyntheticDPOWorkload(vocab_size=V, seq_len=SEQ, num_pairs=32,
                                num_val_pairs=VAL_PAIRS, beta=BETA, seed=0)


def run_case(work, topo, case, out, rank):
    pp, dp, tp, zero, schedule, m, micro, engine = case
    cfg = TrainConfig(model="tiny", lr=LR, weight_decay=0.1, eval_sequences=2 * VAL_PAIRS,
                      micro_batch=micro, microbatches=m if pp > 1 else 0, global_batch=micro * m
                      * dp, dp=dp, tp=tp, pp=pp, zero=zero, task="dpo", dpo_beta=BETA)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, n_layers=N_LAYERS, tie_embeddings=True)
    ref_model = reference_copy(model)
    layout = Layout(pp=pp, dp=dp, tp=tp, zero=zero, schedule=schedule, microbatches=m)
    eng = parallelize(model, topo, layout, engine=engine)
    ref_engine = build_reference(ref_model, layout, lambda mod, lay: parallelize(
        mod, topo, lay, engine=engine))
    ref = DPOReference(ref_engine, topo, BETA)
    opt = build_optimizer(eng, cfg)
    sampler = work.sampler(global_batch(case), dp, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "metrics": [],
           "coords": dict(topo.coords),
           "ref_requires_grad": any(p.requires_grad for p in ref_engine.parameters()),
           "ref_bytes": ref_engine.model_state_bytes()}
    rec["val_loss"] = ref.evaluate(eng, work, cfg, eval_shard)
    rec["val_metrics"] = dict(ref.last_eval)
    for _ in range(STEPS):
        mbs = ref.with_reference(work.batches(sampler.next_local_batch(), micro))
        res = train_step(eng, mbs, opt, topo, max_norm=MAX_NORM, zero_grad=False)
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["metrics"].append(ref.step_metrics(mbs))
        rec["grads"].append({n: g.clone() for n, g in eng.named_full_gradients().items()})
        rec["params"].append({n: t.clone() for n, t in eng.named_full_parameters().items()})
    rec["ref_grads"] = sum(p.grad is not None for p in ref_engine.parameters())
    torch.save(rec, f"{out}/{case_name(*case)}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=TIMEOUT)
    rank = dist.get_rank()
    work = make_work()
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
