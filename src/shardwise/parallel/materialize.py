"""A model built on the meta device becomes this rank's shards, filled from full tensors.

:func:`~.apply.parallelize` accepts a model built on ``meta`` (:mod:`shardwise.models.meta`)
with ``weights``: an iterator of (parameter name, full-shape tensor), one at a time (the
replayed init; a checkpoint's or an HF folder's as :class:`~shardwise.lazy.LazyTensor`, of
which only this rank's part is read, :func:`~.views.to_local`). The transforms that only cut (TP, EP, CP) run on
the meta model; then either

* :func:`materialize_local` gives the parameters this rank holds their storage and fills each
  from its full tensor (:func:`~.views.to_local`: the tp/ep shard; layouts that keep whole
  parameters per rank: DP, ZeRO-1/2, TP alone), or
* :func:`hollow` gives them real tensors whose storage is already freed, the ZeRO-3 sync
  builds its flat buffers over them one unit at a time without copying values, and
  :meth:`~.zero.ZeroSync.fill` writes each rank's flat slice from the stream; or
* (torch engine) DTensor TP and FSDP2 convert the meta model and :func:`fill_dtensors`
  allocates their shards and writes each local slice.

Each tensor is dropped after use, so the peak of a rank is what it keeps plus one full
tensor, or of a lazy one only its part (docs/checkpointing.md, start-up memory).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .views import to_local


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device (any parameter is meta)."""
    return any(p.is_meta for p in module.parameters())


def _swap_params(module: nn.Module, make) -> None:
    """Replace every meta parameter of ``module`` by ``make(p)`` (a new ``nn.Parameter``) in
    every module that holds it (tied parameters stay one object), with its attributes (a
    transform's ``placement``) and ``requires_grad``; meta buffers by empty ones on the
    device ``make`` allocates on (their values: the model's ``init_buffers``)."""
    new: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                q = nn.Parameter(make(p), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                new[id(p)] = q
            m._parameters[name] = new[id(p)]
        for key, value in list(vars(m).items()):  # a plain attribute holding a parameter
            if isinstance(value, nn.Parameter) and id(value) in new:
                m.__dict__[key] = new[id(value)]  # stays a plain attribute (setattr registers)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=make.device)


class _Alloc:
    def __init__(self, device, hollow: bool):
        self.device, self.hollow = torch.device(device), hollow

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        t = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        if self.hollow:  # shape and strides kept, the storage given back at once
            t.untyped_storage().resize_(0)
        return t


class _EmptyLike:
    def __init__(self, device):
        self.device = torch.device(device)

    def __call__(self, p: torch.Tensor) -> torch.Tensor:  # a DTensor stays one, same spec
        return torch.empty_like(p, device=self.device)


def _init_buffers(module: nn.Module) -> None:
    for m in module.modules():
        if callable(getattr(m, "init_buffers", None)):
            m.init_buffers()
            return


@torch.no_grad()
def materialize_local(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                      topo, fqn=None) -> None:
    """Give each parameter of ``module`` (this rank's: tp/ep shards after those transforms) its
    storage on ``topo.device`` and the values of its part of the full tensors in ``weights``
    ((name, full tensor), names as the unsharded model's; names this rank does not hold are
    skipped; ``fqn``: the unsharded model's name of a parameter name of ``module``, a pipeline
    stage's :meth:`~.pp.split.StageModule.fqn`). Raises ``ValueError`` for a held parameter the
    stream never gave, or a full tensor of the wrong shape (:func:`~.views.to_local`)."""
    _swap_params(module, _Alloc(topo.device, hollow=False))
    _copy_in({(fqn or str)(n): p for n, p in module.named_parameters()}, weights, topo)
    _init_buffers(module)


def _copy_in(params: dict, weights: Iterable[tuple[str, torch.Tensor]], topo) -> None:
    """Each parameter of ``params`` (name → allocated parameter) := its part of its full
    tensor in ``weights`` (a DTensor: its local slice; names not in ``params`` are skipped).
    Raises ``ValueError`` for a parameter the stream never gave."""
    seen = set()
    for name, full in weights:
        p = params.get(name)
        if p is None:
            continue
        if hasattr(p, "to_local"):  # a DTensor: its local slice
            p.to_local().copy_(to_local(full, p, topo).to_local())
        else:  # a plain tensor: its tp/ep shard, copied straight from a view of the full one
            p.copy_(to_local(full, p, topo, copy=False))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"no weights for {', '.join(missing[:5])}"
                         f"{' …' if len(missing) > 5 else ''}")


