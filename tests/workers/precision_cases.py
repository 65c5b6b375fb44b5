"""Worker for tests/test_precision.py: bf16 mixed precision vs fp32, per layout, one world.

For each case of :data:`CASES` (a layout in ``shardwise verify``'s syntax, an engine, and the
gradient-reduction dtype of the bf16 run) the member ranks train the tiny Llama 20 AdamW steps
twice from the same seed on the same batches: ``dtype="fp32"`` and ``dtype="bf16"`` (autocast
compute, fp32 master weights). The task is learnable (each sequence counts up by a stride 1-3
from a random start, mod V), so the loss falls from ln V ≈ 4.2 to below 2 and a precision bug
would show. Each rank writes ``<out>/<case>_rank<r>.pt``: both loss curves, and after the bf16
run the dtypes of every parameter, gradient and optimizer-state tensor this rank holds.

Extend :data:`CASES` with 2D/3D layouts (e.g. ``("dp=2,tp=2", "explicit", "fp32")``); the test
spawns max(world) ranks.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.precision import Precision
from shardwise.config import TrainConfig
from shardwise.models import build_model
from shardwise.parallel.apply import parallelize
from shardwise.parallel.layout import parse_layout
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

CASES = [  # (layout, engine, reduce dtype of the bf16 run)
    ("dp=2", "explicit", "fp32"),
    ("dp=2", "explicit", "bf16"),
    ("dp=2,zero=3", "explicit", "fp32"),
    ("dp=2,zero=3", "torch", "fp32"),  # FSDP2
    ("tp=2", "explicit", "fp32"),
    ("pp=2,1f1b,m=2", "explicit", "fp32"),
    ("dp=2,tp=2,zero=1", "explicit", "bf16"),  # the compositions: FSDP+TP, PP×TP, PP×DP
    ("dp=2,tp=2,zero=3", "torch", "fp32"),
    ("tp=2,pp=2,1f1b,m=2", "explicit", "fp32"),
    ("dp=2,pp=2,zero=1,1f1b,m=2", "explicit", "fp32"),
]
STEPS, GLOBAL_BATCH, MICRO, V, S, LR = 20, 8, 2, 67, 16, 1e-2
# ``make test-slow``'s cases (a world whose output folder's name has "slow"); ``make test`` keeps
# dp = 2 with the bf16 reduction, ZeRO-3 on each engine (fp32 reduction; the torch engine's is
# FSDP2 alone: its FSDP2 × DTensor TP case took ~8x the CPU, 40 steps of DTensor TP on 4 ranks,
# and DTensor TP under bf16 autocast stays in make test through tests/test_tensor_parallel.py's
# bf16 ledger cases) and PP×TP
SLOW = {("dp=2", "explicit", "fp32"), ("tp=2", "explicit", "fp32"),
        ("pp=2,1f1b,m=2", "explicit", "fp32"), ("dp=2,tp=2,zero=1", "explicit", "bf16"),
        ("dp=2,tp=2,zero=3", "torch", "fp32"), ("dp=2,pp=2,zero=1,1f1b,m=2", "explicit", "fp32")}


def case_name(layout: str, engine: str, reduce_dtype: str) -> str:
    return f"{layout.replace(',', '_').replace('=', '')}_{engine}_red{reduce_dtype}"


def world_size() -> int:
    return max(parse_layout(c[0]).world for c in CASES)


def global_batch(step: int) -> dict:
    """The step's [GLOBAL_BATCH, S] sequences: start ~ U[0, V), stride k ∈ {1, 2, 3}."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, V, (GLOBAL_BATCH, 1), generator=g)
    k = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + k * torch.arange(S + 1)) % V
    return {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}


def local_microbatches(step: int, dp: int, dp_index: int) -> list[dict]:
    b = global_batch(step)
    n = GLOBAL_BATCH // dp
    mine = {k: v[dp_index * n:(dp_index + 1) * n] for k, v in b.items()}
    return [{k: v[i:i + MICRO] for k, v in mine.items()} for i in range(0, n, MICRO)]


def _dtypes(engine, optimizer) -> dict:
    params = {n: p.dtype for n, p in engine.module.named_parameters()}
    # gradients as the engine presents them (ZeRO-3 keeps sharded gradients in its units;
    # gathered to full shape here, collective over the layout's ranks)
    grads = {n: g.dtype for n, g in engine.named_full_gradients().items()}
    inner = getattr(optimizer, "optim", optimizer)
    state = [(k, v.dtype) for st in inner.state.values() for k, v in st.items()
             if torch.is_tensor(v)]
    return {"params": params, "grads": grads, "optimizer": state}


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=120)
    rank = dist.get_rank()
    cfg = TrainConfig(model="tiny", lr=LR, weight_decay=0.1)
    for text, engine_name, reduce_dtype in CASES:
        if ((text, engine_name, reduce_dtype) in SLOW) != ("slow" in Path(out).name):
            continue
        layout = parse_layout(text)
        topo = Topology(layout.pp, layout.dp, layout.tp, ranks=range(layout.world), timeout_s=120)
        if not topo.member:
            continue
        rec = {}
        for dtype in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = build_model("tiny", vocab_size=V)
            engine = parallelize(model, topo, layout, engine=engine_name,
                                 precision=Precision.of(reduce=reduce_dtype if dtype == "bf16"
                                                       else "fp32"))
            opt = build_optimizer(engine, cfg)
            losses = []
            for step in range(STEPS):
                mbs = local_microbatches(step, layout.dp, topo.index("dp"))
                res = train_step(engine, mbs, opt, topo, max_norm=1.0, dtype=dtype,
                                 zero_grad=False)
                losses.append(res.loss)
            rec[dtype] = losses
            if dtype == "bf16":
                rec["dtypes"] = _dtypes(engine, opt)
        torch.save(rec, f"{out}/{case_name(text, engine_name, reduce_dtype)}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
