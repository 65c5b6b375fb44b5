"""Every check of a configuration that can run without the data (:func:`validate`): each raises
:class:`~shardwise.errors.ShardwiseConfigError` naming the constraint and the fix; it runs in the
launcher and again on every rank before any collective. Also the timeout and output-folder checks
(:func:`check_timeout`, :func:`check_out_writable`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
import typing

from ..errors import ShardwiseConfigError
from ..precision import Precision
from .fields import CHOICES, DERIVABLE, TrainConfig


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Check ``cfg`` (and, if given, that the launched ``world_size`` matches the layout).

    Raises :class:`ShardwiseConfigError` naming the constraint and the fix.
    """
    from ..models import MLP_PRESETS, is_llama_name, max_seq_len_of, model_names
    from ..topology import validate_degrees

    _validate_finite(cfg)
    for name in filter(None, cfg.derived.split(",")):
        if name not in DERIVABLE:
            raise ShardwiseConfigError(f"derived = {cfg.derived!r}: only {', '.join(DERIVABLE)} "
                                       "are derived; remove the others from the config file")
    if cfg.n_layers < 0:
        raise ShardwiseConfigError(f"--n-layers {cfg.n_layers} must be ≥ 1 (or 0 for the preset)")
    for name, value in (("dp", cfg.dp), ("cp", cfg.cp), ("tp", cfg.tp), ("pp", cfg.pp),
                        ("ep", cfg.ep), ("dp-replicate", cfg.dp_replicate),
                        ("steps", cfg.steps),
                        ("seq-len", cfg.seq_len), ("global-batch", cfg.global_batch),
                        ("micro-batch", cfg.micro_batch)):
        if value < 1:
            raise ShardwiseConfigError(f"--{name} {value} must be at least 1")
    if cfg.dp_shard < 0 or (cfg.dp_shard and cfg.dp_shard * cfg.dp_replicate != cfg.dp):
        raise ShardwiseConfigError(
            f"--dp-shard {cfg.dp_shard} × --dp-replicate {cfg.dp_replicate} must equal --dp "
            f"{cfg.dp} (HSDP: dp = dp_replicate × dp_shard): give two of the three, e.g. "
            f"--dp-replicate {cfg.dp_replicate} --dp-shard {max(1, cfg.dp // cfg.dp_replicate)}")
    if world_size is not None:
        validate_degrees(cfg.pp, cfg.dp, cfg.tp, world_size, cfg.cp)
    if not is_llama_name(cfg.model) and cfg.model not in MLP_PRESETS:
        raise ShardwiseConfigError(f"--model {cfg.model!r} is not a preset: choose from "
                                   f"{model_names()}")
    _validate_moe(cfg)
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ShardwiseConfigError(f"--{key.replace('_', '-')} {getattr(cfg, key)!r}: "
                                       f"choose from {allowed}")
    from ..comm.algorithms import check_collectives

    check_collectives(cfg.collectives)
    _validate_task_and_init(cfg)
    if cfg.task == "dpo":
        _validate_dpo(cfg)
    if cfg.pack:
        from ..data.pack import check_pack

        check_pack(cfg.task, cfg.cp, cfg.engine)
    _validate_ranges(cfg)
    _validate_layout(cfg)
    check_optimizer(cfg.optimizer, engine=cfg.engine, tp=cfg.tp, pp=cfg.pp, zero=cfg.zero)
    # a step takes dp × (pipeline microbatches, or micro-batch) sequences; name that flag
    flag, n = (("microbatches", cfg.microbatches) if cfg.pp > 1 and cfg.microbatches else
               ("micro-batch", cfg.micro_batch))
    per_step = cfg.dp * n
    if cfg.global_batch % per_step:
        lo = max(per_step, cfg.global_batch // per_step * per_step)
        raise ShardwiseConfigError(
            f"--global-batch {cfg.global_batch} is not divisible by dp × {flag} = "
            f"{cfg.dp} × {n} = {per_step}: choose a multiple of {per_step} "
            f"(e.g. {lo} or {lo + per_step}) or change --{flag}")
    if is_llama_name(cfg.model) and cfg.seq_len > max_seq_len_of(cfg.model) \
            and not cfg.init_from_hf:  # (the HF model's own limit is checked above)
        raise ShardwiseConfigError(
            f"--seq-len {cfg.seq_len} exceeds the {cfg.model} model's max_seq_len "
            f"{max_seq_len_of(cfg.model)}: choose --seq-len ≤ "
            f"{max_seq_len_of(cfg.model)} or a larger --model")
    if cfg.data and not os.path.exists(cfg.data):
        raise ShardwiseConfigError(f"--data {cfg.data}: no such file or folder; give a .txt, "
                                   ".jsonl or .parquet file or a folder of them, or omit --data "
                                   "for the embedded default corpus")
    _validate_checkpointing(cfg)
    # an empty metrics.jsonl (a run that failed before its first record) holds nothing to lose:
    # a fresh run there starts its logs anew (train.loop._fresh_logs)
    if cfg.out and _nonempty(os.path.join(cfg.out, "metrics.jsonl")) and not cfg.resume:
        raise ShardwiseConfigError(
            f"--out {cfg.out} already holds a run (metrics.jsonl): choose a new --out (a config "
            "file from an earlier run keeps its out = ...; override it with --out), pass "
            "--resume auto to continue that run, or remove "
            "the folder")
    if cfg.lr <= 0:
        raise ShardwiseConfigError(f"--lr {cfg.lr} must be > 0")
    from ..models.ac import check_ac

    check_ac(cfg.ac, cfg.pp, cfg.schedule)
    if cfg.compile:  # layouts whose blocks cannot be one graph (models/compile.py)
        from ..models import MOE_PRESETS
        from ..models.compile import check_compile

        check_compile(tp=cfg.tp, cp=cfg.cp, ep=cfg.ep, moe=cfg.model in MOE_PRESETS,
                      pp=cfg.pp, schedule=cfg.schedule)
    if cfg.peak_tflops < 0:
        raise ShardwiseConfigError(f"--peak-tflops {cfg.peak_tflops} must be ≥ 0 (0 = the "
                                   "device's table value, or a measured CPU peak)")
    check_timeout(cfg.timeout)
    if cfg.hang_after < 0:  # --hang-after
        raise ShardwiseConfigError(f"--hang-after {cfg.hang_after} must be ≥ 0 seconds (0 = "
                                   f"half of --timeout, {cfg.timeout / 2:g} s)")


def _nonempty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def check_optimizer(optimizer: str, *, engine: str, tp: int, pp: int, zero: int) -> None:
    """Raise :class:`ShardwiseConfigError` for an ``--optimizer`` the layout cannot run (before
    any collective). Muon (:mod:`shardwise.parallel.muon`) is built for the explicit engine in
    every layout but a pipeline's ZeRO (1, 2, 3), and for the torch engine where its parameters are
    plain whole tensors (DDP and torch.distributed.pipelining stages: tp = 1, zero = 0)."""
    if optimizer != "muon":
        return
    if engine == "explicit" and pp > 1 and zero > 0:
        raise ShardwiseConfigError(
            f"--optimizer muon with --pp {pp} --zero {zero}: a pipeline's ZeRO does not gather "
            "Muon's updates yet; use --zero 0 with --pp, or --optimizer adamw")
    if engine == "torch" and (tp > 1 or zero > 0):
        raise ShardwiseConfigError(
            f"--optimizer muon --engine torch with tp={tp} zero={zero}: PyTorch's "
            "DTensor/FSDP2/ZeroRedundancyOptimizer parameters are not whole matrices and "
            "torch.optim.Muon cannot gather them; use --engine explicit (every layout), or "
            "--engine torch with DDP and/or pipelining (tp 1, zero 0)")


# The smallest --timeout accepted, seconds: a floor, not a recommendation (the default is 300).
# Far below it a run cannot even start (--timeout 0.001 failed connecting to the rendezvous
# store: "client socket has timed out after 1ms"), and near it ordinary scheduling (a rank on a
# busy CPU descheduled, a peer slower by a step) already looks like a hung peer.
MIN_TIMEOUT_S = 1.0


def check_timeout(seconds: float, flag: str = "--timeout") -> None:
    """Raise :class:`ShardwiseConfigError` unless the process-group timeout ``seconds`` is a
    finite number ≥ :data:`MIN_TIMEOUT_S` (``train``, ``trace`` through :func:`validate`;
    ``verify`` and ``bench`` call it for their own ``--timeout``). Runs before any collective."""
    if not math.isfinite(seconds):
        raise ShardwiseConfigError(f"{flag} {seconds} must be a finite number of seconds: give "
                                   "e.g. 300 (the default)")
    if seconds <= 0:
        raise ShardwiseConfigError(f"{flag} {seconds} must be > 0 seconds")
    if seconds < MIN_TIMEOUT_S:
        raise ShardwiseConfigError(
            f"{flag} {seconds} s is too short to be meaningful: the start-up rendezvous and "
            "every collective must finish within it (a rank waits that long for its slowest "
            f"peer): choose {flag} ≥ {MIN_TIMEOUT_S:g} s (default 300)")


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: AdamW casts lr to it


def _validate_finite(cfg: TrainConfig) -> None:
    """Every float field (``--lr``, ``--timeout``, ``--bucket-mb``, …) must be finite. NaN
    passes every range check below (each comparison with NaN is false) and infinity passes the
    lower bounds; both then fail late — AdamW's ValueError on rank 0 after the process group
    exists, a ``timedelta`` overflow — or silently (NaN weights). Checked for every float field
    of :class:`TrainConfig`, so a new one is covered too."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if hints[f.name] is float and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            raise ShardwiseConfigError(
                f"--{f.name.replace('_', '-')} {value} must be a finite number within fp32's "
                f"range (±{FP32_MAX:.3g}; not NaN or infinity): give a finite value, e.g. the "
                f"default {f.default!r}")


def _validate_moe(cfg: TrainConfig) -> None:
    """The mixture-of-experts flags: only with an MoE preset, each ≥ 0, and a model config
    they can build (top_k ≤ n_experts, …: :class:`~.models.moe.MoEConfig`'s rules, as
    :class:`ShardwiseConfigError`). ``--ep`` itself is the layout's (:func:`_validate_layout`)."""
    from ..models import MOE_PRESETS, preset_config

    flags = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in
             ("n_experts", "top_k", "n_shared_experts", "moe_every", "capacity_factor")
             if getattr(cfg, k)]
    if cfg.model not in MOE_PRESETS:
        if flags:
            raise ShardwiseConfigError(
                f"{', '.join(flags)}: mixture-of-experts settings need an MoE model: choose "
                f"--model {' or '.join(sorted(MOE_PRESETS))}, or drop them")
        return
    for k in ("n_experts", "top_k", "n_shared_experts", "moe_every", "aux_loss_coef",
              "z_loss_coef", "capacity_factor"):
        if getattr(cfg, k) < 0:
            raise ShardwiseConfigError(f"--{k.replace('_', '-')} {getattr(cfg, k)} must be ≥ 0")
    try:
        preset_config(cfg.model, cfg.vocab_size, **cfg.model_overrides())
    except ValueError as e:
        raise ShardwiseConfigError(f"--model {cfg.model}: {e}") from None


