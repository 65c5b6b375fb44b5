"""Worker for tests/test_compose_torch.py: every case of the torch 2D engine in one 4-rank world.

Parity cases (dp=2 × tp=2, ``parallelize(..., engine="torch")``): zero 0 (FSDP2 ``replicate``),
1, 2 (with SP), 3 — 3 AdamW steps of a global batch of 8 sequences, 2 micro-batches
of 2 per rank (gradient accumulation), clipping that binds, on a GQA model (8 heads, 4 kv
heads, tied embeddings) with vocabulary 67 (tp does not divide it). Each rank writes
``<out>/<case>_rank<r>.pt``: loss, grad norm, every gradient gathered to full shape, the
ledger's bytes per tag and the formula per tag at each step.

bf16 cases (zero 0 and 3): one step with ``reduce_dtype="bf16"``: bytes per tag, formula,
gradients. The same for the 1-D torch engines at dp=4 (DDP, ZeroRedundancyOptimizer over DDP,
FSDP2), fp32 and bf16.

Optimizer-state round trip: after the zero-3 case's 3 steps, ``full_optimizer_state`` and the
full parameters are loaded into (a) torch dp=4, zero=3 (FSDP2 over 4 ranks), (b) torch dp=4,
zero=1 (ZeroRedundancyOptimizer: each rank keeps its own parameters' state), (c) torch tp=2
(DTensor, ranks 0 and 1) and (d) a plain
single-process model on every rank; each then trains step 4 on the same global batch as the
2D engine's own step 4. Each rank writes the step-4 losses and each engine's full-shape state
after step 4.
"""

import copy
import sys

import torch
import torch.distributed as dist

from shardwise.precision import Precision
from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.model import Local
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_NORM, LR = 3, 8, 2, 0.3, 3e-4
MODEL = dict(n_heads=8, n_kv_heads=4)  # tiny: d=32, 2 layers, d_ff=64; GQA with k < h
CASES = [(0, False), (1, False), (2, True), (3, False)]  # (zero, sp); verify adds zero=3,sp
BF16_ZEROS = (0, 3)
TAGS = ("grad", "param", "grad_norm", "tp_fwd", "tp_bwd", "ce", "sp_grad", "loss")
CFG = TrainConfig(model="tiny", lr=LR, weight_decay=0.1)


def case_name(zero, sp, reduce_dtype="fp32"):
    return f"z{zero}_{'sp' if sp else 'nosp'}_{reduce_dtype}"


def workload():
    return SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)


def _model():
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=67, **MODEL)


def _step(engine, opt, topo, sampler, work, micro_batch, rec=None):
    res = train_step(engine, work.batches(sampler.next_local_batch(), micro_batch), opt, topo,
                     max_norm=MAX_NORM, zero_grad=False)
    if rec is not None:
        from shardwise.formulas import step_bytes_formula

        f = step_bytes_formula(engine, topo, micro_steps=GLOBAL_BATCH // micro_batch
                               // topo.size("dp"), sequences=GLOBAL_BATCH // topo.size("dp"),
                               seq_len=16)
        rec["bytes"].append({t: topo.ledger.step_bytes(t) for t in TAGS})
        rec["total_bytes"].append(topo.ledger.step_bytes())
        rec["formula"].append(f)
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.detach().clone()
                             for n, g in engine.named_full_gradients().items()})
        if "params" in rec:
            rec["params"].append({n: p.detach().clone()
                                  for n, p in engine.named_full_parameters().items()})
    return res


def run_parity(topo, topo4, topo_tp, work, zero, sp, out, rank):
    layout = Layout(dp=2, tp=2, zero=zero, sp=sp)
    engine = parallelize(_model(), topo, layout, engine="torch")
    opt = build_optimizer(engine, CFG)
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [],
           "total_bytes": [], "formula": [], "engine": type(engine).__name__}
    for _ in range(STEPS):
        _step(engine, opt, topo, sampler, work, MICRO_BATCH, rec)
    if zero == 3 and not sp:
        rec["roundtrip"] = roundtrip(engine, opt, topo, topo4, topo_tp, sampler, work)
    torch.save(rec, f"{out}/{case_name(zero, sp)}_rank{rank}.pt")


