"""The PyTorch engines' traffic, booked in our ledger: DTensor's functional collectives, c10d
calls made inside torch, and DDP's bucket all-reduce — shared by every ``--engine torch`` piece.

PyTorch's own implementations (DTensor TP, FSDP2, DDP, ``torch.distributed.pipelining``) issue
their collectives themselves, not through :mod:`.ops`. Two adapters put them in the same
:class:`~.ledger.Ledger` under the explicit engine's tags, so both engines are checked against
one formula:

* :class:`BookFunctionalCollectives` — a ``TorchDispatchMode`` (the mechanism of torch's own
  ``CommDebugMode``) that books every ``_c10d_functional`` collective, and optionally the
  ``c10d::allreduce_`` FSDP2 calls for ``replicate`` / HSDP; :func:`booked_as` names the tag.
* :func:`ddp_comm_hook` — DDP's documented ``register_comm_hook``: each bucket SUM-all-reduced
  through :func:`.ops.all_reduce_future` (booked; SUM, not mean: shardwise already divides each
  rank's loss by the global token count), fp32 or bf16-compressed.

No ``from __future__ import annotations`` here: DDP checks a comm hook's return annotation at
``register_comm_hook`` (it must be a ``torch.futures.Future``, not a string).
"""

import contextlib
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .ledger import CommRecord, ring_bytes

_OP_NAMES = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
             "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_to_all_single": "all_to_all", "broadcast": "broadcast",
             "broadcast_": "broadcast"}


_TAG_OVERRIDE: list[str] = []  # booked_as's stack


@contextlib.contextmanager
def booked_as(tag: str):
    """Inside the block, :class:`BookFunctionalCollectives` books DTensor's collectives under
    ``tag`` (the cross-entropy under ``loss_parallel``: ``"ce"``)."""
    _TAG_OVERRIDE.append(tag)
    try:
        yield
    finally:
        _TAG_OVERRIDE.pop()


class BookFunctionalCollectives(TorchDispatchMode):
    """While active, book every ``torch.ops._c10d_functional`` collective in ``topo.ledger``
    (op, axis found from the process group's name, dtype, shape, S as the ledger has it: the
    all-gather's output, the reduce-scatter's input, the all-reduce's buffer; ring bytes).
    ``seconds`` is the launch time only (functional collectives are waited for lazily). The
    mechanism is PyTorch's own ``CommDebugMode``'s.

    Tags (docs/architecture.md, "Ledger tags"): ``tp_fwd``/``tp_bwd`` by direction; inside
    :func:`booked_as` its tag; with ``sp_grad=True`` (FSDP2 + TP with SP) ``sp_grad`` for a
    backward all-reduce over tp (under SP, only the norm weights' ``Partial`` gradients).
    ``c10d_tag``: also book ``c10d::allreduce_`` under this tag (FSDP2's ``replicate`` calls
    ``torch.distributed.all_reduce`` itself, with no hook into :mod:`shardwise.comm`); leave it
    None wherever :mod:`shardwise.comm` all-reduces inside the mode (booked twice otherwise)."""

    def __init__(self, topo, c10d_tag: str | None = None, sp_grad: bool = False):
        super().__init__()
        self.topo, self.c10d_tag, self.sp_grad = topo, c10d_tag, sp_grad
        self.axis_of = {topo.group(a).group_name: a for a in ("pp", "dp", "tp", "world")}

    def _axis_by_ranks(self, group_name: str) -> str:
        """DTensor may run a collective on the group of an *equal* device mesh made for an earlier
        layout (meshes compare by ranks and names): name the axis by the group's ranks."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
        except (RuntimeError, ValueError, KeyError):
            return group_name
        return self.topo.axis_of_ranks(ranks) or group_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            # let DTensor run first and desugar into plain ops and collectives, which then come
            # back through this mode (the trick of torch's CommDebugMode)
            return NotImplemented
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        ns, name = func._overloadpacket._qualified_op_name.split("::")
        if ns == "c10d" and name == "allreduce_" and self.c10d_tag is not None:
            self._book_c10d_allreduce(args, time.perf_counter() - t0, f"{ns}.{name}")
        if ns in ("_c10d_functional", "_c10d_functional_autograd") and name in _OP_NAMES:
            op = _OP_NAMES[name]
            group = next(a for a in reversed(args) if isinstance(a, str))
            axis = self.axis_of.get(group) or self._axis_by_ranks(group)
            full = out if op == "all_gather" else args[0]
            size = full.numel() * full.element_size()
            n = self.topo.size(axis) if axis in ("pp", "dp", "tp", "world") else 1
            backward = torch._C._current_graph_task_id() != -1
            tag = _TAG_OVERRIDE[-1] if _TAG_OVERRIDE else ("tp_bwd" if backward else "tp_fwd")
            if self.sp_grad and backward and op == "all_reduce" and axis == "tp":
                tag = "sp_grad"
            self.topo.ledger.add(CommRecord(
                op=op, axis=axis, group_size=n, dtype=str(full.dtype).replace("torch.", ""),
                shape=tuple(full.shape), size_bytes=size, wire_bytes=ring_bytes(op, size, n),
                seconds=time.perf_counter() - t0, phase=self.topo.ledger.current_phase,
                tag=tag, impl=f"{ns}.{name}"))
        return out

    def _book_c10d_allreduce(self, args, seconds: float, impl: str) -> None:
        """Book ``c10d::allreduce_(tensors, process_group, ...)``: a record per tensor, S = its
        bytes, on the axis whose ranks the process group holds."""
        pg = dist.ProcessGroup.unbox(args[1])
        axis = self.topo.axis_of_ranks(dist.get_process_group_ranks(pg)) or pg.group_name
        n = self.topo.size(axis) if axis in ("pp", "dp", "tp", "world") else pg.size()
        for t in args[0]:
            size = t.numel() * t.element_size()
            self.topo.ledger.add(CommRecord(
                op="all_reduce", axis=axis, group_size=n,
                dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape), size_bytes=size,
                wire_bytes=ring_bytes("all_reduce", size, n), seconds=seconds,
                phase=self.topo.ledger.current_phase, tag=self.c10d_tag, impl=impl))


def _ledger_sum_hook(topo, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: SUM-all-reduce the bucket's flat gradient buffer over the data axis
    (dp, or dp × cp), booked in the ledger under ``grad``. Returns the future DDP waits on."""
    return ops.all_reduce_future(bucket.buffer(), topo, topo.data_axis, tag="grad")


def _ledger_sum_hook_bf16(topo, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook with bf16 compression (what ``torch.distributed.algorithms.ddp_comm_hooks
    .default_hooks.bf16_compress_hook`` does), all-reduced through :mod:`.ops`: cast the bucket
    to bf16, SUM-all-reduce it over the data axis (booked: half the bytes), cast the sum back
    into the fp32 bucket."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16)

    def decompress(fut):
        buf.copy_(fut.value())
        return buf

    return ops.all_reduce_future(low, topo, topo.data_axis, tag="grad").then(decompress)


_HOOKS = {"fp32": _ledger_sum_hook, "bf16": _ledger_sum_hook_bf16}


def ddp_comm_hook(reduce_dtype: str = "fp32"):
    """The ledger-booked SUM comm hook for gradients reduced in ``reduce_dtype`` ("fp32" |
    "bf16", validated before by :func:`shardwise.parallel.params.reduce_torch_dtype`); raises
    ``ValueError`` for another dtype."""
    if reduce_dtype not in _HOOKS:
        raise ValueError(f"no DDP comm hook for reduce dtype {reduce_dtype!r}: fp32 or bf16")
    return _HOOKS[reduce_dtype]
