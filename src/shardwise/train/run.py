"""What one training run carries through its step loop (:class:`Run`, built by
:func:`~.loop.setup`) and what each step records: the ``metrics.jsonl`` record
(:func:`_record`, with a mixture of experts' :func:`moe_metrics`) and the first steps' one-time
outputs (:func:`_first_steps`: ledger.json, the traffic lines, the report's first step). The
loop itself: :mod:`.loop`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .. import comm
from ..flops import mfu
from ..report.record import axis_bytes
from .device import memory_record
from .report import describe_traffic, write_ledger_json

log = logging.getLogger("shardwise")


@dataclasses.dataclass
class Run:
    """What :func:`setup` builds for the step loop and :func:`finish`: the configuration (with its
    run folder filled in), the topology, the data, the parallel engine with its optimizer, LR
    schedule and sampler, the loggers and the checkpointer, the MFU terms (``flops_step``: model
    FLOPs of one step; ``peak`` FLOP/s of one of ``n_peak`` devices), and the loop's state:
    ``start`` (the last step done: 0, or the resumed checkpoint's), ``tokens_seen``,
    ``counted`` (loss tokens of this invocation's steps),
    ``val_losses`` [(step, loss)], ``times`` (seconds per step run)."""
    cfg: object
    t_start: object
    topo: object
    work: object
    out: object
    is_main: object
    run_lock: object
    resume_from: object
    fingerprint: object
    engine: object
    optimizer: object
    scheduler: object
    sampler: object
    micro_batch: object
    n_micro: object
    model_cfg: object
    n_params: object
    epoch: object
    flops_step: object
    peak: object
    n_peak: object
    gpu_mem: object
    metrics: object
    bar: object
    checkpointer: object
    recorder: object
    start: object
    tokens_seen: object
    val_losses: object
    times: object
    counted: int = 0


def moe_metrics(engine, topo, tokens: int, model_cfg) -> dict:
    """A mixture of experts' step record for ``metrics.jsonl`` ({} without MoE layers): the loss
    breakdown ``loss_ce`` + ``loss_balance`` + ``loss_z`` (= the logged loss; each a sum over
    the step's tokens / ``tokens``, the global count), the routed copies each expert took over
    all MoE layers, ``moe_tokens_per_expert`` [E], its ``min``/``mean``/``max`` and the
    imbalance ratio max / mean (1 = perfectly balanced), and ``moe_dropped`` copies (capacity
    factor). One fp64 all-reduce of [3 + E] over the data axis (and pp: each stage holds other
    layers), phase ``"metrics"``, outside the step's bytes."""
    from ..models.moe import moe_stats

    n = getattr(model_cfg, "n_experts", None)
    if n is None:
        return {}
    st = moe_stats(engine.module)
    if st is None:  # a pipeline stage without MoE layers still joins the sum
        st = {"balance": 0.0, "z": 0.0, "dropped": 0, "tokens": torch.zeros(1, n)}
    vec = torch.cat([torch.tensor([float(st["balance"]), float(st["z"]), float(st["dropped"])],
                                  dtype=torch.float64),
                     st["tokens"].sum(0).double()]).to(topo.device)
    axes = [topo.data_axis] + (["pp"] if topo.size("pp") > 1 else [])
    with topo.ledger.phase("metrics"):
        for axis in axes:
            comm.all_reduce(vec, topo, axis, tag="moe_stats")
    vec = vec.cpu()
    per_expert = [int(round(x)) for x in vec[3:].tolist()]
    mean = sum(per_expert) / len(per_expert)
    return {"loss_balance": float(vec[0]) / tokens, "loss_z": float(vec[1]) / tokens,
            "moe_tokens_per_expert": per_expert, "moe_tokens_min": min(per_expert),
            "moe_tokens_mean": mean, "moe_tokens_max": max(per_expert),
            "moe_imbalance": max(per_expert) / mean if mean else 1.0,
            "moe_dropped": int(round(float(vec[2])))}


def _record(run: Run, step: int, res, batch, dt: float) -> dict:
    """The step's metrics.jsonl record (README: the run folder's contract)."""
    topo, flops_step = run.topo, run.flops_step
    rec = {"step": step, "loss": res.loss, "lr": run.scheduler.get_last_lr()[0],
           "grad_norm": res.grad_norm, "tokens": run.tokens_seen,
           # tokens/s: every position the step computed (global batch × seq-len, padding
           # included; the summary's too); target_tokens_per_s: those in the loss
           "tokens_per_s": run.cfg.global_batch * run.cfg.seq_len / dt,
           "target_tokens_per_s": res.tokens / dt, "step_time_s": dt,
           # achieved model TFLOP/s of all ranks together, and MFU (flops.py)
           "tflops": flops_step / dt / 1e12,
           "mfu": mfu(flops_step, dt, run.peak, run.n_peak),
           "comm_bytes": topo.ledger.step_bytes(), **axis_bytes(topo),
           # model state this rank holds (bytes): parameters + gradients + optimizer state
           "mem_bytes": res.state_bytes["total"],
           **{f"mem_{k}_bytes": v for k, v in res.state_bytes.items() if k != "total"}}
    rec.update(moe_metrics(run.engine, topo, res.tokens, run.model_cfg))  # {}: a dense model
    if run.cfg.task == "dpo":  # reward margin, accuracy, log-probs (from the step's forward)
        rec.update(run.work.reference.step_metrics(batch))
    if run.gpu_mem:  # per-rank peak/reserved bytes, beside the formula and the planner's
        rec.update(memory_record(topo.device, topo), **run.gpu_mem)
    if "loss_balance" in rec:
        rec["loss_ce"] = rec["loss"] - rec["loss_balance"] - rec["loss_z"]
    return rec


def _first_steps(run: Run, step: int, res) -> None:
    """Step 1: rank 0 writes ledger.json; the first step this run takes (step 1 unless resumed):
    the traffic lines and the report's first step (collective: every rank); a warm step under a
    pipeline: its timeline (collective)."""
    topo, engine, cfg = run.topo, run.engine, run.cfg
    if step == 1 and run.is_main:
        write_ledger_json(run.out / "ledger.json", topo, engine, cfg)
    if step == run.start + 1:  # the first step this run takes (step 1 unless resumed)
        for line in describe_traffic(topo, engine, cfg):
            log.info(line)
        run.recorder.first_step(topo, engine, cfg, res)  # collective: every rank
    if step == min(run.start + 2, cfg.steps):  # pp: a warm step's timeline (collective)
        run.recorder.timeline(engine, topo, cfg)
