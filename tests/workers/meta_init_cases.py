"""Worker for tests/test_meta_init.py: one 4-rank world; for each layout, the engine built from a
model on the meta device (``parallelize(..., weights=plan.stream())``: each rank allocates and
fills only what it holds) against today's path (the model built whole, then parallelized).
Cases named ``hf_*`` start from an HF folder (argument 2, default ``<out>/hf``, written by the
test): the meta path
streams it (``hf_weight_stream``), today's path loads it whole (``load_hf_weights``). Each rank
writes ``<out>/<case>_rank<r>.pt``: for both paths, the full parameters after
parallelize, and after two AdamW steps the losses, grad norms and full parameters; and, for
the meta path, the bytes this rank's engine holds in parameter storage and the elements it
read of each HF tensor (``shardwise.lazy.counting``)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.interop.hf import hf_weight_stream, load_hf_weights
from shardwise.lazy import counting
from shardwise.models import build_model
from shardwise.models.meta import build_on_meta
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 2
# (case name, model, layout kwargs, engine): every family the explicit engine builds from the
# meta model itself; the torch engine's FSDP2, DTensor TP and pipeline stages do too, its DDP
# (dp4_z0_torch) and ZeroRedundancyOptimizer get the whole model first. A case
# ending in "_deep" has 4 layers (an interleaved pipeline needs one per chunk).
CASES = [
    ("dp4", "tiny", dict(dp=4), "explicit"),
    ("dp4_z1", "tiny", dict(dp=4, zero=1), "explicit"),
    ("dp4_z2", "tiny", dict(dp=4, zero=2), "explicit"),
    ("dp4_z3", "tiny", dict(dp=4, zero=3), "explicit"),
    ("hsdp2x2_z3", "tiny", dict(dp=4, zero=3, dp_replicate=2), "explicit"),
    ("tp4", "tiny", dict(tp=4), "explicit"),
    ("dp2_tp2_sp", "tiny", dict(dp=2, tp=2, sp=True), "explicit"),
    ("dp2_tp2_z3", "tiny", dict(dp=2, tp=2, zero=3), "explicit"),
    ("dp2_cp2_z1", "tiny", dict(dp=2, cp=2, zero=1), "explicit"),
    ("moe_dp4_ep2_z3", "moe-tiny", dict(dp=4, ep=2, zero=3), "explicit"),
    ("moe_dp2_tp2_ep2", "moe-tiny", dict(dp=2, tp=2, ep=2), "explicit"),
    ("pp2_dp2", "tiny", dict(pp=2, dp=2), "explicit"),
    ("pp2_tp2_sp", "tiny", dict(pp=2, tp=2, sp=True), "explicit"),
    ("pp2_dp2_z1", "tiny", dict(pp=2, dp=2, zero=1), "explicit"),
    ("pp2_v2_dp2_deep", "tiny", dict(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2),
     "explicit"),
    ("dp4_z3_torch", "tiny", dict(dp=4, zero=3), "torch"),
    ("dp4_z2_torch", "tiny", dict(dp=4, zero=2), "torch"),
    ("hsdp2x2_z1_torch", "tiny", dict(dp=4, zero=1, dp_replicate=2), "torch"),
    ("dp4_z0_torch", "tiny", dict(dp=4), "torch"),
    ("tp4_torch", "tiny", dict(tp=4), "torch"),
    ("dp2_tp2_sp_z3_torch", "tiny", dict(dp=2, tp=2, sp=True, zero=3), "torch"),
    ("dp2_tp2_z0_torch", "tiny", dict(dp=2, tp=2), "torch"),
    ("moe_dp4_z3_torch", "moe-tiny", dict(dp=4, zero=3), "torch"),
    ("pp2_dp2_torch", "tiny", dict(pp=2, dp=2), "torch"),
    ("pp2_tp2_torch", "tiny", dict(pp=2, tp=2), "torch"),
    ("pp2_dp2_z1_torch", "tiny", dict(pp=2, dp=2, zero=1), "torch"),
    # from an HF folder (argv[2], written by the test): hf_weight_stream vs load_hf_weights
    ("hf_dp4_z3", "tiny", dict(dp=4, zero=3), "explicit"),
    ("hf_dp2_tp2", "tiny", dict(dp=2, tp=2), "explicit"),
    ("hf_pp2_dp2", "tiny", dict(pp=2, dp=2), "explicit"),
    ("hf_dp4_z3_torch", "tiny", dict(dp=4, zero=3), "torch"),
    ("hf_pp2_tp2_torch", "tiny", dict(pp=2, tp=2), "torch"),
    ("hf_moe_dp4_ep2_z3", "moe-tiny", dict(dp=4, ep=2, zero=3), "explicit"),  # <hf>_moe
    ("hf_dp4_z1", "tiny", dict(dp=4, zero=1), "explicit"),
    ("hf_hsdp2x2_z3", "tiny", dict(dp=4, zero=3, dp_replicate=2), "explicit"),
    ("hf_dp2_cp2_z2", "tiny", dict(dp=2, cp=2, zero=2), "explicit"),
    ("hf_tp4_sp", "tiny", dict(tp=4, sp=True), "explicit"),
    ("hf_dp2_tp2_sp_z3_torch", "tiny", dict(dp=2, tp=2, sp=True, zero=3), "torch"),
]
# ``make test-slow``'s cases (a world whose output folder's name has "slow"): the ZeRO stages and
# layouts a kept case already builds the same way (``make test`` keeps ZeRO-0/3, HSDP, each
# axis, the pipelines and MoE on both engines). Also there: the replayed-init builds of the
# layouts whose meta build ``make test`` runs from an HF folder in the same layout (hf_pp2_dp2,
# hf_dp4_z3_torch, hf_pp2_tp2_torch, hf_moe_dp4_ep2_z3, hf_dp2_tp2_sp_z3_torch); the replayed
# init itself stays on each engine (dp4, dp4_z3, HSDP, TP, CP, PP explicit; moe_dp4_z3_torch)
SLOW = {"dp4_z1", "dp4_z2", "tp4", "moe_dp2_tp2_ep2", "pp2_dp2_z1", "dp4_z2_torch",
        "hsdp2x2_z1_torch", "dp4_z0_torch", "tp4_torch", "dp2_tp2_z0_torch", "pp2_dp2_z1_torch",
        "hf_dp4_z1", "hf_tp4_sp",
        "pp2_dp2", "dp4_z3_torch", "pp2_tp2_torch", "moe_dp4_ep2_z3", "dp2_tp2_sp_z3_torch"}
MODEL = {"tiny": dict(n_heads=8, n_kv_heads=4), "moe-tiny": {}}  # tp = 4 divides the heads
CFG = TrainConfig(model="tiny", lr=3e-3, weight_decay=0.1)


def engine_bytes(engine) -> int:
    """Bytes of parameter storage this rank's engine holds (each storage once; ZeRO-3's
    freed unit buffers count 0, their slices count)."""
    seen, total = set(), 0
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in engine.module.parameters()]
    for u in getattr(engine.parts[0], "units", ()):
        if hasattr(u, "shard"):  # the explicit ZeRO's flat buffers (FSDP2's units are modules)
            tensors += [u.full, u.shard]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _folder(case, hf):
    """The HF folder of a case: a Mixtral's (``hf_moe_*``) beside the Llama's."""
    return f"{hf}_moe" if case.startswith("hf_moe") else hf


def _model_kw(case, model_name):
    return {**MODEL[model_name], **(dict(n_layers=4) if case.endswith("_deep") else {})}


def run(case, model_name, kw, engine_name, work, out, rank, hf=None):
    layout = Layout(**kw)
    topo = Topology(kw.get("pp", 1), kw.get("dp", 1), kw.get("tp", 1), cp=kw.get("cp", 1),
                    ep=kw.get("ep", 1), dp_replicate=kw.get("dp_replicate", 1), timeout_s=60)
    rec = {}
    for path in ("whole", "meta"):
        torch.manual_seed(0)
        if path == "whole":
            model = build_model(model_name, vocab_size=67, **_model_kw(case, model_name))
            if case.startswith("hf_"):
                load_hf_weights(model, _folder(case, hf))
            engine = parallelize(model, topo, layout, engine=engine_name)
        else:
            model, plan = build_on_meta(model_name, vocab_size=67, **_model_kw(case, model_name))
            weights = plan.stream()
            if case.startswith("hf_"):  # as train does: the init's draws, then the folder's
                plan.replay_draws()
                weights = hf_weight_stream(model, _folder(case, hf))
            with counting() as reads:  # the elements this rank reads of each HF tensor
                engine = parallelize(model, topo, layout, engine=engine_name, weights=weights)
            rec["reads"] = {k: sum(v) for k, v in reads.items()}
            rec["meta_bytes"] = engine_bytes(engine)
        r = {"rng": torch.random.get_rng_state(),
             "init": {n: p.detach().clone() for n, p in engine.named_full_parameters().items()}}
        opt = build_optimizer(engine, CFG)
        sampler = work.sampler(GLOBAL_BATCH, topo.size("dp"), topo.index("dp"), seed=0)
        r["loss"], r["norm"] = [], []
        for _ in range(STEPS):
            res = train_step(engine, work.batches(sampler.next_local_batch(), MICRO_BATCH), opt,
                             topo, max_norm=1.0, zero_grad=False)
            r["loss"].append(res.loss)
            r["norm"].append(res.grad_norm)
        r["final"] = {n: p.detach().clone() for n, p in engine.named_full_parameters().items()}
        rec[path] = r
    torch.save(rec, f"{out}/{case}_rank{rank}.pt")


def main(out):
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    hf = sys.argv[2] if len(sys.argv) > 2 else f"{out}/hf"  # the HF folder (the test's)
    only = sys.argv[3:]  # case names (all when none)
    for case, model_name, kw, engine_name in CASES:
        if (case in SLOW) != ("slow" in Path(out).name):
            continue
        if not only or case in only:
            run(case, model_name, kw, engine_name, work, out, rank, hf)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])  # argv: OUT [HF_FOLDER [CASE ...]]
