"""The training loop: read it top to bottom.

Every rank runs :func:`train`: :func:`setup` (checks, run folder, topology, model in its layout,
optimizer, loggers) → the step loop (the step, the log, the eval, the save) → :func:`finish` (the
last checkpoint, the sample, the summary); the state they share is one :class:`~.run.Run`. Rank 0
also writes the run folder (metrics.jsonl, config.toml, ledger.json, tb/, loss.png, sample.txt;
tokenizer/ when the tokenizer is a model folder's); every rank writes its shard of the
checkpoint. What the loop reports about groups and traffic is in :mod:`.report`; the test-only
fault hooks it calls (``SHARDWISE_TEST_*``) are in :mod:`.faults`.
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
from ..comm import fingerprint as collective_checks
from ..checkpoint import (Checkpointer, DivergedError, RunFolderBusyError,
                           check_checkpoints_writable, check_disk_space, check_same_data,
                           checkpoint_bytes_estimate, data_fingerprint, diverged_message,
                           checkpoint_weight_stream, find_resume_checkpoint, load_model,
                           lock_run_folder, read_meta,
                           restore_training_state)
from ..config import TrainConfig, batching_note, validate
from ..errors import ShardwiseConfigError
from ..flops import mfu, peak_devices, peak_flops, step_flops
from ..models import build_model, set_activation_checkpointing
from ..models.compile import compile_blocks
from ..models.meta import build_on_meta
from ..parallel.apply import Layout, parallelize
from ..precision import Precision
from ..parallel.cp import plain_attention, shard_sequence
from ..parallel.pp.schedules import V_SCHEDULES
from ..parallel.pp.split import describe_placement
from ..topology import Topology, backend_for, init_distributed, resolve_device
from . import faults
from .device import (device_lines, device_memory_keys, host_peak_rss, phase_peaks,
                     record_phases, reset_peak)
from .metrics import MetricsLogger, plot_loss
from .optim import build_optimizer, build_scheduler
from .report import describe_groups, describe_layout
from ..report.record import RunRecorder
from .run import Run, _first_steps, _record
from .step import train_step
from .workload import load_workload


def plural(n: int, word: str) -> str:
    """``"1 step"``, ``"2 steps"``, ``"4 micro-batches"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('ch') else 's'}"

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


