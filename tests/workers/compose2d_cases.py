"""Worker for tests/test_compose_2d.py: every explicit dp × tp case in one spawned 4-rank world.

* parity: dp=2 × tp=2 with zero ∈ {0, 1, 2, 3}, SP on/off, tied/untied embeddings; 3 AdamW steps
  of a global batch of 8 sequences (4 per dp rank in 2 micro-batches: gradient accumulation),
  clipping that binds. Per step: loss, grad norm, every gradient gathered to full shape, the
  ledger's bytes per tag and the engine's formula; at the end: full parameters, an evaluation
  loss sum and the full logits of ``full_model`` on validation rows, the full optimizer state,
  model-state bytes and the memory formula.
* bf16: the same with ``reduce_dtype="bf16"`` (zero 0 and zero 3 + SP); and plain dp=4 (no TP)
  with zero 0 and 2, fp32 and bf16, 2 steps each.
* resume: layout A (dp=2, tp=2, zero=3, sp) trains 4 steps and saves its full parameters and
  full optimizer state after step 2; layouts B (dp=4 zero=1, tp=2, dp=2 tp=2 zero=0, A itself,
  and A with fresh optimizer state as a negative control) load them and train steps 3 and 4.
* dropout: one forward of dp=2 × tp=2 with dropout 0.5: residual-dropout masks per rank.
* errors: bad input to parallelize (dp × tp) / reduce_dtype must raise ShardwiseConfigError.
Each rank writes ``<out>/<case>_rank<r>.pt``.
"""

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.precision import Precision
from shardwise.config import TrainConfig
from shardwise.errors import ShardwiseConfigError
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.dp import DataParallel
from shardwise.parallel.tp import TPDropout
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_NORM, LR, SEQ = 3, 8, 2, 0.3, 3e-4, 16
MODEL = dict(n_heads=8, n_kv_heads=4)  # tiny: d=32, 2 layers, d_ff=64, GQA; vocab 67
TAGS = ("tp_fwd", "tp_bwd", "ce", "grad", "param", "sp_grad", "grad_norm", "loss",
        "checkpoint")
PARITY = [(0, False, True), (0, True, False), (1, False, True), (1, True, False),
          (2, True, True), (3, True, True), (3, False, False)]  # (zero, sp, tied)
BF16 = [(0, False, True), (3, True, True)]  # fp32 twins in PARITY
# ``make test-slow``'s parity cases (a world whose output folder's name has "slow"); ``make test``
# keeps each ZeRO stage once — (0, nosp, tied), (1, sp, untied), (2, sp, tied), (3, sp, tied) —
# so SP on and off, tied and untied, and BF16's fp32 twins
PARITY_SLOW = [(0, True, False), (1, False, True), (3, False, False)]
PLAIN_ZERO = (0, 2)  # dp=4 without TP, fp32 and bf16 gradient reduction
RESUME_STEPS, SAVE_AFTER = 4, 2
RESUME_TARGETS = ("dp4_zero1", "tp2", "dp2_tp2_zero0", "dp2_tp2_zero3_sp", "fresh_state")


def case_name(zero, sp, tied, reduce_dtype="fp32"):
    return (f"z{zero}_{'sp' if sp else 'nosp'}_{'tied' if tied else 'untied'}"
            f"{'_bf16' if reduce_dtype == 'bf16' else ''}")


def workload():
    return SyntheticLMWorkload(vocab_size=67, seq_len=SEQ, num_train=64, num_val=4, seed=0)


def make_model(tied=True, **kw):
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=67, tie_embeddings=tied, **MODEL, **kw)


def _optimizer(engine):
    return build_optimizer(engine, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))


def _step(engine, opt, topo, sampler, work, micro):
    return train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                      max_norm=MAX_NORM, zero_grad=False)


def _copies(named: dict) -> dict:
    """Detached copies (some engines return their live tensors, which later steps change)."""
    return {n: t.detach().clone() for n, t in named.items()}


