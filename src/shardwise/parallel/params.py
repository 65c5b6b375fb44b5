"""Where each parameter's elements live, and the cross-cutting rules that read it — written once.

A transform that shards a parameter records how on the parameter itself (:class:`Placement`, set
by :func:`mark_tp_shard`; the PyTorch engines' DTensors carry their own placements). The rules
that every layout needs then read that record instead of being rewritten per engine:

* :func:`grad_norm_` — the global gradient norm and clipping: each logical element counted on
  exactly one rank (:func:`counted_grads`), then one fp64 all-reduce of Σ g² per axis that splits
  something (tag ``grad_norm``; the engine names the axes).
* :func:`sum_coalesced_` — one flat all-reduce of a list of tensors, in place: the SP sum of the
  norm weights' partial gradients over tp (whole, or the pieces of a ZeRO slice).
* the full-shape views that read the same record live in :mod:`.views` (``to_full`` /
  ``to_local``).
* :func:`local` / :func:`is_dtensor` / :func:`tp_sharded` — what this rank holds of a tensor.
* :func:`reduce_torch_dtype` / :func:`reduce_bytes` — the reduce dtype table, re-exported from
  :mod:`shardwise.precision`, where it is written once.
* :func:`grad_of` / :func:`set_grad_` / :func:`attach_grad_` — a parameter's gradient as the
  syncs, the norm and the optimizer read and write it (bf16 storage: its fp32 main gradient).
* :func:`local_state_bytes` / :func:`storage_state_bytes` — the bytes of what this rank holds
  (by tensor; by distinct storage: the flat buffers' views once).

Sources: Megatron-LM's ``tensor_model_parallel`` attribute and nanotron's ``NanotronParameter``
(metadata on the parameter); torchtitan's one ``clip_grad_norm_`` for every layout (it reads
DTensor placements); the ZeRO paper §5 (slices).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import comm
from ..comm.ledger import ring_bytes
from ..errors import ShardwiseConfigError
# the dtype gradients are reduced in: the one table and its rule (re-exported here)
from ..precision import REDUCE_DTYPES, reduce_bytes, reduce_torch_dtype  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a parameter is split over tp and ep, and where its gradient is summed. ``tp_dim``:
    this rank holds a contiguous 1/tp chunk of the full tensor along this dim (None: replicated
    over tp); ``tp_full``: the full tensor's size along ``tp_dim`` without padding (the
    vocabulary is padded to a multiple of tp). ``ep_full``: an expert weight stacked on dim 0 of
    which this rank holds a contiguous 1/ep (``ep_full`` experts in all; None: not split over
    ep). ``grad_axis``: the mesh axis its gradient is summed over (None: the topology's data
    axis; expert shards: "edp", the ranks holding the same experts); ``replicate_axis``: an axis
    over which a sharded gradient is then all-reduced (HSDP: "dp_replicate"; None: none).
    ``duplicate``: a second copy of a parameter held elsewhere too (a pipeline's tied output on
    the last stage): reduced like the others, never counted in the norm."""

    tp_dim: int | None = None
    tp_full: int | None = None
    ep_full: int | None = None
    grad_axis: str | None = None
    replicate_axis: str | None = None
    duplicate: bool = False


REPLICATED = Placement()


def mark_tp_shard(p: nn.Parameter, dim: int, full_size: int) -> nn.Parameter:
    """Record on ``p`` that it is a tp shard along ``dim`` of a tensor whose unpadded size
    there is ``full_size``; returns ``p``."""
    p.placement = Placement(tp_dim=dim, tp_full=full_size)
    return p


def mark_ep_shard(p: nn.Parameter, n_experts: int, grad_axis: str = "edp") -> nn.Parameter:
    """Record on ``p`` that it holds this ep rank's contiguous 1/ep of ``n_experts`` stacked
    experts (dim 0), its gradient summed over ``grad_axis`` (the expert-data-parallel ranks,
    which hold the same experts); returns ``p``."""
    p.placement = dataclasses.replace(placement(p), ep_full=n_experts, grad_axis=grad_axis)
    return p


def mark_duplicate(p: nn.Parameter) -> nn.Parameter:
    """Record on ``p`` that it is a copy of a parameter another rank counts (the last pipeline
    stage's tied output; :func:`counted_grads` skips it); returns ``p``."""
    p.placement = dataclasses.replace(placement(p), duplicate=True)
    return p


def ep_sharded(p) -> bool:
    """Whether ``p`` is an expert weight split over ep (its elements differ between ep ranks,
    and its gradient is summed over the expert-data-parallel group "edp", not the data axis)."""
    return placement(p).ep_full is not None


