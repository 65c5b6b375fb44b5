"""What the planner evaluates and the rules it checks first: :class:`PlanLayout` (the engine's
:class:`~shardwise.parallel.layout.Layout` plus the planner's own knobs), the precisions
(:data:`PRECISIONS`), the :class:`Assumptions` the model rests on, and the checks a layout must
pass before it is estimated (:func:`check_layout`, with :func:`check_cp`, :func:`check_ep`,
:func:`check_hsdp`). Formulas and sources: docs/planner.md, "The cost model's formulas".
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ShardwiseConfigError
from ..parallel.cp import validate_cp
from ..parallel.layout import Layout
from .hardware import Cluster
from .models import ModelSpec


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter of parameters ``P``, gradients ``G``, optimizer state ``K``; bytes per
    communicated gradient element ``grad_comm``; bytes per activation element ``act``;
    ``compute`` dtype of the matmuls; ``adam_bytes`` read + written per parameter by the
    optimizer step; ``wgrad_bytes`` read + written per parameter and micro-batch to add a new
    weight gradient into the accumulated one when that is a separate element-wise kernel (bf16:
    write and read the bf16 gradient, read and write the fp32 sum; fp32: 4 × 4)."""

    name: str
    param: int
    grad: int
    optim: int
    grad_comm: int
    act: int
    compute: str
    adam_bytes: int
    wgrad_bytes: int


