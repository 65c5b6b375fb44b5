"""Activation checkpointing per block: ``--ac none | selective | full``.

Backward needs the activations forward computed. Keeping all of them costs memory that grows
with batch × sequence × layers; recomputing them in backward trades FLOPs for that memory
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4 ("Selective Activation
Recomputation"), observe that the activations are not all equally expensive: some are large but
cheap to recompute (their attention core — QKᵀ, softmax, softmax dropout, attention over V —
holds 5·a·s²·b bytes per layer for almost no FLOPs), so recomputing *only those* saves most of
the memory for a few percent of extra compute, while full recomputation re-runs the whole layer
(+1 forward, ≈ +33 % FLOPs).

The modes, as this package implements them for its blocks (``TransformerBlock`` in
:mod:`.llama`, ``MLPBlock`` in :mod:`.mlp`):

``none``       autograd keeps every activation it saves.
``full``       the whole block is recomputed in backward: only the block's input is kept.
               ``torch.utils.checkpoint`` (non-reentrant; the RNG state of the block's forward
               is restored for the recompute, so dropout masks are the same).
``selective``  the block is checkpointed with an op-level policy
               (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of
               the *expensive* ops — matrix multiplies (``mm``/``addmm``/``bmm``) and the fused
               attention kernel (``scaled_dot_product_*``) — are saved; everything else
               (RMSNorm, RoPE, the GQA ``repeat_interleave`` of k/v where SDPA lacks native
               GQA, SiLU and the gate product, GELU, residual adds, dtype casts, dropout) is
               recomputed. This is Korthikanti
               §4's principle applied to a block whose attention core is already a fused kernel
               (FlashAttention-style SDPA never stores the s² scores — it *is* a selective
               recompute of the core): what is left that is large and cheap is the pointwise
               work between the matmuls, e.g. SwiGLU's two [b, s, f] intermediates and (without
               native GQA) the repeated k/v [b, h, s, hd]. Extra FLOPs: pointwise only (no
               matmul is re-run).

Where the checkpoint sits. It is applied *inside* the block's ``forward`` (the block calls
:func:`checkpoint_block` on its own body), not by wrapping the block module, so module hooks on
the block — ZeRO-3's parameter all-gather/free hooks, FSDP2's ``fully_shard`` hooks, DDP — fire
exactly once per forward, and the recompute runs after ZeRO-3 has re-gathered the block's
parameters for its backward. Tensor-parallel submodules (explicit or DTensor) that replaced the
block's ``attention``/``feed_forward`` are inside the region and are recomputed too.

Collectives in a recomputed region. Under TP a block's forward issues collectives (Megatron's
g: all-reduce of [b, s, d]; with SP an all-gather and a reduce-scatter). A recompute issues
them again. Each block holds a ``recompute_context`` factory; the training loop, ``verify``,
``trace`` and ``bench`` set it (:func:`set_activation_checkpointing`) to
``lambda: topo.ledger.phase("recompute")``, so these collectives are booked under phase
``"recompute"``: the step's ledger (phase ``"step"``) still equals the step formula exactly, and
the recompute's extra bytes are listed separately (``topo.ledger.records`` with
``phase == "recompute"``). How many collectives a recompute re-issues depends on PyTorch's
early stop (on by default): recompute stops as soon as the last tensor backward needs has been
recomputed, so e.g. the all-reduce that *leaves* a TP block (its output is needed by nothing the
block's backward uses) is not re-issued; the one after attention is (the FFN's RMSNorm input).

A region is recomputed once per backward graph task that needs it: the zb-h1 pipeline schedule
runs each block's backward as two tasks (input gradients, then weight gradients), so ``full``
recomputes twice there; PyTorch's selective checkpoint allows only one backward per region, so
``config.validate`` refuses ``--ac selective`` with zb-h1.

Limitations: the TP dropout RNG regions of :mod:`shardwise.parallel.tp.layers` advance their own
saved generator states, which ``torch.utils.checkpoint`` does not restore, so TP with dropout > 0
and ``--ac`` would draw different masks in the recompute (the default dropout is 0). The
recompute context is a phase on the ledger object, not thread-local: a DDP communication hook
completing on another thread during a recompute would be booked as ``"recompute"``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

AC_MODES = ("none", "selective", "full")


def check_ac(ac: str, pp: int, schedule: str) -> None:
    """Activation checkpointing against the pipeline schedule, written once (train's config
    check and the planner's ``check_train`` call it): ``selective`` with a zero-bubble schedule
    is refused. Raises :class:`~shardwise.errors.ShardwiseConfigError`."""
    from ..errors import ShardwiseConfigError

    if ac == "selective" and pp > 1 and schedule in ("zb-h1", "zbv", "dualpipev"):
        raise ShardwiseConfigError(
            f"--ac selective with --schedule {schedule}: zero-bubble splits each backward "
            "in two "
            "(input, then weight gradients), and PyTorch's selective checkpoint can be "
            "back-propagated through only once: use --ac full (recomputes per pass) or another "
            "--schedule")


def _saved_ops() -> set:
    """The ops whose outputs ``selective`` keeps (matmuls and fused attention kernels)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_attention_math")
    out = set()
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None:
            out.add(packet.default)
    return out


_SAVE = None
_OBSERVERS: list[Callable] = []


@contextlib.contextmanager
def observe_selective_saves(callback: Callable):
    """Call ``callback(output)`` for every op output ``selective`` keeps (held by PyTorch's
    selective-checkpoint cache, which ``saved_tensors_hooks`` do not see). For measuring
    activation memory (``benchmarks/ac_memory.py``)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    global _SAVE
    if _SAVE is None:
        _SAVE = _saved_ops()
    if op in _SAVE:
        for cb in _OBSERVERS:
            cb(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeContext:
    """The context PyTorch enters around each recompute of one checkpointed region: ``inner``
    (the selective-checkpoint cache, or None) plus a *fresh* ``factory()`` context per entry.
    Re-enterable: a region is recomputed once per backward graph task that needs it, e.g.
    twice under the zb-h1 pipeline schedule (input gradients, then weight gradients)."""

    def __init__(self, inner, factory: Callable):
        self.inner, self.factory, self.stacks = inner, factory, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        if self.inner is not None:
            stack.enter_context(self.inner)
        stack.enter_context(self.factory())
        self.stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def checkpoint_block(fn: Callable, *args, mode: str = "full",
                     recompute_context: Callable | None = None):
    """Run ``fn(*args)`` under activation checkpointing ``mode`` ("selective" | "full"; see the
    module docstring). ``recompute_context()``, if given, is a context manager entered around
    the recompute (e.g. a ledger phase). Returns ``fn``'s output; its gradients are those of
    ``fn`` (bitwise: the same ops run in the same order). Raises ``ValueError`` for a bad mode."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode not in ("selective", "full"):
        raise ValueError(f"activation checkpointing mode {mode!r}: choose from {AC_MODES}")
    if torch.compiler.is_compiling():  # a compiled block (--compile, models/compile.py)
        # dynamo turns the checkpoint into a higher-order op and AOT autograd's partitioner
        # decides the recompute inside the compiled backward, so no recompute context can be
        # entered (only TP's collectives are booked by it, and --compile refuses tp > 1);
        # dynamo accepts SAC's context function only as this partial
        kw = {}
        if mode == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 _selective_policy)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kw)
    rc = recompute_context or contextlib.nullcontext

    def context_fn():
        if mode == "selective":
            fwd, rec = create_selective_checkpoint_contexts(_selective_policy)
            return fwd, _RecomputeContext(rec, rc)
        return contextlib.nullcontext(), _RecomputeContext(None, rc)

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=context_fn)


