"""ZeRO-1/2/3 over the dp axis, written out by hand: every all_gather and reduce_scatter in sight.

ZeRO (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", arXiv 1910.02054) keeps plain data parallelism's math — every dp rank runs the same model
on its own slice of the global batch and the gradients are **summed** over dp (see
:mod:`shardwise.parallel.data`) — but stops replicating the model state. With n dp ranks and Ψ
parameters:

Memory (bytes per rank; ZeRO paper §3.1 and Figure 1)
------------------------------------------------------
Model state = parameters + gradients + optimizer state. fp32 AdamW holds 4Ψ + 4Ψ + 8Ψ (two fp32
moments); mixed precision holds 2Ψ + 2Ψ + 12Ψ (bf16/fp16 weights and gradients, fp32 master
weights and moments: the paper's K = 12). In shardwise ``--dtype bf16`` is autocast only: weights,
gradients and optimizer state stay fp32, so the fp32 line applies to every run.

=========  ============================  ==========================  ==================
stage      what is sharded               bytes per rank, fp32 AdamW  paper (§5)
=========  ============================  ==========================  ==================
0 (DP)     nothing                       4Ψ + 4Ψ + 8Ψ                 —
1          optimizer state               4Ψ + 4Ψ + 8Ψ/n               P_os   (§5.1)
2          + gradients                   4Ψ + (4Ψ + 8Ψ)/n             P_os+g (§5.2)
3          + parameters (= FSDP)         (4Ψ + 4Ψ + 8Ψ)/n             P_os+g+p (§5.3)
=========  ============================  ==========================  ==================

:func:`zero_memory_formula` returns these numbers. Padding (below) adds at most n − 1 elements per
unit. ZeRO-3 additionally holds the *gathered* parameters of the units being computed; this
module measures their peak (``gathered_params_peak`` in :meth:`ZeroDataParallel.model_state_bytes`).

Collectives per optimizer step (bytes each rank sends; ZeRO paper §7)
---------------------------------------------------------------------
b bytes per element, ring collectives (:mod:`shardwise.comm.ledger`): an all_reduce sends
2(n−1)/n · S, an all_gather or reduce_scatter (n−1)/n · S.

* DP: all_reduce of the gradients: 2Ψb(n−1)/n (§7.1).
* ZeRO-1 and ZeRO-2: reduce_scatter of the gradients (each rank receives the summed gradient of
  the slice it owns) + all_gather of the updated parameters after the optimizer step:
  Ψb(n−1)/n + Ψb(n−1)/n = 2Ψb(n−1)/n, **the same as DP** (§7.2.1: an all_reduce *is* a
  reduce_scatter followed by an all_gather; ZeRO just runs the optimizer in between).
* ZeRO-3: parameters are all-gathered before each unit's forward, freed, all-gathered again
  before its backward, and the gradients reduce-scattered: 3Ψb(n−1)/n, 1.5× DP (§7.2.2).
  Two refinements are counted exactly by :func:`zero_step_bytes_formula`: the root unit (below)
  is not freed between its forward and its backward, so it is gathered once, not twice; and with
  ``reshard_after_forward=False`` no unit is, which gives 2Ψb(n−1)/n at ZeRO-2's parameter memory
  during forward/backward (PyTorch FSDP's SHARD_GRAD_OP). With M gradient-accumulation micro-steps
  the parameter all-gathers happen M times; the gradient reduce-scatter once.
* ``reduce_dtype="bf16"``: the gradient reduce_scatter moves bf16 (b = 2 in its term only);
  the summed slice is cast back to fp32 (PyTorch FSDP's ``MixedPrecision(reduce_dtype)``).
* Every stage: one all_reduce of one fp64 scalar (the sum of squared gradient elements of the
  local shards) for the global gradient norm: 2(n−1)/n · 8 bytes. Clipping needs the norm of
  the *whole* gradient; the local shard's norm would clip every rank by a different factor.

How the code does it
--------------------
**Units and flat buffers.** The model is cut into *units*: by default every Llama
``TransformerBlock`` / ``MLPBlock``, plus one *root* unit holding the remaining parameters
(embeddings, final norm, output head). Each unit's parameters (in ``named_parameters`` order) are
flattened into one fp32 buffer of Ψ_u elements, padded with zeros to P_u = ⌈Ψ_u/n⌉·n, so that
every rank owns one contiguous slice of k = P_u/n elements: rank i owns ``[i·k, (i+1)·k)``
(PyTorch FSDP, Zhao et al. 2023, "Full Sharding": the FlatParameter; DeepSpeed's flat
partitions). A slice may begin or end inside a parameter; the optimizer does not care, because
AdamW is element-wise. The padding travels in the collectives (gloo all-gathers equal shards
only) but is never part of any parameter, never reaches the optimizer and adds zeros to the norm.

The module's own ``nn.Parameter`` objects stay in place; their ``.data`` becomes a view into the
unit's flat buffer. In ZeRO-1/2 that buffer always holds the full parameters. In ZeRO-3 it is
allocated only while the unit is *gathered*: freeing is ``untyped_storage().resize_(0)`` and
gathering is ``resize_`` back plus an all_gather into it — the storage is freed, not the tensors,
so tensors that autograd saved during forward (e.g. the transposed weight of a Linear) see the
re-gathered values in backward (the FSDP technique).

**Sharded optimizer.** :meth:`ZeroDataParallel.make_optimizer` runs PyTorch's own AdamW, but its
"parameters" are the pieces of this rank's slice that fall inside each model parameter (views of
the slice, so the two weight-decay groups are kept), so the moments exist only on the owning rank
and the update is element-for-element the one ``torch.optim.AdamW`` would apply to the full
tensors. ZeRO-1/2: the slice is a view of the full buffer, so the step updates this rank's part of
the model in place; then one all_gather per unit brings every rank the others' updated parts.
ZeRO-3: the slice *is* the parameter; the next forward gathers it.

**Gradients.** A post-accumulate-grad hook counts arrivals per unit. When a unit's gradients are
complete on the last micro-step, its flat gradient is reduce-scattered (SUM: each rank's loss is
already divided by the global token count) asynchronously while backward goes on; units are
launched strictly in backward order so that every rank issues the same sequence of collectives.
ZeRO-1 keeps the full gradient buffer (the parameters' ``.grad`` are views into it) and writes
the summed slice into it; ZeRO-2/3 keep only the k-element slice, and the full gradient is freed
once it is packed. With gradient accumulation the earlier micro-steps only accumulate full local
gradients in ``.grad`` (ZeRO-2/3 hold 4Ψ of gradients during accumulation; FSDP does the same).

**ZeRO-3 forward/backward.** A forward pre-hook on each unit gathers it (waiting for the
prefetch if one is in flight) and, with ``prefetch=True``, launches the async all_gather of the
next unit so that it overlaps this unit's compute (FSDP paper, "Forward Prefetching"). A
forward hook frees the unit (``reshard_after_forward``) and wraps its output in
:class:`_PreBackward`, an identity whose backward gathers the unit again just before autograd
enters it and prefetches the unit that backward reaches next (FSDP paper, "Backward
Prefetching"). When the last gradient of a unit has arrived the unit is freed again. Units are
assumed to run their forward in the order given (module order by default); another order, the
same on every rank, stays correct, the prefetch is then just wasted. An order that differs
between ranks would pair different units' all-gathers: on the first step every rank agrees on
each unit before gathering it (:class:`UnitOrderCheck`), and a mismatch is a clear error. A
forward under ``no_grad`` (evaluation) frees every unit after it;
:meth:`ZeroDataParallel.full_model` keeps them all gathered for many forwards (sampling); every
step starts with all units freed.

**Tied embeddings.** A tied weight is one parameter and must live in exactly one unit, gathered
whenever any module using it runs. The default puts ``tok_embeddings``, the final ``norm`` and
``output`` in the root unit. The root is gathered by a pre-hook on the whole model and freed only
when its last gradient has arrived, i.e. at the end of backward (the embedding's gradient comes
last), so both uses find it gathered; this is also what PyTorch FSDP2 does with its root module.
The price: the root stays gathered while the blocks run, so the gathered peak is
root + two units (current + prefetched). A user-given ``units`` list that splits a shared
parameter between two units is refused with :class:`ShardwiseConfigError`.

Pitfalls guarded against: see ``docs/zero.md``.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .. import comm
from ..errors import ShardwiseConfigError
from .data import reduce_torch_dtype
from .engine import Engine
from .params import sum_coalesced_, tp_sharded

STAGES = (1, 2, 3)
# Optimizers whose update of an element depends only on that element's own history: they can run
# on any slice of the flat buffer. Optimizers that need whole tensors (LAMB/LARS trust ratios,
# Adafactor's factored moments, Shampoo/Muon's matrix preconditioners) cannot.
SHARDABLE_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
                        "sgd": torch.optim.SGD}


# -- formulas ---------------------------------------------------------------------------------

def zero_memory_formula(stage: int, psi: float, n: int, bytes_param: float = 4,
                        bytes_grad: float = 4, bytes_optim: float = 8) -> dict[str, float]:
    """Model-state bytes one rank holds at ZeRO ``stage`` (0 = plain DP) with ``psi`` parameters
    over ``n`` dp ranks: ``{"params", "grads", "optimizer", "total"}`` (bytes, float).

    Defaults are fp32 AdamW (4 + 4 + 8 bytes per parameter); pass 2, 2, 12 for the paper's mixed
    precision (ZeRO paper §3.1 and Figure 1: 2Ψ + 2Ψ + KΨ, K = 12). Stage s divides the first s of
    (optimizer, gradients, parameters) by n (§5.1–5.3). Raises ``ValueError`` for a bad stage.
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")
    out = {"params": bytes_param * psi / (n if stage >= 3 else 1),
           "grads": bytes_grad * psi / (n if stage >= 2 else 1),
           "optimizer": bytes_optim * psi / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_step_bytes_formula(stage: int, psi: float, n: int, bytes_per_elem: float = 4, *,
                            micro_steps: int = 1, regathered: float | None = None,
                            grad_norm: bool = True,
                            grad_bytes_per_elem: float | None = None) -> dict[str, float]:
    """Bytes one rank sends per optimizer step for the ZeRO ``stage`` (0 = DP), by ledger tag.

    ``psi``: elements that travel, i.e. Σ over units of the *padded* unit size ⌈Ψ_u/n⌉·n (the flat
    buffers travel whole; pass the plain Ψ for the paper's number). ``bytes_per_elem``: 4 for fp32.
    Returns ``{"grad", "param", "grad_norm", "total"}``:

    * ``grad``: stage 0: all_reduce of the gradients, 2(n−1)/n·Ψb; stages 1–3: one
      reduce_scatter, (n−1)/n·Ψb (once per step, whatever ``micro_steps``). Here b is
      ``grad_bytes_per_elem`` when given (the reduce dtype: 2 for bf16), else ``bytes_per_elem``.
    * ``param``: stages 1–2: one all_gather of the updated parameters after the optimizer step,
      (n−1)/n·Ψb. Stage 3: per micro-step, an all_gather of every unit before its forward and of
      ``regathered`` elements again before their backward: micro_steps·(n−1)/n·(Ψ + regathered)·b.
      ``regathered`` defaults to Ψ (the paper's 3Ψ; ZeRO paper §7.2.2); with an un-freed root unit
      it is Ψ − Ψ_root, with ``reshard_after_forward=False`` it is 0.
    * ``grad_norm``: stages 1–3: one all_reduce of one fp64 scalar (sum of squares of the local
      gradient shards): 2(n−1)/n·8. Stage 0 needs none (replicated gradients).
      ``grad_norm=False`` leaves it out (an engine whose norm reduction is not in the ledger).

    Not counted: the two fp64 loss-bookkeeping all_reduces of ``train_step`` (tag ``loss``:
    token count and loss sum, 2(n−1)/n·8 each) and the init broadcast (phase ``init``).
    Raises ``ValueError`` for a bad stage.
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")
    f = (n - 1) / n if n > 1 else 0.0
    gb = bytes_per_elem if grad_bytes_per_elem is None else grad_bytes_per_elem
    if stage == 0:
        out = {"grad": 2 * f * psi * gb, "param": 0.0, "grad_norm": 0.0}
    else:
        if stage < 3:
            param = f * psi * bytes_per_elem
        else:
            again = psi if regathered is None else regathered
            param = micro_steps * f * (psi + again) * bytes_per_elem
        out = {"grad": f * psi * gb, "param": param,
               "grad_norm": 2 * f * 8 if grad_norm else 0.0}
    out["total"] = out["grad"] + out["param"] + out["grad_norm"]
    return out


def validate_zero(zero: int, dp: int, *, optimizer="adamw", engine: str = "explicit") -> None:
    """Raise :class:`ShardwiseConfigError` unless ZeRO ``zero`` can run over ``dp`` ranks with
    ``optimizer`` (a name such as ``"adamw"`` or a ``torch.optim.Optimizer`` subclass).

    ``zero=0`` (plain DP) always passes. Checked before any collective (the lead calls it from
    ``config.validate``; :class:`ZeroDataParallel` calls it again)."""
    if zero not in (0, *STAGES):
        raise ShardwiseConfigError(f"--zero {zero}: choose 0 (plain DP), 1, 2 or 3")
    if zero == 0:
        return
    if not isinstance(dp, int) or dp < 2:
        raise ShardwiseConfigError(
            f"--zero {zero} shards the model state over the dp ranks, but dp={dp}: there is "
            f"nothing to shard over. Use --dp 2 or more, or --zero 0")
    if engine not in ("explicit", "torch"):
        raise ShardwiseConfigError(f"--engine {engine!r}: choose explicit or torch")
    name = optimizer.__name__ if isinstance(optimizer, type) else str(optimizer)
    cls = SHARDABLE_OPTIMIZERS.get(name.lower())
    if cls is None or (isinstance(optimizer, type) and optimizer is not cls):
        raise ShardwiseConfigError(
            f"--zero {zero} with optimizer {name!r}: ZeRO shards the optimizer state element by "
            f"element, which needs an element-wise optimizer (one whose update of an element "
            f"depends on that element alone); {name!r} is not one we can shard. Choose "
            f"{' / '.join(SHARDABLE_OPTIMIZERS)} (shardwise trains with adamw), or use --zero 0")


# -- units ----------------------------------------------------------------------------------------

def default_unit_names(model: nn.Module) -> list[str]:
    """FQNs of the default ZeRO units of ``model``: every Llama ``TransformerBlock`` and every
    ``MLPBlock`` (the remaining parameters form the root unit)."""
    from ..models.llama import TransformerBlock
    from ..models.mlp import MLPBlock

    blocks = (TransformerBlock, MLPBlock)
    return [name for name, m in model.named_modules() if isinstance(m, blocks)]


def assign_units(model: nn.Module, unit_names: list[str] | None = None
                 ) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Split ``model``'s trainable parameters into units: ``[(name, module, [(fqn, param)])]``,
    the root unit (name ``"root"``, module ``model``, everything not inside a listed submodule)
    first if it has parameters, then the listed units in the given order.

    Raises :class:`ShardwiseConfigError` if a name is not a submodule, units nest or repeat,
    a unit has no trainable parameters, or one parameter (a tied weight) is used by modules of two
    different units — it must live in exactly one unit."""
    names = default_unit_names(model) if unit_names is None else list(unit_names)
    modules = dict(model.named_modules())
    for name in names:
        if name == "" or name not in modules:
            raise ShardwiseConfigError(
                f"ZeRO unit {name!r} is not a submodule of the model: give FQNs such as "
                f"{[n for n in modules if n][:4]}, or leave units unset for the default "
                "(one unit per transformer/MLP block)")
    if len(set(names)) != len(names):
        raise ShardwiseConfigError(f"ZeRO units {names} list a module twice: list each once")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ShardwiseConfigError(f"ZeRO units {a!r} and {b!r} nest: units must be "
                                           "disjoint submodules; drop one of them")

    def owner(module_name: str) -> str:
        for u in names:
            if module_name == u or module_name.startswith(u + "."):
                return u
        return "root"

    owners: dict[int, set[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for _, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), set()).add(owner(mname))
    by_unit: dict[str, list] = {u: [] for u in ["root", *names]}
    for fqn, p in model.named_parameters():  # first name of a tied parameter, as PyTorch reports
        if not p.requires_grad:
            continue
        if len(owners[id(p)]) > 1:
            raise ShardwiseConfigError(
                f"parameter {fqn} is used by modules of several ZeRO units "
                f"{sorted(owners[id(p)])} (a tied weight): a parameter must live in exactly one "
                "unit. Put all modules that share it into one unit, or leave them all outside the "
                "listed units (the root unit, the default for tied embeddings)")
        by_unit[owners[id(p)].pop() if len(owners[id(p)]) == 1 else "root"].append((fqn, p))
    for u in names:
        if not by_unit[u]:
            raise ShardwiseConfigError(f"ZeRO unit {u!r} has no trainable parameters: drop it")
    if not any(by_unit.values()):
        raise ShardwiseConfigError("ZeRO: the model has no trainable parameters to shard")
    out = []
    if by_unit["root"]:
        out.append(("root", model, by_unit["root"]))
    out += [(u, modules[u], by_unit[u]) for u in names]
    for name, _, ps in out:
        kinds = {(p.dtype, p.device) for _, p in ps}
        if len(kinds) > 1:
            raise ShardwiseConfigError(f"ZeRO unit {name!r} mixes parameter dtypes/devices "
                                       f"{sorted(map(str, kinds))}: one flat buffer needs one; "
                                       "convert the model first")
    return out


class _Unit:
    """One unit's flat buffers. Sizes in elements: ``numel`` Ψ_u, ``padded`` P_u = ⌈Ψ_u/n⌉·n,
    ``shard_numel`` k = P_u/n; this rank (dp index i) owns flat range ``[lo, hi) = [i·k, (i+1)·k)``.

    ``full``  [P_u]: the gathered parameters; the module's parameters are views into it (ZeRO-3:
              its storage is allocated only while gathered).
    ``shard`` [k]: this rank's slice (ZeRO-1/2: a view of ``full``; ZeRO-3: its own tensor).
    ``grad_full`` [P_u] (ZeRO-1 only): full local gradients; the parameters' ``.grad`` are views.
    ``shard_grad`` [k]: the summed gradient of this rank's slice (ZeRO-1: a view of
              ``grad_full``).
    """

    def __init__(self, name: str, module: nn.Module, named: list, n: int, rank: int):
        self.name, self.module = name, module
        self.fqns = [f for f, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:j]) for j in range(len(self.params))]
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.full = self.shard = self.grad_full = self.shard_grad = None
        self.arrived: set[int] = set()  # ids of parameters whose gradient arrived this backward
        self.grads_complete = False  # all arrived on the syncing micro-step: ready to launch
        self.reduce = None  # (Handle, buffer kept alive until the reduce_scatter is done)
        self.gather = None  # Handle of an in-flight all_gather (ZeRO-3 prefetch)
        self.gathered = True

    def views(self, flat: torch.Tensor):
        """(param, view of ``flat`` shaped like it) for each parameter of the unit."""
        return [(p, flat[o: o + k].view_as(p))
                for p, o, k in zip(self.params, self.offsets, self.numels)]

    def pieces(self) -> list[tuple[int, int, int]]:
        """(j, a, b) for every parameter j with elements in this rank's slice: its flat range
        [a, b) ⊂ [lo, hi) (so ``shard[a − lo: b − lo]`` is that piece)."""
        out = []
        for j, (off, k) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, self.lo), min(off + k, self.hi)
            if a < b:
                out.append((j, a, b))
        return out

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()


