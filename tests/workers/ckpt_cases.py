"""Worker for tests/test_checkpoint.py: the resharding matrix in one spawned world.

For every FROM layout: train K steps (sub-topology over ranks 0..w-1), save a checkpoint with
:class:`shardwise.checkpoint.Checkpointer`. For every (FROM, TO) pair: build the model from a
*different* seed (so the weights can only come from the checkpoint), load the checkpoint into the
plain model, parallelize for TO, restore optimizer/scheduler/sampler/RNG, train to step N. Each
rank dumps ``<out>/matrix_rank<r>.pt``: {(from, to): {"losses": [...], "error": str | None}}, and
the pytest process compares the losses with a single-process reference it computes itself.

A control case resumes without the optimizer state: its losses must *differ* from the reference
(otherwise the matrix could not detect a lost optimizer state).
"""

import dataclasses
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import parallelize
from shardwise.parallel.layout import parse_layout
from shardwise.topology import Topology, init_distributed
from shardwise.checkpoint import Checkpointer, load_model, restore_training_state
from shardwise.train.optim import build_optimizer, build_scheduler
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

K, N, GLOBAL_BATCH, MICRO = 2, 4, 8, 2
CFG = TrainConfig(model="tiny", lr=3e-3, warmup_steps=2, steps=N, grad_clip=1.0, seed=0)

# layouts as "verify syntax[@engine]"; the test file holds the same lists
FROM = ["dp=2", "dp=4,zero=3", "tp=2", "pp=2,1f1b", "dp=2,zero=3@torch", "tp=2@torch",
        "dp=2,cp=2,zero=1", "dp=4,dp_replicate=2,zero=3"]
TO = ["dp=1", "dp=2,zero=3", "tp=2", "pp=2,1f1b", "dp=2@torch", "tp=2@torch",
      "pp=2,tp=2,1f1b", "dp=2,tp=2,zero=3", "cp=2,tp=2,sp", "dp=4,dp_replicate=2,zero=2@torch"]
# ``make test``'s share of the (FROM, TO) pairs (a world whose output folder's name has no
# "slow"): every FROM saved and every TO resumed at least once, each into another layout (and
# across engines); ``make test-slow``'s world resumes every pair
FAST = [("dp=2", "dp=2,zero=3"), ("dp=4,zero=3", "pp=2,tp=2,1f1b"), ("tp=2", "dp=2@torch"),
        ("pp=2,1f1b", "tp=2"), ("dp=2,zero=3@torch", "dp=1"), ("tp=2@torch", "pp=2,1f1b"),
        ("dp=2,cp=2,zero=1", "dp=2,tp=2,zero=3"), ("dp=4,dp_replicate=2,zero=3", "cp=2,tp=2,sp"),
        ("dp=2", "tp=2@torch"), ("dp=4,zero=3", "dp=4,dp_replicate=2,zero=2@torch")]


def split(spec: str):
    text, _, engine = spec.partition("@")
    return parse_layout(text), engine or "explicit"


def workload():
    return SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)


def make(layout, engine, topo, seed):
    torch.manual_seed(seed)
    model = build_model("tiny", vocab_size=67, tie_embeddings=True)
    return model


def run(model, layout, engine_name, topo, work, steps, ckpt=None, restore_optimizer=True,
        cfg=CFG, restored=None):
    engine = parallelize(model, topo, layout, engine=engine_name, seed=cfg.seed)
    opt = build_optimizer(engine, cfg)
    sched = build_scheduler(opt, cfg)
    sampler = work.sampler(GLOBAL_BATCH, topo.size("dp"), topo.index("dp"), cfg.seed)
    if ckpt is not None:
        if restore_optimizer:
            restore_training_state(ckpt, engine, opt, scheduler=sched, sampler=sampler,
                                   rank=topo.index("world"))
            if restored is not None:  # the full-shape state right after the restore
                restored.update(engine.full_optimizer_state(opt))
        else:  # control: everything but the optimizer state
            import json

            meta = json.loads((Path(ckpt) / "meta.json").read_text())
            sched.load_state_dict(meta["scheduler"])
            for g, lr in zip(opt.param_groups, sched.get_last_lr()):
                g["lr"] = lr
            sampler.load_state_dict(meta["sampler"])
    losses = []
    for _ in range(steps):
        res = train_step(engine, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
                         max_norm=cfg.grad_clip, scheduler=sched)
        losses.append(res.loss)
    return engine, opt, sched, sampler, losses


# --optimizer muon (issue 41): the momentum buffers are saved in full shape and resharded too
CFG_MUON = dataclasses.replace(CFG, optimizer="muon")
FROM_MUON = ["dp=4,zero=3"]
TO_MUON = ["dp=1", "dp=2,tp=2,zero=1"]


