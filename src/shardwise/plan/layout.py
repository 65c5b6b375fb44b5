"""What the planner evaluates and the rules it checks first: :class:`PlanLayout` (the engine's
:class:`~shardwise.parallel.layout.Layout` plus the planner's own knobs), the storage recipes
(:data:`PRECISIONS`, built by :meth:`~shardwise.precision.Precision.stored`, and the train flags
of each, :data:`STORAGES`), the :class:`Assumptions` the model rests on, and two checks, both
train's own rules (one definition): :func:`check_layout`, what a layout must pass to be priced
(the layout's rules, :meth:`~shardwise.parallel.layout.Layout.check_rules`, and train's model
checks: the heads and d_ff tp splits, the sequence cp splits, the layers pp splits, the experts
ep splits; plus the planner's knobs and the batch), and :func:`check_train`, what a layout must
pass to be *offered*: :meth:`~shardwise.parallel.layout.Layout.check` itself, as ``shardwise
train`` runs it on the flags :func:`train_flags` prints (what the engines wire, storage and
offload included: :func:`~shardwise.parallel.storage.check_storage`). Formulas and sources:
docs/planner.md, "The cost model's formulas".
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from ..errors import ShardwiseConfigError
from ..precision import Precision
from ..parallel.ep import check_experts_split
from ..parallel.layout import Layout
from ..parallel.storage import OFFLOADS
from ..parallel.pp.schedules import SCHEDULES as ENGINE_SCHEDULES, V_SCHEDULES

# the schedules the cost model prices (bubble, in-flight activations); the V schedules run
# (docs/pipeline-parallel.md) but are not priced yet, so the search leaves them out
SCHEDULES = tuple(s for s in ENGINE_SCHEDULES if s not in V_SCHEDULES)
from .hardware import Cluster
from .models import ModelSpec, train_model_config


# the storage recipes train runs: key → (--dtype, --param-dtype, --master-dtype); the bytes
# per parameter of each are Precision.stored's (one definition): fp32 16 B, amp 16 B (bf16
# compute), bf16 18 B (Megatron-LM: bf16 parameters, fp32 gradients, master and Adam state),
# bf16-pure 8 B (the guide's FSDP2 recipe: everything bf16, no master copy)
STORAGES = {"fp32": ("fp32", "fp32", "fp32"), "amp": ("bf16", "fp32", "fp32"),
            "bf16": ("bf16", "bf16", "fp32"), "bf16-pure": ("bf16", "bf16", "none")}
PRECISIONS = {key: Precision.stored(param, master, compute=compute)
              for key, (compute, param, master) in STORAGES.items()}
# what the search tries when no storage flag is given (fp32 compute only when asked for: it runs
# at the fp32 peak, 67 of 989 TFLOP/s on an H100, and never ranks)
SEARCHED_PRECISIONS = ("amp", "bf16", "bf16-pure")
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
    ZeRO ≥ 1 (:meth:`~shardwise.parallel.layout.Layout.check_rules`). ``offload`` (train's
    ``--offload``): "none"; "optimizer" — the Adam state (and the master copy) and the optimizer
    step on the host, the gradient shard copied there and the updated parameters back every
    step; "params" — the parameter shard on the host too, copied to the device for every use
    (docs/planner.md, "Offload")."""

    micro_batch: int = 1
    ckpt: str = "none"
    precision: str = "bf16"
    grad_reduce: str = "step"  # zero 2/3: "step" (once, after accumulating; what train does)
    # or "micro" (a what-if: DeepSpeed ZeRO-2, FSDP without no_sync; train has no such flag)
    offload: str = "none"  # none | optimizer | params: train's --offload
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
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return ",".join(parts)

    @property
    def prec(self) -> Precision:
        """The :class:`~shardwise.precision.Precision` of :attr:`precision` (a key of
        :data:`PRECISIONS`; KeyError for another: :func:`check_layout` refuses it first)."""
        return PRECISIONS[self.precision]

    def engine_layout(self) -> Layout:
        """The engine's :class:`~shardwise.parallel.layout.Layout` of this one (its fields, none
        of the planner's knobs): what train's check takes."""
        return Layout(*_layout_values(self))


_LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))  # in Layout's order
# a layout's values of those fields, in that order, in one C call (the search's inner loop)
_layout_values = operator.attrgetter(*_LAYOUT_FIELDS)


@functools.lru_cache(maxsize=65536)
def _rules_refusal(values: tuple) -> str | None:
    """The message of :meth:`~shardwise.parallel.layout.Layout.check_rules`'s refusal (None: it
    passes) for the engine's Layout of ``values`` (:data:`_LAYOUT_FIELDS`, in order). Cached:
    the rules read the Layout's fields only (no model, cluster or planner knob), so the outcome
    is a pure function of them, shared by a search's layouts that differ in micro-batch,
    checkpointing, storage or offload. The message, not the exception: each refusal is raised
    anew, so no traceback is kept between calls."""
    try:
        Layout(*values).check_rules()
    except ShardwiseConfigError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# activations