def run_parity(topo, work, zero, sp, tied, reduce_dtype, out, rank):
    engine = parallelize(make_model(tied), topo, Layout(dp=2, tp=2, zero=zero, sp=sp), seed=0,
                         precision=Precision.of(reduce=reduce_dtype))
    opt = _optimizer(engine)
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), seed=0)
    rec = {k: [] for k in ("loss", "grad_norm", "grads", "params", "bytes", "formula",
                           "engine_formula", "grad_dtypes")}
    local_seqs = GLOBAL_BATCH // 2
    for _ in range(STEPS):
        res = _step(engine, opt, topo, sampler, work, MICRO_BATCH)
        rec["bytes"].append({t: topo.ledger.step_bytes(t) for t in TAGS}
                            | {"total": topo.ledger.step_bytes()})
        rec["grad_dtypes"].append(sorted({r.dtype for r in topo.ledger.step_records()
                                          if r.tag == "grad"}))
        rec["formula"].append(step_bytes_formula(engine, topo, micro_steps=2,
                                                 sequences=local_seqs, seq_len=SEQ))
        rec["engine_formula"].append(engine.bytes_formula(2, local_seqs, SEQ))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append(_copies(engine.named_full_gradients()))
        rec["params"].append(_copies(engine.named_full_parameters()))
    (val,) = work.batches(torch.arange(4), 4, split="val")
    rec["eval_loss_sum"] = float(engine.loss_sum_and_count(val)[0])  # no_grad inside
    with torch.no_grad(), engine.full_model() as full:  # sampling: full weights, full logits
        rec["full_logits"] = full(val["input_ids"])  # [b, s, V]
    rec["opt_state"] = engine.full_optimizer_state(opt)
    rec["state_bytes"] = engine.model_state_bytes(opt)
    rec["memory_formula"] = engine.memory_formula()
    rec["local_numel"] = engine.local_numel
    rec["sp_slice_numel"] = engine.grad_sync.replicated_slice_numel() if zero else None
    torch.save(rec, f"{out}/{case_name(zero, sp, tied, reduce_dtype)}_rank{rank}.pt")


def run_plain_dp(topo, work, zero, reduce_dtype, out, rank):
    """dp=4 without TP (DataParallel / ZeroSync) with ``reduce_dtype``: 2 steps."""
    engine = parallelize(make_model(), topo, Layout(dp=4, zero=zero),
                         precision=Precision.of(reduce=reduce_dtype))
    opt = _optimizer(engine)
    sampler = work.sampler(GLOBAL_BATCH, 4, topo.index("dp"), seed=0)
    rec = {k: [] for k in ("loss", "bytes", "formula", "grad_dtypes")}
    for _ in range(2):
        rec["loss"].append(_step(engine, opt, topo, sampler, work, 1).loss)
        rec["bytes"].append({t: topo.ledger.step_bytes(t) for t in TAGS}
                            | {"total": topo.ledger.step_bytes()})
        rec["grad_dtypes"].append(sorted({r.dtype for r in topo.ledger.step_records()
                                          if r.tag == "grad"}))
        rec["formula"].append(step_bytes_formula(engine, topo, micro_steps=2,
                                                 sequences=GLOBAL_BATCH // 4, seq_len=SEQ))
    torch.save(rec, f"{out}/plain_z{zero}_{reduce_dtype}_rank{rank}.pt")


def _resume_layout(target):
    return {"dp4_zero1": Layout(dp=4, zero=1), "tp2": Layout(tp=2),
            "dp2_tp2_zero0": Layout(dp=2, tp=2), "dp2_tp2_zero3_sp": Layout(dp=2, tp=2, zero=3,
                                                                            sp=True),
            "fresh_state": Layout(dp=2, tp=2, zero=3, sp=True)}[target]


def run_resume_source(topo, work, out, rank):
    """Layout A: RESUME_STEPS steps; full params/state saved after SAVE_AFTER steps."""
    engine = parallelize(make_model(), topo, _resume_layout("dp2_tp2_zero3_sp"), seed=0)
    opt = _optimizer(engine)
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), seed=0)
    rec = {"loss": [], "grads": [], "params": []}
    for step in range(RESUME_STEPS):
        rec["loss"].append(_step(engine, opt, topo, sampler, work, MICRO_BATCH).loss)
        rec["grads"].append(_copies(engine.named_full_gradients()))
        rec["params"].append(_copies(engine.named_full_parameters()))
        if step + 1 == SAVE_AFTER:
            rec["saved_state"] = engine.full_optimizer_state(opt)
            rec["saved_params"] = engine.named_full_parameters()
    rec["final_state"] = engine.full_optimizer_state(opt)
    torch.save(rec, f"{out}/resume_source_rank{rank}.pt")
    return rec


