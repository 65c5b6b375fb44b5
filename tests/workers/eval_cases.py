"""Worker for tests/test_eval_and_epoch.py: distributed evaluation in one spawned 4-rank world.

Each case runs :func:`shardwise.train.loop.evaluate` once on the initial tiny Llama (seed 0,
vocab 67, seq 16) over the first ``n`` of 22 synthetic validation rows whose labels are masked
over a random prefix (so rows count different numbers of tokens and a wrong row count shows).
Cases with ``n`` not a multiple of dp, or ``n < dp``, give some ranks fewer micro-batches: those
run padding forwards, which the sharded engines (ZeRO-3, FSDP, TP, PP) need to keep their
collectives matched. Each member rank writes ``<out>/<case>_rank<r>.pt``: the loss and the number
of ``loss_sum_and_count`` calls it made.
"""

import sys

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.loop import evaluate
from shardwise.train.workload import SyntheticLMWorkload

V, SEQ, NUM_VAL = 67, 16, 22
TIMEOUT = 60  # seconds: an unmatched collective fails the world instead of hanging the test

# (name, Layout kwargs, engine, n = --eval-sequences, micro-batch)
CASES = [
    ("dp1_n22", dict(dp=1), "explicit", 22, 8),
    ("dp2_n22", dict(dp=2), "explicit", 22, 8),
    ("dp3_n22", dict(dp=3), "explicit", 22, 8),  # the issue: 21 of 22 counted
    ("dp3_n2", dict(dp=3), "explicit", 2, 8),  # the issue: row 0 counted twice
    ("dp3_n22_mb1", dict(dp=3), "explicit", 22, 1),  # 7, 7, 8 rows: ranks 0, 1 pad once
    ("dp2_zero3_n3", dict(dp=2, zero=3), "explicit", 3, 1),  # gathers inside forward
    ("dp4_zero3_n2", dict(dp=4, zero=3), "explicit", 2, 1),  # two ranks hold no row
    ("dp2_fsdp_n3", dict(dp=2, zero=3), "torch", 3, 1),
    ("dp2_tp2_n3", dict(dp=2, tp=2), "explicit", 3, 1),
    ("dp2_tp2_zero3_sp_n3", dict(dp=2, tp=2, zero=3, sp=True), "explicit", 3, 1),
    ("pp2_dp2_n3", dict(pp=2, dp=2), "explicit", 3, 1),
]


def workload():
    return SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=NUM_VAL, seed=0)


def make_model():
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=V)


def run_case(topo, work, name, layout_kw, engine, n, micro, out, rank):
    layout = Layout(**layout_kw)
    eng = parallelize(make_model(), topo, layout, engine=engine)
    calls = []
    forward = eng.loss_sum_and_count

    def counted(batch):
        calls.append(int(batch["input_ids"].shape[0]))
        return forward(batch)

    eng.loss_sum_and_count = counted  # an instance attribute shadows the method
    cfg = TrainConfig(model="tiny", dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero,
                      micro_batch=micro, global_batch=micro * layout.dp, eval_sequences=n)
    loss = evaluate(eng, work, topo, cfg)
    torch.save({"loss": loss, "calls": len(calls)}, f"{out}/{name}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=TIMEOUT)
    rank = dist.get_rank()
    work = workload()
    topos = {}
    for _, kw, _, _, _ in CASES:  # creation is collective: every rank, the same order
        key = (kw.get("pp", 1), kw.get("dp", 1), kw.get("tp", 1))
        if key not in topos:
            topos[key] = Topology(*key, ranks=range(key[0] * key[1] * key[2]), timeout_s=TIMEOUT)
    for name, kw, engine, n, micro in CASES:
        topo = topos[(kw.get("pp", 1), kw.get("dp", 1), kw.get("tp", 1))]
        if topo.member:
            run_case(topo, work, name, kw, engine, n, micro, out, rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