class CheckpointedBlock:
    """Mixin for a model block: ``ac_mode`` ("none" by default) and ``recompute_context``
    (None = no context); :meth:`run` calls the block body with or without checkpointing."""

    ac_mode: str = "none"
    recompute_context: Callable | None = None

    def run(self, body: Callable, *args):
        if self.ac_mode == "none" or not torch.is_grad_enabled():
            return body(*args)
        return checkpoint_block(body, *args, mode=self.ac_mode,
                                recompute_context=self.recompute_context)


def set_activation_checkpointing(model: nn.Module, mode: str,
                                 recompute_context: Callable | None = None) -> int:
    """Set ``mode`` on every checkpointable block of ``model`` (any submodule with the
    :class:`CheckpointedBlock` mixin) and the recompute context factory (e.g.
    ``lambda: topo.ledger.phase("recompute")``). Call it on the plain model, before or after
    ``parallelize`` (the block objects are kept by every strategy). Returns how many blocks were
    set. Raises :class:`~shardwise.errors.ShardwiseConfigError` for an unknown mode."""
    from ..errors import ShardwiseConfigError

    if mode not in AC_MODES:
        raise ShardwiseConfigError(f"--ac {mode!r}: choose from {', '.join(AC_MODES)}")
    n = 0
    for m in model.modules():
        if isinstance(m, CheckpointedBlock):
            m.ac_mode, m.recompute_context = mode, recompute_context
            n += 1
    return n