def placement(p) -> Placement:
    """The :class:`Placement` a transform recorded on ``p`` (:data:`REPLICATED` if none)."""
    return getattr(p, "placement", REPLICATED)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (the PyTorch engines' params)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t):
    """This rank's part of ``t``: a DTensor's local tensor (the tensor itself, not an autograd
    view of it: a local shard handed to an optimizer must be a leaf), or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def tp_sharded(t) -> bool:
    """Whether the elements ``t`` holds differ between tp ranks: a DTensor with a Shard
    placement on the "tp" mesh dim, or a parameter marked by :func:`mark_tp_shard`. For a
    DTensor gradient ask the gradient itself (DTensor may leave it Replicate while its
    parameter is Shard)."""
    if is_dtensor(t):
        names = t.device_mesh.mesh_dim_names or ()
        return "tp" in names and t.placements[names.index("tp")].is_shard()
    return placement(t).tp_dim is not None


# -- where gradients are reduced: groups read from the placements --------------------------------
@dataclasses.dataclass
class ReduceGroup:
    """Parameters whose gradients are summed over the same mesh ``axis`` (and then, sharded,
    all-reduced over ``replicate_axis``, HSDP); ``items``: the parameters (or (name, parameter)
    pairs) as given to :func:`reduce_groups`, in their order. ``replicas``: the axis over which
    the parameters are the same on every rank (the data axis, or "edp" for expert shards: for
    a sharding sync under HSDP it spans ``axis`` × ``replicate_axis``), where they start
    identical."""

    axis: str
    replicate_axis: str | None
    items: list
    replicas: str | None = None


def reduce_groups(items, topo, *, shard: bool = False) -> list[ReduceGroup]:
    """``items`` (parameters, or (name, parameter) pairs) grouped by where their gradient is
    reduced, read from each parameter's :class:`Placement`: ``grad_axis`` if a transform set
    one (experts: "edp"), else the data axis — for a sharding sync (``shard``: ZeRO) the
    topology's shard axis with HSDP's "dp_replicate" as ``replicate_axis``. The data-axis group
    first, then the others in order of first appearance; empty groups are left out. No
    collective (nanotron's ``ShardedInfo``, Megatron's ``allreduce`` attribute)."""
    default = topo.shard_axis if shard else topo.data_axis
    rep = "dp_replicate" if shard and getattr(topo, "dp_replicate", 1) > 1 else None
    groups: dict[tuple, ReduceGroup] = {}
    for it in items:
        pl = placement(it[1] if isinstance(it, tuple) else it)
        key = (pl.grad_axis or default, pl.replicate_axis or (None if pl.grad_axis else rep))
        groups.setdefault(key, ReduceGroup(*key, [], pl.grad_axis or topo.data_axis)
                          ).items.append(it)
    return sorted(groups.values(), key=lambda g: g.axis != default)


@torch.no_grad()
def broadcast_replicas(params, topo, tag: str = "init") -> None:
    """Make the replicas of ``params`` identical: per :func:`reduce_groups` group, one coalesced
    broadcast from index 0 of its axis (expert shards over "edp": each ep rank holds other
    experts). DTensor parameters (the torch pipeline's TP stages): their local shards."""
    for g in reduce_groups(list(params), topo):
        comm.broadcast_coalesced([local(p.data) for p in g.items], topo, g.axis, tag=tag)


# -- the global gradient norm ---------------------------------------------------------------------
NORM_AXES_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "dp_cp", "edp", "ep", "pp")


@dataclasses.dataclass
class Held:
    """The gradient pieces this rank holds for the norm: ``pieces`` (tensor, counted here)
    pairs (:func:`counted_grads`, or a sharding sync's slices), and ``sliced``: the axes over
    which each piece is a slice of its gradient (ZeRO / FSDP2: the shard axis; expert slices:
    "edp"; none for whole gradients)."""

    pieces: list
    sliced: tuple[str, ...] = ()

    def norm_axes(self, topo) -> tuple[str, ...]:
        """The mesh axes over which the counted elements differ between ranks, *derived* (no
        engine declares them), in :data:`NORM_AXES_ORDER`: tp (tp shards differ; a replicated
        gradient counts on tp index 0 only), every ``sliced`` axis, ep (expert shards differ;
        dense gradients count on ep index 0 only) unless the data axis is sliced (its ranks are
        ep × edp: the expert slices are each summed once there, as is "edp"), pp (stages hold
        different parameters). Axes of size 1 cost nothing (:func:`grad_norm_` skips them)."""
        if topo is None:
            return ()
        axes = {"tp"} | set(self.sliced)
        if topo.size("ep") > 1:
            axes.add("ep")
        if topo.data_axis in axes:  # the data axis spans ep × edp
            axes -= {"ep", "edp"}
        if topo.size("pp") > 1:
            axes.add("pp")
        return tuple(a for a in NORM_AXES_ORDER if a in axes)


def norm_bytes(axes, topo) -> float:
    """Bytes one rank sends for the norm: one fp64 [1] ring all-reduce per axis of size > 1."""
    return sum(ring_bytes("all_reduce", 8, topo.size(a)) for a in axes if topo.size(a) > 1)


# -- fp32 main gradients of bf16 parameters (Megatron's main_grad, armed by .storage) -----------
@torch.no_grad()
def fold_grad_(p) -> None:
    """``p.main_grad += p.grad`` in fp32 (None: created from it), then ``p.grad = None``: one
    micro-batch's bf16 gradient into the fp32 accumulator (no-op without either)."""
    g = p.grad
    if g is None or not hasattr(p, "main_grad"):
        return
    p.main_grad = g.to(torch.float32) if p.main_grad is None else p.main_grad.add_(g)
    p.grad = None


def grad_of(p):
    """The gradient syncs, norm and optimizer read: the main gradient (folded first), or .grad."""
    if hasattr(p, "main_grad"):
        fold_grad_(p)
        return p.main_grad
    return p.grad


def set_grad_(p, value: torch.Tensor) -> None:
    """Write a reduced gradient back (cast) into ``p``'s :func:`grad_of`, allocated if None."""
    if grads_or_zeros([p]) and hasattr(p, "main_grad"):
        p.main_grad.copy_(value.view_as(p.main_grad))
    else:
        local(p.grad).copy_(value)


def attach_grad_(p, view: torch.Tensor) -> None:
    """``view`` (of a flat buffer) as ``p``'s ``main_grad`` when ``p`` has one or its dtype is
    not ``p``'s (a bf16 ZeRO piece), else as ``.grad`` (autograd accumulates into it)."""
    if hasattr(p, "main_grad") or view.dtype != p.dtype:
        p.grad, p.main_grad = None, view
    else:
        p.grad = view


def counted_grads(params, topo, *, skip=()) -> list[tuple[torch.Tensor, bool]]:
    """(this rank's gradient tensor, whether this rank counts it in the norm) for every
    parameter of ``params`` with a gradient, each parameter once. A tp shard counts on every tp
    rank, a tp-replicated gradient on tp index 0 only; with expert parallelism an expert shard
    counts on every ep rank, any other gradient on ep index 0 only (sum the norm over "ep");
    parameters in ``skip`` or marked :func:`mark_duplicate` (a pipeline's tied copy, counted on
    the first stage) never count.
    DTensor gradients are judged by their own placement and given as their local tensor."""
    tp0 = topo is None or topo.index("tp") == 0
    ep0 = topo is None or topo.size("ep") == 1 or topo.index("ep") == 0
    skipped = {id(p) for p in skip}
    out = []
    for p in dict.fromkeys(params):
        g = grad_of(p)  # bf16 storage: the fp32 main gradient (.storage)
        if g is None:
            continue
        sharded = tp_sharded(g) if is_dtensor(g) else tp_sharded(p)
        out.append((local(g), id(p) not in skipped and not placement(p).duplicate
                    and (sharded or tp0)
                     and (ep0 or ep_sharded(p))))
    return out


def held_of(params, topo, *, skip=()) -> Held:
    """:class:`Held` of whole (or DTensor-sharded) gradients: :func:`counted_grads`, and as
    ``sliced`` every mesh axis but tp on which a DTensor gradient is sharded (FSDP2's dp shards;
    ``_StridedShard`` is a shard too: any placement neither Replicate nor Partial)."""
    params = list(dict.fromkeys(params))
    sliced = []
    for p in params:
        g = grad_of(p)
        if g is not None and is_dtensor(g):
            for name, pl in zip(g.device_mesh.mesh_dim_names or (), g.placements):
                if name != "tp" and not (pl.is_replicate() or pl.is_partial()):
                    sliced.append(name)
    return Held(counted_grads(params, topo, skip=skip), tuple(dict.fromkeys(sliced)))


@torch.no_grad()
def grad_norm_(held: Held | list[tuple[torch.Tensor, bool]], topo, axes, max_norm: float
               ) -> torch.Tensor:
    """The global L2 norm of the gradient whose pieces this rank holds, clipping in place.

    ``held``: a :class:`Held` or its (tensor, counted) pairs (:func:`counted_grads`, or an
    engine's own slices); every held tensor is scaled, only the counted ones are summed.
    ``axes``: the mesh axes over which the counted elements differ (None: derived,
    :meth:`Held.norm_axes`; e.g. ``("tp", "dp")`` for ZeRO slices of tp shards); one fp64
    [1] all-reduce per axis of size > 1, tag ``grad_norm``, in that order. Because each element
    is counted on exactly one rank of those axes, the sum is the whole model's Σ g².

    Clipping is ``torch.nn.utils.clip_grad_norm_``'s rule: scale by min(1, max_norm / (norm +
    1e-6)) when ``max_norm`` > 0. Returns the norm before clipping, fp32 []."""
    if isinstance(held, Held):
        axes = held.norm_axes(topo) if axes is None else axes
        held = held.pieces
    tensors = [t for t, _ in held]
    # on the topology's device: --offload params (FSDP2's or ZeRO-3's) keeps gradients on the host
    device = topo.device if topo is not None else (tensors[0].device if tensors else "cpu")
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for t, counted in held:
        if counted:
            sq += t.detach().double().pow(2).sum().to(device)
    for axis in axes:
        if topo.size(axis) > 1:
            comm.all_reduce(sq, topo, axis, tag="grad_norm")
    norm = sq.sqrt().float().squeeze(0)
    if max_norm and max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for t in tensors:
            t.mul_(coef.to(t.device, t.dtype))
    return norm


# -- one flat all-reduce --------------------------------------------------------------------------
@torch.no_grad()
def sum_coalesced_(tensors: list[torch.Tensor], topo, axis: str, *, tag: str,
                   dtype: torch.dtype | None = None) -> None:
    """SUM ``tensors`` over ``axis`` in place with one all-reduce of their concatenation
    ([Σ numel], sent in ``dtype`` if given: bf16 gradient reduction). Every rank of the axis
    passes tensors of the same shapes in the same order. Nothing is sent for an empty list."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if dtype is not None and dtype != flat.dtype:
        flat = flat.to(dtype)
    comm.all_reduce(flat, topo, axis, tag=tag)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def grads_or_zeros(params) -> list[torch.Tensor]:
    """Each parameter's ``.grad``, created as zeros where backward left none (a parameter this
    rank's micro-batches did not reach still takes part in the collective)."""
    for p in params:  # bf16 storage: the fp32 main gradient (grad_of)
        if grad_of(p) is None and hasattr(p, "main_grad"):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif grad_of(p) is None:
            p.grad = torch.zeros_like(p)
    return [local(grad_of(p)) for p in params]


def local_state_bytes(params, optimizer=None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} bytes of what this rank holds of ``params``
    (each once: a tied weight once), their gradients and ``optimizer``'s state (scalar step
    counters included), by the storage actually allocated: DTensors by their local shards (a
    DTensor's ``numel()`` is the global size)."""
    def nbytes(t) -> int:
        return local(t).numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = list(dict.fromkeys(params))
    out = {"params": sum(nbytes(p) for p in params),
           "grads": sum(nbytes(grad_of(p)) for p in params if grad_of(p) is not None),
           "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(nbytes(v) for v in state.values())
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# -- storage bytes: views of one flat buffer counted once -----------------------------------------
def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once; a
    freed storage counts 0; a DTensor by its local tensor; non-tensors skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = local(t).untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def storage_state_bytes(params, grads, optimizer=None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: :func:`storage_bytes` of ``params``, ``grads``
    and every tensor of ``optimizer``'s state (ZeroRedundancyOptimizer: its local optimizer's)."""
    inner = getattr(optimizer, "optim", optimizer)
    state = [] if optimizer is None else [v for st in inner.state.values() for v in st.values()]
    out = {"params": storage_bytes(params), "grads": storage_bytes(grads),
           "optimizer": storage_bytes(state)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def shard_of(full: torch.Tensor, dim: int, topo, padded: int | None = None) -> torch.Tensor:
    """This tp rank's contiguous chunk of a full tensor along ``dim`` (zero-padded to
    ``padded`` first), a copy: how TP cuts a plain weight into the shard it keeps. No
    collective."""
    n, i = topo.size("tp"), topo.index("tp")
    full = full.detach()
    if padded is not None and padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    k = full.shape[dim] // n
    return full.narrow(dim, i * k, k).clone()
