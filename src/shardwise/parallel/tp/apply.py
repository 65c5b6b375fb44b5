"""The TP transform: one :func:`apply_tp` for a whole Llama or for one pipeline stage of it.

torchtitan's ``parallelize_fn`` shape (``models/llama/parallelize_llama.py``, applied to the whole
model and, in ``pipeline_llama.py``, to every stage's chunk): the plain model is converted in
place, module by module (:func:`tp_plan`), into :mod:`.layers`, each rank keeping its shard, and
nothing may be left to run silently replicated (picotron's name-based swap once left the output
head unparallelised, with no test to notice). Beside it, :func:`tp_step_bytes_formula`. Raises
:class:`~shardwise.errors.ShardwiseConfigError` for bad input before any collective,
RuntimeError for a conversion that went wrong (a bug, not bad input).
"""

from __future__ import annotations

import math

from torch import nn

from ... import comm
from ...errors import ShardwiseConfigError
from ...precision import FP32, Precision
from ...models.llama import Attention, FeedForward, Llama
from ..params import tp_sharded
from .comms import AXIS
from .mlp import MLPLoss, apply_tp_mlp, is_mlp, mlp_tp_bytes, validate_mlp_tp
from .layers import (TPRNG, TensorParallelAttention, TensorParallelSwiGLU, TPDropout,
                     TPPositionEmbedding, VocabParallelEmbedding, VocabParallelHead,
                     padded_vocab_size)
from .options import TPOptions


# -- validation (no collectives: called by config.validate and before any conversion) -------------
def valid_tp_degrees(model_config, options: TPOptions = TPOptions(),
                     seq_len: int | None = None) -> list[int]:
    """The tp degrees this model accepts: divisors of gcd(n_heads, n_kv_heads, d_ff[, seq_len
    with SP, ``options.sp``]); with SP, 1 is excluded."""
    sp = options.sp
    g = math.gcd(model_config.n_heads, model_config.n_kv_heads, model_config.d_ff)
    if sp and seq_len:
        g = math.gcd(g, seq_len)
    return [k for k in range(2 if sp else 1, g + 1) if g % k == 0]


def validate_tp(model_config, tp: int, options: TPOptions = TPOptions(),
                seq_len: int | None = None, pp: int = 1) -> None:
    """Raise :class:`ShardwiseConfigError`, naming the valid tp values, unless tp ≥ 1, ``--sp``
    (``options.sp``) comes with tp > 1, and ``model_config`` is Llama-style with tp dividing
    n_heads, n_kv_heads (heads are split whole, kv heads are not replicated), d_ff and, with SP,
    ``seq_len`` (the vocabulary is padded, so needs no constraint), or the stacked MLP
    (:func:`~.mlp.validate_mlp_tp`: tp divides d_ff, no SP, ``pp`` = 1). Runs no collective."""
    sp = options.sp
    if not isinstance(tp, int) or tp < 1:
        raise ShardwiseConfigError(f"--tp {tp} must be a positive integer")
    if tp == 1 and not sp:
        return
    llama = all(hasattr(model_config, a) for a in ("n_heads", "n_kv_heads", "d_ff"))
    valid = valid_tp_degrees(model_config, options, seq_len) if llama else []
    choose = f"choose --tp from {{{', '.join(map(str, valid))}}}" if valid else \
        "no tp > 1 fits this model and sequence length" if llama else "choose --tp > 1"
    if sp and tp == 1:  # the one place this rule is written (Layout.check calls it)
        raise ShardwiseConfigError(
            f"--sp (sequence parallelism) needs --tp > 1: it shards the activations between TP "
            f"regions over the tp ranks; {choose}, or drop --sp")
    if not llama and model_config is not None and is_mlp(model_config):
        return validate_mlp_tp(model_config, tp, options, pp)
    if not llama:
        what = (f"this model's config ({type(model_config).__name__}) has no attention heads"
                if model_config is not None else "this model has no config")
        raise ShardwiseConfigError(
            f"--tp {tp}{' --sp' if sp else ''}: tensor parallelism splits the Llama-style models "
            f"(--model tiny, small or base) and the stacked MLP (mlp, mlp-tiny); {what}, so "
            "there is no TP plan: choose one of those models, or --tp 1")
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(model_config, name)
        if value % tp:
            raise ShardwiseConfigError(
                f"--tp {tp} does not divide the model's {name}={value} (TP splits it evenly "
                f"over the tp ranks): {choose}")
    if sp and seq_len is not None and seq_len % tp:
        raise ShardwiseConfigError(
            f"--sp: --tp {tp} does not divide --seq-len {seq_len} (sequence parallelism splits "
            f"each sequence evenly over the tp ranks): {choose}, or change --seq-len to a "
            f"multiple of {tp}")