def run_resume_target(topo, work, target, saved_params, saved_state, out, rank):
    """Load the saved full params (into the plain model) and full optimizer state (into the new
    layout's optimizer), then train steps SAVE_AFTER+1 … RESUME_STEPS."""
    layout = _resume_layout(target)
    model = make_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved_params[n])
    engine = parallelize(model, topo, layout, seed=0)
    opt = _optimizer(engine)
    if target != "fresh_state":
        engine.load_full_optimizer_state(opt, saved_state)
    rec = {"loaded_state": engine.full_optimizer_state(opt) if target != "fresh_state" else None}
    dp = layout.dp
    sampler = work.sampler(GLOBAL_BATCH, dp, topo.index("dp") if dp > 1 else 0, seed=0)
    for _ in range(SAVE_AFTER):
        sampler.next_local_batch()  # the data position of the checkpoint
    rec["loss"], rec["grads"], rec["params"] = [], [], []
    micro = GLOBAL_BATCH // dp // 2
    for _ in range(SAVE_AFTER, RESUME_STEPS):
        rec["loss"].append(_step(engine, opt, topo, sampler, work, micro).loss)
        rec["grads"].append(_copies(engine.named_full_gradients()))
        rec["params"].append(_copies(engine.named_full_parameters()))
    rec["final_state"] = engine.full_optimizer_state(opt)
    torch.save(rec, f"{out}/resume_{target}_rank{rank}.pt")


def run_dropout(topo, work, out, rank):
    engine = parallelize(make_model(dropout=0.5), topo, Layout(dp=2, tp=2), seed=0)
    masks = []
    for m in engine.module.modules():
        if isinstance(m, TPDropout):  # nonzero input, zero output = dropped
            m.register_forward_hook(lambda mod, i, o: masks.append((o == 0) & (i[0] != 0)))
    (mb,) = work.batches(torch.arange(4), 4)  # the same batch on every rank: masks alone differ
    torch.manual_seed(1234 + rank)  # the default RNG differs per rank: masks must not use it
    engine.loss_sum_and_count(mb)  # eval path runs no_grad, but the model is in train mode
    torch.save({"masks": masks, "dp": topo.index("dp"), "tp": topo.index("tp")},
               f"{out}/dropout_rank{rank}.pt")


def _catch(fn) -> str:
    try:
        fn()
    except ShardwiseConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - the test reports the wrong kind of error
        return "WRONG ERROR TYPE: " + traceback.format_exc()
    return "NO ERROR"


def error_cases(topo22, topo4, out, rank):
    """Each must raise before any collective (a hang would time the world out)."""
    msgs = {}
    if topo22.member:
        msgs["mlp"] = _catch(lambda: parallelize(build_model("mlp-tiny"), topo22,
                                                    Layout(dp=2, tp=2, sp=True)))
        msgs["reduce_dtype"] = _catch(lambda: parallelize(make_model(), topo22,
                                                             Layout(dp=2, tp=2),
                                                             precision=Precision.of(reduce="fp16")))
        msgs["tp_heads"] = _catch(lambda: parallelize(
            build_model("tiny", vocab_size=67, n_heads=4, n_kv_heads=1), topo22,
            Layout(dp=2, tp=2)))
        msgs["wrong_topology"] = _catch(lambda: parallelize(make_model(), topo22,
                                                               Layout(dp=4, tp=2)))
    if topo4.member:
        msgs["dp_reduce_dtype"] = _catch(lambda: DataParallel(make_model(), topo4,
                                                              precision=Precision.of(reduce="int8")))
        msgs["zero_reduce_dtype"] = _catch(lambda: parallelize(make_model(), topo4,
                                                               Layout(dp=4, zero=2),
                                                               precision=Precision.of(reduce="fp8")))
    torch.save(msgs, f"{out}/errors_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=120)
    rank = dist.get_rank()
    work = workload()
    # creation is collective: every rank builds every topology, in the same order
    topo22 = Topology(1, 2, 2, ranks=range(4), timeout_s=120)
    topo4 = Topology(dp=4, ranks=range(4), timeout_s=120)
    topo_tp2 = Topology(tp=2, ranks=range(2), timeout_s=120)
    if "slow" in Path(out).name:
        for zero, sp, tied in PARITY_SLOW:
            run_parity(topo22, work, zero, sp, tied, "fp32", out, rank)
        dist.barrier()
        dist.destroy_process_group()
        return
    for zero, sp, tied in PARITY:
        if (zero, sp, tied) not in PARITY_SLOW:
            run_parity(topo22, work, zero, sp, tied, "fp32", out, rank)
    for zero, sp, tied in BF16:
        run_parity(topo22, work, zero, sp, tied, "bf16", out, rank)
    for zero in PLAIN_ZERO:
        for reduce_dtype in ("fp32", "bf16"):
            run_plain_dp(topo4, work, zero, reduce_dtype, out, rank)
    src = run_resume_source(topo22, work, out, rank)
    for target in RESUME_TARGETS:
        topo = {"dp4_zero1": topo4, "tp2": topo_tp2}.get(target, topo22)
        if topo.member:
            run_resume_target(topo, work, target, src["saved_params"], src["saved_state"], out,
                              rank)
    run_dropout(topo22, work, out, rank)
    error_cases(topo22, topo4, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
