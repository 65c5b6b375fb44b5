"""Worker for tests/test_family_parity.py: every model family × layout in one 2-rank world.

For each family folder that the test wrote with transformers (``<out>/<family>``: GPT-2, Qwen2,
Qwen3, Mistral), the model is imported the way ``shardwise train --init-from-hf`` imports it
(config.json → overrides → plain model → ``load_hf_weights``, before ``parallelize``), then
trained for 2 AdamW steps (global batch 8, micro-batches of 2, clipping that binds) in each
layout of :data:`LAYOUTS` (explicit engine, and the PyTorch one: FSDP2, DTensor TP, torch
pipelining). Each rank writes ``<out>/<family>_<layout>_rank<r>.pt``: loss, grad norm, every
gradient and parameter it holds at full shape (a pipeline stage: its own), and the ledger's
bytes by tag against :func:`shardwise.formulas.step_bytes_formula`, per step.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.interop.hf import hf_model_overrides, load_hf_weights
from shardwise.models import Llama, LlamaConfig, set_activation_checkpointing
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

FAMILIES = ("gpt2", "qwen2", "qwen3", "mistral")
STEPS, GLOBAL_BATCH, MICRO, MAX_NORM, LR, SEQ, V = 2, 8, 2, 0.3, 3e-4, 16, 257
# name → (Layout, topology degrees (pp, dp, tp, cp), engine[, activation checkpointing])
LAYOUTS = {"dp2": (Layout(dp=2), (1, 2, 1, 1), "explicit"),
           "dp2_zero3": (Layout(dp=2, zero=3), (1, 2, 1, 1), "explicit"),
           "tp2": (Layout(tp=2), (1, 1, 2, 1), "explicit"),
           "tp2_sp": (Layout(tp=2, sp=True), (1, 1, 2, 1), "explicit"),
           "pp2": (Layout(pp=2, microbatches=4), (2, 1, 1, 1), "explicit"),
           "cp2": (Layout(cp=2), (1, 1, 1, 2), "explicit"),
           "tp2_ac_full": (Layout(tp=2), (1, 1, 2, 1), "explicit", "full"),
           "tp2_sp_ac_selective": (Layout(tp=2, sp=True), (1, 1, 2, 1), "explicit", "selective"),
           "torch_dp2_zero3": (Layout(dp=2, zero=3), (1, 2, 1, 1), "torch"),
           "torch_tp2": (Layout(tp=2), (1, 1, 2, 1), "torch"),
           "torch_tp2_sp": (Layout(tp=2, sp=True), (1, 1, 2, 1), "torch"),
           "torch_pp2": (Layout(pp=2, microbatches=4), (2, 1, 1, 1), "torch")}


# ``make test``: GPT-2 (the family furthest from Llama) in every layout, the others in these
# (ZeRO-3, TP with SP, DTensor TP, a pipeline: where their biases, q/k norms and head_dim are
# split); ``make test-slow`` (a world whose output folder's name has "slow") runs the rest
FAST_LAYOUTS = ("dp2_zero3", "tp2_sp", "torch_tp2", "pp2")


def is_slow(family: str, layout: str) -> bool:
    return family != "gpt2" and layout not in FAST_LAYOUTS


def workload():
    return SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)


def imported_model(folder: str) -> Llama:
    """The plain model ``--init-from-hf folder`` starts from."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**hf_model_overrides(folder)))
    load_hf_weights(model, folder)
    return model


def run_case(topo, work, family, name, layout, engine_name, out, rank, ac="none"):
    model = imported_model(f"{out}/{family}")
    # a recompute's TP collectives are booked outside the step, as in train/loop.py
    set_activation_checkpointing(model, ac, lambda: topo.ledger.phase("recompute"))
    engine = parallelize(model, topo, layout, seed=0, engine=engine_name)
    opt = build_optimizer(engine, TrainConfig(model="tiny", lr=LR, weight_decay=0.1))
    dp = topo.size("dp")
    sampler = work.sampler(GLOBAL_BATCH, dp, topo.index("dp"), seed=0)
    rec = {"loss": [], "grad_norm": [], "grads": [], "params": [], "bytes": [], "formula": []}
    local = GLOBAL_BATCH // dp
    micro_steps = layout.microbatches or local // MICRO
    for _ in range(STEPS):
        res = train_step(engine, work.batches(sampler.next_local_batch(), local // micro_steps),
                         opt, topo, max_norm=MAX_NORM, zero_grad=False)
        by_tag = {}
        for r in topo.ledger.step_records():
            by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
        rec["bytes"].append(by_tag)
        rec["formula"].append(step_bytes_formula(engine, topo, micro_steps=micro_steps,
                                                 sequences=local, seq_len=SEQ))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.detach().clone()
                             for n, g in engine.named_full_gradients().items()})
        rec["params"].append({n: t.detach().clone()
                              for n, t in engine.named_full_parameters().items()})
    torch.save(rec, f"{out}/{family}_{name}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=120)
    rank = dist.get_rank()
    work = workload()
    topos = {}
    for _, degrees, *_ in LAYOUTS.values():  # creation is collective: every rank, same order
        if degrees not in topos:
            pp, dp, tp, cp = degrees
            topos[degrees] = Topology(pp=pp, dp=dp, tp=tp, cp=cp, ranks=range(2),
                                      timeout_s=120)
    slow = "slow" in Path(out).name
    for family in FAMILIES:
        for name, (layout, degrees, engine, *ac) in LAYOUTS.items():
            if is_slow(family, name) != slow:
                continue
            run_case(topos[degrees], work, family, name, layout, engine, out, rank, *ac)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