def _validate_layout(cfg: TrainConfig) -> None:
    """The layout through the one validator, :meth:`~.parallel.layout.Layout.check`, with the
    model's config (read only when tp, sp, pp or cp needs it) and the batch (before any
    collective)."""
    from ..models import MOE_PRESETS, PRESETS, preset_config
    from ..parallel.layout import Layout
    from ..topology import resolve_device

    needs_model = cfg.tp > 1 or cfg.sp or cfg.pp > 1 or cfg.cp > 1 or cfg.ep > 1 \
        or cfg.model in MOE_PRESETS
    over = cfg.model_overrides()
    if cfg.model in PRESETS or cfg.model in MOE_PRESETS:  # a Llama: its dropout matters to cp
        over = {"dropout": cfg.dropout, **over}
    Layout.from_config(cfg).check(
        preset_config(cfg.model, cfg.vocab_size, **over) if needs_model
        else None, engine=cfg.engine, precision=Precision.from_config(cfg), seq_len=cfg.seq_len,
        device=resolve_device(cfg.device)[0],
        global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
        layers_per_stage=cfg.stage_split() if cfg.pp > 1 else None, offload=cfg.offload)


def _validate_ranges(cfg: TrainConfig) -> None:
    """Numbers that would otherwise fail late (a ZeroDivisionError at step 1, AdamW's ValueError
    after the process group exists) or silently do the wrong thing (a negative clip norm flips
    the gradients; min-lr-ratio > 1 makes the "decay" grow the LR)."""
    for name, value, low in (("log-every", cfg.log_every, 1), ("eval-every", cfg.eval_every, 1),
                             ("eval-sequences", cfg.eval_sequences, 1),
                             ("warmup-steps", cfg.warmup_steps, 0),
                             ("microbatches", cfg.microbatches, 0),
                             ("virtual-stages", cfg.virtual_stages, 0),
                             ("sample-tokens", cfg.sample_tokens, 0)):
        if value < low:
            raise ShardwiseConfigError(f"--{name} {value} must be ≥ {low}")
    if cfg.grad_clip < 0:
        raise ShardwiseConfigError(f"--grad-clip {cfg.grad_clip} must be ≥ 0 (a max gradient "
                                   "norm; 0 = no clipping)")
    if not 0 <= cfg.dropout < 1:
        raise ShardwiseConfigError(f"--dropout {cfg.dropout} must be in [0, 1) (a drop "
                                   "probability; 0 = off)")
    if cfg.bucket_mb <= 0:
        raise ShardwiseConfigError(f"--bucket-mb {cfg.bucket_mb} must be > 0 MiB (e.g. 25; a "
                                   "tiny value means one all-reduce per parameter)")
    if cfg.weight_decay < 0:
        raise ShardwiseConfigError(f"--weight-decay {cfg.weight_decay} must be ≥ 0 (e.g. 0.1)")
    for name, value in (("beta1", cfg.beta1), ("beta2", cfg.beta2)):
        if not 0 <= value < 1:
            raise ShardwiseConfigError(f"--{name} {value} must be in [0, 1) (AdamW's moment "
                                       "decay, e.g. 0.9 and 0.95)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ShardwiseConfigError(f"--min-lr-ratio {cfg.min_lr_ratio} must be in [0, 1] (the "
                                   "final LR as a fraction of --lr)")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ShardwiseConfigError("--device cuda, but this torch sees no CUDA device "
                                       f"(torch {torch.__version__}): use --device cpu (or auto, "
                                       "the default), or install a CUDA build of torch on a "
                                       "GPU machine")


def _validate_task_and_init(cfg: TrainConfig) -> None:
    """``--task sft`` needs a Llama model and a ``.jsonl`` file; ``--init-from-hf DIR`` needs a
    loadable Llama folder (config.json read here; weights when the model is built) whose
    context fits ``--seq-len``. Reads files only: runs before any collective."""
    from ..models import MLP_PRESETS

    from ..interop.hub import data_recipe, looks_like_hub_name

    if cfg.data and looks_like_hub_name(cfg.data):
        raise ShardwiseConfigError(f"--data {cfg.data}: no such file; " + data_recipe(cfg.data))
    if cfg.task == "sft":
        if cfg.model in MLP_PRESETS:
            raise ShardwiseConfigError(f"--task sft trains a language model; --model {cfg.model} "
                                       "is the MLP: choose --model tiny, small or base")
        if not cfg.data:
            raise ShardwiseConfigError("--task sft needs --data FILE.jsonl with one "
                                       '{"instruction", "input", "output"} or {"messages": [...]}'
                                       " record per line (see examples/sft_sample.jsonl, "
                                       "examples/chat_sample.jsonl)")
        if not cfg.data.endswith(".jsonl"):
            raise ShardwiseConfigError(f"--task sft --data {cfg.data}: expected a .jsonl file of "
                                       '{"instruction", "input", "output"} or {"messages": '
                                       '[...]} records (see examples/sft_sample.jsonl, '
                                       "examples/chat_sample.jsonl)")
    if cfg.init_from_hf:
        if cfg.model in MLP_PRESETS:
            raise ShardwiseConfigError(f"--init-from-hf loads a Llama; --model {cfg.model} is the "
                                       "MLP: drop --model (the HF config.json decides the shape)")
        from ..interop.hf import check_weight_files

        from ..interop.hf import hf_to_llama_config, read_hf_config

        over = cfg.model_overrides()  # raises on a missing/unsupported folder
        # no weights, a truncated file, or tensors that do not fit config.json
        check_weight_files(cfg.init_from_hf, hf_to_llama_config(read_hf_config(cfg.init_from_hf)))
        if cfg.seq_len > over["max_seq_len"]:
            raise ShardwiseConfigError(
                f"--seq-len {cfg.seq_len} exceeds the HF model's max_position_embeddings "
                f"{over['max_seq_len']}: choose --seq-len ≤ {over['max_seq_len']}")
        window = over.get("sliding_window") or 0
        if window and cfg.seq_len > window:
            raise ShardwiseConfigError(
                f"--seq-len {cfg.seq_len} exceeds the HF model's sliding_window {window}: "
                "shardwise's attention is full causal attention, equal to the windowed one only "
                f"while a sequence fits the window: choose --seq-len ≤ {window}")


def _validate_dpo(cfg: TrainConfig) -> None:
    """``--task dpo``: a dense Llama, a ``.jsonl`` file, β > 0, a layout DPO runs in, and batches
    of whole pairs: chosen and rejected sit in adjacent rows of one micro-batch on one rank
    (train/dpo.py), so the global batch, each dp rank's share and each micro-batch must be
    even numbers of rows. Before any collective."""
    from ..models import MLP_PRESETS, MOE_PRESETS

    if cfg.model in MLP_PRESETS or cfg.model in MOE_PRESETS:
        raise ShardwiseConfigError(f"--task dpo trains a dense language model; --model {cfg.model}"
                                   " is not one: choose --model tiny, small or base")
    if not cfg.data or not cfg.data.endswith(".jsonl"):
        raise ShardwiseConfigError(f"--task dpo needs --data FILE.jsonl with one "
                                   '{"prompt", "chosen", "rejected"} record per line, got '
                                   f"{cfg.data or 'none'}")
    if not cfg.dpo_beta > 0:
        raise ShardwiseConfigError(f"--dpo-beta {cfg.dpo_beta} must be > 0 (the KL weight β; "
                                   "TRL's default is 0.1)")
    if cfg.cp > 1:
        raise ShardwiseConfigError("--task dpo with --cp > 1: a row's log-prob would be split "
                                   "over the cp ranks; use dp, tp, pp or ZeRO")
    if cfg.engine == "torch" and (cfg.tp > 1 or cfg.pp > 1):
        raise ShardwiseConfigError("--task dpo with --engine torch runs dp and ZeRO layouts "
                                   "only (DTensor's loss_parallel and torch.pipelining give no "
                                   "per-row log-probs): use --engine explicit for tp or pp")
    micro, m = cfg.microbatching()
    local = cfg.global_batch // cfg.dp
    pairs = "each (chosen, rejected) pair sits in adjacent rows of one micro-batch on one rank"
    if cfg.global_batch % 2 or local % 2 or cfg.global_batch % cfg.dp:
        raise ShardwiseConfigError(
            f"--task dpo: --global-batch {cfg.global_batch} over --dp {cfg.dp} gives "
            f"{cfg.global_batch / cfg.dp:g} rows per rank, which would split a pair ({pairs}): "
            f"choose --global-batch a multiple of 2 × dp = {2 * cfg.dp}")
    if micro % 2:
        raise ShardwiseConfigError(
            f"--task dpo: a micro-batch of {micro} rows would split a pair ({pairs}): choose an "
            "even --micro-batch" + (" (or --microbatches dividing global batch / (2·dp))"
                                    if cfg.pp > 1 else ""))


def _validate_checkpointing(cfg: TrainConfig) -> None:
    """``--save-every``, ``--keep``, ``--resume`` and ``--out`` (writable), before anything starts.
    The checkpoint itself is checked on every rank before any collective
    (:func:`shardwise.checkpoint.find_resume_checkpoint`)."""
    if cfg.save_every < 0:
        raise ShardwiseConfigError(f"--save-every {cfg.save_every} must be ≥ 0 (0 = only the "
                                   "final checkpoint)")
    if cfg.keep < 0:
        raise ShardwiseConfigError(f"--keep {cfg.keep} must be ≥ 0 (0 = keep every checkpoint)")
    if cfg.resume == "auto" and not cfg.out:
        raise ShardwiseConfigError("--resume auto looks for checkpoints in --out, but no --out "
                                   "was given: pass --out DIR (the same folder on every restart)")
    if cfg.resume and cfg.resume != "auto" and not os.path.exists(cfg.resume):
        raise ShardwiseConfigError(f"--resume {cfg.resume}: no such folder: give a "
                                   "checkpoints/step_N folder, a run folder, or auto")
    if cfg.max_restarts < 0:
        raise ShardwiseConfigError(f"--max-restarts {cfg.max_restarts} must be ≥ 0 (0 = a "
                                   "failed rank stops the run)")
    if cfg.max_restarts and cfg.resume != "auto":
        raise ShardwiseConfigError(
            f"--max-restarts {cfg.max_restarts} restarts every rank from the newest checkpoint "
            "in --out: add --resume auto (with --out DIR, the same folder on every attempt, and "
            "--save-every K, so that there is a checkpoint to go back to)")
    if cfg.resume:  # before --out is created: a refusal leaves nothing behind
        _validate_resume_optimizer(cfg)
    if cfg.out:
        check_out_writable(cfg.out)


def _validate_resume_optimizer(cfg: TrainConfig) -> None:
    """``--resume`` of a checkpoint saved with another ``--optimizer`` (Muon's state into AdamW,
    or the reverse), refused from its ``meta.json`` alone, in the launcher and on every rank
    before any collective (:func:`~shardwise.checkpoint.check_saved_optimizer`; the checkpoint
    :func:`~shardwise.checkpoint.resume_candidate` names, not yet verified: a damaged one is
    named later by :func:`~shardwise.checkpoint.find_resume_checkpoint`)."""
    from ..checkpoint import CheckpointError, check_saved_optimizer, read_meta, resume_candidate

    folder = resume_candidate(cfg.resume, cfg.out)
    if folder is None:
        return
    try:
        meta = read_meta(folder)
    except CheckpointError:
        return
    if isinstance(meta, dict):
        check_saved_optimizer(folder, meta, cfg.optimizer)


def check_out_writable(out: str) -> None:
    """Raise :class:`ShardwiseConfigError` unless ``out`` is (or can be created as) a writable
    folder, before anything starts: creates it (as the run would) and writes and removes a probe
    file in it."""
    p = Path(out).absolute()
    if p.exists() and not p.is_dir():
        raise ShardwiseConfigError(f"--out {out}: exists and is not a folder: choose a folder "
                                   "path for the run's outputs")
    anc = p
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ShardwiseConfigError(f"--out {out}: cannot be created because {anc} is a file, not "
                                   "a folder: choose another --out")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ShardwiseConfigError(f"--out {out}: {anc} is not writable by this user: choose a "
                                   "writable --out (or fix the folder's permissions)")
    # permissions do not tell everything (root, read-only or special file systems): try it
    probe = p / f".shardwise-write-test-{os.getpid()}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ShardwiseConfigError(f"--out {out}: cannot write there ({e.strerror or e}): choose "
                                   "a writable --out") from None