PRECISIONS = {
    # bf16 weights, fp32 main gradients (Megatron-LM's accumulation buffer, reduced in fp32 as
    # Llama 3 §3.3.2 does), fp32 master weights + Adam m, v: 2 + 4 + 12 = 18 bytes/parameter
    # (Megatron-LM distributed-optimizer table; ZeRO §3.1 counts 2 + 2 + 12 with fp16 gradients)
    "bf16": Precision("bf16", 2, 4, 12, 4, 2, "bf16", 30, 12),
    # shardwise's --dtype bf16: fp32 weights, gradients and Adam state, bf16 autocast compute
    "amp": Precision("amp", 4, 4, 8, 4, 2, "bf16", 28, 16),
    # everything fp32 (the CPU tests): 4 + 4 + 8 = 16 bytes/parameter
    "fp32": Precision("fp32", 4, 4, 8, 4, 4, "fp32", 28, 16),
}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
CKPT = ("none", "selective", "full")
STEP_COUNTER_BYTES = 4  # torch.optim.AdamW: one float32 `step` tensor per parameter tensor


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The constants that are not datasheet numbers (see the module docstring)."""

    gemm_efficiency: float = 0.676
    link_efficiency: float = 0.8
    memory_reserve: float = 0.10
    grad_bucket_copy: bool = False  # True for shardwise's explicit DP engine
    p2p_overlap: bool = True  # pipeline sends run under compute except in the fill and drain
    grad_accum_fused: bool = False  # weight gradients accumulate inside the GEMM (Megatron-LM)


@dataclasses.dataclass(frozen=True)
class PlanLayout(Layout):
    """One way to run a step: a :class:`~shardwise.parallel.layout.Layout` (dp, cp, tp, pp,
    zero, sp, schedule, ``virtual_stages``: model chunks per pipeline rank, interleaved-1f1b
    only, 0 = the schedule's default, read through ``chunks``; ``cp`` ranks split every
    sequence, ``cp_method`` "ring" or "allgather") plus the knobs only the planner
    varies. ``schedule`` is ignored when pp == 1; ``microbatches`` stays 0: m follows from the
    global batch, m = G/(dp·b). ``micro_batch``: sequences per micro-batch (b). ``ckpt``:
    activation checkpointing (none | selective | full). ``precision``: a key of
    :data:`PRECISIONS`. ``grad_reduce`` (zero 2 and 3 with several micro-batches): "step" — the
    micro-batches accumulate full local gradients and one reduce-scatter runs after the last
    (shardwise's ZeRO engine, FSDP under ``no_sync``); "micro" — a reduce-scatter after every
    micro-batch, gradients stay sharded (DeepSpeed ZeRO-2, FSDP without ``no_sync``).
    ``dp_replicate`` R (HSDP, hybrid sharded data parallelism): dp = R × S, ZeRO shards over the
    shard group of S = :attr:`dp_shard` ranks (× cp) and the R shard groups replicate each other
    (module docstring, section "HSDP"); R = 1 is ZeRO over all of dp. R must divide dp and needs
    ZeRO ≥ 1 (:func:`check_layout`)."""

    micro_batch: int = 1
    ckpt: str = "none"
    precision: str = "bf16"
    grad_reduce: str = "step"  # zero 2/3: "step" (once, after accumulating) or "micro"
    # (``dp_replicate`` and ``dp_shard``: the engine's Layout fields, inherited)

    def name(self) -> str:
        """:meth:`Layout.name` (the format of verify and bench), then the planner's knobs, e.g.
        ``"dp=64,tp=8,pp=16,zero=1,sp,interleaved-1f1b,v=8,b=1,ckpt=selective"``;
        ``reduce/micro-batch`` marks ZeRO-2/3 reducing after every micro-batch; an HSDP layout
        has ``dp_replicate=R`` after its degrees, e.g. ``"dp=16,pp=4,dp_replicate=2,zero=3,…"``
        (the format of the engine's ``Layout.name``)."""
        base = super().name()
        if self.dp_replicate > 1 and "dp_replicate=" not in base:
            # the engine's Layout.name format: after the degrees (dp, cp, tp, pp)
            head = base.split(",")
            k = 0
            while k < len(head) and head[k].split("=")[0] in ("dp", "cp", "tp", "pp"):
                k += 1
            base = ",".join(head[:k] + [f"dp_replicate={self.dp_replicate}"] + head[k:])
        parts = [base, f"b={self.micro_batch}"]
        if self.ckpt != "none":
            parts.append(f"ckpt={self.ckpt}")
        if self.zero >= 2 and self.grad_reduce == "micro":
            parts.append("reduce/micro-batch")
        return ",".join(parts)


# ---------------------------------------------------------------------------------------------
# activations


def llama_style(model: ModelSpec) -> bool:
    """The shape our context-parallel attention runs on (and the estimator builds): SwiGLU,
    RMSNorm, RoPE, no biases, no dropout."""
    return (model.mlp == "swiglu" and model.norm == "rmsnorm" and not model.bias
            and not model.learned_positions and not model.dropout)


def check_cp(model: ModelSpec, cp: int, method: str = "ring") -> None:
    """Raise ShardwiseConfigError unless ``model`` can run context parallelism over ``cp`` ranks
    with ``method``: the core's own checks (:func:`shardwise.parallel.cp.validate_cp`: cp ≥ 1, a
    known method), a Llama-style model (:func:`llama_style`), and ``model.seq_len`` divisible
    by 2·cp (the zig-zag split cuts every sequence into 2·cp chunks)."""
    validate_cp(None, cp, method)
    if cp == 1:
        return
    if not llama_style(model):
        raise ShardwiseConfigError(
            f"--cp {cp}: context parallelism runs on Llama-style models (SwiGLU, RMSNorm, RoPE, "
            f"no biases, no dropout), and {model.name} is not one: choose a Llama model "
            "(llama3-8b, llama3-70b, llama3-405b, tiny, …) or --cp 1")
    if model.seq_len % (2 * cp):
        good = [k * 2 * cp for k in range(1, 4)]
        raise ShardwiseConfigError(
            f"--cp {cp} cuts each sequence into 2·cp = {2 * cp} chunks (the load-balanced causal "
            f"split), but the sequence length {model.seq_len} is not divisible by {2 * cp}: "
            f"choose a --seq-len that is a multiple of {2 * cp} (e.g. "
            f"{', '.join(map(str, good))}), or another --cp")


def check_ep(model: ModelSpec, layout: PlanLayout) -> None:
    """Raise ShardwiseConfigError unless ``layout.ep`` expert-parallel ranks can run ``model``:
    the core's own check (:func:`shardwise.parallel.ep.validate_ep` without a model: ep ≥ 1
    dividing dp × cp, EP ⊆ dp × cp), then an MoE model whose n_experts ep divides. The engine's
    refusal of MoE with SP or cp > 1 (a sequence split needs its routing counts summed for the
    per-sequence balance loss, not wired there) is not the planner's: it models those layouts
    as Megatron-Core runs them."""
    from ..parallel.ep import validate_ep

    validate_ep(None, layout.ep, layout.dp, layout.cp)
    if layout.ep > 1 and not model.is_moe:
        raise ShardwiseConfigError(
            f"--ep {layout.ep} needs a mixture-of-experts model (there are no experts to split), "
            f"and {model.name} is dense: choose an MoE model (mixtral-8x7b, mixtral-8x22b, dbrx, "
            "llama4-scout, llama4-maverick, moe-tiny, …) or --ep 1")
    if model.is_moe and model.n_experts % layout.ep:
        ok = [e for e in range(1, model.n_experts + 1) if model.n_experts % e == 0
              and (layout.dp * layout.cp) % e == 0]
        raise ShardwiseConfigError(
            f"--ep {layout.ep} must divide n_experts = {model.n_experts} ({model.name}): each "
            f"rank holds n_experts / ep experts; choose --ep from {ok}")


def check_hsdp(layout: PlanLayout) -> None:
    """Raise ShardwiseConfigError unless ``layout.dp_replicate`` R is a valid HSDP split of dp:
    a positive integer dividing dp (dp = R × S) that leaves a shard group of S·cp ≥ 2 ranks,
    with a ZeRO stage ≥ 1 when R > 1 (ZeRO-0
    shards nothing, so every rank already holds everything and all-reduces over all of dp: an
    R would change nothing but the name), and with ep > 1 an ep that divides S·cp (the expert
    group lives inside a shard group, as torchtitan carves ep out of ``dp_shard_cp``)."""
    R, dp = layout.dp_replicate, layout.dp
    if not isinstance(R, int) or R < 1:
        raise ShardwiseConfigError(f"--dp-replicate {R!r} must be a positive integer")
    if dp % R:
        ok = [r for r in range(1, dp + 1) if dp % r == 0]
        raise ShardwiseConfigError(
            f"--dp-replicate {R} must divide dp = {dp} (dp = dp_replicate × dp_shard): choose "
            f"from {ok}")
    if R > 1 and layout.zero == 0:
        raise ShardwiseConfigError(
            f"--dp-replicate {R} with --zero 0: without ZeRO every rank holds the whole model "
            "state and the gradient all-reduce already spans all of dp (plain DP); HSDP shards "
            "the state within a group and replicates it across groups: choose --zero 1, 2 or "
            "3, or --dp-replicate 1")
    shard = layout.dp_shard * layout.cp
    if R > 1 and shard < 2:
        raise ShardwiseConfigError(
            f"--dp-replicate {R} with dp = {dp} leaves a shard group of dp_shard·cp = "
            f"{layout.dp_shard}·{layout.cp} = 1 rank: nothing to shard within a replica; "
            "choose a smaller --dp-replicate (the shard group needs ≥ 2 ranks)")
    if R > 1 and layout.ep > 1 and shard % layout.ep:
        ok = [e for e in range(1, shard + 1) if shard % e == 0]
        raise ShardwiseConfigError(
            f"--ep {layout.ep} with --dp-replicate {R}: the expert group must lie inside a "
            f"shard group of dp_shard·cp = {layout.dp_shard}·{layout.cp} = {shard} ranks: "
            f"choose --ep from {ok}, or another --dp-replicate")


def check_layout(model: ModelSpec, cluster: Cluster, layout: PlanLayout, global_batch: int) -> int:
    """Validate ``layout`` for ``model`` and a step of ``global_batch`` sequences; return m, the
    micro-batches per step and replica. Raises ShardwiseConfigError naming the constraint."""
    lay = layout
    for name, v in (("dp", lay.dp), ("cp", lay.cp), ("tp", lay.tp), ("pp", lay.pp),
                    ("micro-batch", lay.micro_batch), ("virtual stages", lay.virtual_stages or 1)):
        if not isinstance(v, int) or v < 1:
            raise ShardwiseConfigError(f"{name} = {v!r} must be a positive integer")
    if lay.cp > 1:
        check_cp(model, lay.cp, lay.cp_method)
    check_hsdp(lay)
    if lay.ep != 1 or model.is_moe:
        check_ep(model, lay)
    if lay.precision not in PRECISIONS:
        raise ShardwiseConfigError(f"--precision {lay.precision!r}: choose from "
                                   f"{sorted(PRECISIONS)}")
    if lay.ckpt not in CKPT:
        raise ShardwiseConfigError(f"--ckpt {lay.ckpt!r}: choose from {CKPT}")
    if lay.zero not in (0, 1, 2, 3):
        raise ShardwiseConfigError(f"--zero {lay.zero}: choose from 0, 1, 2, 3")
    if lay.grad_reduce not in ("step", "micro"):
        raise ShardwiseConfigError(f"grad_reduce {lay.grad_reduce!r}: choose step or micro")
    if lay.schedule not in SCHEDULES:
        raise ShardwiseConfigError(f"--schedule {lay.schedule!r}: choose from {SCHEDULES}")
    if model.n_heads % lay.tp or model.n_kv_heads % lay.tp:
        ok = [t for t in range(1, model.n_kv_heads + 1) if model.n_kv_heads % t == 0]
        raise ShardwiseConfigError(f"tp={lay.tp} must divide n_heads={model.n_heads} and "
                                   f"n_kv_heads={model.n_kv_heads} ({model.name}): choose tp in "
                                   f"{ok}")
    if lay.sp and lay.tp == 1:  # the rule's one message is TP's
        from ..parallel.tp import validate_tp

        validate_tp(None, lay.tp, lay.sp)
    if lay.pp > model.n_layers:
        raise ShardwiseConfigError(f"pp={lay.pp} exceeds the model's {model.n_layers} layers: "
                                   f"choose pp ≤ {model.n_layers}")
    if lay.pp > 1 and lay.schedule != "interleaved-1f1b" and lay.chunks != 1:
        raise ShardwiseConfigError(f"virtual stages = {lay.chunks} need --schedule "
                                   "interleaved-1f1b")
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b":
        per_rank = math.ceil(model.n_layers / lay.pp)
        if lay.chunks > per_rank:
            raise ShardwiseConfigError(f"{lay.chunks} virtual stages per rank exceed the "
                                       f"{per_rank} layers per rank: choose v ≤ {per_rank}")
    per_step = lay.dp * lay.micro_batch
    if global_batch % per_step:
        raise ShardwiseConfigError(
            f"global batch of {global_batch} sequences is not divisible by dp × micro-batch = "
            f"{lay.dp} × {lay.micro_batch} = {per_step}: change --global-batch-tokens or the "
            "layout")
    return global_batch // per_step
