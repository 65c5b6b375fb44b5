"""Worker for tests/test_numerics.py: in one world of 2 gloo ranks, every layout of
:data:`CASES` on each engine that runs it, built by ``parallelize`` with a numerics transform
in its slot (a weight fake-quantizer on every ``nn.Linear``, :func:`quantizer`), one training
step. Writes ``<out>/<case>_rank<r>.pt``: the names of the linear layers whose op ran on this
rank and the step's loss; and ``<out>/<case>_ref.pt`` (rank 0): the single-process
reference's losses with the same transform and without it."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.config import TrainConfig
from shardwise.errors import ShardwiseConfigError
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.model import Local
from shardwise.parallel.numerics import each_linear
from shardwise.tools.verify import CP_SEQ_LEN, build_case, verify_workload
from shardwise.topology import Topology, init_distributed
from shardwise.train.step import train_step

STEPS = 1  # the step whose weights are the same everywhere: rounding them agrees exactly
# layout → (model, degrees): every transform of parallelize once on 2 ranks
CASES = {"dp": ("tiny", dict(dp=2)), "zero3": ("tiny", dict(dp=2, zero=3)),
         "tp": ("tiny", dict(tp=2)), "tp_sp": ("tiny", dict(tp=2, sp=True)),
         "pp": ("tiny", dict(pp=2, schedule="1f1b", microbatches=4)),
         "cp": ("tiny", dict(cp=2)), "ep": ("moe-tiny", dict(dp=2, ep=2)),
         "mlp_tp": ("mlp-tiny", dict(tp=2))}
ENGINES = ("explicit", "torch")


def quantizer(seen: set):
    """The numerics transform: every ``nn.Linear`` computes with its weight rounded to a grid
    of 1/16 (straight-through: the gradient is the unrounded weight's), recording its name in
    ``seen`` when it runs."""
    def make(name, _linear):
        def fake_quant_linear(x, w, b):
            seen.add(name)
            return F.linear(x, w + (torch.round(w * 16) / 16 - w).detach(), b)
        return fake_quant_linear
    return lambda model: each_linear(model, make)


def _config(model: str, kw: dict) -> TrainConfig:
    kw = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, **kw}
    micro = 0 if kw["pp"] > 1 else 8 // (kw["dp"] * kw.get("cp", 1))
    return TrainConfig(model=model, global_batch=8, micro_batch=micro, seed=0, lr=1e-2,
                       warmup_steps=1, steps=STEPS,
                       seq_len=CP_SEQ_LEN if kw.get("cp", 1) > 1 else 16, **kw)


def _losses(engine, opt, sched, work, cfg, topo) -> list[float]:
    micro, _ = cfg.microbatching()
    dp = topo.size("dp") if topo else 1
    sampler = work.sampler(cfg.global_batch, dp, topo.index("dp") if topo else 0, cfg.seed)
    return [train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                       scheduler=sched).loss for _ in range(STEPS)]


def run_case(name: str, engine_name: str, out: str) -> None:
    model_name, kw = CASES[name]
    cfg = _config(model_name, kw)
    lay = Layout.from_config(cfg)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, cp=cfg.cp, ep=cfg.ep, ranks=range(2), timeout_s=60)
    work = verify_workload(model_name, 0, cfg.model_overrides(), seq_len=cfg.seq_len)
    seen: set = set()
    try:
        _, engine, opt, sched = build_case(model_name, work, cfg, lambda m: parallelize(
            m, topo, lay, engine=engine_name, seed=0, numerics=[quantizer(seen)]))
    except ShardwiseConfigError as e:  # a layout this engine refuses (torch cp: CUDA only)
        torch.save({"refused": str(e)}, f"{out}/{name}_{engine_name}_rank{dist.get_rank()}.pt")
        return
    losses = _losses(engine, opt, sched, work, cfg, topo)
    torch.save({"seen": sorted(seen), "losses": losses},
               f"{out}/{name}_{engine_name}_rank{dist.get_rank()}.pt")


def reference(name: str, out: str) -> None:
    """Rank 0: one process, the same model and batches, with the transform and without."""
    model_name, kw = CASES[name]
    cfg = _config(model_name, {})  # dp = 1: the whole batch of 8 in one micro-batch
    work = verify_workload(model_name, 0, cfg.model_overrides(),
                           seq_len=CP_SEQ_LEN if kw.get("cp", 1) > 1 else 16)
    rec = {}
    for quantized in (True, False):
        names: set = set()

        def wrap(m):
            if quantized:
                quantizer(names)(m)
            return Local(m)
        model, engine, opt, sched = build_case(model_name, work, cfg, wrap)
        rec["linears"] = sorted(n for n, m in model.named_modules()
                                if isinstance(m, torch.nn.Linear))
        rec["quantized" if quantized else "plain"] = _losses(engine, opt, sched, work, cfg, None)
    torch.save(rec, f"{out}/{name}_ref.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    for name in CASES:
        for engine_name in ENGINES:
            run_case(name, engine_name, out)
        if dist.get_rank() == 0:
            reference(name, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
