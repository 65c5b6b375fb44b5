"""Flat padded buffers sharded over dp: the one mechanism under ZeRO-1/2/3 and a pipeline's ZeRO-1.

A group of parameters (a ZeRO *unit*, or a whole pipeline stage) is flattened, in an order every
dp rank shares, into one buffer of Ψ_u elements zero-padded to P_u = ⌈Ψ_u/n⌉·n; rank i owns
the contiguous slice ``[i·k, (i+1)·k)``, k = P_u/n (PyTorch FSDP's FlatParameter, Zhao et al.
2023 §3.2; DeepSpeed's flat partitions; ZeRO paper §5). A slice may begin or end inside a
parameter: the element-wise optimizer does not care. The padding travels (gloo gathers equal
shards only) but never reaches a parameter, the optimizer or the norm (docs/zero.md, padding).

What moves, all over dp (ring costs, :mod:`shardwise.comm.ledger`; b bytes per element):

* gradients: one reduce_scatter (SUM) of the flat gradient, (n−1)/n·P_u·b, tag ``grad``
  (b of the reduce dtype); each rank keeps the summed gradient of its slice;
* parameters, when the buffer holds them whole (ZeRO-1/2, PP's ZeRO-1): one all_gather of the
  updated slices after the optimizer step, (n−1)/n·P_u·b, tag ``param`` (ZeRO paper §7.2.1:
  reduce_scatter + all_gather = DP's all_reduce);
* full-shape views (parity checks, checkpoints; outside a step's bytes): one all_gather of the
  slices (phase and tag ``verify``), and of each optimizer-state tensor plus a MAX all_reduce of
  the step counters (phase and tag ``checkpoint``).

"dp" above is the buffer's ``axis``: the data axis (dp, or dp × cp), or, for the expert weights
of an expert-parallel model, "edp" — the ranks of the data axis that hold the *same* experts
(:mod:`shardwise.parallel.ep`): their gradients are summed there and nowhere else, so their
buffers are sharded there (Megatron-Core's distributed optimizer shards expert parameters over
its expert-data-parallel group the same way). An axis of one rank (ep = dp·cp) shards nothing:
k = P_u, and the collectives are local copies booked at 0 bytes.

The optimizer is PyTorch's own, run over the *pieces* of this rank's slice
(:func:`sharded_optimizer`): its state exists only on the owning rank (AdamW: 8Ψ/n bytes instead
of 8Ψ, §5.1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import comm
from ...errors import ShardwiseConfigError
from ..params import attach_grad_, grad_of, tp_sharded


# -- one group's flat buffers ---------------------------------------------------------------------
class FlatShards:
    """The flat buffers of one group of parameters over ``axis`` of ``topo`` (default: its data
    axis; "edp" for expert shards, module docstring).

    ``named``: [(FQN, parameter)] in the order every dp rank shares. Sizes in elements:
    ``numel`` Ψ_u, ``padded`` P_u = ⌈Ψ_u/n⌉·n, ``shard_numel`` k = P_u/n; this rank (dp index i)
    owns flat range ``[lo, hi) = [i·k, (i+1)·k)``. Construction copies the parameters into

    ``full``  [P_u]: the parameters' ``.data`` become views of it (same ``nn.Parameter`` objects,
              so optimizer groups and hooks still hold). ZeRO-3 frees its storage between uses;
    ``shard`` [k]: this rank's slice, a view of ``full`` (ZeRO-3 replaces it by its own copy);
    ``grad_full`` [P_u] (``keep_full_grad``: ZeRO-1, PP's ZeRO-1): full local gradients, the
              parameters' ``.grad`` are views of it, so autograd accumulates into it in place;
    ``shard_grad`` [k]: the summed gradient of this rank's slice (a view of ``grad_full``, or
              its own buffer when the full gradient is not kept: ZeRO-2/3).

    ``reduce_torch``: the torch dtype the gradient reduce_scatter moves (None: the parameters').
    ``grad_torch``: the dtype of ``grad_full`` / ``shard_grad`` (None: the parameters'; fp32
    main gradients under bf16 storage, :func:`..storage.attach_grad_`).
    ``n`` and the rank index i are those of ``axis``. ``replicate_axis`` (HSDP: "dp_replicate"):
    after the reduce-scatter, the summed slice is all-reduced over it (tag ``grad_replicate``,
    in the reduce dtype), the replicas holding the same slices. ``deferred``: the parameters
    hold no values yet (:func:`..materialize.hollow`): nothing is copied, the buffers start at
    zero and the owner fills them (:meth:`.zero.ZeroSync.fill`); ZeRO-3's only: over more than
    one rank ``shard`` is its own [k] buffer at once and ``full``'s storage is freed (ZeRO-3
    regathers it before use), so building the units holds one unit's buffer at a time."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], topo, *, keep_full_grad: bool,
                 reduce_torch: torch.dtype | None = None, name: str = "",
                 module: nn.Module | None = None, axis: str | None = None,
                 replicate_axis: str | None = None, deferred: bool = False,
                 grad_torch: torch.dtype | None = None):
        self.name, self.module, self.topo = name, module, topo
        self.axis = axis or topo.data_axis
        self.replicate_axis = replicate_axis  # HSDP: shards all-reduced over "dp_replicate"
        self.n, self.rank = topo.size(self.axis), topo.index(self.axis)
        self.fqns = [f for f, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:j]) for j in range(len(self.params))]
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / self.n) * self.n
        self.shard_numel = self.padded // self.n
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.reduce_dtype = reduce_torch or self.dtype
        self.grad_dtype = grad_torch or self.dtype
        self._reduce = None  # (handle, input's bytes, output) of an in-flight reduce_scatter
        self.offload = None  # --offload params: its .offload.HostShards (shards on the host)
        with torch.no_grad():
            # pad 0; deferred ZeRO-3 (below) never reads it: left untouched, its pages are never
            # resident (a zeroed one would stay in the allocator's heap after it is freed)
            new = torch.empty if deferred and self.n > 1 else torch.zeros
            self.full = new(self.padded, dtype=self.dtype, device=self.device)
            for p, view in self.views(self.full):
                if not deferred:  # deferred: the parameters hold no values yet (fill later)
                    view.copy_(p.detach())
                p.data = view  # same Parameter object; storage = `full`
        self.shard = self.full[self.lo:self.hi]  # [k] view: the optimizer updates it in place
        if deferred and self.n > 1:  # (ZeRO-3 only) its own slice at once,
            # the unit's buffer given back before the next unit's (one unit's bytes at a time)
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            self.full.untyped_storage().resize_(0)
        self.grad_full = None
        if keep_full_grad:
            self.grad_full = torch.zeros_like(self.full, dtype=self.grad_dtype)  # [P_u]
            self.shard_grad = self.grad_full[self.lo:self.hi]
            self.arm_grads()
        else:
            self.shard_grad = torch.zeros(self.shard_numel, dtype=self.grad_dtype,
                                          device=self.device)

    def views(self, flat: torch.Tensor):
        """(param, view of ``flat`` shaped like it) for each parameter."""
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

    @torch.no_grad()
    def arm_grads(self) -> None:
        """Before a step's backward: ``.grad`` are zeroed views of ``grad_full``, or None when the
        full gradient is not kept (backward then allocates them; the reduce_scatter frees them)."""
        if self.grad_full is None:
            for p in self.params:
                p.grad = None
            return
        self.grad_full.zero_()
        for p, view in self.views(self.grad_full):
            attach_grad_(p, view)  # bf16 storage: p.main_grad (..storage)

    @torch.no_grad()
    def launch_reduce_scatter(self) -> None:
        """Start summing the flat gradient over ``axis`` (async, tag ``grad``, in
        ``reduce_dtype``);
        :meth:`wait_reduce_scatter` leaves this rank's slice in ``shard_grad``."""
        rdtype = self.reduce_dtype
        if self.grad_full is not None:
            for p, view in self.views(self.grad_full):  # .grad should be our view; repair if not
                g = grad_of(p)  # bf16 storage: the fp32 main gradient (..storage)
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                attach_grad_(p, view)
            flat = (self.grad_full if rdtype == self.grad_dtype
                    else self.grad_full.to(rdtype))  # [P_u]
            # [k]; copied into grad_full's slice after (the input aliases it)
            out = torch.empty(self.shard_numel, dtype=rdtype, device=self.device)
        else:
            flat = torch.zeros(self.padded, dtype=rdtype, device=self.device)  # [P_u], pad 0
            for p, view in self.views(flat):
                g = grad_of(p)
                if g is not None:
                    view.copy_(g)  # casts to the reduce dtype
                    p.grad = None  # the full gradient is not kept
                    if hasattr(p, "main_grad"):
                        p.main_grad = None
            out = self.shard_grad if rdtype == self.grad_dtype and not self.offload else \
                torch.empty(self.shard_numel, dtype=rdtype, device=self.device)  # [k]
        handle = comm.reduce_scatter(out, flat, self.topo, self.axis, tag="grad",
                                     async_op=True)
        # the input is not kept: the backend's work holds what it still reads (gloo: its copy)
        self._reduce = (handle, flat.nbytes, out)

    @torch.no_grad()
    def wait_reduce_scatter(self) -> None:
        handle, _, out = self._reduce
        handle.wait()
        if self.replicate_axis is not None:  # HSDP: sum this shard across the replicas
            comm.all_reduce(out, self.topo, self.replicate_axis, tag="grad_replicate")
        if self.offload:  # --offload params: down to the host shard, booked
            self.offload.land_grad(out)
        elif out is not self.shard_grad:
            self.shard_grad.copy_(out)  # out of the aliased buffer; bf16 → fp32
        self._reduce = None

    def reduce_scatter(self) -> None:
        """:meth:`launch_reduce_scatter` and wait for it."""
        self.launch_reduce_scatter()
        self.wait_reduce_scatter()

    def held_grads(self, skip=()) -> list[tuple[torch.Tensor, bool]]:
        """(gradient piece of this rank's slice, counted here) for the global norm: every piece,
        except that a tp-replicated parameter's counts on tp index 0 only (its elements sit on
        every tp rank) and parameters in ``skip`` (a pipeline's tied copy) never count."""
        tp0, skipped = self.topo.index("tp") == 0, {id(p) for p in skip}
        return [(self.shard_grad[a - self.lo: b - self.lo],
                 id(self.params[j]) not in skipped and (tp0 or tp_sharded(self.params[j])))
                for j, a, b in self.pieces()]


