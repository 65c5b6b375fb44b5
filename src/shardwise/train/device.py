"""What the training loop reports about the accelerator: the attention kernel it runs, the
AdamW implementation, and the device memory each rank peaks at per step.

Device memory (``metrics.jsonl``, on an accelerator only). PyTorch's caching allocator counts
the bytes of live tensors (``max_memory_allocated``: the step's peak, reset before each step)
and the bytes it holds from the driver (``memory_reserved``: allocated + cached free blocks,
what ``nvidia-smi`` shows minus the CUDA context). Each rank's pair is gathered (one int64
all-reduce of ``[world, 2]`` over all ranks, phase ``"metrics"``, outside the step's bytes) and
rank 0 writes ``gpu_max_allocated_bytes`` and ``gpu_reserved_bytes`` as lists indexed by global
rank. Beside them, per rank 0 (the same on every dp rank of a dp-only layout):
``mem_formula_bytes`` — the model-state formula (:func:`shardwise.formulas.memory_formula`, the
ZeRO paper's 16Ψ, 4Ψ + 4Ψ + 8Ψ/N, …) — and ``act_estimate_bytes`` — the planner's activation
bytes for one micro-batch (:func:`activation_estimate`). On CPU nothing is measured, so these
device keys are absent (never zeros or guesses).
"""

from __future__ import annotations

import torch

from .. import comm


