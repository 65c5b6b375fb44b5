"""Enumerate the layouts of a model on a cluster and rank them by predicted MFU.

A layout fixes dp × cp × tp × pp = the number of GPUs, expert parallelism ep over dp × cp (MoE
models), the ZeRO stage over dp, sequence parallelism,
the pipeline schedule and its virtual stages, the micro-batch size and activation checkpointing
(:class:`~shardwise.plan.layout.PlanLayout`), the storage recipe and offload. :func:`search`
keeps every one that ``shardwise train`` runs (train's own check,
:func:`~shardwise.plan.layout.check_train`) and prices it with
:func:`~shardwise.plan.cost.estimate`; the ones that fit come first, best MFU first (ties: less
memory), then the ones that do not fit, best MFU first. Any dimension can be fixed (``fixed``),
which is how the CLI's layout flags work.

What is enumerated, and why not more:

* tp: powers of two up to the GPUs per node (TP's per-layer all-reduces want NVLink; Narayanan
  et al. 2021 §3.3, takeaway #1) that divide the heads and the kv heads.
* pp: divisors of GPUs / tp up to the number of layers.
* ep (mixture-of-experts models only): every divisor of dp × cp that divides the number of
  experts (expert parallelism rides on the data axes, EP ⊆ dp × cp, so it adds no GPUs: each
  (dp, cp) split is tried with every such ep). Dense models: ep = 1; a fixed ``--ep`` is kept so
  that the estimate refuses it with its reason.
* cp: powers of two dividing GPUs / (tp · pp) with the sequence divisible by 2·cp, Llama-style
  models only (:func:`~shardwise.plan.layout.check_cp`), while each rank keeps at least
  :data:`MIN_CP_TOKENS` tokens of a sequence; for cp > 1 both methods, ring and all-gather.
  dp is what is left: GPUs / (tp · pp · cp). The bound: the cost model runs every attention
  block at the flash kernel's long-sequence utilisation, and the ring hides each transfer under
  one block of ``s/cp`` queries; FlashAttention-2's attention benchmarks (Dao 2023, arXiv
  2307.08691, §4.1) reach their lowest throughput at the shortest sequences they run (512–1k),
  so below 2,048 local tokens the model's timing is not trusted and the search does not go
  there (a fixed ``--cp`` still may).
* zero: 0–3 when dp > 1 (a ZeRO stage over one rank is plain DP).
* dp_replicate (HSDP, zero ≥ 1): 1, and the R whose shard group fills one node, S·cp·tp =
  GPUs per node (S = dp/R ≥ 2 when cp = 1, R ≥ 2), when it exists. The shard group must lie
  inside a node — that is what HSDP is for (Zhao et al. 2023, §3.2.3: shard within the
  high-bandwidth domain, replicate across it) — and among the groups that do, the one that
  fills the node dominates the smaller ones in this model: less state per GPU (÷ S) and fewer
  inter-node bytes (the replicas' all-reduce, 2(R−1)/R·Ψ/S, shrinks as S grows), at a few
  more NVLink ring steps. So HSDP adds at most one candidate per ZeRO layout. A fixed
  ``dp_replicate`` is kept as given (the estimate refuses an R that does not divide dp).
* sp: on whenever tp > 1 (same bytes as TP without it, less memory: Korthikanti et al. 2022
  §4.2.2), unless fixed; for an MoE model off too (train runs MoE without sp only).
* schedule (pp > 1): gpipe, 1f1b, zb-h1, and interleaved-1f1b with 2, 4, 8, … virtual stages up
  to the layers per rank.
* micro-batch size: 1, 2, 4, 8 sequences (when it divides the replica's batch).
* ckpt: none, selective, full.
* storage (train's ``--dtype``, ``--param-dtype``, ``--master-dtype``): amp (fp32 parameters,
  bf16 compute), bf16 with fp32 master weights (Megatron-LM's), bf16 without (the guide's FSDP2
  recipe): :data:`~shardwise.plan.layout.SEARCHED_PRECISIONS`; fp32 compute only when asked.
* offload (``--offload``): none; a layout that does not fit on the device is tried again with
  the optimizer on the host, then with the parameters too. Offload only adds time (copies over
  the host link, the optimizer step at host memory bandwidth) and host memory, so a layout
  that fits without it is not offered with it.
* zero 2/3 with several micro-batches: one gradient reduce-scatter per step, after the last
  micro-batch (full local gradients held), as train does; one per micro-batch (gradients stay
  sharded: DeepSpeed ZeRO-2) only when fixed (``grad_reduce="micro"``), with ``runnable`` off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math

from ..errors import ShardwiseConfigError
from ..parallel.cp import CP_METHODS
from .cost import Estimate, estimate
from ..parallel.storage import OFFLOADS
from .layout import (CKPT, SCHEDULES, SEARCHED_PRECISIONS, Assumptions, PlanLayout, check_train,
                     llama_style)
from .hardware import Cluster
from .models import ModelSpec

MIN_CP_TOKENS = 2048  # tokens of each sequence per rank below which cp is not searched

FAMILIES = ("DP", "ZeRO-1/2", "FSDP (ZeRO-3)", "TP + DP", "PP + DP", "TP + PP + DP",
            "CP + any", "EP + any", "HSDP + any")


def family(layout: PlanLayout) -> str:
    """The strategy family of a layout, for the plot: which axes are > 1, and the ZeRO stage
    when only data parallelism is used; every layout with ep > 1 is "EP + any", every other
    one with cp > 1 "CP + any", every other one with dp_replicate > 1 "HSDP + any"."""
    if layout.ep > 1:
        return "EP + any"
    if layout.cp > 1:
        return "CP + any"
    if layout.dp_replicate > 1:
        return "HSDP + any"
    if layout.tp == 1 and layout.pp == 1:
        return {0: "DP", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "FSDP (ZeRO-3)"}[layout.zero]
    if layout.pp == 1:
        return "TP + DP"
    if layout.tp == 1:
        return "PP + DP"
    return "TP + PP + DP"


def parse_tokens(text: str | int) -> int:
    """``"4M"`` → 4·2**20, ``"16M"`` → 16,777,216, ``"512K"``, ``"1G"``, ``"4194304"``, ``4e6``.
    Binary suffixes, the convention of "16M tokens" in Llama 3 §3.4.1 (2,048 sequences × 8,192).
    Raises ShardwiseConfigError."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().upper().replace("_", "").replace(",", "")
        mult = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 2**30}.get(s[-1:], 1)
        if mult != 1:
            s = s[:-1]
        try:
            value = float(s) * mult
        except ValueError:
            raise ShardwiseConfigError(f"--global-batch-tokens {text!r}: write a number of "
                                       "tokens such as 4M, 512K or 4194304") from None
        if value != int(value):
            raise ShardwiseConfigError(f"--global-batch-tokens {text!r} is not a whole number "
                                       "of tokens")
        value = int(value)
    if value < 1:
        raise ShardwiseConfigError(f"--global-batch-tokens {text!r} must be positive")
    return value