def hollow(module: nn.Module, topo) -> None:
    """Give each meta parameter of ``module`` a real tensor of its shape on ``topo.device``
    whose storage is freed at once (one tensor allocated at a time): the ZeRO-3 sync's flat
    buffers take them over without reading them (``deferred``), and :meth:`fill` writes the
    values. Its buffers are computed on the device."""
    _swap_params(module, _Alloc(topo.device, hollow=True))
    _init_buffers(module)


@torch.no_grad()
def fill_dtensors(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], topo,
                  fqn=None) -> None:
    """A module DTensor TP and/or FSDP2 converted on the meta device: storage on
    ``topo.device`` for each DTensor's local shard only (FSDP2: its ``to_empty``; TP alone: new
    DTensors of the same placements, ties kept), then each local shard from its full tensor
    (``distribute_tensor(..., src_data_rank=None)``: local slicing, no collective; a plain
    parameter beside them as :func:`materialize_local`; ``fqn`` as there: a pipeline stage's
    names). Raises ``ValueError`` for a parameter the stream never gave."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        module.to_empty(device=topo.device)  # FSDP2 keeps its parameters (and ties) itself
    else:  # DTensor TP alone: new DTensors of the same placements, ties kept
        _swap_params(module, _EmptyLike(topo.device))
    _copy_in({(fqn or str)(n): p for n, p in module.named_parameters()}, weights, topo)
    _init_buffers(module)


def fill_module(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], topo,
                fqn=None) -> None:
    """This rank's part of each parameter of ``module`` from ``weights``: :func:`fill_dtensors`
    where DTensor TP or FSDP2 converted it (DTensor parameters), else :func:`materialize_local`
    (plain parameters, our tp/ep shards). The plain copy of :meth:`.sync.Sync.fill`."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        fill_dtensors(module, weights, topo, fqn=fqn)
    else:
        materialize_local(module, weights, topo, fqn=fqn)


class Values:
    """Where the parameters' values come from, decided once by :func:`~.apply.parallelize`:
    the model's own (built on a device), or ``weights`` streamed into this rank's shards (built
    on the meta device, :mod:`shardwise.models.meta`). Each method is one step of the meta
    init and does nothing for a model holding its own values (or once the values are in).
    ``whole``: the engine's parts read whole parameters (DDP, ZeroRedundancyOptimizer, torch's
    context parallelism): the whole model gets its values at once, and is then as a model
    built with them. Raises ``ValueError`` for a meta model without ``weights``."""

    def __init__(self, model: nn.Module, weights, topo, *, whole: bool = False):
        self.streamed = is_meta(model)
        if self.streamed and weights is None:
            raise ValueError("a model built on the meta device needs weights= "
                             "(name, full tensor)")
        self.weights, self.topo = (weights if self.streamed else None), topo
        self.pending = self.streamed  # values not yet written
        if whole:
            self.whole(model)

    def whole(self, model: nn.Module) -> None:
        """The whole model's values now (an engine part that reads whole parameters: DDP,
        ZeroRedundancyOptimizer); afterwards it is as a model built with its values."""
        if self.pending:
            materialize_local(model, self.weights, self.topo)
            self.streamed = self.pending = False

    def local(self, module: nn.Module, fqn=None, after=None) -> None:
        """This rank's part of ``module`` now (:func:`fill_module`), before a gradient sync that
        reads the values as it is built (DP, ZeRO-1/2, a pipeline's syncs); ``after()`` then
        (a stage's tied draw, :meth:`~.pp.split.StageModule.replay_tied_draw`)."""
        if self.pending:
            fill_module(module, self.weights, self.topo, fqn=fqn)
            self.pending = False
            if after is not None:
                after()

    def hollow(self, module: nn.Module) -> bool:
        """Storage-less parameters for a sync that builds its flat buffers without reading them
        (ZeRO-3, :func:`hollow`); returns whether its ``fill`` is still to come (``deferred``)."""
        if self.pending:
            hollow(module, self.topo)
        return self.pending

    def fill(self, sync) -> None:
        """The sync's ``fill`` from the weights (:meth:`.sync.Sync.fill`), if they are not in."""
        if self.pending:
            sync.fill(self.weights)
            self.pending = False

    def start_equal(self, make_equal, *args) -> None:
        """``make_equal(*args)`` (a broadcast that makes replicas start equal) for a model holding
        its own values; streamed ones are the same on every rank already."""
        if not self.streamed:
            make_equal(*args)