def _topo(layout):
    return Topology(layout.pp, layout.dp, layout.tp, cp=layout.cp,
                    dp_replicate=layout.dp_replicate, ranks=range(layout.world), timeout_s=60)


def muon_matrix(out, work, results) -> None:
    """Save after K Muon steps in each FROM_MUON layout (and the full-shape state gathered
    there, ``muon_state_<i>.pt``); resume in each TO_MUON layout (and "control": dp=2 without
    the optimizer state): ``results[("muon " + from, to)]`` = {"losses", "error", "state":
    the full-shape state right after the restore (rank 0 of the layout), or None}."""
    for i, spec in enumerate(FROM_MUON):
        layout, engine_name = split(spec)
        topo = _topo(layout)
        if not topo.member:
            continue
        try:
            model = make(layout, engine_name, topo, CFG.seed)
            engine, opt, sched, sampler, losses = run(model, layout, engine_name, topo, work, K,
                                                      cfg=CFG_MUON)
            ck = Checkpointer(Path(out) / f"muon_from_{i}", topo)
            ck.save(K, engine, opt, scheduler=sched, sampler=sampler)
            ck.close()
            state = engine.full_optimizer_state(opt)
            if topo.index("world") == 0:
                torch.save(state, Path(out) / f"muon_state_{i}.pt")
            results[("muon " + spec, "save")] = {"losses": losses, "error": None}
        except Exception:
            results[("muon " + spec, "save")] = {"losses": [], "error": traceback.format_exc()}
    dist.barrier()
    for i, spec in enumerate(FROM_MUON):
        ckpt = Path(out) / f"muon_from_{i}" / "checkpoints" / f"step_{K}"
        for to in TO_MUON + (["control"] if i == 0 else []):
            layout, engine_name = split("dp=2" if to == "control" else to)
            topo = _topo(layout)
            if not topo.member:
                continue
            restored: dict = {}
            try:
                model = make(layout, engine_name, topo, seed=1234)
                load_model(ckpt, model)
                _, _, _, _, losses = run(model, layout, engine_name, topo, work, N - K, ckpt,
                                         restore_optimizer=to != "control", cfg=CFG_MUON,
                                         restored=restored)
                results[("muon " + spec, to)] = {
                    "losses": losses, "error": None,
                    "state": restored if topo.index("world") == 0 and restored else None}
            except Exception:
                results[("muon " + spec, to)] = {"losses": [], "error": traceback.format_exc(),
                                                 "state": None}


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    work = workload()
    results, saved = {}, {}
    for spec in FROM:
        layout, engine_name = split(spec)
        topo = Topology(layout.pp, layout.dp, layout.tp, cp=layout.cp,
                        dp_replicate=layout.dp_replicate, ranks=range(layout.world),
                        timeout_s=60)
        if not topo.member:
            continue
        folder = Path(out) / ("from_" + spec.replace(",", "_").replace("=", "").replace("@", "_"))
        try:
            model = make(layout, engine_name, topo, CFG.seed)
            engine, opt, sched, sampler, losses = run(model, layout, engine_name, topo, work, K)
            ck = Checkpointer(folder, topo)
            saved[spec] = ck.save(K, engine, opt, scheduler=sched, sampler=sampler)
            ck.close()
            results[(spec, "save")] = {"losses": losses, "error": None}
        except Exception:
            results[(spec, "save")] = {"losses": [], "error": traceback.format_exc()}
    dist.barrier()
    for spec in FROM:
        ckpt = Path(out) / ("from_" + spec.replace(",", "_").replace("=", "").replace("@", "_")) \
            / "checkpoints" / f"step_{K}"
        for to in TO + ["control"]:
            if to != "control" and (spec, to) not in FAST and "slow" not in Path(out).name:
                continue
            layout, engine_name = split("dp=2" if to == "control" else to)
            topo = Topology(layout.pp, layout.dp, layout.tp, cp=layout.cp,
                            dp_replicate=layout.dp_replicate, ranks=range(layout.world),
                            timeout_s=60)
            if not topo.member:
                continue
            if to == "control" and spec != FROM[0]:
                continue
            try:
                if not (ckpt / "COMPLETE").is_file():
                    raise RuntimeError(f"no complete checkpoint from {spec}")
                model = make(layout, engine_name, topo, seed=1234)  # not the saved init
                load_model(ckpt, model)
                _, _, _, _, losses = run(model, layout, engine_name, topo, work, N - K, ckpt,
                                         restore_optimizer=(to != "control"))
                results[(spec, to)] = {"losses": losses, "error": None}
            except Exception:
                results[(spec, to)] = {"losses": [], "error": traceback.format_exc()}
    muon_matrix(out, work, results)
    torch.save(results, f"{out}/matrix_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