@torch.no_grad()
def all_gather_params(flats: list[FlatShards]) -> None:
    """After the optimizer step: every rank's updated slice into ``full`` (one all_gather per
    group over its axis, tag ``param``, launched together)."""
    handles = []
    for f in flats:
        with f.topo.ledger.note(f"{f.name} after step"):
            handles.append(comm.all_gather(f.full, f.shard.clone(), f.topo, f.axis, tag="param",
                                           async_op=True))
    for h in handles:
        h.wait()


# -- the sharded optimizer ------------------------------------------------------------------------
def segment_groups(flats: list[FlatShards], param_groups: list[dict]) -> list[dict]:
    """Optimizer groups over views of this rank's slices, one piece per (slice ∩ parameter),
    grouped as ``param_groups`` groups the parameters (the two weight-decay groups are kept).
    Each piece's ``.grad`` is the matching view of the summed slice gradient, and
    ``piece.zero_slot = (group index, j, a, b)`` records where it lives. Raises
    :class:`ShardwiseConfigError` for an optimizer parameter that no group holds."""
    group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
    pieces: list[list[torch.Tensor]] = [[] for _ in param_groups]
    for fi, f in enumerate(flats):
        for j, a, b in f.pieces():  # parameters owned by other ranks have no piece here
            if id(f.params[j]) not in group_of:
                continue  # not optimized (as in the plain model with these groups)
            piece = f.shard[a - f.lo: b - f.lo]
            attach_grad_(piece, f.shard_grad[a - f.lo: b - f.lo])  # or its main_grad
            piece.zero_slot = (fi, j, a, b)
            pieces[group_of[id(f.params[j])]].append(piece)
    known = {id(p) for f in flats for p in f.params}
    missing = [i for i in group_of if i not in known]
    if missing:
        raise ShardwiseConfigError(f"{len(missing)} optimizer parameters are not trainable "
                                   "parameters of the wrapped model: build param_groups from "
                                   "engine.module")
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
            for g, ps in zip(param_groups, pieces)]


