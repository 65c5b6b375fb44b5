"""ZeRO units: which parameters are sharded, gathered and reduced together, and the first step's
check that every dp rank runs them in the same order.

A unit is a submodule whose parameters form one flat buffer (:mod:`.flat`): by default every Llama
``TransformerBlock`` / ``MLPBlock``, plus one *root* unit of the remaining parameters (embeddings,
final norm, output head). A tied weight is one parameter and must live in exactly one unit (the
root, by default). PyTorch FSDP2 wraps the same units (:mod:`.torch_zero`).

What moves, first step only: one all_gather over dp (or the world) of an int64 [3] row per unit
and pass checked, plus one at the end of the pass, (n−1)/n · 24n bytes each
(:class:`UnitOrderCheck`; phase ``"order_check"``, tag ``"unit_order"``, outside a step's bytes).
Why: docs/zero.md, limitations.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import comm
from ...errors import ShardwiseConfigError


# -- units ----------------------------------------------------------------------------------------
def default_unit_names(model: nn.Module) -> list[str]:
    """FQNs of the default ZeRO units of ``model``: every Llama ``TransformerBlock`` and every
    ``MLPBlock`` (the remaining parameters form the root unit)."""
    from ...models.llama import TransformerBlock
    from ...models.mlp import MLPBlock

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


def _ordinal(k: int) -> str:
    """1 → "1st", 2 → "2nd", 11 → "11th"."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


class UnitOrderCheck:
    """The first step's check that every rank runs the ZeRO-3 / FSDP2 units in the same order.

    A unit's parameters are all-gathered when it runs (or is prefetched), so the all-gathers of
    two ranks pair up only if both run the units in the same order (docs/zero.md, limitations).
    :meth:`agree` runs before a unit's forward (and, in the explicit engine, its backward) does
    anything else: one all_gather over ``axis`` of an int64 [3] row (pass, position k in the
    pass, unit index; −1 = the end of the pass, which catches a rank that runs more or fewer
    units). Every rank compares the rows and on any difference raises the same
    :class:`ShardwiseConfigError`, naming what each rank wanted, before a mismatched gather.
    After :meth:`finish` of a pass the check costs nothing. The explicit engine checks forward
    and backward; FSDP2 (:meth:`hook_forward`) the forward, whose order its backward follows.

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
        with self.topo.ledger.phase("order_check"):  # not in a step's bytes
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