# -- the plan and its checks ----------------------------------------------------------------------
def _held(model: nn.Module, name: str) -> bool:
    """Whether ``model`` holds ``name`` (a pipeline stage: the embedding on the first only)."""
    return getattr(model, name, None) is not None


def tp_plan(model: nn.Module) -> list[tuple[str, type, type]]:
    """(FQN, plain type expected, TP type it becomes) for every module TP converts in ``model``:
    a Llama, or a pipeline stage of one (its blocks under their global ``layers.{i}`` names).
    A block's feed-forward is planned when it is of the plan's class (:class:`FeedForward`);
    one of another class is left whole (:func:`_whole`)."""
    plan = [("tok_embeddings", nn.Embedding, VocabParallelEmbedding)] \
        if _held(model, "tok_embeddings") else []
    if _held(model, "pos_embeddings"):  # learned positions (GPT-2): replicated table
        plan.append(("pos_embeddings", nn.Embedding, TPPositionEmbedding))
    for i, layer in model.layers.named_children():
        plan += [(f"layers.{i}.attention", Attention, TensorParallelAttention),
                 (f"layers.{i}.dropout", nn.Dropout, TPDropout)]
        if isinstance(layer.feed_forward, FeedForward):  # (experts are not: :func:`_whole`)
            plan.append((f"layers.{i}.feed_forward", FeedForward, TensorParallelSwiGLU))
    if _held(model, "output"):
        plan.append(("output", nn.Linear, VocabParallelHead))
    return plan


_PLAIN_TYPES = (nn.Linear, nn.Embedding, nn.Dropout, Attention, FeedForward)


def _whole(model: nn.Module, plan) -> list[str]:
    """FQNs of the blocks' feed-forwards ``plan`` (:func:`tp_plan`) does not list (not a
    :class:`FeedForward`: a mixture of experts, whose router, experts and shared experts run
    whole on every tp rank, on the tp-replicated input: docs/expert-parallel.md)."""
    planned = {fqn for fqn, _, _ in plan}
    return [f for f in (f"layers.{i}.feed_forward" for i, _ in model.layers.named_children())
            if f not in planned]


def _leftovers(model: nn.Module, plan) -> list[str]:
    """Modules whose *exact* type is a plain one TP replaces (subclasses such as ours are fine),
    outside the feed-forwards ``plan`` leaves whole (:func:`_whole`)."""
    whole = _whole(model, plan)
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if type(m) in _PLAIN_TYPES and not any(name.startswith(r + ".") for r in whole)]


def check_plan_covers(model: nn.Module) -> list[tuple[str, type, type]]:
    """Before any collective: ``model`` is a Llama (or a pipeline stage of one, ``is_llama``),
    every module of :func:`tp_plan` exists with its plain type, and every Linear/Embedding/
    Dropout of the model lies inside a planned module. Returns the plan."""
    if not (isinstance(model, Llama) or getattr(model, "is_llama", False)):
        raise ShardwiseConfigError(f"tensor parallelism supports the Llama-style models (--model "
                                   f"tiny, small, base), not {type(model).__name__}")
    plan = tp_plan(model)
    modules = dict(model.named_modules())
    for fqn, plain_type, _ in plan:
        if not isinstance(modules.get(fqn), plain_type):
            raise ShardwiseConfigError(f"TP plan: expected a {plain_type.__name__} at {fqn!r}, "
                                       f"found {type(modules.get(fqn)).__name__}")
    roots = tuple(fqn for fqn, _, _ in plan)
    stray = [s for s in _leftovers(model, plan)
             if not any(s.split(" ")[0] == r or s.startswith(r + ".") for r in roots)]
    if stray:
        raise ShardwiseConfigError(f"TP plan does not cover {', '.join(stray)}: they would run "
                                   "replicated and unsharded; add them to tp_plan() in "
                                   "parallel/tp/apply.py or remove them from the model")
    return plan