_SHARDED_CLASSES: dict[type, type] = {}


def sharded_optimizer(flats: list[FlatShards], param_groups: list[dict],
                      optimizer_class: type = torch.optim.AdamW, *, gather_params: bool = True,
                      **kwargs) -> torch.optim.Optimizer:
    """``optimizer_class`` (with ``kwargs``: lr, betas, eps) over this rank's pieces of
    ``flats`` (:func:`segment_groups`): a subclass whose ``zero_grad`` re-arms the gradient
    buffers (:meth:`FlatShards.arm_grads`) and whose ``step`` ends with
    :func:`all_gather_params` when ``gather_params`` (the buffers hold whole parameters)."""
    if optimizer_class not in _SHARDED_CLASSES:
        class Sharded(optimizer_class):
            def __init__(self, flats, param_groups, gather_params, **kwargs):
                self.flats, self.gather_params = list(flats), gather_params
                # group index of every parameter, held here or not (the state keys of a
                # whole parameter, gather_optimizer_state)
                self.group_of = {id(p): i for i, g in enumerate(param_groups)
                                 for p in g["params"]}
                super().__init__(segment_groups(self.flats, param_groups), **kwargs)

            def zero_grad(self, set_to_none: bool = True) -> None:
                for f in self.flats:
                    f.arm_grads()

            def step(self, closure=None):
                loss = super().step(closure)
                if self.gather_params:
                    all_gather_params(self.flats)
                return loss

        name = optimizer_class.__name__
        Sharded.__name__ = Sharded.__qualname__ = f"Sharded{name}"
        Sharded.__doc__ = f"{name} over this rank's flat-buffer slices (see sharded_optimizer)."
        _SHARDED_CLASSES[optimizer_class] = Sharded
    return _SHARDED_CLASSES[optimizer_class](flats, param_groups, gather_params, **kwargs)