def eval_shard(n: int, dp: int, r: int, micro_batch: int) -> tuple[torch.Tensor, int]:
    """This dp rank's share of ``n`` evaluation sequences, and the forwards every rank runs.

    Rank ``r`` takes rows ``[r·n // dp, (r+1)·n // dp)``: the shares are disjoint, cover
    ``0..n-1`` exactly once and differ in size by at most one (a rank may get none when
    ``n < dp``). Every rank runs ``ceil(ceil(n / dp) / micro_batch)`` forwards, the most any
    rank needs, so collectives inside forward (ZeRO-3/FSDP gathers, TP, PP) stay matched.

    Returns:
        (row indices ``[n_r]`` int64, forwards per rank).

    Raises:
        ShardwiseConfigError: ``n``, ``dp`` or ``micro_batch`` below 1, or ``r`` not in
            ``[0, dp)``.
    """
    if n < 1 or dp < 1 or micro_batch < 1 or not 0 <= r < dp:
        raise ShardwiseConfigError(
            f"evaluation split needs n ≥ 1, dp ≥ 1, micro_batch ≥ 1 and 0 ≤ r < dp, got n={n}, "
            f"dp={dp}, r={r}, micro_batch={micro_batch}: check --eval-sequences and --dp")
    most = -(-n // dp)  # the largest share
    return torch.arange(r * n // dp, (r + 1) * n // dp), -(-most // micro_batch)


@torch.no_grad()
def evaluate(engine, work, topo, cfg: TrainConfig) -> float:
    """Token-weighted mean loss over exactly the first ``N = min(num_val, eval_sequences)``
    validation sequences, each counted once, so the value is the same at every dp (to fp32
    round-off). The sequences are split over dp ranks by :func:`eval_shard`; a rank with fewer
    micro-batches than the most loaded one runs padding forwards (validation row 0) whose loss
    sum and token count are not added, because sharded engines gather inside forward and every
    rank must issue the same collectives. The [loss sum, tokens] pair is all-reduced over dp
    (phase "eval"); a collective over the layout: every rank calls it together."""
    if cfg.task == "dpo":  # the mean DPO loss over validation pairs (train/dpo.py)
        return work.reference.evaluate(engine, work, cfg, eval_shard)
    dp, r = topo.size("dp"), topo.index("dp")
    micro = cfg.microbatching()[0]
    idx, forwards = eval_shard(min(work.num_val, cfg.eval_sequences), dp, r, micro)
    batches = work.batches(idx, micro, split="val") if idx.numel() else []
    sums = torch.zeros(2, dtype=torch.float64, device=topo.device)  # [loss sum, tokens]
    engine.eval()
    for i in range(forwards):
        real = i < len(batches)
        mb = batches[i] if real else work.batches(torch.zeros(1, dtype=torch.long), 1, "val")[0]
        mb = shard_sequence({k: v.to(topo.device) for k, v in mb.items()}, topo)  # cp chunks
        s, c = engine.loss_sum_and_count(mb)
        if real:  # padding: the forward ran (matched collectives); its sums count zero
            sums[0] += s.double().sum()  # engines return [] or [1]
            sums[1] += torch.as_tensor(c).sum()
    engine.train()
    with topo.ledger.phase("eval"):
        comm.all_reduce(sums, topo, topo.data_axis, tag="eval")  # dp (× cp: chunk sums)
    return float(sums[0] / sums[1])


def train(cfg: TrainConfig) -> dict:
    """Train with ``cfg`` on this rank (one of ``WORLD_SIZE`` ranks, or alone). Returns a summary
    dict (rank 0: first/last validation loss, wall time, tokens/s)."""
    run = setup(cfg)
    cfg = run.cfg  # with its run folder
    for step in range(run.start + 1, cfg.steps + 1):
        batch = _next_batch(run, step)
        t0 = time.perf_counter()
        if cfg.task == "dpo":  # the frozen reference's log-probs, one forward per micro-batch
            batch = run.work.reference.with_reference(batch)  # (inside the step's time)
        res = train_step(run.engine, batch, run.optimizer, run.topo, max_norm=cfg.grad_clip,
                         scheduler=run.scheduler, dtype=cfg.dtype, measure_memory=True,
                         step=step)
        dt = time.perf_counter() - t0
        run.times.append(dt)
        run.tokens_seen += res.tokens
        run.counted += res.tokens
        _stop_if_diverged(run, step, res)  # every rank together: the loss and norm are global
        rec = _record(run, step, res, batch, dt)
        _first_steps(run, step, res)  # ledger.json, traffic lines, the report's first step
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["val_loss"] = evaluate(run.engine, run.work, run.topo, cfg)
            run.val_losses.append((step, rec["val_loss"]))
        run.metrics.log(rec)
        _log_step(run, step, res, rec, dt)
        if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
            run.checkpointer.save(step, run.engine, run.optimizer, scheduler=run.scheduler,
                                  sampler=run.sampler,
                                  extra_meta=_meta(cfg, run.tokens_seen, run.val_losses,
                                                   run.model_cfg))
        faults.kill_at_step(step, run.checkpointer)
        faults.rank_only_collective(step, run.topo)  # SHARDWISE_TEST_RANK0_GATHER: a desync
    return finish(run)


def setup(cfg: TrainConfig) -> Run:
    """Everything before the first step: checks (before any collective), the run folder and its
    lock, the topology, the model (resumed or from HF weights) in its layout, the optimizer, the
    loggers, and the step-0 validation loss or the resumed state."""
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
    # one run per folder: rank 0 locks it before anything is written; a refusal reaches every
    # rank with the run's first broadcast below, and every rank raises the same error
    out_name = cfg.out or default_out_dir()
    run_lock, refused = lock_run_folder(out_name) if rank == 0 else (None, None)
    # --resume: pick and verify the checkpoint, check it fits this model and data (files only)
    fingerprint = data_fingerprint(work, cfg.data)
    resume_from = None if refused else _find_resume(cfg, work, rank, fingerprint)

    # --device auto (the default): CUDA when torch sees it, else CPU; the backend follows.
    # config.toml keeps what was asked (auto: the same file picks again on another machine);
    # the start-up line says what was picked and why
    device, device_why = resolve_device(cfg.device)
    init_distributed(device, cfg.timeout)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, cp=cfg.cp, ep=cfg.ep, dp_replicate=cfg.dp_replicate,
                    device=device,
                    timeout_s=cfg.timeout,
                    collectives=cfg.collectives, check_collectives=cfg.check_collectives)
    with topo.ledger.phase("init"):
        out, refused = comm.broadcast_object((out_name, refused), topo, "world")
    if refused:
        raise RunFolderBusyError(refused)
    out = Path(out)
    cfg = dataclasses.replace(cfg, out=str(out))
    # --hang-after: a wait past it writes out/flight/rank{r}.json and ends the run
    topo.checks.hang_after_s = cfg.hang_after if cfg.hang_after > 0 else cfg.timeout / 2
    topo.checks.flight_dir = str(out / "flight")
    is_main = topo.index("world") == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())
        # a model folder's tokenizer: its files into out/tokenizer/, what export ships (the
        # folder may be gone or changed by then; interop/hf_tokenizer_copy.py)
        from ..interop.hf_tokenizer_copy import save_run_tokenizer

        save_run_tokenizer(getattr(getattr(work, "data", None), "tokenizer", None), out)

    # -- model: same seed on every rank → same init. Built on the meta device (no storage):
    # the engine allocates only what this rank holds and fills it from `weights`, full-shape
    # tensors one at a time (parallel/materialize.py): the replayed init (models/meta.py), the
    # HF folder's tensors or the checkpoint's (lazy: only this rank's part is read). DPO's
    # frozen reference is a second meta model filled with the initial policy (the init replayed
    # from the same RNG state, or the HF folder again). SHARDWISE_WHOLE_BUILD=1 builds whole
    # (benchmarks/host_memory.py measures both).
    torch.manual_seed(cfg.seed)
    overrides = work.model_overrides(cfg)
    weights = ref_weights = None
    if os.environ.get("SHARDWISE_WHOLE_BUILD") == "1":  # (benchmarks, comparisons)
        model = build_model(cfg.model, vocab_size=work.vocab_size, **overrides)
    else:
        rng_before_init = torch.get_rng_state()
        model, plan = build_on_meta(cfg.model, vocab_size=work.vocab_size, **overrides)
        weights = plan.stream()
        if cfg.init_from_hf or resume_from is not None:
            plan.replay_draws()  # the init's draws, so the RNG continues as after a whole build
        if cfg.init_from_hf:
            from ..interop.hf import hf_weight_stream

            weights = hf_weight_stream(model, cfg.init_from_hf)
        if cfg.task == "dpo":  # the frozen reference: the initial policy, never a --resume's
            ref_model, ref_plan = build_on_meta(cfg.model, vocab_size=work.vocab_size,
                                                **overrides)
            ref_weights = (hf_weight_stream(ref_model, cfg.init_from_hf) if cfg.init_from_hf
                           else ref_plan.stream_from(rng_before_init))  # the same init again
        if resume_from is not None:  # layout-free weights, each rank reads its part
            weights = checkpoint_weight_stream(resume_from, model)
    if cfg.init_from_hf and weights is None:  # HF weights into the plain model
        from ..interop.hf import load_hf_weights

        load_hf_weights(model, cfg.init_from_hf)
    if cfg.task == "dpo" and ref_weights is None:  # the whole build: a copy, before --resume
        from .dpo import reference_copy

        ref_model = reference_copy(model)
    if resume_from is not None and weights is None:  # layout-free weights, before parallelize
        load_model(resume_from, model)
    if weights is None:
        model.to(topo.device)
    n_params = sum(p.numel() for p in model.parameters())
    model_cfg = model.config  # before parallelize: a pipeline keeps only this rank's stage
    # --ac: checkpoint inside each block; collectives a recompute re-issues (TP) are booked
    # under phase "recompute", outside the step's bytes (see models/ac.py)
    set_activation_checkpointing(model, cfg.ac, lambda: topo.ledger.phase("recompute"))
    def parallelize_as_configured(m, layout):
        return parallelize(m, topo, layout, engine=cfg.engine, bucket_mb=cfg.bucket_mb,
                           overlap=cfg.overlap, prefetch=cfg.prefetch,
                           reshard_after_forward=cfg.reshard_after_forward,
                           layers_per_stage=cfg.stage_split(), seed=cfg.seed,
                           precision=Precision.from_config(cfg), offload=cfg.offload,
                           weights=weights if m is model else ref_weights)

    engine = parallelize_as_configured(model, Layout.from_config(cfg))
    if cfg.task == "dpo":  # the reference in the policy's layout, frozen (train/dpo.py)
        from .dpo import DPOReference, build_reference

        work.reference = DPOReference(build_reference(
            ref_model if ref_weights is not None else ref_model.to(topo.device),
            Layout.from_config(cfg), parallelize_as_configured), topo, cfg.dpo_beta, cfg.dtype)
    if cfg.compile:  # each block's forward; hooks and the step stay eager (models/compile.py)
        log.info(f"  --compile: torch.compile on {compile_blocks(engine.module)} blocks")
    micro_batch, n_micro = cfg.microbatching()
    optimizer = build_optimizer(engine, cfg)
    startup_rss = host_peak_rss(topo)  # every rank's start-up peak: model, engine, optimizer
    phases = {"startup": phase_peaks(topo)}  # then each phase's own peak (finish adds its)
    scheduler = build_scheduler(optimizer, cfg)
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    from ..interop.hf import describe_source

    # the model's own units: an MLP regresses rows of d_model numbers, not token sequences
    size = f"{n_params / 1e6:.2f} M" if n_params >= 100_000 else f"{n_params:,}"
    rows = (f"{plural(cfg.global_batch, 'sequence')} × {plural(cfg.seq_len, 'token')}"
            if work.kind == "lm" else
            f"{plural(cfg.global_batch, 'row')} × d_model {model_cfg.d_model} ({work.kind})")
    log.info(f"shardwise train: {describe_source(cfg)} ({size} parameters), layout "
             f"{topo.describe()}, engine={cfg.engine}, data={work.description}")
    log.info(f"  device {topo.device} ({device_why}), backend {backend_for(device)}"
             + ("; each rank on the GPU of its LOCAL_RANK"
                if topo.device.type == "cuda" and topo.world_size > 1 else ""))
    log.info(f"  {plural(cfg.steps, 'step')} × {rows}; {plural(n_micro, 'micro-batch')} of "
             f"{micro_batch} per rank per step; output → {out}")
    if batching_note(cfg):  # values the user did not give, derived from the layout
        log.info(f"  {batching_note(cfg)}")
    from .optim import warmup_warning

    if is_main and warmup_warning(cfg):  # once, rank 0: the LR never reaches --lr
        log.warning(f"  {warmup_warning(cfg)}")
    epoch = sampler.epoch_counts()  # the tail shorter than a global batch is dropped
    log.info(f"  epoch: {epoch['sequences_per_epoch']:,} training sequences = "
             f"{epoch['steps_per_epoch']:,} steps × {cfg.global_batch} + "
             f"{epoch['dropped_per_epoch']:,} dropped (the tail of each epoch's shuffle)")
    for line in describe_groups(topo):
        log.info(line)
    for line in describe_layout(Layout.from_config(cfg), cfg.engine, optimizer=cfg.optimizer,
                                microbatches=n_micro):
        log.info(line)
    if cfg.pp > 1 and cfg.schedule in V_SCHEDULES:  # the V placement, done for the user
        for line in describe_placement(model_cfg.n_layers, cfg.pp, cfg.schedule,
                                       cfg.virtual_stages or None, cfg.stage_split()):
            log.info(f"  {line}")
    # MFU: model FLOPs of a step (every position of the global batch; flops.py has the
    # convention and its sources) over the peak of all ranks
    seq = cfg.seq_len if work.kind == "lm" else 1
    flops_step = step_flops(model_cfg, cfg.global_batch, seq)
    peak, peak_src = peak_flops(topo.device, cfg.dtype, cfg.peak_tflops)
    n_peak = peak_devices(topo.device, topo.world_size)  # CPU: ranks sharing a core share it
    from ..parallel.storage import describe_storage

    stored = cfg.param_dtype != "fp32" or cfg.offload != "none"
    for line in describe_storage(engine) if stored else []:  # --param-dtype, --offload
        log.info(line)
    log.info(f"  precision: compute {engine.precision.compute}, "
             f"{'' if stored else 'master weights/gradients/AdamW state fp32, '}"
             f"gradient reduction {cfg.reduce_dtype}; activation checkpointing: {cfg.ac}; "
             f"{flops_step / 1e9:,.2f} GFLOP per step (6·N + 12·L·d·s per token); peak "
             f"{peak / 1e12:.3f} TFLOP/s × {n_peak} "
             f"{'GPUs' if topo.device.type == 'cuda' else 'cores'} ({peak_src})")

    gpu_mem = device_memory_keys(engine, topo, cfg, model_cfg, n_params)  # {} on CPU
    for line in device_lines(model_cfg, topo, cfg, engine.module):  # SDPA kernel, AdamW
        log.info(line)
    mib = [b / 2**20 for b in startup_rss]
    built = "on the meta device" if weights is not None else "whole on every rank"
    log.info(f"  host memory at start-up: peak RSS {min(mib):,.0f}–{max(mib):,.0f} MiB per rank "
             f"(model built {built}; {out / 'host_memory.json'})")
    if is_main:
        (out / "host_memory.json").write_text(json.dumps(
            {"peak_rss_bytes": startup_rss, "meta_build": weights is not None,
             "phases": phases}) + "\n")

    if resume_from is not None and is_main:  # steps after the checkpoint are redone
        _truncate_metrics(out / "metrics.jsonl", _checkpoint_step(resume_from))
    elif is_main:  # a fresh start (e.g. --resume auto with nothing to resume): fresh logs
        _fresh_logs(out)
    metrics = MetricsLogger(out, enabled=is_main, wandb=cfg.wandb,
                            run_config=dataclasses.asdict(cfg))
    show_bar = is_main and (sys.stderr.isatty() or os.environ.get("SHARDWISE_TTY") == "1")
    bar = None
    if show_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="train", dynamic_ncols=True, file=sys.stderr)
    checkpointer = Checkpointer(out, topo, keep=cfg.keep, async_save=cfg.async_save,
                                data=fingerprint, resumed_from=resume_from)
    start, times = 0, []
    if resume_from is not None:  # optimizer state → this rank's shards; LR, data position, RNG
        got = restore_training_state(resume_from, engine, optimizer, scheduler=scheduler,
                                     sampler=sampler, rank=topo.index("world"))
        start, tokens_seen, val_losses = got.step, got.tokens_seen, got.val_losses
        log.info(f"resumed from {resume_from} (step {start}, saved under layout "
                 f"{got.meta.get('layout')}): optimizer state "
                 f"{'restored' if got.optimizer_restored else 'NOT in the checkpoint (fresh)'}"
                 f", RNG {'restored' if got.rng_restored else 'seeded (no state for this rank)'}")
    else:
        val_losses = [(0, evaluate(engine, work, topo, cfg))]
        log.info(f"step 0: validation loss {val_losses[0][1]:.4f}")
        metrics.log({"step": 0, "val_loss": val_losses[0][1]})
        tokens_seen = 0
    recorder = RunRecorder(out, is_main)  # RUN/report_data.json for `shardwise report`
    recorder.start(cfg, topo, resume_from=resume_from, start_step=start, epoch=epoch,
                   n_params=n_params, group_lines=describe_groups(topo))
    if bar is not None:
        bar.update(start)
    return Run(cfg=cfg, t_start=t_start, topo=topo, work=work, out=out, is_main=is_main,
               run_lock=run_lock, resume_from=resume_from, fingerprint=fingerprint, engine=engine,
               optimizer=optimizer, scheduler=scheduler, sampler=sampler, micro_batch=micro_batch,
               n_micro=n_micro, model_cfg=model_cfg, n_params=n_params, epoch=epoch,
               flops_step=flops_step, peak=peak, n_peak=n_peak, gpu_mem=gpu_mem, metrics=metrics,
               bar=bar, checkpointer=checkpointer, recorder=recorder, start=start,
               tokens_seen=tokens_seen, val_losses=val_losses, times=times)


