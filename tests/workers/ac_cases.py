"""Worker for tests/test_ac.py: activation checkpointing under distributed layouts, one world.

2 ranks. For each layout (tp=2 explicit and DTensor, tp=2 with SP, dp=2 zero=3 explicit and
FSDP2, pp=2 1f1b, zb-h1 and zbv — the V on a 4-layer model) and each ``--ac`` mode (none,
selective, full; zb-h1 and zbv: none and full), from the same seed: 2 AdamW
steps of 2 micro-batches on the tiny GQA Llama, with the recompute booked under the ledger phase
"recompute". Each rank writes ``<out>/<layout>_<mode>_rank<r>.pt``: per step the loss, every
gradient gathered to full shape, the step's bytes (phase "step") and the recompute's bytes
(phase "recompute", with the op/shape of each record).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model, set_activation_checkpointing
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, MICRO, N_MICRO, SEQ = 2, 2, 2, 16
MODEL = dict(n_heads=8, n_kv_heads=4)  # tiny: d=32, 2 layers, d_ff=64
LAYOUTS = {  # name: (Layout, engine)
    "tp2_explicit": (Layout(tp=2), "explicit"),
    "tp2_torch": (Layout(tp=2), "torch"),
    "tp2_sp_explicit": (Layout(tp=2, sp=True), "explicit"),
    "dp2_zero3_explicit": (Layout(dp=2, zero=3), "explicit"),
    "dp2_zero3_torch": (Layout(dp=2, zero=3), "torch"),
    "pp2_1f1b_explicit": (Layout(pp=2, schedule="1f1b", microbatches=N_MICRO), "explicit"),
    # zero-bubble: each block's backward runs as two graph tasks, so it is recomputed twice
    "pp2_zbh1_explicit": (Layout(pp=2, schedule="zb-h1", microbatches=N_MICRO), "explicit"),
    # the V (issue 40): two chunks per rank, so 4 layers; I/W split like zb-h1
    "pp2_zbv_explicit": (Layout(pp=2, schedule="zbv", microbatches=N_MICRO), "explicit"),
}
N_LAYERS = {"pp2_zbv_explicit": 4}  # the others: tiny's 2
MODES = ("none", "selective", "full")
# selective checkpointing allows one backward per region: refused with zb-h1 (config.validate)
MODES_OF = {name: ("none", "full") if "zbh1" in name or "zbv" in name else MODES
            for name in LAYOUTS}
# ``make test-slow``'s layouts (a world whose output folder's name has "slow"): each engine's TP,
# ZeRO-3 and the I/W split stay in ``make test`` — TP without SP on the torch engine (the same
# 2(n−1)/n·S recompute as the explicit one's), TP + SP explicit, ZeRO-3 explicit, zbv (split like
# zb-h1)
SLOW = ("tp2_explicit", "dp2_zero3_torch", "pp2_zbh1_explicit")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=67, seq_len=SEQ, num_train=64, num_val=4, seed=0)
    cfg = TrainConfig(model="tiny", lr=3e-4, weight_decay=0.1)
    slow = "slow" in Path(out).name
    for name, (layout, engine) in LAYOUTS.items():
        if (name in SLOW) != slow:
            continue
        topo = Topology(layout.pp, layout.dp, layout.tp, ranks=range(2), timeout_s=60)
        for mode in MODES_OF[name]:
            torch.manual_seed(0)
            model = build_model("tiny", vocab_size=67, **MODEL,
                                **({"n_layers": N_LAYERS[name]} if name in N_LAYERS else {}))
            set_activation_checkpointing(model, mode, lambda t=topo: t.ledger.phase("recompute"))
            wrapped = parallelize(model, topo, layout, engine=engine, seed=0)
            opt = build_optimizer(wrapped, cfg)
            global_batch = MICRO * N_MICRO * layout.dp
            sampler = work.sampler(global_batch, layout.dp, topo.index("dp"), seed=0)
            rec = {"loss": [], "grads": [], "step_bytes": [], "recompute": []}
            for _ in range(STEPS):
                n_before = len(topo.ledger.records)
                res = train_step(wrapped, work.batches(sampler.next_local_batch(), MICRO), opt,
                                 topo, max_norm=0.3, zero_grad=False)
                rec["loss"].append(res.loss)
                rec["grads"].append({n: g.detach().clone()
                                     for n, g in wrapped.named_full_gradients().items()})
                rec["step_bytes"].append(topo.ledger.step_bytes())
                rec["recompute"].append([(r.op, tuple(r.shape), r.wire_bytes)
                                         for r in topo.ledger.records[n_before:]
                                         if r.phase == "recompute"])
            torch.save(rec, f"{out}/{name}_{mode}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
