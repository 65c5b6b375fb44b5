"""Build a model on the meta device, then initialise it one full tensor at a time.

A model built on ``meta`` has shapes and no storage, and its init draws nothing. While it is
built, :func:`build_on_meta` records every init call on a meta tensor (``nn.init.*``, and the
in-place fills and draws of ``torch.Tensor``), in order: the construction's own defaults
(``nn.Linear``'s Kaiming-uniform, ``nn.Embedding``'s normal, also of modules built and then
replaced), then the model's ``reset_parameters``. :meth:`InitPlan.stream` replays that record
on CPU, one full-shape tensor at a time, and yields each parameter's tensor at its last write:
what an ordinary build with the same global RNG state wrote, **bitwise**, and the global RNG
left in the same state. A consumer keeps what it owns of each (a TP shard, a flat ZeRO-3
slice, a pipeline stage's tensors) and drops the rest, so its peak is what it keeps plus the
largest single tensor. :func:`materialize` is the consumer that keeps everything (one
process; the reference the sharded ones are tested against).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import build_model

# what an init may call on a tensor: each overwrites all of it
_INITS = {getattr(nn.init, n) for n in (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_")} | {getattr(torch.Tensor, n) for n in (
        "uniform_", "normal_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
        "geometric_", "log_normal_", "cauchy_")}


class _Recorder(TorchFunctionMode):
    """Records (function, tensor, args, kwargs) for each outermost call of :data:`_INITS` on a
    meta tensor (an ``nn.init`` function's own inner ``Tensor`` call is not recorded twice)."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []
        self._depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = kwargs.get("tensor", args[0] if args else None)
        if func not in _INITS or not isinstance(t, torch.Tensor) or not t.is_meta \
                or self._depth:
            return func(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != "tensor"}
        if rest.get("generator") is not None:
            raise NotImplementedError(f"{func.__name__} with its own generator: only the global "
                                      f"RNG can be replayed")
        self.log.append((func, t, tuple(args[1:]) if "tensor" not in kwargs else tuple(args),
                         rest))
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1


class InitPlan:
    """The init calls a meta build recorded (:class:`_Recorder`), and which of them wrote each
    parameter of the built model last. Raises ``ValueError`` if a parameter was never written
    by a recorded init (its value could not be replayed) or was written in part (an init on a
    view of it)."""

    def __init__(self, model: nn.Module, log: list[tuple]):
        self.log = log
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = {i: names.get(id(t)) for i, (_, t, _, _) in enumerate(log)}
        self.last = {n: i for i, n in self.names.items() if n is not None}
        for i, (func, t, _, _) in enumerate(log):
            if t._is_view():
                raise ValueError(f"{func.__name__} on a view (of shape {tuple(t.shape)}): "
                                 f"a partial init cannot be replayed one tensor at a time")
        missing = sorted(set(names.values()) - set(self.last))
        if missing:
            raise ValueError(f"no recorded init wrote {', '.join(missing)}: its value cannot be "
                             f"replayed (give it an nn.init call in the model's init)")

    @torch.no_grad()
    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, full-shape tensor on CPU) for each parameter, at its last recorded
        write, after replaying every recorded call in order on a fresh CPU tensor of its shape
        and dtype (the others are dropped at once). Each yielded tensor is a new one: drop it
        before the next (peak: one full tensor)."""
        for i, (func, t, args, kwargs) in enumerate(self.log):
            full = torch.empty(t.shape, dtype=t.dtype)
            func(full, *args, **kwargs)
            name = self.names[i]
            if name is not None and self.last[name] == i:
                yield name, full
            del full

    def stream_from(self, rng_state: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`stream` replayed from the global RNG state ``rng_state`` (the state before
        the init drew, e.g. for a second copy of the initial model: DPO's frozen reference),
        the RNG put back where it was when the first tensor was asked for once the last one
        is given: draws after it continue as if this replay had not happened."""
        here = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            yield from self.stream()
        finally:
            torch.set_rng_state(here)

    def replay_draws(self) -> None:
        """Replay every recorded call and keep nothing: the global RNG ends where a whole build
        leaves it, for a model whose values come from elsewhere (an HF folder, a checkpoint).
        Peak: one full tensor, freed on return (a caller's ``for _ in stream()`` would keep the
        last one, the largest of a Llama, alive in ``_``)."""
        for _ in self.stream():
            pass


def build_on_meta(name: str, vocab_size: int = 4096, **overrides
                  ) -> tuple[nn.Module, InitPlan]:
    """:func:`~shardwise.models.build_model` on the meta device (no storage, no RNG drawn), and
    the :class:`InitPlan` that initialises it as the ordinary build would have."""
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = build_model(name, vocab_size, **overrides)
    return model, InitPlan(model, rec.log)


def _to_empty(model: nn.Module, device) -> None:
    """``model.to_empty(device=device)`` keeping tied parameters tied (one tensor in two
    modules: the tied embedding and output)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for n, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((m, n))
    model.to_empty(device=device)
    for places in owners.values():
        (m0, n0), *rest = places
        for m, n in rest:
            setattr(m, n, getattr(m0, n0))


@torch.no_grad()
def materialize(model: nn.Module, plan: InitPlan,
                device: str | torch.device = "cpu") -> nn.Module:
    """Allocate a meta-built, unsharded ``model`` on ``device`` and initialise it by ``plan``
    (bitwise what an ordinary build with the same global RNG state holds; its non-persistent
    buffers recomputed by ``init_buffers()``); returns it."""
    _to_empty(model, device)
    params = dict(model.named_parameters())
    for name, full in plan.stream():
        params[name].copy_(full)
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    return model
