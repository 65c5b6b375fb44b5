"""Worker for tests/test_ep_zero.py: explicit ZeRO-1/2/3 with expert parallelism, every case in
one spawned 4-rank world, results dumped.

Each case builds the MoE Llama, applies ``parallelize`` with ``Layout(dp, zero, ep)`` (EP's
transform, then ZeRO with the expert shards over "edp"), trains STEPS AdamW steps with clipping
through ``train_step`` and writes ``<out>/<case>_rank<r>.pt``: per step the loss, the grad norm,
every full (gathered) gradient and parameter, the ledger's bytes by tag and
``formulas.step_bytes_formula``; after the last step the full AdamW state (layout-free), the
same state read back from a second engine it was loaded into, the model-state bytes, the
engine's memory formula and its units. The test compares them with a single-process reference
and with formulas it writes out itself.
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

STEPS, GLOBAL_BATCH, SEQ_LEN, LR, MAX_NORM = 2, 8, 16, 3e-4, 0.3
# name → build_model overrides of moe-tiny (d 32, 2 MoE blocks, 4 experts of hidden 32)
MODELS = {
    "top2": dict(vocab_size=67),
    "shared": dict(vocab_size=67, top_k=1, n_shared_experts=1),
}


def case_name(model, stage, dp, ep, tp=1, accum=1, reshard=True):
    return (f"{model}_z{stage}_dp{dp}_ep{ep}{f'_tp{tp}' if tp > 1 else ''}_acc{accum}"
            f"{'' if reshard else '_noraf'}")


# (model, stage, dp, ep, tp, accum, reshard_after_forward)
CASES = [("top2", z, 4, ep, 1, 1, True) for z in (1, 2, 3) for ep in (2, 4)]
CASES += [
    ("shared", 1, 4, 2, 1, 1, True),
    ("shared", 3, 4, 4, 1, 1, True),
    ("top2", 3, 4, 2, 1, 2, True),  # two micro-steps: ZeRO-3 gathers every unit twice
    ("top2", 3, 4, 2, 1, 1, False),  # no reshard after forward: no re-gather for backward
    ("top2", 2, 2, 2, 1, 1, True),  # edp of one rank: experts owned whole
    ("top2", 3, 2, 2, 1, 1, True),
]


# ``make test-slow``'s cases (a world whose output folder's name has "slow"): top-2 ZeRO-1 at ep=2
# (kept with the shared expert), ZeRO-2 at ep=4 (edp of one rank: kept at dp=2, ep=2), ZeRO-3 at
# ep=2 (kept with two micro-steps and without reshard-after-forward); ``make test`` keeps each
# stage at ep=2 and ZeRO-1/3 at ep=4 too
SLOW = [("top2", 1, 4, 2, 1, 1, True), ("top2", 2, 4, 4, 1, 1, True),
        ("top2", 3, 4, 2, 1, 1, True)]


def workload():
    return SyntheticLMWorkload(vocab_size=67, seq_len=SEQ_LEN, num_train=64, num_val=4, seed=0)


def make_model(model):
    torch.manual_seed(0)
    return build_model("moe-tiny", **MODELS[model])


def build(topo, model, stage, dp, ep, tp, reshard):
    engine = parallelize(make_model(model), topo, Layout(dp=dp, tp=tp, zero=stage, ep=ep),
                         reshard_after_forward=reshard)
    return engine, build_optimizer(engine, TrainConfig(lr=LR, weight_decay=0.1))


def run_case(out, topo, rank, model, stage, dp, ep, tp, accum, reshard):
    work = workload()
    engine, opt = build(topo, model, stage, dp, ep, tp, reshard)
    sampler = work.sampler(GLOBAL_BATCH, dp, topo.index("dp"), 0)
    micro = GLOBAL_BATCH // dp // accum
    rec = {k: [] for k in ("loss", "grad_norm", "grads", "params", "bytes", "formula")}
    for _ in range(STEPS):
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                         max_norm=MAX_NORM, zero_grad=False)
        led: dict = {}
        for r in topo.ledger.step_records():
            led[r.tag] = led.get(r.tag, 0.0) + r.wire_bytes
        rec["bytes"].append(led)
        rec["formula"].append(step_bytes_formula(engine, topo, micro_steps=accum,
                                                 sequences=GLOBAL_BATCH // dp, seq_len=SEQ_LEN))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in engine.named_full_gradients().items()})
        rec["params"].append({n: p.detach().clone()
                              for n, p in engine.named_full_parameters().items()})
    rec["state_bytes"] = engine.model_state_bytes(opt)
    rec["memory_formula"] = engine.memory_formula()
    zero = getattr(engine, "grad_sync", engine)  # dp × tp: the ZeRO part of the ParallelModel
    rec["units"] = [(u.name, u.axis, u.n, u.numel, u.padded) for u in zero.units]
    rec["n_pieces"] = sum(len(g["params"]) for g in opt.param_groups)
    rec["state"] = engine.full_optimizer_state(opt)
    # a layout-free checkpoint loaded into a second engine of this layout gives the same state
    engine2, opt2 = build(topo, model, stage, dp, ep, tp, reshard)
    engine2.load_full_optimizer_state(opt2, rec["state"])
    rec["state_reloaded"] = engine2.full_optimizer_state(opt2)
    torch.save(rec, f"{out}/{case_name(model, stage, dp, ep, tp, accum, reshard)}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    topos = {}
    for _, _, dp, ep, tp, _, _ in CASES:  # every rank creates every topology, in one order
        if (dp, ep, tp) not in topos:
            topos[dp, ep, tp] = Topology(dp=dp, ep=ep, tp=tp, ranks=range(dp * tp),
                                         timeout_s=60)
    slow = "slow" in Path(out).name
    for case in CASES:
        topo = topos[case[2], case[3], case[4]]
        if topo.member and (case in SLOW) == slow:
            run_case(out, topo, rank, *case)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
