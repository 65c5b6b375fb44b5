"""Worker for tests/test_checkpoint.py's shard-by-shard cases (issue 53), in one spawned world.

For every layout of ``SAVE`` (``SLOW`` instead when the output folder's name says "slow"): train K steps, then
gather the full-shape state the old way (``engine.named_full_parameters()`` and
``engine.full_optimizer_state``: collectives, an independent code path: the reference), record
the boxes this rank holds (``engine.held_boxes``), and save a checkpoint with
:class:`shardwise.checkpoint.Checkpointer` (shard by shard). Then the dp 4 ZeRO-3 checkpoint is
resumed at tp 2 × pp 2 (a model built from another seed: the weights can only come from the
checkpoint) and its full-shape parameters and optimizer state are gathered there. Each rank
dumps ``<out>/shard_rank<r>.pt``: {spec: {"ref": (model, optim) | None, "boxes": [(key,
offsets)], "folder": str, "error": str | None}} and {"resumed " + spec: {...}}.
"""

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.checkpoint import Checkpointer, load_model, restore_training_state
from shardwise.models import build_model
from shardwise.parallel.apply import parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer, build_scheduler
from shardwise.train.step import train_step

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_cases import CFG, GLOBAL_BATCH, MICRO, split, workload

K = 2
# one each of ZeRO-1 (with TP and its vocabulary padding: 67 rows over tp 2), ZeRO-2, ZeRO-3,
# PP (its ZeRO-1), HSDP, EP and FSDP2; "moe" = the MoE model
SAVE = ["dp=4,zero=3", "dp=2,tp=2,zero=1", "dp=2,zero=2", "pp=2,dp=2,zero=1,1f1b",
        "dp=4,dp_replicate=2,zero=3", "dp=2,ep=2 moe", "dp=2,zero=3@torch"]
SLOW = ["tp=2", "tp=2@torch", "dp=2,tp=2,zero=3@torch", "dp=4,ep=2,zero=3 moe",
        "pp=2,tp=2,1f1b", "dp=2,cp=2,zero=2"]
RESUME = {"dp=4,zero=3": "pp=2,tp=2,1f1b"}


class CopiesDcpHolds:
    """Counts, while DCP writes a save, the bytes of the copies it holds: every tensor DCP's
    writer hands to ``torch.save`` (``filesystem._write_item``, torch 2.13) whose memory is no
    box's (``box_ptrs``: a clone of a view, a device tensor's host copy) is a copy; at each
    write, the bytes of the copies still alive (weak references) are summed. ``peak``: the
    largest sum."""

    def __init__(self, box_ptrs: set):
        import torch.distributed.checkpoint.filesystem as fs

        self.fs, self.box_ptrs, self.live, self.peak = fs, box_ptrs, [], 0
        self.original = fs._write_item  # AttributeError: DCP's writer changed, update the hook

    def __enter__(self):
        import weakref

        def counting(transforms, stream, data, *args, **kwargs):
            if torch.is_tensor(data) and data.data_ptr() not in self.box_ptrs:
                self.live.append((weakref.ref(data), data.nbytes))
            self.live = [(r, n) for r, n in self.live if r() is not None]
            self.peak = max(self.peak, sum(n for _, n in self.live))
            return self.original(transforms, stream, data, *args, **kwargs)

        self.fs._write_item = counting
        return self

    def __exit__(self, *exc):
        self.fs._write_item = self.original


def model_of(spec: str, seed: int):
    torch.manual_seed(seed)
    if spec.endswith(" moe"):
        return build_model("moe-tiny", vocab_size=67, tie_embeddings=True)
    return build_model("tiny", vocab_size=67, tie_embeddings=True)


def build(spec: str, seed: int):
    layout, engine_name = split(spec.removesuffix(" moe"))
    topo = Topology(layout.pp, layout.dp, layout.tp, cp=layout.cp, ep=layout.ep,
                    dp_replicate=layout.dp_replicate, ranks=range(layout.world), timeout_s=60)
    return layout, engine_name, topo


def folder(out, spec: str) -> Path:
    return Path(out) / ("shard_" + "".join(c if c.isalnum() else "_" for c in spec))


def save_case(out, spec: str, work) -> dict | None:
    layout, engine_name, topo = build(spec, CFG.seed)
    if not topo.member:
        return None
    try:
        engine = parallelize(model_of(spec, CFG.seed), topo, layout, engine=engine_name,
                             seed=CFG.seed)
        opt, sampler = build_optimizer(engine, CFG), work.sampler(
            GLOBAL_BATCH, topo.size("dp"), topo.index("dp"), CFG.seed)
        sched = build_scheduler(opt, CFG)
        for _ in range(K):
            train_step(engine, work.batches(sampler.next_local_batch(), MICRO), opt, topo,
                       max_norm=CFG.grad_clip, scheduler=sched)
        ref = (engine.named_full_parameters(), engine.full_optimizer_state(opt))
        boxes = [(b.key, tuple(b.offsets)) for b in engine.held_boxes(opt)]
        held = engine.held_boxes(opt)
        ck = Checkpointer(folder(out, spec), topo)
        with CopiesDcpHolds({b.tensor.data_ptr() for b in held}) as copies:
            ck.save(K, engine, opt, scheduler=sched, sampler=sampler)
        ck.close()
        return {"ref": ref, "boxes": boxes, "rank": topo.index("world"), "error": None,
                "copies": (copies.peak, max(b.tensor.nbytes for b in held))}
    except Exception:
        return {"ref": None, "boxes": [], "error": traceback.format_exc()}


def resume_case(out, spec: str, to: str, work) -> dict | None:
    layout, engine_name, topo = build(to, 1234)
    if not topo.member:
        return None
    try:
        model = model_of(spec, 1234)  # not the saved weights
        ckpt = folder(out, spec) / "checkpoints" / f"step_{K}"
        load_model(ckpt, model)
        engine = parallelize(model, topo, layout, engine=engine_name, seed=CFG.seed)
        opt = build_optimizer(engine, CFG)
        restore_training_state(ckpt, engine, opt, scheduler=build_scheduler(opt, CFG),
                               rank=topo.index("world"))
        return {"ref": (engine.named_full_parameters(), engine.full_optimizer_state(opt)),
                "error": None}
    except Exception:
        return {"ref": None, "error": traceback.format_exc()}


def main(out: str) -> None:
    # the test's folder names the set (run_world passes the folder only)
    which = "slow" if "slow" in Path(out).name else "fast"
    init_distributed("cpu", timeout_s=60)
    rank, work = dist.get_rank(), workload()
    results = {}
    for spec in SLOW if which == "slow" else SAVE:
        res = save_case(out, spec, work)
        if res is not None:
            results[spec] = {**res, "folder": str(folder(out, spec))}
    dist.barrier()
    for spec, to in (RESUME.items() if which == "fast" else ()):
        res = resume_case(out, spec, to, work)
        if res is not None:
            results["resumed " + spec] = res
    torch.save(results, f"{out}/shard_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