# -- the first step: every rank runs the units in the same order ----------------------------------

ORDER_CHECK_PHASE = "order_check"  # ledger phase of UnitOrderCheck (not in a step's bytes)


def _ordinal(k: int) -> str:
    """1 → "1st", 2 → "2nd", 11 → "11th"."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


class UnitOrderCheck:
    """The first step's check that every rank runs the ZeRO-3 / FSDP2 units in the same order.

    A unit's parameters are all-gathered when it runs (or is prefetched), so the all-gathers of
    two ranks pair up only if both run the units in the same order. A model whose forward
    depends on the rank (``if rank == 1: blocks = reversed(blocks)``) would otherwise hang in the
    gathers, or, with units of equal size, silently gather one unit's shards into another's
    parameters (wrong gradients). :meth:`agree` is called before a unit's forward (and, in the
    explicit engine, its backward) does anything else, so before its all-gather: one all_gather
    over ``axis`` of an int64 [3] row (pass, position k in the pass, unit index; index −1 = the
    end of the pass), booked under ledger phase ``"order_check"``, tag ``"unit_order"`` (not in
    :meth:`~shardwise.comm.Ledger.step_bytes`). Every rank compares the rows and on any
    difference raises the same :class:`ShardwiseConfigError`, naming what each rank wanted; no
    rank goes on to a mismatched gather. The end-of-pass row catches a rank that runs more or
    fewer units than the others. After :meth:`finish` of a pass the check costs nothing: only
    the first forward and the first backward pay, (units + 1) all_gathers of S = n·24 bytes
    ((n−1)/n · S sent each) per pass checked. The explicit engine checks forward and backward;
    FSDP2 (:meth:`hook_forward`) the forward, whose order its backward follows.

    ``names``: the units' FQNs, by index. ``what``: the engine, as the message names it.
    ``axis``: "world" when the layout has no pipeline stages (every rank runs the same units,
    so tp peers are compared too), else "dp". No collective when that axis has one rank.
    """

    PASSES = ("forward", "backward")
    END = -1

    def __init__(self, topo, names: list[str], what: str):
        self.topo, self.names, self.what = topo, list(names), what
        self.axis = "world" if topo.size("pp") == 1 else "dp"
        self.active = dict.fromkeys(self.PASSES, topo.size(self.axis) > 1)
        self.count = dict.fromkeys(self.PASSES, 0)
        self._handles: list = []

    def agree(self, pass_: str, index: int) -> None:
        """All ranks of the axis agree that the next unit of ``pass_`` ("forward" |
        "backward") is unit ``index`` (``END``: the pass is over). Collective while the pass's
        check is active (a no-op after :meth:`finish`). Raises :class:`ShardwiseConfigError`
        on every rank if any rank wanted another unit."""
        if not self.active[pass_]:
            return
        k = self.count[pass_]
        self.count[pass_] += 1
        n = self.topo.size(self.axis)
        mine = torch.tensor([self.PASSES.index(pass_), k, index], dtype=torch.int64,
                            device=self.topo.device)  # [3]
        rows = mine.new_empty(n * 3)  # [n·3]: rank i's row at [3i, 3i + 3)
        with self.topo.ledger.phase(ORDER_CHECK_PHASE):
            comm.all_gather(rows, mine, self.topo, self.axis, tag="unit_order")
        rows = rows.view(n, 3).tolist()
        if any(r != rows[0] for r in rows):
            raise ShardwiseConfigError(self._message(rows))

    def finish(self, pass_: str) -> None:
        """The check of ``pass_`` is done (every rank agreed): stop checking it."""
        self.active[pass_] = False
        if not any(self.active.values()):
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def hook_forward(self, units: list[nn.Module], root: nn.Module) -> None:
        """Check the forward order of ``units`` (index j = ``names[j]``): a forward pre-hook on
        each, registered with ``prepend=True`` so that it runs before the hooks already there
        (FSDP2's pre-forward, which all-gathers the unit), and a forward hook on ``root`` that
        checks the end of the forward and finishes the check. Removed once finished."""
        self.active["backward"] = False  # FSDP2's backward order follows its forward's
        for j, m in enumerate(units):
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, j=j: self.agree("forward", j), prepend=True))

        def end(mod, args, out):
            self.agree("forward", self.END)
            self.finish("forward")

        self._handles.append(root.register_forward_hook(end))

    def _message(self, rows: list[list[int]]) -> str:
        p0, k0, _ = rows[0]

        def wanted(row):
            p, k, i = row
            where = "" if (p, k) == (p0, k0) else f" ({_ordinal(k + 1)} of {self.PASSES[p]})"
            if i == self.END:
                return f"the end of {self.PASSES[p]} (after {k} units)"
            return f"{self.names[i]}{where}"

        by_unit: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            by_unit.setdefault(wanted(row), []).append(self.topo.global_rank(self.axis, r))
        said = ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} wanted {w}"
                         for w, rs in by_unit.items())
        return (f"{self.what}: the units run in a rank-dependent order: for the "
                f"{_ordinal(k0 + 1)} unit gathered in {self.PASSES[p0]}, {said}. Each unit's "
                f"parameter all-gather (and gradient reduction) is issued in the order the units "
                f"run, so these collectives would pair different units across the ranks (a "
                f"hang, or wrong gradients): make the module order the same on every rank (no "
                f"rank-dependent control flow over the units)")


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward runs ``hook()`` when the output's gradient is
    ready, i.e. just before autograd enters the unit's backward. Moves no data itself."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


def _wrap_outputs(out, hook):
    if isinstance(out, torch.Tensor):
        return _PreBackward.apply(hook, out) if out.requires_grad else out
    if isinstance(out, tuple):
        return tuple(_wrap_outputs(o, hook) for o in out)
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once; a
    freed storage counts 0)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _optimizer_state_tensors(optimizer):
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps a local one
    return [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# -- the engine -----------------------------------------------------------------------------------

class ZeroDataParallel(Engine):
    """ZeRO ``stage`` ∈ {1, 2, 3} over ``topo``'s "dp" axis (the module docstring has the math).

    ``module``: the plain model (seeded alike on every rank; its parameters are broadcast from dp
    index 0 anyway). ``units``: FQNs of the submodules that form units (default
    :func:`default_unit_names`); the rest is the root unit. ``prefetch``: ZeRO-3 launches the
    next unit's all_gather while the current one computes (forward and backward).
    ``reshard_after_forward``: ZeRO-3 frees a unit after its forward (True: 3Ψ traffic, least
    memory) or keeps it until its backward is done (False: 2Ψ). ``overlap``: launch each unit's
    gradient reduce_scatter from the backward hooks (True) or all after backward (False).
    ``reduce_dtype``: "fp32" | "bf16", the dtype the gradients are reduce-scattered in (cast back
    to fp32 into the slice after; see :func:`~.data.reduce_torch_dtype`).

    Inside a dp × tp layout (``topo.size("tp") > 1``, :mod:`.compose`) the module holds this tp
    rank's shards; parameters marked by :func:`.params.mark_tp_shard` are tp-sharded, the others
    replicated over tp, and :meth:`held_grads` counts each element of the whole model once.

    Raises :class:`ShardwiseConfigError` (before any collective) for dp < 2, a bad stage, a bad
    ``reduce_dtype``, or bad ``units`` (see :func:`assign_units`). Construction broadcasts each flat buffer from dp index 0
    (ledger phase ``init``). After wrapping, do not move or re-create the model's parameters
    (``.to()``, ``load_state_dict`` into them); in ZeRO-3 read full parameters only through
    :meth:`named_full_parameters` or inside :meth:`summon_full_params`.
    """

    def __init__(self, module: nn.Module, topo, stage: int, *, units: list[str] | None = None,
                 prefetch: bool = True, reshard_after_forward: bool = True, overlap: bool = True,
                 reduce_dtype: str = "fp32"):
        validate_zero(stage, topo.size("dp"))
        rdtype = reduce_torch_dtype(reduce_dtype)
        named_units = assign_units(module, units)  # all checks done before the first collective
        super().__init__(module)
        self.topo, self.stage = topo, stage
        self.n, self.rank = topo.size("dp"), topo.index("dp")
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.overlap = overlap
        self.reduce_dtype, self._rdtype = reduce_dtype, rdtype  # of the gradient reduce_scatter
        self.units = [_Unit(name, mod, named, self.n, self.rank)
                      for name, mod, named in named_units]
        self.root = self.units[0] if self.units and self.units[0].name == "root" else None
        self.blocks = [u for u in self.units if u is not self.root]  # forward order
        # gradients become complete in reverse forward order, the root (tied embedding) last
        self._reduce_order = self.blocks[::-1] + ([self.root] if self.root else [])
        self._next_reduce = 0
        self._sync = True
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.gathered_peak_bytes = 0
        self._pinned = False  # inside summon_full_params: nothing is freed
        with topo.ledger.phase("init"):
            for u in self.units:
                self._flatten(u)
        for u in self.units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        module.register_forward_pre_hook(self._model_pre_forward)
        # ZeRO-3 gathers each unit as it runs: on the first step, check the order is the same on
        # every rank before each gather (UnitOrderCheck), so a rank-dependent order is an error
        self._order = UnitOrderCheck(topo, [u.name for u in self.blocks],
                                     "ZeRO-3 (--zero 3 --engine explicit)")
        if stage == 3:
            module.register_forward_hook(self._model_post_forward)
            for u in self.blocks:
                u.module.register_forward_pre_hook(self._make_pre_forward(u))
                u.module.register_forward_hook(self._make_post_forward(u))

    # -- sizes ------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Ψ: trainable parameters (a tied weight once)."""
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Σ_u P_u: elements of all flat buffers, padding included (what the collectives move)."""
        return sum(u.padded for u in self.units)

    def unit_sizes(self) -> dict[str, tuple[int, int]]:
        """{unit name: (Ψ_u, P_u)} in elements."""
        return {u.name: (u.numel, u.padded) for u in self.units}

    # -- construction ---------------------------------------------------------------------------
    @torch.no_grad()
    def _flatten(self, u: _Unit) -> None:
        """Copy the unit's parameters into one padded flat buffer, make the parameters views of it,
        and keep this rank's slice (ZeRO-3: free the rest)."""
        full = torch.zeros(u.padded, dtype=u.dtype, device=u.device)  # [P_u], padding = 0
        for p, view in u.views(full):
            view.copy_(p.detach())
        comm.broadcast(full, self.topo, "dp", src=0, tag="init")  # replicas start identical
        for p, view in u.views(full):
            p.data = view  # same Parameter object (optimizer groups, hooks); storage = `full`
        u.full = full
        if self.stage == 3:
            u.shard = full[u.lo:u.hi].clone()  # [k]: the only persistent copy of these weights
            self._free(u)
        else:
            u.shard = full[u.lo:u.hi]  # [k] view: the optimizer updates the model in place
        if self.stage == 1:
            u.grad_full = torch.zeros(u.padded, dtype=u.dtype, device=u.device)  # [P_u]
            for p, view in u.views(u.grad_full):
                p.grad = view  # autograd accumulates into the buffer in place
            u.shard_grad = u.grad_full[u.lo:u.hi]
        else:
            u.shard_grad = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)  # [k]

    # -- ZeRO-3: gather and free ----------------------------------------------------------------
    def _free(self, u: _Unit) -> None:
        """Free the unit's gathered parameters (storage only; the tensors and autograd's saved
        views of them stay valid for the next gather)."""
        if self._pinned:
            return
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _launch_gather(self, u: _Unit, async_op: bool) -> None:
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        self.gathered_peak_bytes = max(self.gathered_peak_bytes,
                                       sum(v.gathered_bytes() for v in self.units))
        # [k] from every rank → [P_u]; rank j's slice lands at [j·k, (j+1)·k)
        u.gather = comm.all_gather(u.full, u.shard, self.topo, "dp", tag="param",
                                   async_op=async_op)

    def _unshard(self, u: _Unit | None) -> None:
        """Make the unit's full parameters available: wait for its prefetch, or gather now."""
        if u is None or u.gathered:
            return
        if u.gather is None:
            self._launch_gather(u, async_op=False)
        else:
            u.gather.wait()
        u.gather, u.gathered = None, True

    def _prefetch(self, u: _Unit | None) -> None:
        """Start ``u``'s all_gather asynchronously (if prefetching, and not gathered/in flight)."""
        if self.prefetch and u is not None and not u.gathered and u.gather is None:
            self._launch_gather(u, async_op=True)

    def _reshard(self, u: _Unit) -> None:
        if u.gather is not None:  # a prefetch nobody used: finish it before freeing its buffer
            u.gather.wait()
            u.gather, u.gathered = None, True
        if u.gathered:
            self._free(u)

    def _neighbour(self, u: _Unit | None, step: int) -> _Unit | None:
        """The block after (step=+1) or before (−1) ``u`` in forward order; from the root (or the
        model when there is no root unit), +1 is the first block and −1 the last."""
        if not self.blocks:
            return None
        if u is None or u is self.root:
            return self.blocks[0] if step > 0 else self.blocks[-1]
        j = self.blocks.index(u) + step
        return self.blocks[j] if 0 <= j < len(self.blocks) else None

    def _model_pre_forward(self, module, args):
        for u in self.units:  # a new forward (micro-step): count gradient arrivals afresh
            u.arrived.clear()
        if self.stage != 3:
            return
        self._unshard(self.root)
        self._prefetch(self._neighbour(self.root, +1))  # overlaps the embedding lookup

    def _model_post_forward(self, module, args, out):
        self._order.agree("forward", UnitOrderCheck.END)  # first forward: same unit count
        self._order.finish("forward")
        if not torch.is_grad_enabled():  # evaluation: no backward will come to free them
            for u in self.units:
                self._reshard(u)
            return out
        # root stays gathered: the output head's backward needs it next (FSDP2 does the same)
        return _wrap_outputs(out, lambda: self._pre_backward(self.root))

    def _make_pre_forward(self, u: _Unit):
        j = self.blocks.index(u)

        def hook(module, args):
            self._order.agree("forward", j)  # first forward: before any gather of this unit
            self._unshard(u)
            self._prefetch(self._neighbour(u, +1))
        return hook

    def _make_post_forward(self, u: _Unit):
        def hook(module, args, out):
            if not torch.is_grad_enabled():
                self._reshard(u)
                return out
            if self.reshard_after_forward:
                self._free(u)
            return _wrap_outputs(out, lambda: self._pre_backward(u))
        return hook

    def _pre_backward(self, u: _Unit | None) -> None:
        """Autograd is about to enter unit ``u`` (None: the model's output, no root unit)."""
        if self._order.active["backward"] and u is not None and u is not self.root:
            self._order.agree("backward", self.blocks.index(u))  # before any gather of u
        self._unshard(u)
        self._prefetch(self._neighbour(u, -1))

    # -- gradients ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        """Inside ``sync_gradients(False)`` backward only accumulates full gradients locally."""
        prev, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = prev

    def begin_forward_backward(self) -> None:
        """Call before a step's first forward (an engine composing this one runs its own
        micro-batch loop): every unit starts sharded and the gathered peak is measured afresh."""
        if self.stage == 3:  # start every step sharded, whatever ran before (e.g. an evaluation
            for u in self.units:  # forward with grad enabled leaves the root gathered)
                self._reshard(u)
        self.gathered_peak_bytes = 0

    @torch.no_grad()
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation: (loss sum, counted items) of ``batch`` under ``no_grad``, so ZeRO-3 frees
        every unit after its forward (no backward will come to free the root)."""
        return super().loss_sum_and_count(batch)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        u = self._unit_of[id(p)]
        u.arrived.add(id(p))
        if len(u.arrived) < len(u.params):
            return
        u.arrived.clear()
        if self.stage == 3:
            self._free(u)  # its backward is done: drop the gathered parameters
        if not self._sync:
            return
        u.grads_complete = True
        if self.overlap:  # launch in backward order only: every rank issues the same sequence
            while (self._next_reduce < len(self._reduce_order)
                   and self._reduce_order[self._next_reduce].grads_complete):
                self._launch_reduce(self._reduce_order[self._next_reduce])

    @torch.no_grad()
    def _launch_reduce(self, u: _Unit) -> None:
        """Sum the unit's flat gradient over dp, leaving this rank's slice [k] (reduce_scatter)."""
        rdtype = self._rdtype
        if self.stage == 1:
            for p, view in u.views(u.grad_full):  # .grad should be our view; repair if replaced
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
            flat = u.grad_full if rdtype == u.dtype else u.grad_full.to(rdtype)  # [P_u]
            out = torch.empty(u.shard_numel, dtype=rdtype, device=u.device)  # [k]; copied
        else:  # into grad_full's slice after (the input aliases it)
            flat = torch.zeros(u.padded, dtype=rdtype, device=u.device)  # [P_u], padding 0
            for p, view in u.views(flat):
                if p.grad is not None:
                    view.copy_(p.grad)  # casts to the reduce dtype
                    p.grad = None  # ZeRO-2/3: the full gradient is not kept
            out = u.shard_grad if rdtype == u.dtype else torch.empty(
                u.shard_numel, dtype=rdtype, device=u.device)  # [k]
        u.reduce = (comm.reduce_scatter(out, flat, self.topo, "dp", tag="grad", async_op=True),
                    flat, out)
        self._next_reduce += 1

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Launch the reduce_scatters not launched yet (units with an unused parameter, or
        ``overlap=False``), in backward order, wait for all, and (ZeRO-3) free every unit.
        Ends the first step's unit-order check of backward (:class:`UnitOrderCheck`)."""
        if self.stage == 3:
            self._order.agree("backward", UnitOrderCheck.END)
            self._order.finish("backward")
        for u in self._reduce_order[self._next_reduce:]:
            self._launch_reduce(u)
        for u in self._reduce_order:
            handle, _, out = u.reduce
            handle.wait()
            if out is not u.shard_grad:
                u.shard_grad.copy_(out)  # (ZeRO-1: out of the aliased buffer; bf16 → fp32)
            u.reduce, u.grads_complete = None, False
        self._next_reduce = 0
        if self.stage == 3:
            for u in self.units:
                self._reshard(u)

    def held_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """The gradient this rank holds is its slices (padding is 0): every piece of a slice,
        counted here unless it belongs to a tp-replicated parameter and this is not tp index 0
        (inside dp × tp the same replicated elements sit on every tp rank)."""
        tp0 = self.topo.index("tp") == 0
        return [(u.shard_grad[a - u.lo: b - u.lo], tp0 or tp_sharded(u.params[j]))
                for u in self.units for j, a, b in u.pieces()]

    def norm_axes(self) -> tuple[str, ...]:
        """tp shards differ over tp (dp × tp), slices over dp: the base ``clip_grad_norm_``
        (:func:`.params.grad_norm_`) all-reduces the fp64 Σ g² over tp, then over dp, so every
        rank gets the norm of the *whole* gradient and scales its slices by the same factor."""
        return ("tp", "dp")

    # -- optimizer ------------------------------------------------------------------------------
    def make_optimizer(self, param_groups: list[dict], optimizer_class=torch.optim.AdamW,
                       **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class`` (AdamW by default, with ``kwargs`` such as lr, betas, eps) over this
        rank's slices only: each group of ``param_groups`` (parameters of the plain model, e.g.
        the decay / no-decay groups) becomes a group of the pieces of this rank's slices that lie
        in its parameters. State (AdamW: exp_avg, exp_avg_sq [piece], step) exists only here.
        ``step()`` updates the slices; ZeRO-1/2 then all_gather the updated parameters.
        Raises :class:`ShardwiseConfigError` for a non-element-wise optimizer."""
        validate_zero(self.stage, self.n, optimizer=optimizer_class)
        return _sharded_class(optimizer_class)(self, param_groups, **kwargs)

    def _segment_groups(self, param_groups: list[dict]) -> list[dict]:
        """Optimizer groups over views of this rank's slices, one piece per (slice ∩ parameter);
        each piece's ``.grad`` is the matching view of the slice's summed gradient."""
        group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        pieces: list[list[torch.Tensor]] = [[] for _ in param_groups]
        for ui, u in enumerate(self.units):
            for j, a, b in u.pieces():  # parameters owned by other ranks have no piece here
                if id(u.params[j]) not in group_of:
                    continue  # not optimized (as in the plain model with these groups)
                piece = u.shard[a - u.lo: b - u.lo]
                piece.grad = u.shard_grad[a - u.lo: b - u.lo]
                piece.zero_slot = (ui, j, a, b)  # where it lives: for full_optimizer_state
                pieces[group_of[id(u.params[j])]].append(piece)
        known = {id(p) for u in self.units for p in u.params}
        missing = [i for i in group_of if i not in known]
        if missing:
            raise ShardwiseConfigError(f"{len(missing)} optimizer parameters are not trainable "
                                       "parameters of the wrapped model: build param_groups from "
                                       "engine.module")
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                for g, ps in zip(param_groups, pieces)]

    @torch.no_grad()
    def _zero_grad(self) -> None:
        for u in self.units:
            if self.stage == 1:
                u.grad_full.zero_()
                for p, view in u.views(u.grad_full):
                    p.grad = view
            else:
                for p in u.params:
                    p.grad = None

    @torch.no_grad()
    def _after_optimizer_step(self) -> None:
        """ZeRO-1/2: every rank updated only its slice; all_gather the slices into the full
        parameters (one all_gather per unit, launched together)."""
        if self.stage == 3:
            return
        handles = [comm.all_gather(u.full, u.shard.clone(), self.topo, "dp", tag="param",
                                   async_op=True) for u in self.units]
        for h in handles:
            h.wait()

    # -- tp-replicated gradients (dp × tp with sequence parallelism) ----------------------------
    def _replicated_pieces(self) -> list[tuple[_Unit, int, int]]:
        return [(u, a, b) for u in self.units for j, a, b in u.pieces()
                if not tp_sharded(u.params[j])]

    def replicated_slice_numel(self) -> int:
        """Elements of this rank's slices that belong to tp-replicated parameters (no
        tp placement; the norm weights in a TP model)."""
        return sum(b - a for _, a, b in self._replicated_pieces())

    @torch.no_grad()
    def reduce_replicated_grads(self, axis: str = "tp", tag: str = "sp_grad") -> None:
        """SUM over ``axis`` the gradient pieces of this rank's slices that belong to
        tp-replicated parameters (call after :meth:`finish_gradient_sync`). With sequence
        parallelism each tp rank saw only s/tp positions, so the norm weights' gradients are
        partial sums over tp; only the summed dp slice this rank owns needs completing: one flat
        all_reduce of :meth:`replicated_slice_numel` elements (the tp peers of a rank have the
        same unit layout, hence the same pieces). Nothing is sent when the slice holds none."""
        pieces = [u.shard_grad[a - u.lo: b - u.lo] for u, a, b in self._replicated_pieces()]
        sum_coalesced_(pieces, self.topo, axis, tag=tag)

    # -- layout-free optimizer state ------------------------------------------------------------
    @torch.no_grad()
    def dp_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN: {"step": fp32 [], "exp_avg": [param shape], "exp_avg_sq": ...}}: every state
        tensor of the optimizer's pieces written into a zero [P_u] buffer at its flat position and
        all-gathered over dp (ledger phase ``checkpoint``; one all_gather per unit and state key),
        the step counters all-reduced (MAX) over dp. Shapes are those of this module's
        parameters (inside dp × tp: the tp shard; :mod:`.compose` gathers over tp). Parameters
        without state (never stepped) are absent. Collective over dp; every dp rank must hold
        state for some piece or none does (true after any step: each slice holds optimized
        elements), since the state keys are read from this rank's own state."""
        units_state = [dict() for _ in self.units]  # per unit: {j: (piece state, a, b)}
        keys: set[str] = set()
        for group in optimizer.param_groups:
            for piece in group["params"]:
                st = optimizer.state.get(piece)
                if st:
                    ui, j, a, b = piece.zero_slot
                    units_state[ui][j] = (st, a, b)
                    keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        out = {}
        with self.topo.ledger.phase("checkpoint"):
            for u, held in zip(self.units, units_state):
                steps = torch.zeros(len(u.params), dtype=torch.float64, device=u.device)
                for j, (st, _, _) in held.items():
                    steps[j] = float(st["step"]) + 1.0  # 0 = no state on this rank
                comm.all_reduce(steps, self.topo, "dp", op="max", tag="checkpoint")
                full = {}
                for k in sorted(keys):
                    mine = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
                    for st, a, b in held.values():
                        mine[a:b] = st[k].reshape(-1)
                    full[k] = torch.empty_like(mine)
                    comm.all_gather(full[k], mine[u.lo:u.hi].clone(), self.topo, "dp",
                                    tag="checkpoint")
                for j, (fqn, p) in enumerate(zip(u.fqns, u.params)):
                    if steps[j] > 0:
                        o, k_ = u.offsets[j], u.numels[j]
                        out[fqn] = {"step": torch.tensor(float(steps[j]) - 1.0),
                                    **{k: full[k][o: o + k_].view_as(p).clone() for k in full}}
        return out

    @torch.no_grad()
    def dp_load_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """The inverse of :meth:`dp_optimizer_state` (the state may come from any layout):
        each piece of this rank's slices gets its elements of every full-shape state tensor and
        its own copy of ``step``. No collective. Raises ``KeyError`` naming the FQNs this rank's
        pieces need but ``state`` lacks."""
        todo = [(piece, self.units[piece.zero_slot[0]], *piece.zero_slot[1:])
                for group in optimizer.param_groups for piece in group["params"]]
        missing = sorted({u.fqns[j] for _, u, j, _, _ in todo if u.fqns[j] not in state})
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. {missing[:3]}")
        for piece, u, j, a, b in todo:
            o = u.offsets[j]
            new = {}
            for k, v in state[u.fqns[j]].items():
                if k == "step":
                    new[k] = torch.tensor(float(v), dtype=torch.float32)
                elif torch.is_tensor(v) and v.dim() > 0:
                    new[k] = v.reshape(-1)[a - o: b - o].to(piece.device, piece.dtype).clone()
                else:
                    new[k] = v
            optimizer.state[piece] = new

    # -- inspection -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self):
        """ZeRO-3: gather every unit for the block and keep them gathered through any forwards
        inside it (e.g. sampling many tokens, or reading the full model); free them after.
        Collective: every dp rank enters it together. No-op for ZeRO-1/2. Do not train inside."""
        if self.stage != 3 or self._pinned:
            yield
            return
        for u in self.units:
            self._unshard(u)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for u in self.units:
                self._reshard(u)

    @contextlib.contextmanager
    def full_model(self):
        """The plain model with its full weights (ZeRO-3: gathered once, for the whole block; see
        :meth:`summon_full_params`). Every dp rank enters it together."""
        with self.summon_full_params():
            yield self.module

    @torch.no_grad()
    def _gather_flats(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each unit's padded flat buffer ``[P_u]`` from every rank's slice ``shards[u]``
        ``[P_u/n]``: one all_gather over dp for all the units (ledger phase ``verify``) of
        ``[Σ P_u/n]`` into ``[n, Σ P_u/n]``, whose unit columns, rank after rank, are the flat
        buffer. Collective over dp."""
        if len({s.dtype for s in shards}) > 1:  # one gather per unit then
            return [x for s in shards for x in self._gather_flats([s])]
        mine = torch.cat(shards)
        rows = mine.new_empty(self.n * mine.numel())
        with self.topo.ledger.phase("verify"):
            comm.all_gather(rows, mine, self.topo, "dp", tag="verify")
        rows, start, out = rows.view(self.n, -1), 0, []
        for s in shards:
            out.append(rows[:, start:start + s.numel()].reshape(-1))
            start += s.numel()
        return out

    def dp_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN: full-shape parameter} (tied weight once). ZeRO-1/2: the model's own (replicated)
        parameters; ZeRO-3: all-gathered from the shards (ledger phase ``verify``). Collective
        for ZeRO-3."""
        out = {}
        flats = ([u.full for u in self.units] if self.stage < 3
                 else self._gather_flats([u.shard for u in self.units]))
        for u, flat in zip(self.units, flats):
            for fqn, (_, view) in zip(u.fqns, u.views(flat)):
                out[fqn] = view.detach().clone()
        return out

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        """{FQN: full-shape summed (and clipped) gradient}, all-gathered from every rank's slice
        (ledger phase ``verify``). Call after :meth:`finish_gradient_sync`. Collective."""
        out = {}
        for u, flat in zip(self.units, self._gather_flats([u.shard_grad for u in self.units])):
            for fqn, (_, view) in zip(u.fqns, u.views(flat)):
                out[fqn] = view.clone()
        return out

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes this rank holds, from the storages actually allocated (views of one buffer
        counted once, freed storage 0): ``params`` (ZeRO-1/2 the full flat buffers; ZeRO-3 the
        slices plus whatever is gathered right now), ``grads`` (ZeRO-1 the full gradient buffers;
        ZeRO-2/3 the slices plus any full ``.grad`` not yet reduced), ``optimizer`` (state of
        ``optimizer``), ``total``; and for ZeRO-3 ``gathered_params_peak``, the largest number of
        bytes of gathered parameters held at once during the last forward/backward."""
        params = [p for u in self.units for p in u.params] + [u.shard for u in self.units]
        grads = ([p.grad for u in self.units for p in u.params]
                 + [u.shard_grad for u in self.units])
        out = {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
               "optimizer": _storage_bytes(_optimizer_state_tensors(optimizer))}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        if self.stage == 3:
            out["gathered_params_peak"] = self.gathered_peak_bytes
        return out

    def memory_formula(self) -> dict[str, float]:
        """:func:`zero_memory_formula` for this stage, Ψ = :attr:`numel`, n = dp (fp32 AdamW)."""
        return zero_memory_formula(self.stage, self.numel, self.n,
                                   bytes_param=self.units[0].full.element_size(),
                                   bytes_grad=self.units[0].full.element_size(),
                                   bytes_optim=2 * self.units[0].full.element_size())

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{"grad", "param", "grad_norm": bytes} of :meth:`step_bytes_formula`."""
        z = self.step_bytes_formula(micro_steps)
        return {k: z[k] for k in ("grad", "param", "grad_norm")}

    def step_bytes_formula(self, micro_steps: int = 1) -> dict[str, float]:
        """:func:`zero_step_bytes_formula` with this engine's padded Ψ, the reduce dtype's bytes
        for the gradient reduce_scatter, and what ZeRO-3 gathers a second time for backward:
        every block if ``reshard_after_forward`` (not the root, which stays gathered), else
        nothing. Inside dp × tp the tp scalar of the norm (tag ``"grad_norm"`` on axis tp) is
        not included."""
        regathered = None
        if self.stage == 3:
            regathered = (sum(u.padded for u in self.blocks) if self.reshard_after_forward else 0)
        return zero_step_bytes_formula(
            self.stage, self.padded_numel, self.n, self.units[0].full.element_size(),
            micro_steps=micro_steps, regathered=regathered,
            grad_bytes_per_elem=torch.empty(0, dtype=self._rdtype).element_size())


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(base: type) -> type:
    """A subclass of optimizer ``base`` built from a ZeRO engine: its parameters are this rank's
    slice pieces, ``zero_grad`` leaves the persistent gradient buffers in place, and ``step``
    ends with the engine's parameter all_gather (ZeRO-1/2)."""
    if base not in _SHARDED_CLASSES:
        class Sharded(base):
            def __init__(self, engine: ZeroDataParallel, param_groups: list[dict], **kwargs):
                self.engine = engine
                super().__init__(engine._segment_groups(param_groups), **kwargs)

            def zero_grad(self, set_to_none: bool = True) -> None:
                self.engine._zero_grad()

            def step(self, closure=None):
                loss = super().step(closure)
                self.engine._after_optimizer_step()
                return loss

        Sharded.__name__ = Sharded.__qualname__ = f"Sharded{base.__name__}"
        Sharded.__doc__ = f"{base.__name__} over this rank's ZeRO slices (see ZeroDataParallel)."
        _SHARDED_CLASSES[base] = Sharded
    return _SHARDED_CLASSES[base]