def global_batch_sequences(tokens: int, seq_len: int) -> int:
    """Sequences per step. Raises ShardwiseConfigError when ``tokens`` is not a multiple of the
    sequence length, naming the two nearest valid values."""
    if tokens % seq_len:
        lo = max(seq_len, tokens // seq_len * seq_len)
        raise ShardwiseConfigError(
            f"--global-batch-tokens {tokens:,} is not a multiple of the sequence length "
            f"{seq_len}: choose {lo:,} or {lo + seq_len:,} (or change --seq-len)")
    return tokens // seq_len


@dataclasses.dataclass
class Fixed:
    """Dimensions the user fixed (None = search over it)."""

    dp: int | None = None
    dp_replicate: int | None = None  # HSDP replicas R (dp = R × S); 1 = ZeRO over all of dp
    cp: int | None = None
    cp_method: str | None = None  # "ring" or "allgather" (cp > 1)
    ep: int | None = None  # expert parallelism over the data axes (MoE models)
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    sp: bool | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    microbatches: int | None = None  # m: micro-batches per step and replica
    micro_batch: int | None = None
    ckpt: str | None = None
    grad_reduce: str | None = None  # zero 2/3: "step" (train's, the default) or "micro"
    offload: str | None = None  # none | optimizer | params (None: none, or more if it must)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(model: ModelSpec, cluster: Cluster, gpus: int, global_batch: int,
               fixed: Fixed = Fixed(), precision: str | list[str] | None = None
               ) -> list[PlanLayout]:
    """Every layout :func:`search` evaluates (before validity checks that need the estimate),
    at ``fixed.offload`` (default none: :func:`search` tries more where one does not fit) and
    ``precision`` (a key of :data:`~shardwise.plan.layout.PRECISIONS`, or a list of them; None:
    each of
    :data:`~shardwise.plan.layout.SEARCHED_PRECISIONS`). Raises ShardwiseConfigError when a
    fixed dimension is impossible for ``gpus``."""
    f = fixed
    if gpus < 1:
        raise ShardwiseConfigError(f"--gpus {gpus} must be at least 1")
    for name in ("dp", "cp", "tp", "pp"):
        v = getattr(f, name)
        if v is not None and (v < 1 or gpus % v):
            raise ShardwiseConfigError(f"--{name} {v} does not divide --gpus {gpus}: choose "
                                       f"from {_divisors(gpus)}")
    if f.tp is not None:
        tps = [f.tp]
    else:
        tps = [t for t in (2**i for i in range(0, 11))
               if t <= min(cluster.gpus_per_node, gpus) and gpus % t == 0
               and model.n_heads % t == 0 and model.n_kv_heads % t == 0]
    out = []
    cp_ok = llama_style(model)
    precs = ([precision] if isinstance(precision, str) else list(precision or [])
             or list(SEARCHED_PRECISIONS))
    for tp in tps:
        pps = [f.pp] if f.pp is not None else [p for p in _divisors(gpus // tp)
                                                 if p <= model.n_layers]
        for pp, cp in _pp_cp(pps, f.cp, gpus, tp, model.seq_len, cp_ok):
            dp = gpus // (tp * pp * cp)
            if f.dp is not None and dp != f.dp:
                continue
            methods = ([f.cp_method] if f.cp_method is not None else
                       list(CP_METHODS)) if cp > 1 else ["ring"]
            if f.ep is not None:
                eps = [f.ep]
            elif model.is_moe:
                eps = [e for e in _divisors(dp * cp) if model.n_experts % e == 0]
            else:
                eps = [1]
            zeros = [f.zero] if f.zero is not None else ([0, 1, 2, 3] if dp > 1 else [0])
            if f.dp_replicate is not None and f.dp_replicate > 1 and f.zero is None:
                zeros = [z for z in zeros if z] or zeros  # HSDP needs ZeRO (zero 0 refused)
            reps = _replicas(f.dp_replicate, dp, cp, tp, cluster.gpus_per_node)
            # sp on with tp (less memory, the same bytes); an MoE model without it too (train
            # refuses MoE with sp: the routing counts of a split sequence are not summed)
            sps = ([f.sp] if f.sp is not None else [True, False] if tp > 1 and model.is_moe
                   else [tp > 1])
            if pp == 1:
                scheds = [("1f1b", 1)]
            else:
                per_rank = math.ceil(model.n_layers / pp)
                scheds = []
                for s in ([f.schedule] if f.schedule else SCHEDULES):
                    if s == "interleaved-1f1b":
                        vs = ([f.virtual_stages] if f.virtual_stages else
                              [v for v in (2**i for i in range(1, 8)) if v <= per_rank])
                        scheds += [(s, v) for v in vs]
                    else:
                        scheds.append((s, 1))
            if f.microbatches is not None:
                if global_batch % (dp * f.microbatches):
                    continue
                mbs = [global_batch // (dp * f.microbatches)]
            elif f.micro_batch is not None:
                mbs = [f.micro_batch]
            else:
                mbs = [b for b in (1, 2, 4, 8) if global_batch % (dp * b) == 0]
            red = f.grad_reduce if f.grad_reduce is not None else "step"
            for zero, sp, (sched, v), b, ck, prec, meth, ep in itertools.product(
                    zeros, sps, scheds, mbs, [f.ckpt] if f.ckpt else CKPT, precs, methods,
                    eps):
                for r in (reps if zero or f.dp_replicate else [1]):
                    if r > 1 and f.ep is None and (dp // r * cp) % ep:
                        continue  # ep must fit in a shard group
                    out.append(PlanLayout(
                        dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, sp=sp, schedule=sched,
                        virtual_stages=v, micro_batch=b, ckpt=ck, precision=prec,
                        grad_reduce=red if zero >= 2 else "step", cp_method=meth, ep=ep,
                        dp_replicate=r, offload=f.offload or "none"))
    return out


def _offloads(fixed: str | None) -> tuple[str, ...]:
    """The offload variants :func:`search` tries in turn for a layout (at offload none, or the
    fixed one): the fixed one, else none, optimizer, params (it stops at the first that fits).
    Names only: the search makes a variant (:func:`_with_offload`) only when it prices it."""
    return (fixed,) if fixed is not None else OFFLOADS


def _with_offload(layout: PlanLayout, offload: str) -> PlanLayout:
    """``layout`` at ``offload`` (itself when it already is)."""
    return layout if layout.offload == offload else dataclasses.replace(layout, offload=offload)


def _could_fit(e: Estimate, offload: str) -> bool:
    """Whether ``offload`` could bring estimate ``e`` (made without offload) into the device:
    each stage's total less the state it moves to the host (the optimizer state; with "params"
    the parameters too) fits. The estimate with offload holds exactly that on the device, plus,
    for "params" below ZeRO-3, the two layers copied up at a time: a lower bound. ("params"
    moves the gradient shard too: all the gradients are subtracted, a lower bound still.)"""
    moved = ("optimizer",) + (("params", "grads") if offload == "params" else ())
    return all(mem["total"] - sum(mem[k] for k in moved) <= e.capacity_bytes
               for mem in e.memory.values())


def _replicas(fixed: int | None, dp: int, cp: int, tp: int, gpus_per_node: int) -> list[int]:
    """The dp_replicate values tried for a (dp, cp, tp): the fixed one, else 1 and the R whose
    shard group of S = dp/R data ranks fills one node (S·cp·tp = GPUs per node, S·cp ≥ 2,
    R ≥ 2; the module docstring says why only that one)."""
    if fixed is not None:
        return [fixed]
    out = [1]
    if gpus_per_node % (cp * tp) == 0:
        s = gpus_per_node // (cp * tp)
        if s * cp >= 2 and dp % s == 0 and dp // s >= 2:
            out.append(dp // s)
    return out


def _pp_cp(pps, fixed_cp, gpus, tp, seq_len, cp_ok):
    """(pp, cp) pairs with tp·pp·cp dividing ``gpus``: cp fixed, or the powers of two whose
    2·cp divides the sequence (only 1 unless the model is Llama-style, ``cp_ok``). A fixed cp
    the model cannot run is kept, so that the estimate refuses it with its reason."""
    for pp in pps:
        if gpus % (tp * pp):
            continue
        rest = gpus // (tp * pp)
        if fixed_cp is not None:
            cps = [fixed_cp] if rest % fixed_cp == 0 else []
        else:
            cps = [c for c in (2**i for i in range(0, 20)) if c <= rest and rest % c == 0
                   and (c == 1 or (cp_ok and seq_len % (2 * c) == 0
                                   and seq_len // c >= MIN_CP_TOKENS))]
        for cp in cps:
            yield pp, cp


def search(model: ModelSpec, cluster: Cluster, gpus: int, global_batch: int,
           fixed: Fixed = Fixed(), precision: str | list[str] | None = None,
           assumptions: Assumptions = Assumptions(), runnable: bool = True) -> list[Estimate]:
    """Estimates of every valid layout, fitting ones first, each group best MFU first.
    ``precision``: a storage recipe (a key of :data:`~shardwise.plan.layout.PRECISIONS`), a
    list of them, or None to search them. ``runnable`` (default): only the layouts ``shardwise train`` runs
    (:func:`~shardwise.plan.layout.check_train`); off, every layout the cost model prices (the
    published runs of Megatron-LM and Llama 3: :mod:`.published`). A layout that does not fit
    without offload is tried with ``--offload optimizer``, then ``params`` (unless
    ``fixed.offload``): the first that fits is kept, or, when none does, the last tried
    beside the one without. Raises ShardwiseConfigError when no layout is valid, with the
    reason of the first rejection."""
    results, first_error = [], None
    with _cyclic_gc_paused():
        for lay in candidates(model, cluster, gpus, global_batch, fixed, precision):
            tried = []
            for offload in _offloads(fixed.offload):
                if tried and not _could_fit(tried[0], offload):
                    continue
                variant = _with_offload(lay, offload)
                try:
                    if runnable:
                        check_train(model, variant, global_batch)
                    tried.append(estimate(model, cluster, variant, global_batch, assumptions))
                except ShardwiseConfigError as e:
                    first_error = first_error or e
                    if variant.offload == "none":
                        break  # refused without offload: refused with it too
                    continue
                if tried[-1].fits:
                    break
            results += tried if len(tried) < 3 or tried[-1].fits else [tried[0], tried[-1]]
        # sorted while the collector is still paused: the sort's key tuples would set off its
        # full passes over the estimates (1.8 s of a 405B search's profile)
        results.sort(key=lambda e: (not e.fits, -e.mfu, e.mem_bytes_per_gpu))
    if not results:
        if first_error:
            raise first_error
        raise ShardwiseConfigError(
            f"no layout of {gpus} GPUs splits {global_batch} sequences of {model.name} with the "
            "fixed dimensions: change --global-batch-tokens, --gpus or the layout flags")
    return results


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector (when it is on) for the search loop. The loop
    keeps every estimate until it returns, some twenty container objects each (collectives,
    dicts, lists) and no reference cycles, and the collector went over that growing heap again
    and again: its full passes took 3.9 of 9.4 s CPU of the search for Llama 3 405B on 8,192
    GPUs. Paused, it goes over the estimates about once per generation when it resumes, and
    the search takes some 15-20 % less. Reference counting still frees everything else as
    usual; only cycles made meanwhile wait for the first collection after it. Nothing an
    estimate computes depends on it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def best_by_family(results: list[Estimate]) -> dict[str, Estimate]:
    """The best fitting estimate of each strategy family (:func:`family`)."""
    out: dict[str, Estimate] = {}
    for e in results:
        if e.fits and family(e.layout) not in out:
            out[family(e.layout)] = e
    return out