# -- full shapes over dp (parity checks, checkpoints) ---------------------------------------------
@torch.no_grad()
def gather_flats(shards: list[torch.Tensor], topo, axis: str | None = None) -> list[torch.Tensor]:
    """Each group's padded flat buffer ``[P_u]`` from every rank's slice ``shards[u]``
    ``[P_u/n]``: one all_gather over ``axis`` (default the data axis; n its size) for all of
    them (phase and tag ``verify``) of ``[Σ P_u/n]`` into ``[n, Σ P_u/n]``, whose group columns,
    rank after rank, are the flat buffer (one gather per group when the dtypes differ).
    Collective over ``axis``."""
    axis = axis or topo.data_axis
    if len({s.dtype for s in shards}) > 1:
        return [x for s in shards for x in gather_flats([s], topo, axis)]
    mine = torch.cat(shards).to(topo.device)  # (--offload params: host slices)
    n = topo.size(axis)
    rows = mine.new_empty(n * mine.numel())
    with topo.ledger.phase("verify"):
        comm.all_gather(rows, mine, topo, axis, tag="verify")
    rows, start, out = rows.view(n, -1), 0, []
    for s in shards:
        out.append(rows[:, start:start + s.numel()].reshape(-1))
        start += s.numel()
    return out


def gather_named(flats: list[FlatShards], shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{FQN: tensor in its parameter's shape} from each group's slice ``shards[u]`` (e.g. the
    summed gradients), gathered over each group's axis by :func:`gather_flats` (one gather per
    axis, the axes in the order the groups first name them). Collective over those axes."""
    full: dict[int, torch.Tensor] = {}
    for axis in dict.fromkeys(f.axis for f in flats):
        idx = [i for i, f in enumerate(flats) if f.axis == axis]
        for i, flat in zip(idx, gather_flats([shards[i] for i in idx], flats[0].topo, axis)):
            full[i] = flat
    out = {}
    for i, f in enumerate(flats):
        for fqn, (_, view) in zip(f.fqns, f.views(full[i])):
            out[fqn] = view.clone()
    return out


@torch.no_grad()
def gather_optimizer_state(flats: list[FlatShards], optimizer) -> dict[str, dict]:
    """{FQN: {"step": fp32 [], "exp_avg": [param shape], ...}} from a :func:`sharded_optimizer`:
    every state tensor of the pieces written into a zero [P_u] buffer at its flat position and
    all-gathered over the group's axis (one all_gather per group and key), the step counters
    all-reduced (MAX) over it (phase and tag ``checkpoint``). Parameters without state (never
    stepped) are absent. Collective over the groups' axes; every rank must hold state for some
    piece or none does (true after any step), since the state keys are read from this rank's
    own state."""
    held = [dict() for _ in flats]  # per group: {j: (piece state, a, b)}
    keys: set[str] = set()
    for group in optimizer.param_groups:
        for piece in group["params"]:
            st = optimizer.state.get(piece)
            if st:
                fi, j, a, b = piece.zero_slot
                held[fi][j] = (st, a, b)
                keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
    # an optimizer whose groups keep different state (Muon: momentum_buffer; AdamW: exp_avg,
    # exp_avg_sq) names each group's keys: every rank then gathers the same keys of a unit,
    # whichever pieces it holds, and each parameter gets only its own group's
    keys_of = getattr(optimizer, "state_keys", None)
    out = {}
    with flats[0].topo.ledger.phase("checkpoint"):
        for f, mine_ in zip(flats, held):
            own = None
            if keys_of is not None:
                own = [keys_of(optimizer.param_groups[optimizer.group_of[id(p)]])
                       if id(p) in optimizer.group_of else () for p in f.params]
                keys = set().union(*own)
            steps = torch.zeros(len(f.params), dtype=torch.float64, device=f.device)
            for j, (st, _, _) in mine_.items():
                steps[j] = float(st["step"]) + 1.0  # 0 = no state on this rank
            comm.all_reduce(steps, f.topo, f.axis, op="max", tag="checkpoint")
            full = {}
            for k in sorted(keys):  # (a master optimizer's state: its own dtype, ..master)
                mine = torch.zeros(f.padded, dtype=getattr(optimizer, "state_dtype", None)
                                   or f.dtype, device=f.device)
                for st, a, b in mine_.values():
                    if k in st:  # (a piece of another group's kind keeps other keys)
                        mine[a:b] = st[k].reshape(-1)
                full[k] = torch.empty_like(mine)
                comm.all_gather(full[k], mine[f.lo:f.hi].clone(), f.topo, f.axis,
                                tag="checkpoint")
            for j, (fqn, p) in enumerate(zip(f.fqns, f.params)):
                if steps[j] > 0:
                    o, n = f.offsets[j], f.numels[j]
                    out[fqn] = {"step": torch.tensor(float(steps[j]) - 1.0),
                                **{k: full[k][o: o + n].view_as(p).clone() for k in full
                                   if own is None or k in own[j]}}
    return out


@torch.no_grad()
def load_optimizer_state(flats: list[FlatShards], optimizer, state: dict[str, dict]) -> None:
    """The inverse of :func:`gather_optimizer_state` (``state`` may come from any layout): each
    piece gets its elements of every full-shape state tensor and its own copy of ``step``. No
    collective. Raises ``KeyError`` naming the FQNs this rank's pieces need but ``state`` lacks."""
    todo = [(piece, flats[piece.zero_slot[0]], *piece.zero_slot[1:])
            for group in optimizer.param_groups for piece in group["params"]]
    missing = sorted({f.fqns[j] for _, f, j, _, _ in todo if f.fqns[j] not in state})
    if missing:
        raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. {missing[:3]}")
    dtype, device = (getattr(optimizer, "state_dtype", None),
                     getattr(optimizer, "state_device", None))  # (..master: fp32, the host)
    for piece, f, j, a, b in todo:
        o, new = f.offsets[j], {}
        for k, v in state[f.fqns[j]].items():
            if k == "step":
                new[k] = torch.tensor(float(v), dtype=torch.float32)
            elif torch.is_tensor(v) and v.dim() > 0:
                new[k] = v.reshape(-1)[a - o: b - o].to(device or piece.device,
                                                          dtype or piece.dtype).clone()
            else:
                new[k] = v
        optimizer.state[piece] = new

