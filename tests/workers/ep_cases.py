"""Worker for tests/test_expert_parallel.py: expert parallelism in one 4-rank world.

Each case builds the seeded MoE model (``moe-tiny``, vocab 67), parallelizes it for its layout,
runs one training step on this rank's share of a global batch of 8 sequences (micro-batches of
2) and saves: the logged loss, every gradient gathered to full shape, the step's ledger by tag
and the step formula by tag, the routing statistics, and the global batch's indices (the test
computes the single-process reference itself). Cases (name → layout, model overrides):

* dp = 4 with ep = 2 and 4, top-1 and top-2, with and without a shared expert;
* dp = 2 × tp = 2 with ep = 2 (experts whole on each tp rank);
* ``skew``: the router's weights zeroed, so every logit ties and every token goes to experts
  0..k-1 (index tie-break): all the dispatch lands on ep rank 0;
* ``ring``: ep = 4 over our pairwise all-to-all (``--collectives ring``), with the bytes handed
  to send;
* ``capacity``: capacity factor 1.0 (tokens dropped per sequence, identically in every
  layout).

Each rank writes ``<out>/rank<r>.pt``.
"""

import sys

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model
from shardwise.models.moe import moe_stats
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

VOCAB, SEQ, GLOBAL, MICRO = 67, 32, 8, 2

# name → (dp, tp, ep, model overrides, collectives, zero the router)
CASES = {
    "dp4_ep2_top2": (4, 1, 2, {}, "native", False),
    "dp4_ep4_top2": (4, 1, 4, {}, "native", False),
    "dp4_ep2_top1": (4, 1, 2, dict(top_k=1), "native", False),
    "dp4_ep4_top1_shared": (4, 1, 4, dict(top_k=1, n_shared_experts=1), "native", False),
    "dp4_ep2_top2_shared": (4, 1, 2, dict(n_shared_experts=1), "native", False),
    "dp2_tp2_ep2": (2, 2, 2, dict(moe_every=2, n_layers=3), "native", False),
    "skew_ep4_top1": (4, 1, 4, dict(top_k=1), "native", True),
    "skew_ep2_top2": (4, 1, 2, {}, "native", True),
    "ring_ep4": (4, 1, 4, {}, "ring", False),
    "capacity_ep2": (4, 1, 2, dict(capacity_factor=1.0), "native", False),
}


def make_model(overrides: dict, zero_router: bool):
    """The seeded plain model every case and the reference start from."""
    torch.manual_seed(0)
    model = build_model("moe-tiny", vocab_size=VOCAB, **overrides)
    if zero_router:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.zero_()
    return model


# the bounded N = 8 set (workers/ep_n8_cases.py): ep = 8 (E = 8), ep = 4 with a shared
# expert, tp = 2 with ep = 2 and 4, ep = 4 under ZeRO-3, tp × ep under ZeRO-1 (a name → (...,
# Layout options))
CASES_N8 = {
    "dp8_ep8_top2": (8, 1, 8, dict(n_experts=8), "native", False),
    "dp8_ep4_top1_shared": (8, 1, 4, dict(top_k=1, n_shared_experts=1), "native", False),
    "dp4_tp2_ep4": (4, 2, 4, {}, "native", False),
    "dp4_tp2_ep2_capacity": (4, 2, 2, dict(capacity_factor=1.25), "native", False),
    "dp8_ep4_zero3": (8, 1, 4, {}, "native", False, dict(zero=3)),
    "dp4_tp2_ep2_zero1": (4, 2, 2, {}, "native", False, dict(zero=1)),
}
ALL = {**CASES, **CASES_N8}


def run_case(name: str, work) -> dict:
    dp, tp, ep, over, collectives, zero_router, *extra = ALL[name]
    topo = Topology(dp=dp, tp=tp, ep=ep, timeout_s=60, collectives=collectives)
    layout = Layout(dp=dp, tp=tp, ep=ep, **(extra[0] if extra else {}))
    engine = parallelize(make_model(over, zero_router), topo, layout)
    opt = build_optimizer(engine, TrainConfig(model="moe-tiny", lr=3e-4))
    sampler = work.sampler(GLOBAL, dp, topo.index("dp"), 0)
    local = sampler.next_local_batch()
    batches = work.batches(local, MICRO)
    res = train_step(engine, batches, opt, topo, zero_grad=False)
    ledger, sent = {}, {}
    for r in topo.ledger.step_records():
        ledger[r.tag] = ledger.get(r.tag, 0.0) + r.wire_bytes
        if r.sent_bytes is not None:
            sent[r.tag] = sent.get(r.tag, 0.0) + r.sent_bytes
    formula = step_bytes_formula(engine, topo, micro_steps=len(batches),
                                 sequences=len(local), seq_len=SEQ)
    stats = moe_stats(engine.module)
    every = [work.sampler(GLOBAL, dp, j, 0).next_local_batch() for j in range(dp)]
    return {"loss": res.loss, "grad_norm": res.grad_norm,
            "grads": {n: g.clone() for n, g in engine.named_full_gradients().items()},
            "ledger": ledger, "sent": sent, "formula": formula,
            "tokens": stats["tokens"].clone(), "dropped": int(stats["dropped"]),
            "global_indices": torch.cat(every), "ep_index": topo.index("ep")}


def main(out: str, cases: dict = CASES) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=VOCAB, seq_len=SEQ, num_train=64, num_val=8, seed=0)
    rec = {"rank": rank, "cases": {name: run_case(name, work) for name in cases}}
    torch.save(rec, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
