"""Worker for tests/test_dp_parity.py: run every DP case in one spawned world, dump results.

Each rank writes ``<out>/<case>_rank<r>.pt`` with what it saw and computed: the sample indices of
each step, the loss and grad norm of each step, every gradient after each step's sync, the
ledger's bytes, and the parameters after each step. The test compares them with a reference it
computes itself in one process.
"""

import sys

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, GLOBAL_BATCH, MAX_NORM, LR = 3, 8, 0.3, 3e-4


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    cfg = TrainConfig(model="tiny", lr=LR, weight_decay=0.1)
    for dp in (1, 2, 4):
        topo = Topology(dp=dp, ranks=range(dp), timeout_s=60)
        for engine in ("explicit", "torch"):
            for accum in (1, 2):
                if not topo.member:
                    continue
                torch.manual_seed(0)
                model = build_model("tiny", vocab_size=67, tie_embeddings=True)
                wrapped = parallelize(model, topo, engine=engine, bucket_mb=0.01)
                opt = build_optimizer(wrapped, cfg)
                sampler = work.sampler(GLOBAL_BATCH, dp, topo.index("dp"), seed=0)
                micro = GLOBAL_BATCH // dp // accum
                rec = {"indices": [], "loss": [], "grad_norm": [], "grads": [], "params": [],
                       "grad_bytes": [], "total_bytes": [],
                       "n_buckets": len(getattr(getattr(wrapped, "grad_sync", wrapped), "buckets", []))}
                for _ in range(STEPS):
                    idx = sampler.next_local_batch()
                    res = train_step(wrapped, work.batches(idx, micro), opt, topo,
                                     max_norm=MAX_NORM, zero_grad=False)
                    rec["indices"].append(idx.clone())
                    rec["loss"].append(res.loss)
                    rec["grad_norm"].append(res.grad_norm)
                    rec["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
                    rec["params"].append({n: p.detach().clone()
                                          for n, p in model.named_parameters()})
                    rec["grad_bytes"].append(topo.ledger.step_bytes("grad"))
                    rec["total_bytes"].append(topo.ledger.step_bytes())
                torch.save(rec, f"{out}/dp{dp}_{engine}_acc{accum}_rank{rank}.pt")
    # overlap: how many bucket all-reduces are in flight when backward returns
    topo = Topology(dp=2, ranks=range(2), timeout_s=60)
    if topo.member:
        from shardwise.models import loss_sum_and_count

        launched, grads = {}, {}
        for overlap, unused in ((True, False), (False, False), (True, True)):
            torch.manual_seed(0)
            model = build_model("tiny", vocab_size=67)
            if unused:  # a parameter no forward touches: its bucket must still launch (zeros)
                model.unused = torch.nn.Parameter(torch.ones(5))
            wrapped = parallelize(model, topo, engine="explicit", bucket_mb=0.01, overlap=overlap)
            (mb,) = work.batches(torch.arange(4) + 4 * topo.index("dp"), 4)
            with wrapped.grad_sync.sync_gradients(True):
                loss_sum_and_count(wrapped, mb)[0].backward()
            buckets = wrapped.grad_sync.buckets  # the engine's gradient sync
            launched[overlap, unused] = (sum(b.handle is not None for b in buckets),
                                         len(buckets))
            wrapped.finish_gradient_sync()
            grads[overlap, unused] = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.save({"launched": launched, "grads": grads}, f"{out}/overlap_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