def accelerator_type(device: torch.device) -> str | None:
    """``device.type`` when it is an accelerator with a memory-statistics API in
    ``torch.<type>`` (``max_memory_allocated``, ``memory_reserved``), else None (CPU, meta)."""
    if device.type in ("cpu", "meta"):
        return None
    mod = getattr(torch, device.type, None)
    return device.type if mod is not None and hasattr(mod, "max_memory_allocated") else None


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (no-op on CPU)."""
    kind = accelerator_type(device)
    if kind is not None:
        getattr(torch, kind).reset_peak_memory_stats(device)


def memory_record(device: torch.device, topo) -> dict:
    """``{"gpu_max_allocated_bytes": [per rank], "gpu_reserved_bytes": [per rank]}`` since the
    last :func:`reset_peak`, gathered over all ranks (a collective: every rank calls it,
    module docstring); {} on CPU, where no collective is issued either."""
    kind = accelerator_type(device)
    if kind is None:
        return {}
    mod = getattr(torch, kind)
    world, me = topo.size("world"), topo.index("world")
    table = torch.zeros(world, 2, dtype=torch.int64, device=device)
    table[me, 0] = mod.max_memory_allocated(device)
    table[me, 1] = mod.memory_reserved(device)
    if world > 1:
        with topo.ledger.phase("metrics"):
            comm.all_reduce(table, topo, "world", tag="memory")
    rows = table.cpu().tolist()
    return {"gpu_max_allocated_bytes": [r[0] for r in rows],
            "gpu_reserved_bytes": [r[1] for r in rows]}


def activation_estimate(model_cfg, *, micro_batch: int, seq_len: int, ac: str, dtype: str,
                        tp: int = 1, sp: bool = False, compiled: bool = False) -> float | None:
    """The planner's bytes of activations one micro-batch keeps for backward on one rank
    (:func:`shardwise.plan.memory.layer_activation_bytes` × layers + the head and embedding
    terms), for ``model_cfg`` (a dense :class:`~shardwise.models.LlamaConfig`; None for other
    models) with ``micro_batch`` sequences of ``seq_len`` tokens, ``ac`` (none | selective |
    full), compute ``dtype`` (bf16: 2-byte activations, else 4). Kernels: "eager" (our PyTorch
    Llama, exact in fp32) or, ``compiled``, "fused" (what inductor's fusions approach)."""
    from ..models import LlamaConfig
    from ..plan import memory as plan_memory
    from ..plan.models import from_llama_config

    if type(model_cfg) is not LlamaConfig:
        return None
    spec = from_llama_config(model_cfg, seq_len=seq_len,
                             kernels="fused" if compiled else "eager")
    a, tokens = (2 if dtype == "bf16" else 4), micro_batch * seq_len
    return (model_cfg.n_layers * plan_memory.layer_activation_bytes(spec, tokens, tp=tp, sp=sp,
                                                                    ckpt=ac, act_bytes=a)
            + plan_memory.head_activation_bytes(spec, tokens, tp=tp, sp=sp, act_bytes=a)
            + plan_memory.embedding_activation_bytes(spec, tokens))


def attention_line(model_cfg, *, device: torch.device, dtype: str, micro_batch: int,
                   seq_len: int, tp: int = 1, packed: bool = False) -> str | None:
    """The start-up line naming the SDPA kernel the blocks run (:func:`~shardwise.models.sdpa.
    sdpa_backend` for this rank's heads, micro-batch, sequence and compute dtype) and whether
    GQA is native; None for a model without attention (the MLP)."""
    from ..models.sdpa import SDPA_GQA, sdpa_backend

    heads, kv = getattr(model_cfg, "n_heads", None), getattr(model_cfg, "n_kv_heads", None)
    if heads is None or kv is None:
        return None
    h, k = max(1, heads // tp), max(1, kv // tp)
    name = sdpa_backend(h, k, model_cfg.head_dim, seq_len, device=device,
                        dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                        batch=micro_batch, masked=packed)
    gqa = ("MHA" if h == k else "native GQA (enable_gqa)" if SDPA_GQA
           else "GQA by repeating K/V (this torch's SDPA has no enable_gqa)")
    return (f"  attention: scaled_dot_product_attention, {name} kernel on {device.type} "
            f"({h} q / {k} kv heads per rank, {gqa}"
            + (", block-diagonal document mask (--pack)" if packed else "") + ")")


def host_peak_rss(topo) -> list[int]:
    """Every rank's peak resident set size so far, in bytes, indexed by global rank (``getrusage
    ru_maxrss``: the kernel's high-water mark of the process's resident pages; kB on Linux,
    bytes on macOS; forked workers count the pages they share with the launcher, the import
    floor). One int64 all_gather over the world, phase and tag ``init``. The training loop
    calls it once the engine and optimizer exist: the start-up peak (docs/checkpointing.md)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024
    mine = torch.tensor([peak], dtype=torch.int64, device=topo.device)
    out = torch.empty(topo.world_size, dtype=torch.int64, device=topo.device)
    with topo.ledger.phase("init"):
        comm.all_gather(out, mine, topo, "world", tag="init")
    return [int(x) for x in out.tolist()]


def phase_peaks(topo) -> dict:
    """Every rank's memory peaks since the previous call (or the start), then a new window:
    ``{"host": [bytes per global rank], "host_now": [bytes per rank], "device": [bytes per
    rank] | None, "host_reset": bool}``. ``host_now``: the RSS at the call (``VmRSS``), where
    the next window starts. Host: the peak RSS (``VmHWM`` of ``/proc/self/status``, reset by writing 5 to
    ``/proc/self/clear_refs``, Linux ≥ 4.0); where that is missing, ``ru_maxrss`` (the peak
    since the process began: ``host_reset`` False). Device: ``max_memory_allocated`` since the
    last :func:`reset_peak` (the live tensors' bytes), reset after; None on CPU, where device
    memory is host memory. One int64 all_gather of [3] over the world (phase and tag
    ``init``). The training loop calls it after start-up, before and after the final save, and
    after the final sample: each phase's peak apart (``host_memory.json``,
    docs/checkpointing.md)."""
    import resource
    import sys
    from pathlib import Path

    try:
        status = Path("/proc/self/status").read_text()
        host = int(status.split("VmHWM:")[1].split()[0]) * 1024
        now = int(status.split("VmRSS:")[1].split()[0]) * 1024
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except (OSError, IndexError, ValueError):
        host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        host *= 1 if sys.platform == "darwin" else 1024
        now, reset = -1, False
    kind = accelerator_type(topo.device)
    dev = getattr(torch, kind).max_memory_allocated(topo.device) if kind else -1
    reset_peak(topo.device)
    mine = torch.tensor([host, dev, now], dtype=torch.int64, device=topo.device)
    out = torch.empty(3 * topo.world_size, dtype=torch.int64, device=topo.device)
    with topo.ledger.phase("init"):
        comm.all_gather(out, mine, topo, "world", tag="init")
    rows = out.view(-1, 3).tolist()
    return {"host": [r[0] for r in rows], "host_now": [r[2] for r in rows],
            "device": [r[1] for r in rows] if kind else None, "host_reset": reset}


def record_phases(out, phases: dict) -> None:
    """Rank 0: the end's phases (:func:`phase_peaks`) into ``out/host_memory.json`` beside the
    start-up's, and one log line of each phase's host peak range."""
    import json
    import logging
    from pathlib import Path

    path = Path(out) / "host_memory.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    rec.setdefault("phases", {}).update(phases)
    path.write_text(json.dumps(rec) + "\n")
    logging.getLogger("shardwise").info(
        "  host memory by phase (peak RSS per rank, MiB): " + "; ".join(
            f"{k} {min(v['host']) / 2**20:,.0f}–{max(v['host']) / 2**20:,.0f}"
            for k, v in rec["phases"].items()))


def device_memory_keys(engine, topo, cfg, model_cfg, n_params: int) -> dict:
    """The constant keys written next to each step's measured device memory (module
    docstring): ``mem_formula_bytes`` (rank 0's model-state formula; a single process: the
    replica's 16Ψ) and ``act_estimate_bytes`` (:func:`activation_estimate`, None where the
    planner has no formula for this model); {} on CPU, where no device memory is measured."""
    from ..formulas import memory_formula
    from ..parallel.dp.data_parallel import dp_memory_formula

    if accelerator_type(topo.device) is None:
        return {}
    formula = memory_formula(engine, topo)
    if formula is None and topo.world_size == 1:
        formula = dp_memory_formula(n_params)
    micro_batch = cfg.microbatching()[0]
    act = None
    if cfg.pp == 1 and cfg.cp == 1:  # one stage, whole sequences: the formula's setting
        act = activation_estimate(model_cfg, micro_batch=micro_batch, seq_len=cfg.seq_len,
                                  ac=cfg.ac, dtype=cfg.dtype, tp=cfg.tp, sp=cfg.sp,
                                  compiled=cfg.compile)
    return {"mem_formula_bytes": formula["total"] if formula else None,
            "act_estimate_bytes": act}


def device_lines(model_cfg, topo, cfg, module) -> list[str]:
    """Start-up log lines: the attention kernel (:func:`attention_line`) and the AdamW
    implementation (:func:`shardwise.train.optim.adamw_impl_of` this rank's ``module``)."""
    from .optim import adamw_impl_of, optimizer_lines

    lines = []
    att = attention_line(model_cfg, device=topo.device, dtype=cfg.dtype,
                         micro_batch=cfg.microbatching()[0], seq_len=cfg.seq_len // cfg.cp,
                         tp=cfg.tp, packed=cfg.pack)
    if att:
        lines.append(att)
    which = "AdamW" if cfg.optimizer != "muon" else "AdamW (for what Muon leaves, next line)"
    lines.append(f"  optimizer: {which}, {adamw_impl_of(module)} implementation "
                 "(fused on CUDA, foreach on CPU, for-loop over mixed DTensor/Tensor)")
    return lines + optimizer_lines(module, cfg)  # --optimizer muon: which tensors get which
