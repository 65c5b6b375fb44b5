"""The training loop: read it top to bottom.

Every rank runs :func:`train`. Rank 0 also writes the run folder (metrics.jsonl, config.toml,
ledger.json, tb/, loss.png, sample.txt); every rank writes its shard of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from .. import comm
from ..config import TrainConfig, validate
from ..models import build_model
from ..parallel.apply import Layout, parallelize
from ..topology import Topology, init_distributed
from .checkpoint import save_checkpoint
from .metrics import MetricsLogger, plot_loss
from .optim import build_optimizer, build_scheduler
from .step import train_step
from .workload import load_workload

log = logging.getLogger("shardwise")


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere; prefixed with the rank unless the local launcher
    already prefixes every line of the worker's output."""
    prefix = "" if os.environ.get("SHARDWISE_LAUNCHER") else f"[rank {rank}] "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def default_out_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


@torch.no_grad()
def evaluate(engine, work, topo, cfg: TrainConfig) -> float:
    """Token-weighted mean loss on the first ``eval_sequences`` validation sequences (rounded
    down to a multiple of dp), split evenly over dp ranks so every rank runs the same number of
    forwards (sharded engines gather inside them); the sums are all-reduced over dp (phase
    "eval")."""
    dp, r = topo.size("dp"), topo.index("dp")
    n = max(dp, min(work.num_val, cfg.eval_sequences) // dp * dp)
    idx = torch.arange(n)[r * n // dp:(r + 1) * n // dp] % work.num_val
    sums = torch.zeros(2, dtype=torch.float64, device=topo.device)  # [loss sum, tokens]
    engine.eval()
    for mb in work.batches(idx, cfg.microbatching()[0], split="val"):
        s, c = engine.loss_sum_and_count({k: v.to(topo.device) for k, v in mb.items()})
        sums[0] += s.double().sum()  # engines return [] or [1]
        sums[1] += torch.as_tensor(c).sum()
    engine.train()
    with topo.ledger.phase("eval"):
        comm.all_reduce(sums, topo, "dp", tag="eval")
    return float(sums[0] / sums[1])


def train(cfg: TrainConfig) -> dict:
    """Train with ``cfg`` on this rank (one of ``WORLD_SIZE`` ranks, or alone). Returns a summary
    dict (rank 0: first/last validation loss, wall time, tokens/s)."""
    t_start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    # -- everything that can fail on bad input happens before the first collective ----------
    validate(cfg, world)
    work = load_workload(cfg)
    if work.num_train < cfg.global_batch:
        from ..errors import ShardwiseConfigError

        raise ShardwiseConfigError(
            f"--global-batch {cfg.global_batch} needs {cfg.global_batch} training sequences but "
            f"the data gives {work.num_train} at --seq-len {cfg.seq_len}: lower --global-batch "
            f"or --seq-len, or give more --data")

    init_distributed(cfg.device, cfg.timeout)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, device=cfg.device, timeout_s=cfg.timeout)
    with topo.ledger.phase("init"):
        out = Path(comm.broadcast_object(cfg.out or default_out_dir(), topo, "world"))
    cfg = dataclasses.replace(cfg, out=str(out))
    is_main = topo.index("world") == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())

    # -- model: same seed on every rank → same init; DP also broadcasts from dp index 0 ------
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab_size=work.vocab_size, **work.model_overrides(cfg))
    model.to(topo.device)
    n_params = sum(p.numel() for p in model.parameters())
    engine = parallelize(model, topo, Layout.from_config(cfg), engine=cfg.engine,
                         bucket_mb=cfg.bucket_mb, overlap=cfg.overlap, prefetch=cfg.prefetch,
                         reshard_after_forward=cfg.reshard_after_forward,
                         layers_per_stage=cfg.stage_split(), seed=cfg.seed)
    micro_batch, n_micro = cfg.microbatching()
    optimizer = build_optimizer(engine, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    log.info(f"shardwise train: {cfg.model} ({n_params / 1e6:.2f} M parameters), layout "
             f"{topo.describe()}, engine={cfg.engine}, data={work.description}")
    log.info(f"  {cfg.steps} steps × {cfg.global_batch} sequences × {cfg.seq_len} tokens; "
             f"{n_micro} micro-batches of {micro_batch} per rank per step; output → {out}")

    metrics = MetricsLogger(out, enabled=is_main)
    show_bar = is_main and (sys.stderr.isatty() or os.environ.get("SHARDWISE_TTY") == "1")
    bar = None
    if show_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="train", dynamic_ncols=True, file=sys.stderr)
    val_losses = [(0, evaluate(engine, work, topo, cfg))]
    log.info(f"step 0: validation loss {val_losses[0][1]:.4f}")
    metrics.log({"step": 0, "val_loss": val_losses[0][1]})
    tokens_seen, times = 0, []
    for step in range(1, cfg.steps + 1):
        batch = work.batches(sampler.next_local_batch(), micro_batch)
        t0 = time.perf_counter()
        res = train_step(engine, batch, optimizer, topo, max_norm=cfg.grad_clip,
                         scheduler=scheduler, dtype=cfg.dtype, measure_memory=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        tokens_seen += res.tokens
        if not math.isfinite(res.loss):
            raise FloatingPointError(f"loss is {res.loss} at step {step}: lower --lr or check "
                                     "the data")
        rec = {"step": step, "loss": res.loss, "lr": scheduler.get_last_lr()[0],
               "grad_norm": res.grad_norm, "tokens": tokens_seen,
               "tokens_per_s": res.tokens / dt, "step_time_s": dt,
               "comm_bytes": topo.ledger.step_bytes(),
               # model state this rank holds (bytes): parameters + gradients + optimizer state
               "mem_bytes": res.state_bytes["total"],
               **{f"mem_{k}_bytes": v for k, v in res.state_bytes.items() if k != "total"}}
        if step == 1 and is_main:
            write_ledger_json(out / "ledger.json", topo, engine, cfg)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["val_loss"] = evaluate(engine, work, topo, cfg)
            val_losses.append((step, rec["val_loss"]))
        metrics.log(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{res.tokens / dt:,.0f}",
                            step_s=f"{dt:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps or "val_loss" in rec:
            msg = (f"step {step}/{cfg.steps}: loss {res.loss:.4f}, lr {rec['lr']:.2e}, "
                   f"grad norm {res.grad_norm:.3f}, {rec['tokens_per_s']:,.0f} tok/s, "
                   f"{dt * 1e3:.0f} ms/step")
            if "val_loss" in rec:
                msg += f", validation loss {rec['val_loss']:.4f}"
            (bar.write(msg) if bar is not None else log.info(msg))
        if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
            save_checkpoint(out, step, engine, optimizer, topo, meta=_meta(cfg, sampler))
    if bar is not None:
        bar.close()
    metrics.close()

    # -- the end: checkpoint (every rank), then rank 0 draws and samples ---------------------
    ckpt = save_checkpoint(out, cfg.steps, engine, optimizer, topo, meta=_meta(cfg, sampler))
    with engine.full_model() as full:  # every rank together: sharded weights gather here
        sample = work.sample_text(full, cfg) if full is not None else None
    summary = {
        "val_loss_start": val_losses[0][1], "val_loss_end": val_losses[-1][1],
        "wall_s": time.perf_counter() - t_start,
        "median_step_s": sorted(times)[len(times) // 2],
        "tokens_per_s": cfg.global_batch * cfg.seq_len / sorted(times)[len(times) // 2],
        "params": n_params, "out": str(out), "checkpoint": str(ckpt),
    }
    if is_main:
        plot_loss(out)
        if sample is not None:
            (out / "sample.txt").write_text(sample)
            log.info("sample from the trained model:\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info(f"done in {summary['wall_s']:.0f} s: validation loss "
                 f"{summary['val_loss_start']:.3f} → {summary['val_loss_end']:.3f}, "
                 f"{summary['tokens_per_s']:,.0f} tokens/s (median step "
                 f"{summary['median_step_s'] * 1e3:.0f} ms); outputs in {out}")
    return summary


def _meta(cfg: TrainConfig, sampler) -> dict:
    return {"sampler": sampler.state_dict(), "config": dataclasses.asdict(cfg)}


def write_ledger_json(path: Path, topo, engine, cfg: TrainConfig) -> None:
    """One step's collectives next to the formula of the layout (see :mod:`shardwise.formulas`)."""
    from ..formulas import step_bytes_formula

    micro_batch, n_micro = cfg.microbatching()
    expected = step_bytes_formula(engine, topo, micro_steps=n_micro,
                                  sequences=cfg.global_batch // cfg.dp, seq_len=cfg.seq_len,
                                  dtype=cfg.dtype)
    measured = topo.ledger.step_bytes()
    topo.ledger.to_json(path, extra={
        "layout": topo.describe(), "engine": cfg.engine,
        "formula": expected, "measured_total": measured,
        "ratio": (measured / expected["total"]) if expected["total"] else None,
    })