def _next_batch(run: Run, step: int):
    """This rank's micro-batches of ``step`` (the sampler's next global batch, this dp rank's
    slice); the device's peak-memory counter starts over for it."""
    local = run.sampler.next_local_batch()
    faults.log_samples(step, local, run.topo)  # SHARDWISE_TEST_* hooks: no-ops unless set
    batch = run.work.batches(local, run.micro_batch)
    reset_peak(run.topo.device)  # device memory: this step's peak (train/device.py)
    return batch


def _stop_if_diverged(run: Run, step: int, res) -> None:
    """Raise :class:`DivergedError` (after logging the step and letting a pending save land)
    when the step's loss or gradient norm is not finite."""
    if not (math.isfinite(res.loss) and math.isfinite(res.grad_norm)):
        # both are global values, the same on every rank: every rank stops here together
        run.metrics.log({"step": step, "loss": res.loss, "grad_norm": res.grad_norm,
                         "lr": run.scheduler.get_last_lr()[0]})  # the step that diverged
        run.checkpointer.wait(barrier=True)  # a pending async save (of a finite state) lands
        raise DivergedError(diverged_message(
            step, f"the loss ({res.loss}) or the gradient norm ({res.grad_norm})",
            run.checkpointer.last_good()))


def _log_step(run: Run, step: int, res, rec: dict, dt: float) -> None:
    """The progress bar, and every ``--log-every`` steps (and at an evaluation) the step line."""
    cfg, bar = run.cfg, run.bar
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                        step_s=f"{dt:.3f}")
    if step % cfg.log_every == 0 or step == cfg.steps or "val_loss" in rec:
        msg = (f"step {step}/{cfg.steps}: loss {res.loss:.4f}, lr {rec['lr']:.2e}, "
               f"grad norm {res.grad_norm:.3f}, {rec['tokens_per_s']:,.0f} tok/s"
               + (f" ({rec['target_tokens_per_s']:,.0f} in the loss)" if cfg.task != "lm"
                  else "") + ", "
               f"{dt * 1e3:.0f} ms/step, {rec['tflops']:.3f} TFLOP/s, MFU {rec['mfu']:.1%}")
        if "moe_imbalance" in rec:
            msg += (f" (ce {rec['loss_ce']:.4f} + balance {rec['loss_balance']:.4f} + z "
                    f"{rec['loss_z']:.4f}; expert load max/mean {rec['moe_imbalance']:.2f}"
                    + (f", {rec['moe_dropped']} dropped" if rec["moe_dropped"] else "")
                    + ")")
        if cfg.task == "dpo":
            from .dpo import log_suffix

            msg += log_suffix(rec)
        if "val_loss" in rec:
            msg += f", validation loss {rec['val_loss']:.4f}"
        (bar.write(msg) if bar is not None else log.info(msg))