def _check_converted(model: nn.Module, plan, topo, tied: bool) -> None:
    """RuntimeError unless conversion left TP types, nothing plain, shard shapes/marks, ties."""
    cfg, n = model.config, topo.size(AXIS)
    modules = dict(model.named_modules())
    problems = [f"{fqn} is {type(modules.get(fqn)).__name__}, not {tp_type.__name__}"
                for fqn, _, tp_type in plan if type(modules.get(fqn)) is not tp_type]
    problems += [f"{s} left unconverted" for s in _leftovers(model, plan)]
    vpad = padded_vocab_size(cfg.vocab_size, n)
    expect = {"tok_embeddings.weight": (vpad // n, cfg.d_model),
              "output.weight": (vpad // n, cfg.d_model)}
    for i in range(cfg.n_layers):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        expect |= {f"{a}.wq.weight": (cfg.n_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wk.weight": (cfg.n_kv_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wv.weight": (cfg.n_kv_heads // n * cfg.head_dim, cfg.d_model),
                   f"{a}.wo.weight": (cfg.d_model, cfg.n_heads // n * cfg.head_dim),
                   f"{f}.w1.weight": (cfg.d_ff // n, cfg.d_model),
                   f"{f}.w3.weight": (cfg.d_ff // n, cfg.d_model),
                   f"{f}.w2.weight": (cfg.d_model, cfg.d_ff // n)}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, shape in expect.items():
        if name in params and tuple(params[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(params[name].shape)}, expected {shape}")
        if name in params and not tp_sharded(params[name]):
            problems.append(f"{name} is not marked as a tp shard")
    if tied and model.output.weight is not model.tok_embeddings.weight:
        problems.append("tied embeddings: output.weight is no longer tok_embeddings.weight")
    if problems:
        raise RuntimeError("tensor-parallel conversion incomplete: " + "; ".join(problems))


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


# -- the transform --------------------------------------------------------------------------------
def apply_tp(model: nn.Module, topo, options: TPOptions = TPOptions(), *,
             seed: int = 0) -> TPRNG:
    """Convert ``model`` in place for tensor parallelism over ``topo``'s "tp" axis (sequence
    parallelism with ``options.sp``) and return the dropout RNG (:class:`~.layers.TPRNG`,
    seeded by ``seed``). ``model``: a plain Llama, or one pipeline stage of it
    (``pp.split.StageModule``).

    Order (docs/tensor-parallel.md §3): (1) :func:`validate_tp`, :func:`check_plan_covers`
    (ShardwiseConfigError, before any collective); (2) broadcast every parameter from tp index 0
    (phase and tag ``"init"``), so shards cut on differently seeded ranks fit together; (3)
    replace the modules of :func:`tp_plan` (a head tied to the embedding on this rank shares its
    shard Parameter); (4) :func:`_check_converted` (RuntimeError). The sequence length is checked
    at the first SP forward (reduce-scatter: ValueError); ``validate_tp(cfg, tp, options,
    seq_len)`` up front gives the configuration error instead."""
    n = topo.size(AXIS)
    validate_tp(getattr(model, "config", None), n, options)
    plan = check_plan_covers(model)
    has_emb, has_head = _held(model, "tok_embeddings"), _held(model, "output")
    tied = has_emb and has_head and model.output.weight is model.tok_embeddings.weight
    if not any(p.is_meta for p in model.parameters()):  # meta: every rank fills the same later
        with topo.ledger.phase("init"):
            comm.broadcast_coalesced([p.data for p in model.parameters()], topo, AXIS,
                                     tag="init")
    rng = TPRNG(seed, topo)
    emb = None
    if has_emb:
        emb = VocabParallelEmbedding(model.tok_embeddings, topo, options)
        _set_submodule(model, "tok_embeddings", emb)
    if _held(model, "pos_embeddings"):
        _set_submodule(model, "pos_embeddings", TPPositionEmbedding(model.pos_embeddings,
                                                                    topo, options))
    for layer in model.layers.children():
        layer.attention = TensorParallelAttention(layer.attention, topo, options, rng)
        if isinstance(layer.feed_forward, FeedForward):  # the plan's class (:func:`tp_plan`)
            layer.feed_forward = TensorParallelSwiGLU(layer.feed_forward, topo, options)
        layer.dropout = TPDropout(layer.dropout.p, rng, options)
    if has_head:
        head = VocabParallelHead(model.output, topo, options,
                                 weight=emb.weight if tied else None)
        _set_submodule(model, "output", head)
    for c in getattr(model, "chunks", ()):  # a stage's chunks run the modules it holds
        if c.tok_embeddings is not None:
            c.tok_embeddings = model.tok_embeddings
        if getattr(c, "pos_embeddings", None) is not None:
            c.pos_embeddings = model.pos_embeddings
        if c.output is not None:
            c.output = model.output
        c.sp_degree = n if options.sp else 1
    _check_converted(model, plan, topo, tied)
    return rng


def parallelize_tensor(model: Llama, topo, options: TPOptions = TPOptions(), *, seed: int = 0):
    """Convert the plain Llama ``model`` in place (:func:`apply_tp`: checks, broadcast,
    conversion, check) and return its loss function, :class:`~.loss.VocabParallelLoss` (which
    holds the dropout RNG, seeded by ``seed``); the stacked MLP: :func:`~.mlp.apply_tp_mlp` and
    :class:`~.mlp.MLPLoss`. :func:`~shardwise.parallel.apply.parallelize` composes it with a
    gradient sync into the engine."""
    from .loss import VocabParallelLoss

    if is_mlp(model):
        validate_tp(model.config, topo.size(AXIS), options)
        apply_tp_mlp(model, topo)
        return MLPLoss(model, topo)

    return VocabParallelLoss(model, topo, options, apply_tp(model, topo, options, seed=seed))


class SPSum:
    """The SP finisher: after the gradient sync, SUM over tp the gradients of the tp-replicated
    parameters (the norm weights, whose gradient on one tp rank covers only its s/tp
    positions) on what the sync ``sync`` leaves on this rank (whole gradients; ZeRO: its slice),
    one flat all-reduce, tag ``sp_grad`` (``sync.sum_replicated_grads``)."""

    def __init__(self, sync):
        self.sync = sync

    def __call__(self) -> None:
        self.sync.sum_replicated_grads()


class TPTraffic:
    """TP's terms of a step's byte formula for ``module`` (a converted Llama) on ``topo``:
    :func:`tp_step_bytes_formula` on the tp and dp sizes without ``loss`` and ``total``
    (:func:`shardwise.formulas.step_bytes_formula` adds them); ``micro_steps`` matter only for
    Qwen3's q/k norms without SP (every other byte is linear in the batch); ``options``: the
    layout's :class:`~.options.TPOptions`."""

    def __init__(self, module, topo, options: TPOptions):
        self.module, self.topo, self.options = module, topo, options

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        if is_mlp(self.module):  # rows, not sequences × tokens
            return mlp_tp_bytes(self.module.config, sequences, self.topo.size(AXIS),
                                precision.param)
        t = tp_step_bytes_formula(self.module.config, sequences, seq_len, self.topo.size(AXIS),
                                  self.options, dp=self.topo.size("dp"), precision=precision,
                                  micro_steps=micro_steps)
        return {k: v for k, v in t.items() if k not in ("total", "loss")}


# -- the formula ----------------------------------------------------------------------------------
def tp_replicated_numel(cfg) -> int:
    """Elements of the parameters TP leaves whole on every tp rank (explicit engine), from the
    model config: the norms ((2L + 1)·d, twice with LayerNorm's bias), the row-parallel biases
    (wo, w2: d each per layer), Qwen3's q/k norms (2·hd per layer) and GPT-2's position table
    (P·d). Column-parallel biases are sharded with their weight."""
    d, L = cfg.d_model, cfg.n_layers
    norm = getattr(cfg, "norm", "rms")
    out = (2 * L + 1) * d * (2 if norm == "layer" else 1)
    out += L * d * (int(getattr(cfg, "o_bias", False)) + int(getattr(cfg, "mlp_bias", False)))
    out += 2 * L * cfg.head_dim * int(getattr(cfg, "qk_norm", False))
    if getattr(cfg, "pos", "rope") == "learned":
        out += cfg.max_seq_len * d
    return out


def tp_step_bytes_formula(model_config, sequences: int, seq_len: int, tp: int,
                          options: TPOptions = TPOptions(), dp: int = 1,
                          precision: Precision = FP32, micro_steps: int = 1
                          ) -> dict[str, float]:
    """Bytes one rank sends per optimizer step with explicit TP, by ledger tag, plus ``"total"``.

    ``sequences``: sequences this rank processes in the step (all micro-batches: every byte
    is linear in the batch), ``seq_len`` tokens each; SP when ``options.sp``. n = tp,
    L = n_layers, d = d_model, N = sequences·seq_len tokens, r = 2(n−1)/n (ring all-reduce);
    per-op counts: :mod:`shardwise.comm.ledger`.

    * ``tp_fwd``/``tp_bwd`` — activations, A = N·d·4: (1 + 2L)·r·A each way, with or without SP
      (SP: (2 + 4L) collectives of (n−1)/n·A); by direction, and ``precision.compute`` "bf16" (the 2L
      row-parallel outputs under autocast carry 2 bytes): :func:`tp_activation_bytes`.
    * ``ce`` — the vocab-parallel cross-entropy: r·(N + 2N)·4 (MAX of [N], SUM of [2, N], fp32).
    * ``sp_grad`` — SP only: r·R·4, the gradients of the R tp-replicated elements
      (:func:`tp_replicated_numel`: (2L + 1)·d norm weights for a Llama; the families' biases,
      positions and q/k norms too).
    * ``tp_bwd`` also holds, without SP, Qwen3's q/k-norm gradients summed by f in each
      micro-step's backward: ``micro_steps``·r·2L·hd·4 (the one term not linear in the batch).
    * ``grad_norm`` — r·8: the squared gradient norm (fp64 scalar) over tp.
    * ``loss`` — 2·(2(dp−1)/dp)·8: token count and loss sum over dp (0 at dp = 1).

    Init broadcasts, ``named_full_*`` gathers and evaluation are outside the step. Source:
    Megatron-LM §3 (f/g per block), Korthikanti et al. 2022 §4.2.2 (SP), JAX scaling book ch. 5."""
    n, L, d, sp = tp, model_config.n_layers, model_config.d_model, options.sp
    r = 2 * (n - 1) / n
    moe = getattr(model_config, "n_moe_layers", 0)  # MoE blocks: attention only is tp-split
    out = tp_activation_bytes(sequences * seq_len, d, n, options, blocks=L, precision=precision,
                              moe_blocks=moe)
    out |= {"sp_grad": r * tp_replicated_numel(model_config) * 4 if sp else 0.0,
            "grad_norm": r * 8, "loss": 2 * (2 * (dp - 1) / dp * 8)}
    if getattr(model_config, "qk_norm", False) and not sp:
        out["tp_bwd"] += micro_steps * r * 2 * L * model_config.head_dim * 4
    out["total"] = sum(out.values())
    return out


def tp_activation_bytes(tokens: int, d: int, tp: int, options: TPOptions, *, blocks: int,
                        has_embedding: bool = True, has_head: bool = True,
                        precision: Precision = FP32, moe_blocks: int = 0) -> dict[str, float]:
    """{"tp_fwd", "tp_bwd", "ce": bytes} one rank sends per step for ``tokens`` tokens (all
    micro-batches) through ``blocks`` TP blocks of width ``d`` over ``tp`` ranks (SP when
    ``options.sp``), plus the
    embedding exit (``has_embedding``) and the head entry and vocab-parallel cross-entropy
    (``has_head``): the whole model (:func:`tp_step_bytes_formula`) or one pipeline stage. With
    r = 2(n−1)/n, h = (n−1)/n, W = tokens·d·4 and X = tokens·d·(2 if bf16 else 4) (the
    row-parallel outputs under autocast), E/H = 1 where the stage holds the embedding / head:
    no SP fwd = r·(E·W + 2L·X), bwd = r·(2L·W + H·W); SP fwd = bwd = h·(E·W + 2L·W + 2L·X +
    H·W); ``ce`` = H·r·3·tokens·4. ``moe_blocks`` of the blocks are mixture-of-experts blocks,
    whose feed-forward is not tp-split: one f/g pair each instead of two (2L → 2L − M below).
    Megatron-LM §3, Korthikanti et al. 2022 §4.2.2."""
    n, L, sp = tp, blocks, options.sp
    r, h = 2 * (n - 1) / n, (n - 1) / n
    e, hd = float(has_embedding), float(has_head)
    wide = tokens * d * precision.param  # [.., d] the residual stream: the storage dtype
    exit_b = tokens * d * precision.act  # row-parallel outputs under autocast
    regions = 2 * L - moe_blocks  # tp-split regions: attention, and the dense feed-forwards
    if not sp:
        fwd = r * (e * wide + regions * exit_b)  # embedding g + 2 g per block
        bwd = r * (regions * wide + hd * wide)  # 2 f per block + head f
    else:  # emb RS, AG+RS ×2L, head AG forward; head RS, RS+AG ×2L, emb AG backward
        fwd = bwd = h * (e * wide + regions * wide + regions * exit_b + hd * wide)
    return {"tp_fwd": fwd, "tp_bwd": bwd, "ce": hd * r * 3 * tokens * 4}
