"""Where and in which dtype the model state lives: the parameters' storage dtype, their master
copy (:class:`~shardwise.precision.Precision`) and host offload (``--offload``), and the rules
of what the engines wire (:func:`check_storage`, called by :meth:`~.layout.Layout.check`).

Megatron-LM's recipe (``--param-dtype bf16 --master-dtype fp32``) keeps a bf16 parameter for
the forward and backward, and beside it an fp32 **main gradient** (Megatron's ``main_grad``):
each micro-batch's bf16 ``.grad`` is added into it and freed (:func:`fold_grad_`), so the
accumulation over micro-batches and the dp reduction run in fp32; the optimizer
(:class:`~.master.MasterAdamW`) steps fp32 master weights with it and writes them back rounded
to bf16. The gradient syncs, the norm and the optimizer read a parameter's gradient through
:func:`grad_of` and write a reduced one through :func:`set_grad_`, so every layout gets the
recipe from these (in :mod:`.params`, beside the other per-parameter rules). Derivation and
accuracy: docs/precision-memory-mfu.md, "bf16 storage"; parity rule: docs/parity.md §7.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..errors import ShardwiseConfigError
from ..precision import ELEMENT_BYTES, Precision
from .params import fold_grad_

OFFLOADS = ("none", "optimizer", "params")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_storage(layout, precision: Precision, offload: str, engine: str) -> None:
    """Where and in which dtype the model state lives — ``precision.param_dtype`` (and its
    master copy) and ``offload`` ("none" | "optimizer" | "params") — against what the engines
    wire for ``layout`` on ``engine``: the one definition ``train`` and the planner share.
    Wired: the explicit engine (dp, ZeRO-1/2/3, HSDP, tp, pp with its stage syncs), bf16
    storage (both recipes) and ``--offload optimizer``; ``--offload params`` on ZeRO-3 (HSDP,
    pp's stages too) without tp, cp or ep (:mod:`.zero.offload`); the torch engine where FSDP2
    is the sync (:func:`_torch_wired`). Raises :class:`ShardwiseConfigError`."""
    if offload not in OFFLOADS:
        raise ShardwiseConfigError(f"--offload {offload!r}: choose none, optimizer or params")
    stored = precision.param_dtype != "fp32"
    if not stored and offload == "none":
        return
    what = (f"--param-dtype {precision.param_dtype}" if stored else f"--offload {offload}")
    if engine != "explicit":
        return _check_torch(layout, precision, offload, what)
    if layout.cp > 1 or layout.ep > 1:
        raise ShardwiseConfigError(f"{what} is not proven with cp or ep yet (no parity test): "
                                   "use --cp 1 --ep 1, or --param-dtype fp32 --offload none")
    if offload == "params" and engine == "explicit" and (layout.zero != 3 or layout.tp > 1):
        raise ShardwiseConfigError("--offload params moves ZeRO-3's shards to the host: wired "
                                   "for --zero 3 without tp only; use --zero 3 --tp 1, or "
                                   "--offload optimizer")


def _check_torch(layout, precision: Precision, offload: str, what: str) -> None:
    """The torch engine's share of :func:`check_storage` (:func:`_torch_wired`), one line each."""
    if offload == "optimizer":
        raise ShardwiseConfigError(
            "--offload optimizer on the torch engine: FSDP2 offloads parameters, gradients and "
            "the optimizer step together: use --offload params, or --engine explicit")
    if not fsdp2_syncs(layout):
        raise ShardwiseConfigError(
            f"{what} on the torch engine needs FSDP2 as the gradient sync (--zero 2/3, HSDP, "
            "FSDP2 over tp or in pp stages; not DDP, ZeroRedundancyOptimizer, cp or ep): use "
            "--zero 2 or 3, or --engine explicit")
    if fsdp2_masters(precision, "torch") and precision.reduce_dtype != "fp32":
        raise ShardwiseConfigError(
            "--reduce-dtype bf16 with Megatron's recipe on the torch engine: FSDP2 would "
            "accumulate the micro-batches' gradients in its reduce dtype, bf16, not fp32: use "
            "--reduce-dtype fp32, or --engine explicit")
    if not _torch_wired(layout, precision, offload):
        raise ShardwiseConfigError(
            "--param-dtype bf16 --master-dtype none (the guide's recipe) on the torch engine is "
            "wired only over dp (--zero 2/3 without HSDP, tp or pp): use --master-dtype fp32, "
            "or --engine explicit")


def fsdp2_syncs(layout) -> bool:
    """Whether the torch engine's gradient sync for ``layout`` is FSDP2 (``fully_shard``):
    ZeRO-2/3 over dp or inside pipeline stages, HSDP, FSDP2 over DTensor TP with zero ≥ 1 —
    not DDP (zero 0), ZeroRedundancyOptimizer (zero 1 over dp), ``replicate`` or no dp sync
    (:meth:`~.engines.Torch.dp_sync`, :meth:`~.engines.Torch.stage_sync`)."""
    if layout.dp < 2 or layout.cp > 1 or layout.ep > 1:
        return False
    if layout.zero >= 2 or layout.dp_replicate > 1:
        return True
    return layout.zero == 1 and layout.tp > 1 and layout.pp == 1


def fsdp2_masters(precision: Precision, engine: str) -> bool:
    """Megatron's recipe on the torch engine in FSDP2's form: the model stays fp32 (its
    sharded parameters ARE the master weights, their AdamW state beside them) and FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gathers them in bf16
    (:func:`.zero.torch_zero.apply_fsdp`); no :class:`~.master.MasterAdamW`, no main gradients.
    Derivation and parity rule: docs/parity.md §7."""
    return (engine == "torch" and precision.param_dtype != "fp32"
            and precision.master_dtype is not None)


def _torch_wired(layout, precision: Precision, offload: str) -> bool:
    """The torch engine's share, where FSDP2 is the sync (:func:`fsdp2_syncs`): Megatron's
    recipe in FSDP2's form (:func:`fsdp2_masters`) and ``--offload params`` (FSDP2's
    ``CPUOffloadPolicy``: sharded parameters, gradients and the AdamW step on the host) in
    every such layout; the guide's recipe (a bf16 model, no master, reduced in
    ``--reduce-dtype``) only for ZeRO-2/3 over dp (not proven with HSDP, tp or pp).
    ``--offload optimizer`` has no FSDP2 form (:func:`_check_torch` refuses it)."""
    if offload == "optimizer" or not fsdp2_syncs(layout):
        return False
    if precision.param_dtype != "fp32" and precision.master_dtype is None:
        return layout.zero >= 2 and layout.tp == layout.pp == layout.dp_replicate == 1
    return True


def fsdp2_state(engine) -> bool:
    """Whether ``engine``'s optimizer is plain AdamW on FSDP2's shards, which themselves carry
    the recipe: the fp32 masters of :func:`fsdp2_masters`, the host of ``--offload params``
    (the torch engine's FSDP2 syncs say so: ``fsdp2_state``)."""
    return bool(getattr(getattr(engine, "grad_sync", None), "fsdp2_state", False))


@torch.no_grad()
def load_masters_(named_params, local: dict[str, dict]) -> None:
    """FSDP2's shards are the masters (:func:`fsdp2_state`): each ``master`` of ``local``
    (optimizer state in this rank's shape, as saved by the explicit engine's
    :class:`~.master.MasterAdamW`) is taken out and written into its parameter, so that a
    resumed run continues from the fp32 masters, not from the saved bf16 parameters, and no
    stale copy stays in the state to be saved again."""
    for n, p in named_params:
        master = local.get(n, {}).pop("master", None)
        if master is not None:
            p.copy_(master)


def storage_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype the parameters are stored in (``precision.param_dtype``)."""
    return TORCH_DTYPES[precision.param_dtype]


def main_grads(precision: Precision) -> bool:
    """Whether gradients are accumulated in another dtype than the parameters are stored in
    (Megatron's recipe: bf16 parameters, fp32 main gradients)."""
    return precision.main_grad_torch is not None


def store(module: nn.Module, precision: Precision) -> None:
    """bf16 storage of ``module`` (after its transforms, before its gradient sync is built):
    :func:`store_parameters`, then :func:`arm_main_grads`."""
    store_parameters(module, precision)
    arm_main_grads(module, precision)


@torch.no_grad()
def store_parameters(module: nn.Module, precision: Precision) -> None:
    """Cast ``module``'s floating parameters (not its buffers: RoPE tables stay as built) to
    the storage dtype in place (same ``nn.Parameter`` objects; a meta model stays meta).
    Nothing for fp32 storage."""
    dtype = storage_dtype(precision)
    if dtype == torch.float32:
        return
    for p in dict.fromkeys(module.parameters()):
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def arm_main_grads(module: nn.Module, precision: Precision) -> None:
    """Megatron's recipe: give every trainable parameter of ``module`` an fp32 main gradient
    (``p.main_grad``, None = zero) and a post-accumulate-grad hook that folds each backward's
    ``.grad`` into it (:func:`.params.fold_grad_`). Hook order does not matter: a sync that
    reads a gradient folds it first (:func:`.params.grad_of`), so this runs after the sync is
    built and the values are in (a meta model's parameters are new objects then). Nothing
    unless :func:`main_grads`."""
    if not main_grads(precision):
        return
    for p in dict.fromkeys(module.parameters()):
        # once per parameter object (a meta model's are replaced, attributes copied, hooks not)
        if p.requires_grad and getattr(p, "_folded_by", lambda: None)() is not p:
            if not hasattr(p, "main_grad"):
                p.main_grad = None
            p.register_post_accumulate_grad_hook(fold_grad_)
            p._folded_by = weakref.ref(p)


def clear_main_grads(params) -> None:
    """Set every main gradient of ``params`` to None (a step's ``zero_grad``)."""
    for p in params:
        if hasattr(p, "main_grad"):
            p.main_grad = None


def optimized_numel(sync) -> int:
    """Elements this rank's optimizer steps: ZeRO's slices without their padding (Σ_u of
    |[lo, hi) ∩ [0, Ψ_u)|, :mod:`.zero.flat`), else every trainable parameter it holds (each
    once)."""
    units = getattr(sync, "units", getattr(sync, "flats", None))  # ZeRO; a stage's ZeRO-1
    if units is not None:
        return sum(max(0, min(u.hi, u.numel) - u.lo) for u in units)
    return sum(p.numel() for p in dict.fromkeys(sync.module.parameters()) if p.requires_grad)


def offload_bytes_formula(engine, micro_steps: int = 1) -> dict[str, float]:
    """``{"offload_d2h", "offload_h2d"}`` bytes one rank copies per step with ``--offload
    optimizer`` ({} without): its N optimized elements (:func:`optimized_numel`) cross once
    each way — the gradients to the host in the gradient dtype (fp32 main gradients: 4 B),
    the updated parameters back in the storage dtype (bf16: 2 B). ZeRO-Offload (Ren et al.
    2021, §4.1: gradients down, fp16 parameters up, the optimizer on the CPU). ``--offload
    params``: the shard up before each of the ``micro_steps`` micro-batches' gathers and the
    reduced slice down once (:func:`.zero.offload.offload_params_bytes`)."""
    offload = getattr(engine, "offload", "none")
    if offload == "none" or fsdp2_state(engine):
        return {}  # FSDP2's own copies: not booked (docs/precision-memory-mfu.md, offload)
    n, p = optimized_numel(engine.grad_sync), engine.precision
    if offload == "params":
        from .zero.offload import offload_params_bytes

        return offload_params_bytes(engine.grad_sync, micro_steps, p.param)
    return {"offload_d2h": float(n * p.grad), "offload_h2d": float(n * p.param)}


def fsdp2_offload_bytes_formula(engine, micro_steps: int = 1) -> dict[str, float]:
    """``{"fsdp2_h2d", "fsdp2_d2h"}`` bytes one rank copies per step under FSDP2's
    ``CPUOffloadPolicy`` ({} without): each all-gather first copies this rank's shards of the
    unit to the device in the shards' dtype b_s (fp32 masters or fp32 storage: 4; the guide's
    bf16 model: 2) and casts them there (FSDP2's ``all_gather_inputs``), each reduce-scatter's
    output shard goes back to the host in the reduce dtype (``foreach_reduce``). Read off the
    sync's own formula: a ring all-gather that sends (n−1)/n·G·b_g moves G/n shard elements
    H2D, so H2D = param·b_s/((n−1)·b_g); a reduce-scatter sending (n−1)/n·G·b_r returns G/n·b_r,
    so D2H = grad/(n−1). **Not booked** in the ledger: these copies are ``.to()`` calls inside
    FSDP2 (no hook), and on a CPU-only world no copy happens at all (docs/parity.md §7)."""
    if getattr(engine, "offload", "none") != "params" or not fsdp2_state(engine):
        return {}
    sync, p = engine.grad_sync, engine.precision
    n = sync.topo.size(sync.topo.shard_axis)
    f = sync.bytes_formula(micro_steps=micro_steps)
    b_s = 4 if p.master_dtype is not None else p.param
    return {"fsdp2_h2d": f["param"] * b_s / ((n - 1) * sync.param_bytes),
            "fsdp2_d2h": f["grad"] / (n - 1)}


RECIPES = {  # (param_dtype, master_dtype) → the recipe's words
    ("fp32", None): "fp32 parameters, gradients and AdamW state",
    ("bf16", "fp32"): "bf16 parameters; fp32 main gradients, master weights and AdamW state "
                      "(Megatron-LM's recipe)",
    ("bf16", None): "bf16 parameters, gradients and AdamW state, no master copy (the guide's "
                    "FSDP recipe)"}


def storage_memory_formula(engine) -> dict[str, dict[str, float]] | None:
    """{"device": {"params", "grads", "optimizer", "total"}, "host": {...}} model-state bytes
    of this rank by the formula: the engine's ``memory_formula`` (fp32 counts, ZeRO paper
    §5.1–5.3) read as element counts (4 B per parameter and gradient, 8 B per optimizer
    element) and priced in ``engine.precision``'s bytes (parameter, gradient, master + m + v);
    ``--offload optimizer`` puts the optimizer part on the host, ``params`` the parameter and
    gradient shards too (ZeRO-3's: the formula's whole params and grads terms). The torch
    engine's FSDP2 (:func:`fsdp2_state`): every part in the shards' dtype (Megatron's form:
    fp32, 4 + 4 + 8 = 16 B per element, the bf16 gathered unit transient and not counted) and
    with ``--offload params`` all three on the host. None without a closed form."""
    f = engine.memory_formula()
    if f is None:
        return None
    where = getattr(engine, "offload", "none")
    p, offload = engine.precision, where != "none"
    if fsdp2_state(engine):  # FSDP2's shards: fp32 masters (Megatron's form) or the stored dtype
        b = 4 if p.master_dtype is not None else p.param
        dev = {"params": f["params"] / 4 * b, "grads": f["grads"] / 4 * b,
               "optimizer": f["optimizer"] / 4 * b}
    else:
        # optimizer offloaded without a master dtype, the host keeps its own copy of the
        # parameters (the step's master, :class:`.master.MasterAdamW`); with params offloaded
        # the host shard is the master then
        per = p.optim + (p.param if where == "optimizer" and p.master_dtype is None else 0)
        # the bytes per element the engine's formula priced: 4 (fp32), but ZeRO's flat units
        # price the storage dtype's (:func:`.zero.formulas.units_memory_formula`: 2 under bf16)
        units = getattr(engine.grad_sync, "units", None)
        b = units[0].full.element_size() if units else 4
        dev = {"params": f["params"] / b * p.param, "grads": f["grads"] / b * p.grad,
               "optimizer": f["optimizer"] / (2 * b) * per}
    host = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if offload:  # FSDP2's CPUOffloadPolicy and ZeRO-3's --offload params: all three on the host
        moved = ("params", "grads", "optimizer") if where == "params" else ("optimizer",)
        for part in moved:
            host[part], dev[part] = dev[part], 0.0
    for d in (dev, host):
        d["total"] = d["params"] + d["grads"] + d["optimizer"]
    return {"device": dev, "host": host}


def describe_storage(engine) -> list[str]:
    """Start-up lines: the storage recipe, its bytes per parameter and, by
    :func:`storage_memory_formula`, this rank's model state on the device and on the host."""
    p, offload = engine.precision, getattr(engine, "offload", "none")
    words = RECIPES.get((p.param_dtype, p.master_dtype), p.name)
    master = f"{p.optim - 2 * ELEMENT_BYTES[p.optim_dtype]} + " if p.master_dtype else ""
    b = (f"{p.param} + {p.grad} + {master}{2 * ELEMENT_BYTES[p.optim_dtype]} = "
         f"{p.param + p.grad + p.optim} B/parameter (parameter, gradient, "
         f"{'master, ' if master else ''}AdamW m and v)")
    where = "master, m, v and the AdamW step"
    if offload == "params":
        where = "parameter and gradient shards, " + where
    if fsdp2_state(engine):  # the torch engine: FSDP2's shards hold the recipe
        where = "FSDP2's CPUOffloadPolicy: sharded parameters, gradients, m, v and the AdamW step"
        if p.param_dtype != "fp32" and p.master_dtype is not None:
            words = ("Megatron-LM's recipe in FSDP2's form: fp32 sharded parameters (the "
                     "masters) gathered in bf16, gradients accumulated and reduce-scattered in "
                     "fp32")
            b = ("4 + 4 + 8 = 16 B/parameter sharded (parameter = master, gradient, AdamW m "
                 "and v), plus each gathered unit in bf16 (2 B/parameter, transient)")
    lines = [f"  storage: {words}: {b}" + (f"; --offload {offload}: {where} in host memory"
                                           if offload != "none" else "")]
    copies = fsdp2_offload_bytes_formula(engine)
    if copies:
        lines.append(f"  FSDP2's host ↔ device copies per step of one micro-batch (formula, not "
                     f"booked): {copies['fsdp2_h2d'] / 2**20:,.2f} MiB to the device, "
                     f"{copies['fsdp2_d2h'] / 2**20:,.2f} MiB back")
    mem = storage_memory_formula(engine)
    if mem is not None:
        d, h = mem["device"], mem["host"]
        lines.append(f"  model state per rank (formula): device {d['total'] / 2**20:,.2f} MiB "
                     f"(parameters {d['params'] / 2**20:,.2f}, gradients "
                     f"{d['grads'] / 2**20:,.2f}, optimizer {d['optimizer'] / 2**20:,.2f}), "
                     f"host {h['total'] / 2**20:,.2f} MiB")
    return lines