def finish(run: Run) -> dict:
    """After the last step: the final checkpoint (every rank), the end-of-run collective check, a
    sample from the model, the summary (returned; rank 0 writes summary.json, loss.png,
    sample.txt), and the run folder's lock released."""
    (cfg, topo, work, engine, out, is_main, times, t_start, val_losses, n_params, epoch, start,
     resume_from, checkpointer, metrics, bar, run_lock, flops_step, peak, n_peak) = (
        run.cfg, run.topo, run.work, run.engine, run.out, run.is_main, run.times, run.t_start,
        run.val_losses, run.n_params, run.epoch, run.start, run.resume_from, run.checkpointer,
        run.metrics, run.bar, run.run_lock, run.flops_step, run.peak, run.n_peak)
    optimizer, scheduler, sampler, tokens_seen, model_cfg = (
        run.optimizer, run.scheduler, run.sampler, run.tokens_seen, run.model_cfg)
    if bar is not None:
        bar.close()
    metrics.close()

    # -- the end: checkpoint (every rank), then rank 0 draws and samples ---------------------
    ckpt = resume_from  # a run resumed at its last step has nothing more to save
    phases = {"steps": phase_peaks(topo)}  # the steps' own peak (evaluations, saves between)
    if start < cfg.steps:
        ckpt = checkpointer.save(cfg.steps, engine, optimizer, scheduler=scheduler,
                                 sampler=sampler,
                                 extra_meta=_meta(cfg, tokens_seen, val_losses, model_cfg))
    checkpointer.close()  # waits for an async save to be written and committed
    phases["save"] = phase_peaks(topo)  # the final save's own peak (shard by shard)
    collective_checks.check(topo, label="at the end of training")  # the last step's, the save's
    sample = None
    if cfg.sample_tokens > 0:  # --sample-tokens 0: no sample (and no gather for one)
        with engine.sampling_model() as full:  # every rank together (ZeRO-3: unit by unit)
            with plain_attention(full):  # cp: whole sequences on every rank, no ring
                sample = work.sample_text(full, cfg) if full is not None else None
    phases["sample"] = phase_peaks(topo)  # the final sample's
    if is_main:
        record_phases(out, phases)
    summary = {
        "val_loss_start": val_losses[0][1], "val_loss_end": val_losses[-1][1],
        "wall_s": time.perf_counter() - t_start, "steps_run": len(times),
        "params": n_params, "out": str(out), "checkpoint": str(ckpt),
        **epoch,  # sequences_per_epoch, steps_per_epoch, dropped_per_epoch
    }
    # timings at the median step; model TFLOP/s and MFU there (flops.py: 6·N + 12·L·d·s per
    # token). None when no step ran (resumed at --steps): there is nothing to time
    med = sorted(times)[len(times) // 2] if times else None
    summary["median_step_s"] = med
    summary["tokens_per_s"] = cfg.global_batch * cfg.seq_len / med if med else None
    summary["target_tokens_per_s"] = run.counted / sum(times) if times else None
    summary["tflops"] = flops_step / med / 1e12 if med else None
    summary["mfu"] = mfu(flops_step, med, peak, n_peak) if med else None
    summary["peak_tflops"] = peak * n_peak / 1e12  # of all devices (CPU: cores) together
    if is_main:
        plot_loss(out)
        if sample is not None:
            (out / "sample.txt").write_text(sample)
            log.info("sample from the trained model:\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if med is None:
            log.info(f"done in {summary['wall_s']:.0f} s: no steps ran in this invocation (the "
                     f"checkpoint {ckpt} is already at --steps {cfg.steps}; pass a larger "
                     f"--steps to train on); validation loss {summary['val_loss_start']:.3f} → "
                     f"{summary['val_loss_end']:.3f}; outputs in {out}")
        else:
            log.info(f"done in {summary['wall_s']:.0f} s: validation loss "
                     f"{summary['val_loss_start']:.3f} → {summary['val_loss_end']:.3f}, "
                     f"{summary['tokens_per_s']:,.0f} tokens/s computed (global batch × seq-len"
                     + (f"; {summary['target_tokens_per_s']:,.0f}/s in the loss" if cfg.task
                        != "lm" else "") + f") at the median step "
                     f"({med * 1e3:.0f} ms, {summary['tflops']:.3f} TFLOP/s, "
                     f"MFU {summary['mfu']:.1%}); outputs in {out}")
    if run_lock is not None:  # the run folder is free for the next run
        run_lock.close()
    return summary




def _meta(cfg: TrainConfig, tokens_seen: int, val_losses: list, model_cfg) -> dict:
    """The run's bookkeeping for ``meta.json`` (the checkpointer adds step, sampler, scheduler)."""
    return {"config": dataclasses.asdict(cfg), "tokens_seen": tokens_seen,
            "val_losses": [list(v) for v in val_losses],
            "model_config": (dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg)
                             else None)}


# -- resume ------------------------------------------------------------------------------------
def _find_resume(cfg: TrainConfig, work, rank: int, fingerprint: dict) -> Path | None:
    """``--resume auto|PATH`` → a verified checkpoint folder (None: start fresh), checked against
    this model's parameter names and shapes (built on the meta device) and this run's data
    (``fingerprint``, :func:`~shardwise.checkpoint.check_same_data`), and the disk space
    and the writable ``checkpoints/`` folder the run needs. Reads files only, so a bad
    checkpoint fails before any collective; every rank decides the same from the same files."""
    warned = []

    def warn(msg: str) -> None:
        warned.append(msg)
        if rank == 0:
            log.warning(msg)

    folder = None
    if cfg.resume:
        folder = find_resume_checkpoint(cfg.resume, cfg.out, warn=warn)
        if folder is None:
            if not warned:  # (incomplete checkpoints alone were reported in one warning)
                log.info(f"--resume auto: no checkpoint in {cfg.out}/checkpoints yet: starting "
                         "fresh")
        elif _checkpoint_step(folder) > cfg.steps:
            raise ShardwiseConfigError(
                f"--resume: {folder} is at step {_checkpoint_step(folder)}, past --steps "
                f"{cfg.steps}: pass --steps greater than {_checkpoint_step(folder)} to train on "
                "(the LR schedule follows --steps)")
    if folder is not None or cfg.out:
        from ..checkpoint import check_model_compatible

        with torch.device("meta"):
            shape = build_model(cfg.model, vocab_size=work.vocab_size,
                                **work.model_overrides(cfg))
        if folder is not None:
            from ..checkpoint import check_saved_optimizer

            meta = read_meta(folder)
            check_model_compatible(folder, shape, meta, current=dataclasses.asdict(cfg))
            check_saved_optimizer(folder, meta, cfg.optimizer)
            check_same_data(folder, meta, fingerprint, dataclasses.asdict(cfg),
                            allow=cfg.allow_data_change, warn=warn)
        if cfg.out:
            n = sum(p.numel() for p in shape.parameters())
            check_disk_space(cfg.out, checkpoint_bytes_estimate(n, cfg.keep))
            check_checkpoints_writable(cfg.out, rank)
    return folder


def _checkpoint_step(folder: Path) -> int:
    return int(read_meta(folder)["step"])


def _fresh_logs(out: Path) -> None:
    """A fresh start in a folder an earlier attempt wrote to (``--resume auto`` that found no
    complete checkpoint): remove the logs a run appends to, ``metrics.jsonl`` and the
    TensorBoard events in ``tb/``, so no step is logged twice. Rank 0, holding the run lock."""
    import shutil

    (out / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(out / "tb", ignore_errors=True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the ``metrics.jsonl`` records up to ``step`` (the resumed run logs the rest again)."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