def roundtrip(engine, opt, topo, topo4, topo_tp, sampler, work):
    """Save layout-free state from the 2D engine, load it under dp=4 zero=3 and into a plain
    model, and train step 4 everywhere; returns the three step-4 losses."""
    state = engine.full_optimizer_state(opt)
    step = float(next(iter(state.values()))["step"])  # before any optimizer holds it
    params = engine.named_full_parameters()
    own = _step(engine, opt, topo, sampler, work, MICRO_BATCH).loss  # the 2D engine's step 4

    def restored(wrap):
        model = _model()
        model.load_state_dict(params, strict=False)
        eng = wrap(model)
        o = build_optimizer(eng, CFG)
        eng.load_full_optimizer_state(o, copy.deepcopy(state))  # as if read from a file
        return eng, o

    eng4, opt4 = restored(lambda m: parallelize(m, topo4, Layout(dp=4, zero=3), engine="torch"))
    s4 = work.sampler(GLOBAL_BATCH, 4, topo4.index("dp"), seed=0)
    for _ in range(STEPS):
        s4.next_local_batch()
    dp4 = _step(eng4, opt4, topo4, s4, work, 1).loss  # 4 ranks × 2 micro-batches of 1
    after = {"dp4_zero3": eng4.full_optimizer_state(opt4)}
    eng1, opt1z = restored(lambda m: parallelize(m, topo4, Layout(dp=4, zero=1), engine="torch"))
    s4 = work.sampler(GLOBAL_BATCH, 4, topo4.index("dp"), seed=0)
    for _ in range(STEPS):
        s4.next_local_batch()
    z1 = _step(eng1, opt1z, topo4, s4, work, 1).loss  # ZeroRedundancyOptimizer: owners only
    after["dp4_zero1"] = eng1.full_optimizer_state(opt1z)
    local, opt1 = restored(Local)
    s1 = work.sampler(GLOBAL_BATCH, 1, 0, seed=0)
    for _ in range(STEPS):
        s1.next_local_batch()
    plain = train_step(local, work.batches(s1.next_local_batch(), MICRO_BATCH), opt1,
                       max_norm=MAX_NORM, zero_grad=False).loss
    after["plain"] = local.full_optimizer_state(opt1)
    plain_grads = {n: p.grad.clone() for n, p in local.module.named_parameters()}
    if topo_tp.member:  # torch tp=2 (DTensor) on ranks 0, 1
        eng_tp, opt_tp = restored(lambda m: parallelize(m, topo_tp, Layout(tp=2),
                                                        engine="torch"))
        s1 = work.sampler(GLOBAL_BATCH, 1, 0, seed=0)
        for _ in range(STEPS):
            s1.next_local_batch()
        tp2 = _step(eng_tp, opt_tp, topo_tp, s1, work, MICRO_BATCH).loss
        after["tp2"] = eng_tp.full_optimizer_state(opt_tp)
    else:
        tp2, after["tp2"] = plain, after["plain"]  # not a member: nothing to compare
    after["own"] = engine.full_optimizer_state(opt)
    return {"own": own, "dp4_zero3": dp4, "dp4_zero1": z1, "plain": plain, "tp2": tp2,
            "state_keys": sorted(state), "step": step, "state_after": after,
            "params": {n: p.detach().clone() for n, p in params.items()},
            "plain_grads": plain_grads}


def run_bf16(topo, work, zero, out, rank):
    layout = Layout(dp=2, tp=2, zero=zero)
    engine = parallelize(_model(), topo, layout, engine="torch",
                         precision=Precision.of(reduce="bf16"))
    opt = build_optimizer(engine, CFG)
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "bytes": [], "total_bytes": [],
           "formula": []}
    _step(engine, opt, topo, sampler, work, MICRO_BATCH, rec)
    rec["grad_dtypes"] = sorted({r.dtype for r in topo.ledger.step_records() if r.tag == "grad"})
    torch.save(rec, f"{out}/{case_name(zero, False, 'bf16')}_rank{rank}.pt")


def run_bf16_1d(topo4, work, zero, out, rank):
    """Torch dp=4 (DDP: zero 0, ZeroRedundancyOptimizer over DDP: zero 1, FSDP2: zero 3) with
    reduce_dtype fp32 and bf16: one step each, bytes per tag and the formula."""
    rec = {}
    for reduce_dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        engine = parallelize(_model(), topo4, Layout(dp=4, zero=zero), engine="torch",
                             precision=Precision.of(reduce=reduce_dtype))
        opt = build_optimizer(engine, CFG)
        sampler = work.sampler(GLOBAL_BATCH, 4, topo4.index("dp"), seed=0)
        r = {"loss": [], "grad_norm": [], "grads": [], "bytes": [], "total_bytes": [],
             "formula": []}
        _step(engine, opt, topo4, sampler, work, 1, r)
        r["grad_dtypes"] = sorted({x.dtype for x in topo4.ledger.step_records()
                                   if x.tag == "grad"})
        rec[reduce_dtype] = r
    torch.save(rec, f"{out}/dp4_z{zero}_reduce_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = workload()
    topo = Topology(dp=2, tp=2, ranks=range(4), timeout_s=60)  # collective, same order
    topo4 = Topology(dp=4, ranks=range(4), timeout_s=60)
    topo_tp = Topology(tp=2, ranks=range(2), timeout_s=60)
    for zero, sp in CASES:
        run_parity(topo, topo4, topo_tp, work, zero, sp, out, rank)
    for zero in BF16_ZEROS:
        run_bf16(topo, work, zero, out, rank)
    for zero in (0, 1, 3):
        run_bf16_1d(topo4, work, zero, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
