"""What the planner evaluates and the rules it checks first: :class:`PlanLayout` (the engine's
:class:`~shardwise.parallel.layout.Layout` plus the planner's own knobs), the precisions
(:data:`PRECISIONS`), the :class:`Assumptions` the model rests on, and the checks a layout must
pass before it is estimated (:func:`check_layout`: the rules of the layout alone are the
engine's, :meth:`~shardwise.parallel.layout.Layout.check_rules`, written once there; the
planner's own are the model's (:func:`check_cp`, :func:`check_ep`, the heads tp splits, the
layers pp splits), its knobs and the batch). Formulas and sources: docs/planner.md, "The cost
model's formulas".
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ShardwiseConfigError
from ..precision import PRESETS, Precision  # noqa: F401  (Precision: the record, re-exported)
from ..parallel.ep import check_experts_split
from ..parallel.layout import Layout
from ..parallel.pp.schedules import SCHEDULES as ENGINE_SCHEDULES, V_SCHEDULES

# the schedules the cost model prices (bubble, in-flight activations); the V schedules run
# (docs/pipeline-parallel.md) but are not priced yet, so the search leaves them out
SCHEDULES = tuple(s for s in ENGINE_SCHEDULES if s not in V_SCHEDULES)
from .hardware import Cluster
from .models import ModelSpec


PRECISIONS = PRESETS  # the planner's precisions: the training's own record (precision.py)
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
    ZeRO ≥ 1 (:meth:`~shardwise.parallel.layout.Layout.check_rules`)."""

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
    """Raise ShardwiseConfigError unless ``model`` can run context parallelism over ``cp`` ranks:
    a Llama-style model (:func:`llama_style`), and ``model.seq_len`` divisible by 2·cp (the
    zig-zag split cuts every sequence into 2·cp chunks). cp ≥ 1 and a known ``method`` are the
    layout's rules (:meth:`~shardwise.parallel.layout.Layout.check_rules`, which
    :func:`check_layout` runs first)."""
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
    an MoE model whose n_experts ep divides (the engine's rule,
    :func:`~shardwise.parallel.ep.check_experts_split`). ep ≥ 1 dividing dp × cp (EP ⊆ dp × cp)
    and an expert group inside an HSDP shard group are the layout's rules
    (:meth:`~shardwise.parallel.layout.Layout.check_rules`, which :func:`check_layout` runs
    first). The engine's refusal of MoE with SP or cp > 1 (a sequence split needs its routing
    counts summed for the per-sequence balance loss, not wired there) is not the planner's: it
    models those layouts as Megatron-Core runs them."""
    if layout.ep > 1 and not model.is_moe:
        raise ShardwiseConfigError(
            f"--ep {layout.ep} needs a mixture-of-experts model (there are no experts to split), "
            f"and {model.name} is dense: choose an MoE model (mixtral-8x7b, mixtral-8x22b, dbrx, "
            "llama4-scout, llama4-maverick, moe-tiny, …) or --ep 1")
    if model.is_moe:  # the engine's rule, with the preset's name (it has no --n-experts)
        check_experts_split(layout.ep, model.n_experts, layout.dp * layout.cp, model=model.name,
                            fix="")


def check_layout(model: ModelSpec, cluster: Cluster, layout: PlanLayout, global_batch: int) -> int:
    """Validate ``layout`` for ``model`` and a step of ``global_batch`` sequences; return m, the
    micro-batches per step and replica. Raises ShardwiseConfigError naming the constraint."""
    lay = layout
    if not isinstance(lay.micro_batch, int) or lay.micro_batch < 1:
        raise ShardwiseConfigError(f"micro-batch = {lay.micro_batch!r} must be a positive "
                                   "integer")
    # the layout alone: the engine's rules (degrees, ep | dp × cp, the HSDP split, sp needs tp,
    # the ZeRO stage over dp × cp ≥ 2, the cp method, the schedule and its virtual stages)
    lay.check_rules()
    if lay.pp > 1 and lay.schedule in V_SCHEDULES:
        raise ShardwiseConfigError(
            f"--schedule {lay.schedule}: the planner does not price the V schedules yet (they "
            f"run: shardwise train/trace/bench --schedule {lay.schedule}); plan with "
            f"{', '.join(SCHEDULES)}")
    if lay.cp > 1:
        check_cp(model, lay.cp, lay.cp_method)
    if lay.ep != 1 or model.is_moe:
        check_ep(model, lay)
    if lay.precision not in PRECISIONS:
        raise ShardwiseConfigError(f"--precision {lay.precision!r}: choose from "
                                   f"{sorted(PRECISIONS)}")
    if lay.ckpt not in CKPT:
        raise ShardwiseConfigError(f"--ckpt {lay.ckpt!r}: choose from {CKPT}")
    if lay.grad_reduce not in ("step", "micro"):
        raise ShardwiseConfigError(f"grad_reduce {lay.grad_reduce!r}: choose step or micro")
    if model.n_heads % lay.tp or model.n_kv_heads % lay.tp:
        ok = [t for t in range(1, model.n_kv_heads + 1) if model.n_kv_heads % t == 0]
        raise ShardwiseConfigError(f"tp={lay.tp} must divide n_heads={model.n_heads} and "
                                   f"n_kv_heads={model.n_kv_heads} ({model.name}): choose tp in "
                                   f"{ok}")
    if lay.pp > model.n_layers:
        raise ShardwiseConfigError(f"pp={lay.pp} exceeds the model's {model.n_layers} layers: "
                                   f"choose pp ≤ {model.n_layers}")
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
