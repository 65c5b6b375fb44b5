"""Where a ZeRO-3 step's host memory goes (issue 53): VmRSS at points inside one training step.

Run as 4 gloo ranks: ``OMP_NUM_THREADS=1 python -m shardwise.launch --nproc 4
benchmarks/zero3_step_rss.py [field=int ...]`` (``build_model("llama-1b", **fields)``, vocabulary
257 as ``host_memory.py --run``; default the 64.6 M folder's shape). The model is built whole
and handed to ``parallelize(Layout(dp=4, zero=3))``, then 3 ``train_step``s of 1 × 64 tokens
with AdamW (``build_optimizer``, as ``train``). In the last step each rank records, relative to
its RSS before the step: after the forward, at each unit's gradient reduce_scatter launch (with
the bytes held then in gathered units and in reduce-scatter inputs in flight), at the end of the
gradient sync, after the optimizer step, and the step's own peak (``VmHWM``, reset through
``/proc/self/clear_refs`` before the step). Rank 0 prints the table and the engine's persistent
bytes (``model_state_bytes``). Linux only (``/proc``).
"""

import sys

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

SHAPE = dict(vocab_size=257, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=2624, n_layers=6)
MiB = 2**20


def status(key: str) -> int:
    """``/proc/self/status`` field ``key`` (VmRSS, VmHWM) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def main(sets: list[str]) -> None:
    init_distributed("cpu", timeout_s=600)
    shape = {**SHAPE, **{k: int(v) for k, v in (s.split("=") for s in sets)}}
    topo = Topology(dp=4, ranks=range(4), timeout_s=600)
    torch.manual_seed(0)
    engine = parallelize(build_model("llama-1b", **shape), topo, Layout(dp=4, zero=3))
    opt = build_optimizer(engine, TrainConfig(lr=1e-4, weight_decay=0.1))
    sync = engine.grad_sync
    work = SyntheticLMWorkload(vocab_size=shape["vocab_size"], seq_len=64, num_train=64,
                               num_val=4)
    sampler = work.sampler(4, 4, topo.index("dp"), 0)
    marks: list[tuple[str, int, int, int]] = []  # (point, RSS, gathered, in-flight inputs)

    def mark(point: str) -> None:
        gathered = sum(u.full.untyped_storage().nbytes() for u in sync.units)
        inflight = sum(u._reduce[1] for u in sync.units if u._reduce is not None)
        marks.append((point, status("VmRSS"), gathered, inflight))

    launch, finish = sync._launch_reduce, sync.finish_gradient_sync
    sync._launch_reduce = lambda u: (launch(u), mark(f"reduce launched: {u.name}"))
    engine.finishers = [(lambda: (finish(), mark("gradient sync done"))) if f == finish else f
                        for f in engine.finishers]
    engine.module.register_forward_hook(lambda m, a, o: mark("forward done"))
    for step in range(3):
        marks.clear()
        reset_hwm()
        before = status("VmRSS")
        train_step(engine, work.batches(sampler.next_local_batch(), 1), opt, topo, max_norm=1.0)
        mark("optimizer step done")
        peak = status("VmHWM")
    if topo.index("dp") == 0:
        state = engine.model_state_bytes(opt)
        print("model state bytes (MiB):", {k: round(v / MiB, 1) for k, v in state.items()})
        print(f"RSS before the last step {before / MiB:,.0f} MiB; "
              f"its peak +{(peak - before) / MiB:,.0f}")
        print("| point | RSS − before (MiB) | gathered units (MiB) "
              "| reduce inputs in flight (MiB) |")
        print("|---|---|---|---|")
        for point, rss, g, f in marks:
            print(f"| {point} | {(rss - before) / MiB:+,.0f} | {g / MiB:,.0f} | {f / MiB:,.0f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