def llama_style(model: ModelSpec) -> bool:
    """The shape our context-parallel attention runs on (and the estimator builds): SwiGLU,
    RMSNorm, RoPE, no biases, no dropout."""
    return (model.mlp == "swiglu" and model.norm == "rmsnorm" and not model.bias
            and not model.learned_positions and not model.dropout)


def check_cp(model: ModelSpec, cp: int, method: str = "ring") -> None:
    """Raise ShardwiseConfigError unless ``model`` can run context parallelism over ``cp``
    ranks: train's rule (:func:`~shardwise.parallel.cp.validate_cp` on the model's config,
    :func:`~.models.train_model_config`: a model without dropout, the sequence divisible by 2·cp
    for the zig-zag split). cp ≥ 1 and a known ``method`` are the layout's rules
    (:meth:`~shardwise.parallel.layout.Layout.check_rules`, which :func:`check_layout` runs
    first)."""
    from ..parallel.cp import validate_cp

    validate_cp(train_model_config(model), cp, method, seq_len=model.seq_len)


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
    """Validate ``layout`` for ``model`` and a step of ``global_batch`` sequences before it is
    priced; return m, the micro-batches per step and replica. Raises ShardwiseConfigError
    naming the constraint. The rules are train's (one definition): the layout's own
    (:meth:`~shardwise.parallel.layout.Layout.check_rules`) and the model's splits
    (:func:`~shardwise.parallel.tp.validate_tp`: tp divides the heads, kv heads and d_ff, and
    with SP the sequence; :func:`check_cp`; :func:`check_ep`); then the planner's own: the
    layers pp splits (pp ≤ L, v ≤ ⌈L/pp⌉: uneven splits priced, where train's balanced split
    wants a layer in each of the pp·v stages), its knobs and the batch. What the engines do not wire yet (ZeRO-2/3 or HSDP
    in a pipeline, bf16 storage, offload, MoE with SP) is priced here, as Megatron-Core,
    torchtitan and FSDP2 run it; whether train runs it is :func:`check_train`."""
    from ..parallel.tp import validate_tp

    lay = layout
    if not isinstance(lay.micro_batch, int) or lay.micro_batch < 1:
        raise ShardwiseConfigError(f"micro-batch = {lay.micro_batch!r} must be a positive "
                                   "integer")
    # the layout alone: the engine's rules (degrees, ep | dp × cp, the HSDP split, sp needs tp,
    # the ZeRO stage over dp × cp ≥ 2, the cp method, the schedule and its virtual stages)
    refusal = _rules_refusal(_layout_values(lay))  # lay.check_rules(), cached
    if refusal is not None:
        raise ShardwiseConfigError(refusal)
    if lay.pp > 1 and lay.schedule in V_SCHEDULES:
        raise ShardwiseConfigError(
            f"--schedule {lay.schedule}: the planner does not price the V schedules yet (they "
            f"run: shardwise train/trace/bench --schedule {lay.schedule}); plan with "
            f"{', '.join(SCHEDULES)}")
    if lay.precision not in PRECISIONS:
        raise ShardwiseConfigError(f"--precision {lay.precision!r}: choose from "
                                   f"{sorted(PRECISIONS)}")
    if lay.offload not in OFFLOADS:
        raise ShardwiseConfigError(f"--offload {lay.offload!r}: choose from {OFFLOADS}")
    if lay.ckpt not in CKPT:
        raise ShardwiseConfigError(f"--ckpt {lay.ckpt!r}: choose from {CKPT}")
    if lay.grad_reduce not in ("step", "micro"):
        raise ShardwiseConfigError(f"grad_reduce {lay.grad_reduce!r}: choose step or micro")
    # the model against the layout: train's checks of the splits
    if lay.cp > 1:
        check_cp(model, lay.cp, lay.cp_method)
    if lay.ep != 1 or model.is_moe:
        check_ep(model, lay)
    if lay.tp > 1:
        validate_tp(train_model_config(model), lay.tp, lay.tp_options,
                    model.seq_len // lay.cp, pp=lay.pp)
    # pp: the planner's own rule, looser than train's balanced split (every one of the pp·v
    # stages at least one layer: check_train): it prices uneven splits as Llama 3 ran them
    # (126 layers over pp 16 × v 8 = 128 stages, one layer fewer on the first and the last)
    if lay.pp > model.n_layers:
        raise ShardwiseConfigError(f"pp={lay.pp} exceeds the model's {model.n_layers} layers: "
                                   f"choose pp ≤ {model.n_layers}")
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b":
        per_rank = -(-model.n_layers // lay.pp)
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


def check_train(model: ModelSpec, layout: PlanLayout, global_batch: int) -> None:
    """Raise ShardwiseConfigError unless ``shardwise train`` runs ``layout`` with the flags
    :func:`train_flags` prints: train's own check,
    :meth:`~shardwise.parallel.layout.Layout.check`, called as train's config validation calls
    it (``config.checks._validate_layout``) — the explicit engine on a GPU, the model's config
    (:func:`~.models.train_model_config`), its precision
    (:meth:`~shardwise.precision.Precision.stored`: storage and master weights), ``--offload``
    (:func:`~shardwise.parallel.storage.check_storage`), the sequence, the global batch and the
    micro-batch — train's check of activation checkpointing against the schedule
    (:func:`~shardwise.models.ac.check_ac`), and, as train does not reduce per micro-batch,
    ``grad_reduce`` "step"."""
    lay = layout
    if lay.zero >= 2 and lay.grad_reduce == "micro" and global_batch > lay.dp * lay.micro_batch:
        raise ShardwiseConfigError(
            "--grad-reduce micro: train reduce-scatters the gradients once per step (after "
            "accumulating them); a reduction per micro-batch is a what-if the planner prices "
            "but train does not run: use --grad-reduce step")
    refusal = _train_refusal(model, lay.engine_layout(), lay.precision, lay.offload,
                             global_batch, lay.micro_batch)
    if refusal is not None:
        raise refusal
    from ..models.ac import check_ac  # train's config check of --ac with the schedule

    check_ac(lay.ckpt, lay.pp, lay.schedule)


def _train_refusal(model: ModelSpec, engine_layout: Layout, precision: str, offload: str,
                   global_batch: int, micro_batch: int) -> ShardwiseConfigError | None:
    """Train's refusal of a layout (None: it runs): :meth:`~shardwise.parallel.layout.Layout.check`
    as train's config validation calls it. Two caches, on what the check reads: its steps
    before the pipeline's batch split read neither the global batch nor the micro-batch, so
    their outcome (:func:`_refusal_before_batch`) is shared by the layouts of a search that
    differ only in those or in the planner's knobs (activation checkpointing); the batch split
    (pp > 1 only) is checked, once per batch, by the whole check (:func:`_pipeline_refusal`)."""
    before = _refusal_before_batch(model, engine_layout, precision, offload)
    if before is not None or engine_layout.pp == 1:
        return before  # the whole check raises the same (it stops at the same step) or passes
    return _pipeline_refusal(model, engine_layout, precision, offload, global_batch,
                             micro_batch)


def _train_check(model: ModelSpec, engine_layout: Layout, precision: str, offload: str,
                 global_batch: int | None, micro_batch: int | None
                 ) -> ShardwiseConfigError | None:
    """``Layout.check`` as train calls it (the explicit engine on a GPU); its refusal or None.
    Without ``global_batch`` and ``micro_batch`` it skips only the pipeline's batch split."""
    try:
        engine_layout.check(train_model_config(model), engine="explicit",
                            precision=PRECISIONS[precision], seq_len=model.seq_len,
                            global_batch=global_batch, micro_batch=micro_batch, device="cuda",
                            offload=offload)
    except ShardwiseConfigError as e:
        return e
    return None


@functools.lru_cache(maxsize=65536)
def _refusal_before_batch(model: ModelSpec, engine_layout: Layout, precision: str,
                          offload: str) -> ShardwiseConfigError | None:
    return _train_check(model, engine_layout, precision, offload, None, None)


@functools.lru_cache(maxsize=65536)
def _pipeline_refusal(model: ModelSpec, engine_layout: Layout, precision: str, offload: str,
                      global_batch: int, micro_batch: int) -> ShardwiseConfigError | None:
    return _train_check(model, engine_layout, precision, offload, global_batch, micro_batch)


def train_flags(layout: PlanLayout, global_batch: int, seq_len: int) -> list[str]:
    """The ``shardwise train`` flags that run ``layout`` (its degrees, ZeRO stage, schedule,
    micro-batch, activation checkpointing, storage and offload) on a step of ``global_batch``
    sequences of ``seq_len`` tokens, e.g. ``["--dp", "8", "--pp", "8", "--zero", "1", …]``.
    Flags at train's default (degree 1, ring cp, no SP) are left out; the model is not among
    them (the planner's presets are shapes, not train's ``--model`` presets)."""
    lay = layout
    out = ["--dp", str(lay.dp)]
    if lay.dp_replicate > 1:
        out += ["--dp-replicate", str(lay.dp_replicate)]
    if lay.cp > 1:
        out += ["--cp", str(lay.cp)] + (["--cp-method", lay.cp_method]
                                        if lay.cp_method != "ring" else [])
    if lay.ep > 1:
        out += ["--ep", str(lay.ep)]
    if lay.tp > 1:
        out += ["--tp", str(lay.tp)] + (["--sp"] if lay.sp else [])
    if lay.pp > 1:
        out += ["--pp", str(lay.pp), "--schedule", lay.schedule]
        if lay.schedule == "interleaved-1f1b":
            out += ["--virtual-stages", str(lay.chunks)]
    compute, param, master = STORAGES[lay.precision]
    out += ["--zero", str(lay.zero), "--global-batch", str(global_batch), "--micro-batch",
            str(lay.micro_batch), "--seq-len", str(seq_len), "--ac", lay.ckpt,
            "--dtype", compute, "--param-dtype", param]
    if param != "fp32":
        out += ["--master-dtype", master]
    return out + ["--offload", lay.offload]
