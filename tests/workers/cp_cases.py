"""Worker for tests/test_context_parallel.py: context parallelism in one 4-rank world.

1. core attention alone: ring and all-gather attention over cp = 2 (ranks 0, 1) and cp = 4, GQA
   (8 query heads, 2 kv heads), on seeded q, k, v [2, 8, 64, 8] and an output gradient: each
   rank saves its output and its q/k/v gradients at its chunks, and the ledger records of the
   forward and the backward (op, tag, bytes); the all-gather method also under
   ``--collectives ring`` (our algorithms, on the comm thread);
2. the model under cp = 2 × dp = 2: one training step with ``--ac none | full | selective``
   (gradients gathered to full shape, and the bytes of phase "step" and "recompute");
3. evaluation and sampling under cp = 4: the loss sum and count of a batch (every rank's
   chunks, all-reduced), and the logits of the plain-attention model (``plain_attention``);
4. torch's ``context_parallel`` on CPU (cp = 2): its split of the positions (checked against
   ours inside ``torch_context_parallel``), and what its attention raises on CPU.

Each rank writes ``<out>/rank<r>.pt``.
"""

import sys

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.config import TrainConfig
from shardwise.models import build_model, set_activation_checkpointing
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.cp import (ContextParallelAttention, plain_attention, shard_sequence,
                                   zigzag_positions)
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

B, H, KV, S, HD = 2, 8, 2, 64, 8
MODEL = dict(n_heads=8, n_kv_heads=4)  # tiny: d = 32, 2 layers


def core_case(topo, method: str) -> dict:
    """One forward + backward of ``method`` on this rank's chunks of the seeded tensors."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, n, S, HD, generator=g) for n in (H, KV, KV))
    dout = torch.randn(B, H, S, HD, generator=g)
    pos = zigzag_positions(S, topo.size("cp"), topo.index("cp"))
    q, k, v = (t.index_select(2, pos).requires_grad_() for t in (q, k, v))
    core = ContextParallelAttention(topo, method)
    topo.ledger.records.clear()
    out = core(q, k, v)
    fwd = [(r.op, r.tag, r.wire_bytes) for r in topo.ledger.records]
    topo.ledger.records.clear()
    out.backward(dout.index_select(2, pos))
    bwd = [(r.op, r.tag, r.wire_bytes) for r in topo.ledger.records]
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "pos": pos,
            "fwd": fwd, "bwd": bwd}


def model_step(topo, work, ac: str) -> dict:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **MODEL)
    set_activation_checkpointing(model, ac, lambda: topo.ledger.phase("recompute"))
    engine = parallelize(model, topo, Layout(dp=2, cp=2))
    opt = build_optimizer(engine, TrainConfig(model="tiny", lr=3e-4))
    sampler = work.sampler(8, topo.size("dp"), topo.index("dp"), 0)
    res = train_step(engine, work.batches(sampler.next_local_batch(), 2), opt, topo,
                     max_norm=1.0, zero_grad=False)
    by_phase = {}
    for r in topo.ledger.records:
        by_phase[r.phase] = by_phase.get(r.phase, 0.0) + r.wire_bytes
    return {"loss": res.loss, "grads": {n: t.clone() for n, t in
                                        engine.named_full_gradients().items()},
            "step_bytes": topo.ledger.step_bytes(), "recompute_bytes": by_phase.get("recompute",
                                                                                    0.0)}


def eval_and_sample(topo, work) -> dict:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **MODEL)
    engine = parallelize(model, topo, Layout(cp=4))
    batch = work.batches(torch.arange(4), 4, split="val")[0]
    with torch.no_grad():
        s, c = engine.loss_sum_and_count(shard_sequence(batch, topo))
    sums = torch.tensor([float(s), float(c)], dtype=torch.float64)
    comm.all_reduce(sums, topo, topo.data_axis, tag="eval")
    with engine.full_model() as full, plain_attention(full), torch.no_grad():
        logits = full(batch["input_ids"])  # whole sequences on every rank, no ring
    return {"eval_sums": sums, "logits": logits}


def torch_cp_on_cpu(topo) -> dict:
    """Enter torch's context_parallel: our check of its split runs; then its patched SDPA on
    this rank's chunks, which has no CPU kernel (the error validate_cp quotes)."""
    from shardwise.parallel.cp.torch_cp import torch_context_parallel

    error = ""
    with torch_context_parallel(topo, S):  # raises if torch splits differently
        q = torch.randn(B, H, S // 2, HD)
        try:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except Exception as e:  # noqa: BLE001 - recorded for the test to read
            error = f"{type(e).__name__}: {e}"
    return {"split_checked": True, "sdpa_error": error}


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    rec = {"rank": rank}
    cp2 = Topology(cp=2, ranks=[0, 1], timeout_s=60)
    cp4 = Topology(cp=4, timeout_s=60)
    for method in ("ring", "allgather"):
        if cp2.member:
            rec[f"core_cp2_{method}"] = core_case(cp2, method)
        rec[f"core_cp4_{method}"] = core_case(cp4, method)
    # the all-gather method over our own point-to-point algorithms (--collectives ring)
    rec["core_cp4_allgather_ours"] = core_case(Topology(cp=4, timeout_s=60, collectives="ring"),
                                               "allgather")
    work = SyntheticLMWorkload(vocab_size=67, seq_len=32, num_train=64, num_val=8, seed=0)
    dpcp = Topology(dp=2, cp=2, timeout_s=60)
    for ac in ("none", "full", "selective"):
        dpcp.ledger.records.clear()
        rec[f"model_ac_{ac}"] = model_step(dpcp, work, ac)
    rec.update(eval_and_sample(cp4, work))
    if cp2.member:
        rec["torch_cp"] = torch_cp_on_cpu(cp2)
    torch.save(rec, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
