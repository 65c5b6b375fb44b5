"""Worker for tests/test_tensor_parallel.py: every TP case in one spawned 4-rank world.

Parity cases: tp ∈ {2, 4} × engine ∈ {explicit, torch} × sp ∈ {off, on} × tied ∈ {yes, no} on a
GQA model (8 query heads, 4 kv heads) with vocabulary 67 (no tp divides it), 3 AdamW steps of a
global batch of 8 sequences in 2 micro-batches, clipping that binds. Each rank writes
``<out>/<case>_rank<r>.pt``: loss, grad norm, every gradient gathered to full shape and the
ledger's bytes per tag and the full parameters at each step.

Dropout cases (explicit, tp=2, dropout 0.5, sp off/on): the residual-dropout masks and block
outputs of one forward, and draws from the two RNG regions, per rank.

bf16 cases (tp=2, both engines, sp off/on): the ledger's bytes of one step's forward/backward
under bf16 autocast (2 micro-batches of 4).
"""

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.tp import TPDropout
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_NORM, LR = 3, 8, 4, 0.3, 3e-4
MODEL = dict(n_heads=8, n_kv_heads=4)  # tiny: d=32, 2 layers, d_ff=64; GQA with k < h
TPS, ENGINES, SPS, TIED = (2, 4), ("explicit", "torch"), (False, True), (True, False)
TAGS = ("tp_fwd", "tp_bwd", "ce", "sp_grad", "grad_norm", "loss")


def is_slow(tp, engine, sp, tied) -> bool:
    """``make test-slow``'s parity cases (a world whose output folder's name has "slow"): half of
    the 2⁴ product. ``make test`` keeps the half where tp=4, the torch engine, SP and an untied
    embedding are an even number of the four, so every pair of two factors' values (tp × engine,
    engine × SP, SP × tied, ...) still runs in it, each engine at each tp with and without SP."""
    return ((tp == 4) + (engine == "torch") + sp + (not tied)) % 2 == 1


def case_name(tp, engine, sp, tied):
    return f"tp{tp}_{engine}_{'sp' if sp else 'nosp'}_{'tied' if tied else 'untied'}"


def run_parity(topo, work, tp, engine, sp, tied, out, rank):
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, tie_embeddings=tied, **MODEL)
    wrapped = parallelize(model, topo, Layout(tp=tp, sp=sp), engine=engine)
    opt = build_optimizer(wrapped, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))
    sampler = work.sampler(GLOBAL_BATCH, 1, 0, seed=0)  # every tp rank: the whole batch
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [],
           "total_bytes": []}
    with torch.no_grad():  # the evaluation path: loss sum of rows 0..7 before training
        (mb,) = work.batches(torch.arange(8), 8)
        rec["eval_loss_sum"] = float(wrapped.loss_sum_and_count(mb)[0])
    for _ in range(STEPS):
        res = train_step(wrapped, work.batches(sampler.next_local_batch(), MICRO_BATCH), opt,
                         topo, max_norm=MAX_NORM, zero_grad=False)
        rec["bytes"].append({t: topo.ledger.step_bytes(t) for t in TAGS})
        rec["total_bytes"].append(topo.ledger.step_bytes())
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in wrapped.named_full_gradients().items()})
        rec["params"].append({n: p.detach().clone()
                              for n, p in wrapped.named_full_parameters().items()})
    if engine == "explicit":  # local rows beyond the real vocabulary (zero padding)
        emb = model.tok_embeddings
        pad = emb.weight[max(0, 67 - emb.vocab_start):]
        rec["padded_rows"] = pad.shape[0]
        rec["padded_max_abs"] = max([0.0] + [float(w[max(0, 67 - emb.vocab_start):].abs().max())
                                            for w in (emb.weight, model.output.weight)
                                            if pad.shape[0]])
    torch.save(rec, f"{out}/{case_name(tp, engine, sp, tied)}_rank{rank}.pt")


def run_dropout(topo, work, sp, out, rank):
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, dropout=0.5, **MODEL)
    engine = parallelize(model, topo, Layout(tp=2, sp=sp), seed=0)
    masks, blocks = [], []
    for m in model.modules():
        if isinstance(m, TPDropout):  # nonzero input, zero output = dropped
            m.register_forward_hook(lambda mod, i, o: masks.append((o == 0) & (i[0] != 0)))
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, i, o: blocks.append(o.detach().clone()))
    (mb,) = work.batches(torch.arange(4), 4)
    torch.manual_seed(1234 + rank)  # the default RNG differs per rank: masks must not use it
    state = torch.get_rng_state()
    engine.loss_fn.loss_sum_and_count(mb)[0].backward()  # with grad (the engine's is no_grad)
    untouched = torch.equal(state, torch.get_rng_state())
    with engine.loss_fn.rng.fork("replicated"):
        rep = torch.rand(8)
    with engine.loss_fn.rng.fork("sharded"):
        shd = torch.rand(8)
    torch.save({"masks": masks, "blocks": blocks, "replicated_draw": rep, "sharded_draw": shd,
                "default_rng_untouched": untouched, "tp_index": topo.index("tp")},
               f"{out}/dropout_{'sp' if sp else 'nosp'}_rank{rank}.pt")


def run_bf16_bytes(topo, work, engine, sp, out, rank):
    """One forward/backward under bf16 autocast: the ledger's bytes per tag."""
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **MODEL)
    wrapped = parallelize(model, topo, Layout(tp=2, sp=sp), engine=engine)
    topo.ledger.begin_step()
    wrapped.forward_backward(work.batches(torch.arange(8), MICRO_BATCH), 1.0, "bf16")
    wrapped.finish_gradient_sync()
    torch.save({t: topo.ledger.step_bytes(t) for t in TAGS},
               f"{out}/bf16_{engine}_{'sp' if sp else 'nosp'}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    topos = {tp: Topology(tp=tp, ranks=range(tp), timeout_s=60) for tp in TPS}  # collective
    slow = "slow" in Path(out).name
    for tp in TPS:
        for engine, sp, tied in itertools.product(ENGINES, SPS, TIED):
            if topos[tp].member and is_slow(tp, engine, sp, tied) == slow:
                run_parity(topos[tp], work, tp, engine, sp, tied, out, rank)
    for sp in SPS if not slow else ():
        if topos[2].member:
            run_dropout(topos[2], work, sp, out, rank)
            for engine in ENGINES:
                run_bf16_bytes(topos[2], work, engine, sp, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
