"""Explicit collectives over one named axis of a :class:`~shardwise.topology.Topology`.

Every function here issues one collective on the process group of ``axis`` and books it in
``topo.ledger`` (op, axis, dtype, shape, bytes sent by the ring formula, seconds; see
:mod:`shardwise.comm.ledger` for what is counted). Nothing else in shardwise calls
``torch.distributed`` collectives directly, so the ledger sees everything.

Which implementation runs is the topology's ``collectives`` (``--collectives``, chosen once per
run): "native" issues torch's one call (gloo's or NCCL's own algorithm); "ring", "tree" and
"auto" run :mod:`shardwise.comm.algorithms` over ``isend``/``irecv`` on the same group and book
the bytes they handed to send (``sent_bytes``) and each send (``sends``) next to the formula.
Ours run on one comm thread in the order they are issued (so a blocking call waits for the async
ones before it, and every rank's messages keep the program's order); ``async_op=True`` returns
a :class:`Handle` while it runs, so DP buckets and ZeRO-3 prefetch overlap with compute as with
a backend's async collective.

Backend quirks live here and nowhere else:

* torch ≥ 2.13 names the flat-tensor collectives ``all_gather_single`` / ``reduce_scatter_single``
  and deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older torch only has the
  latter. :func:`all_gather` and :func:`reduce_scatter` use whichever exists.
* gloo has no ``PREMUL_SUM``; averaging is done as SUM then a local divide (``op="avg"``), which
  is also exact for fp32 when the divisor is a power of two.
* gloo cannot all-gather shards of unequal size: :func:`all_gather` takes equal shards only, and
  callers pad (ZeRO pads every flat buffer to a multiple of the group size).
* A collective that does not complete within the process group's timeout fails in torch with a
  backend's raw text (gloo: ``Timed out waiting 3000ms for recv operation to complete``), after
  the timeout. Every function here turns that into one line naming the collective (op, axis,
  tag, dtype, shape, group size, the timeout) and its usual cause — called from a subset of the
  ranks, or in different orders on different ranks — as a
  :class:`~shardwise.errors.CollectiveTimeout` chained to torch's error. Other errors pass
  through unchanged.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout
from . import algorithms
from .groups import NcclHazard, claim_p2p
from .ledger import CommRecord, ring_bytes
from .streams import StreamOrder

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# torch.distributed reports a timeout as a RuntimeError (DistBackendError on some paths) whose
# text is the backend's: gloo "Timed out waiting 3000ms for recv operation to complete" (and, on
# the next call over the broken connection, "Application timeout caused pair closure"), NCCL
# "Watchdog caught collective operation timeout", the store "... timed out".
_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _timeout_s(topo, axis: str, exc: BaseException) -> float | None:
    """The timeout (seconds) of the process group of ``axis``, or the one gloo's message names,
    or None if neither can be read."""
    try:
        return topo.group(axis)._get_backend(topo.device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API of the pinned torch; fall back to the text
        m = re.search(r"waiting (\d+)\s*ms", str(exc))
        return int(m.group(1)) / 1000.0 if m else None


def _timeout_error(exc: BaseException, topo, op: str, axis: str, what, tag: str
                   ) -> CollectiveTimeout:
    """The one-line :class:`CollectiveTimeout` for torch's timeout ``exc`` of collective ``op``
    over ``axis``; ``what``: its buffer (a tensor, named by dtype and shape) or a description;
    ``tag``: the ledger tag."""
    if isinstance(what, torch.Tensor):
        what = f"{str(what.dtype).replace('torch.', '')} {list(what.shape)}"
    t = _timeout_s(topo, axis, exc)
    after = f"after the process group's timeout of {t:g} s" if t is not None else \
        "after the process group's timeout"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveTimeout(
        f"{op} over axis {axis!r} (tag {tag!r}, {what}, group of {topo.size(axis)} ranks) timed "
        f"out on rank {rank} {after}: it was probably called from a subset of the ranks (e.g. a "
        f"checkpoint save or a log line on rank 0 only), or the ranks called collectives in "
        f"different orders; issue every collective on every rank of the group, in the same order")


@contextlib.contextmanager
def _naming_timeouts(topo, op: str, axis: str, what, tag: str):
    """Re-raise torch's timeout inside the block as :func:`_timeout_error`'s one line (chained
    to it); any other error passes through unchanged."""
    try:
        yield
    except RuntimeError as e:
        if not _TIMEOUT_TEXT.search(str(e)):
            raise
        raise _timeout_error(e, topo, op, axis, what, tag) from e


class Handle:
    """An in-flight async collective. :meth:`wait` blocks until done and books it in the ledger;
    it raises :class:`CollectiveTimeout` if the collective timed out."""

    def __init__(self, work, finish, guard=contextlib.nullcontext, waiter=None):
        self._work, self._finish, self._guard, self.done = work, finish, guard, False
        self._waiter = waiter  # waiter(work): comm.fingerprint's sliced wait (None: work.wait)

    def wait(self) -> None:
        if not self.done:
            if self._work is not None:
                with self._guard():
                    if self._waiter is not None:
                        self._waiter(self._work)
                    else:
                        self._work.wait()
            self._finish()
            self.done = True


def _book(topo, op, axis, tensor_like, size_bytes, t0, impl, tag, sent=None, sends=(),
          note=None):
    """Add the record of a completed collective; ``note``: the ledger's note when it was
    launched (None: the current one, for a collective booked where it was launched)."""
    n = topo.size(axis)
    topo.ledger.add(CommRecord(
        op=op, axis=axis, group_size=n, dtype=str(tensor_like.dtype).replace("torch.", ""),
        shape=tuple(tensor_like.shape), size_bytes=int(size_bytes),
        wire_bytes=ring_bytes(op, size_bytes, n), seconds=time.perf_counter() - t0,
        phase=topo.ledger.current_phase, tag=tag, impl=impl, sent_bytes=sent, sends=sends,
        issued=t0, note=topo.ledger.current_note if note is None else note,
    ))


def _algorithm(topo, op: str, size_bytes: int, axis: str) -> str | None:
    """The algorithm of :mod:`.algorithms` that runs ``op`` here, or None for the backend's."""
    mode = getattr(topo, "collectives", "native")
    return algorithms.choose(op, mode, size_bytes, topo.size(axis))


class _CommThread:
    """The one thread that runs our algorithms, in the order they are issued (a FIFO of one
    worker). Every call of ours goes through it, blocking or not, so the ranks' point-to-point
    messages on a group keep the program's order even when an async all-gather is still in
    flight; a blocking call waits for its own turn. Recreated after a fork."""

    _pool, _pid = None, None

    @classmethod
    def submit(cls, fn):
        import concurrent.futures
        import os

        if cls._pool is None or cls._pid != os.getpid():
            cls._pool = concurrent.futures.ThreadPoolExecutor(1, "shardwise-comm")
            cls._pid = os.getpid()
        return cls._pool.submit(fn)


class _FutureWork:
    """A ``concurrent.futures.Future`` with the ``wait()`` of a torch work."""

    def __init__(self, fut):
        self._fut = fut

    def wait(self):
        return self._fut.result()  # re-raises the algorithm's error (e.g. torch's timeout)


def _ours(topo, op, axis, tensor_like, size_bytes, algorithm, tag, async_op, out, body,
          after=None):
    """Run ``body(flat, peers) -> bytes sent`` (one of :mod:`.algorithms` over the group of
    ``axis``; ``flat``: ``out`` as one contiguous vector, written back into ``out`` when done)
    on the comm thread (:class:`_CommThread`); on completion run ``after`` and book it with the
    bytes it sent. Returns a :class:`Handle` if ``async_op`` (the algorithm runs while the
    caller computes, as a backend's async collective does), else waits. A peer that never sends
    raises :class:`CollectiveTimeout` after the group's timeout."""
    t0, note = time.perf_counter(), topo.ledger.current_note
    n = topo.size(axis)
    peers = algorithms.Peers(topo.group(axis), [topo.global_rank(axis, j) for j in range(n)],
                             topo.index(axis))
    flat, back = _flat(out)
    phase = topo.ledger.current_phase  # booked under the phase it was issued in
    # the comm thread's own stream, ordered after the compute stream's writes and before its
    # reads (NCCL hazard 5, comm/streams.py; no stream on CPU: the same calls do nothing)
    checks = getattr(topo, "checks", None)
    if checks is not None and checks.active:  # NCCL hazard 4 (see check_device)
        check_device(topo, op, axis, tensor_like, tag)
    order = StreamOrder.for_device(getattr(topo, "device", "cpu"))
    ready = order.before()
    claim_p2p(peers.group, "single")

    def run():  # grad mode is per thread: a collective never records autograd history
        with torch.no_grad():
            return order.run(lambda: body(flat, peers), ready)

    fut = _CommThread.submit(run)  # → (the bytes handed to send, the done event)

    def finish():
        order.after(fut.result()[1])
        back()
        if after is not None:
            after()
        sends = tuple((step, to, b) for (step, to), b in sorted(peers.log.items()))
        with topo.ledger.phase(phase):
            _book(topo, op, axis, tensor_like, size_bytes, t0, algorithm, tag,
                  float(fut.result()[0]), sends, note)

    h = Handle(_FutureWork(fut), finish,
               lambda: _naming_timeouts(topo, op, axis, tensor_like, tag))
    if not async_op:
        h.wait()
        return None
    return h


def _flat(t: torch.Tensor):
    """(a flat contiguous view of ``t`` or a copy, a function writing it back into ``t``)."""
    if t.is_contiguous():
        return t.view(-1), lambda: None
    c = t.contiguous().view(-1)
    return c, lambda: t.copy_(c.view_as(t))


def _run(topo, op, axis, tensor_like, size_bytes, impl, tag, async_op, launch, after=None,
         sent=None, reduce=None, src=None, peer=None):
    """Launch ``launch()`` (a torch.distributed call); book it on completion (``sent``: the
    measured bytes handed to send, for point-to-point; None for a backend collective); run
    ``after``. A timeout, at launch (a blocking call) or in :meth:`Handle.wait`, is raised as
    :class:`CollectiveTimeout`. With collective checks on (``topo.checks``,
    :mod:`.fingerprint`) the collective is fingerprinted first (``reduce``: its reduce op,
    ``src``: a broadcast's root) and always launched async, so its wait can report and raise
    ``CollectiveMismatch`` instead of blocking for good. A send or receive (``peer``: the other
    rank's global rank) is counted per channel instead (:meth:`~.fingerprint.CollectiveChecks.
    issue_p2p`) and waited for the same way: a receive whose message never comes is named
    after ``--hang-after``."""
    t0, note = time.perf_counter(), topo.ledger.current_note
    # the Handle books the buffer's dtype and shape only: it does not pin the caller's tensors,
    # the backend's work keeps what it still reads (gloo's own copy, NCCL's stashed inputs)
    like = _described(tensor_like)

    def guard():
        return _naming_timeouts(topo, op, axis, like, tag)

    checks = getattr(topo, "checks", None)
    checks = checks if checks is not None and checks.active else None
    waiter = None
    if topo.size(axis) == 1:  # a group of one: nothing moves; still booked (0 bytes)
        work = None
    else:
        if checks is not None:  # NCCL hazard 4: a collective's tensors on the topology's device
            check_device(topo, op, axis, tensor_like, tag)
        if checks is not None and peer is not None:
            p2p = checks.issue_p2p(op, axis, peer, tensor_like, tag)
            waiter = lambda w: checks.wait(w, axis, p2p=p2p)  # noqa: E731
        elif checks is not None:
            entry = checks.issue(op, axis, tensor_like, tag, reduce, src)
            waiter = lambda w: checks.wait(w, axis, entry)  # noqa: E731
        with guard():
            work = launch(async_op or checks is not None)

    def finish():
        if after is not None:
            after()
        _book(topo, op, axis, like, size_bytes, t0, impl, tag, sent, note=note)

    h = Handle(work if async_op or checks is not None else None, finish, guard, waiter)
    if not async_op:
        h.wait()
        return None
    return h


def check_device(topo, op: str, axis: str, tensor, tag: str = "") -> None:
    """Raise :class:`~shardwise.comm.groups.NcclHazard` unless ``tensor`` lives on the
    topology's device type (NCCL hazard 4: a CPU scalar handed to an NCCL collective fails or,
    through a silent copy, syncs the stream). Run when collective checks are on
    (``--check-collectives step|every``); objects without a device (a pickled payload) pass."""
    want = getattr(topo, "device", None)
    have = getattr(tensor, "device", None)
    if want is None or have is None or have.type == "meta" or have.type == want.type:
        return
    raise NcclHazard(
        f"{op} on axis {axis}{f' ({tag})' if tag else ''}: tensor on {have}, the topology's "
        f"device is {want}; create it with device=topo.device (NCCL takes device tensors only)")


def _described(t):
    """A tensor's dtype and shape without its storage (a meta tensor); anything else as is."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if torch.is_tensor(t) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, topo, axis: str, op: str = "sum", *, tag: str = "",
               async_op: bool = False):
    """In-place all-reduce of ``tensor`` (any shape, replicated layout) over ``axis``.

    ``op``: "sum", "avg" (SUM then divide by the group size: gloo has no PREMUL_SUM), "max",
    "min". Books 2(n−1)/n · S bytes. Returns a :class:`Handle` if ``async_op`` else None.
    α-β cost: ring 2(n−1)α + 2(n−1)/n·S·β (Patarasuk & Yuan 2009), halving-doubling
    2·log₂n·α + 2(n−1)/n·S·β for n a power of two (Thakur, Rabenseifner & Gropp 2005 §4.4).
    """
    n = topo.size(axis)
    red = _OPS["sum" if op == "avg" else op]
    after = (lambda: tensor.div_(n)) if op == "avg" and n > 1 else None
    algo = _algorithm(topo, "all_reduce", _nbytes(tensor), axis)
    if algo:
        return _ours(topo, "all_reduce", axis, tensor, _nbytes(tensor), algo, tag, async_op,
                     tensor, lambda y, peers: algorithms.all_reduce(
                         y, peers, algo, "sum" if op == "avg" else op), after)
    return _run(topo, "all_reduce", axis, tensor, _nbytes(tensor), "all_reduce", tag, async_op,
                lambda a: dist.all_reduce(tensor, op=red, group=topo.group(axis), async_op=a),
                after, reduce=op)


def all_reduce_future(tensor: torch.Tensor, topo, axis: str, *, tag: str = "") -> torch.futures.Future:
    """SUM-all-reduce ``tensor`` in place asynchronously and return a ``torch.futures.Future``
    whose value is ``tensor`` (the form DDP communication hooks must return). Booked like
    :func:`all_reduce` when the future completes."""
    if _algorithm(topo, "all_reduce", _nbytes(tensor), axis):  # ours: done when it returns
        all_reduce(tensor, topo, axis, tag=tag)
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    t0, note = time.perf_counter(), topo.ledger.current_note
    if topo.size(axis) == 1:
        fut = torch.futures.Future()
        fut.set_result([tensor])
    else:
        if getattr(topo, "checks", None) is not None:  # fingerprinted (its wait is DDP's)
            topo.checks.issue("all_reduce", axis, tensor, tag)
        fut = dist.all_reduce(tensor, group=topo.group(axis), async_op=True).get_future()

    def done(f):
        with _naming_timeouts(topo, "all_reduce", axis, tensor, tag):
            f.value()  # re-raises the collective's error, if it failed
        _book(topo, "all_reduce", axis, tensor, _nbytes(tensor), t0, "all_reduce", tag,
              note=note)
        return tensor

    return fut.then(done)


def all_gather(output: torch.Tensor, shard: torch.Tensor, topo, axis: str, *, tag: str = "",
               async_op: bool = False):
    """Gather equal ``shard`` s [k, ...] from every rank of ``axis`` into ``output`` [n·k, ...]
    (rank i's shard at rows i·k:(i+1)·k). Books (n−1)/n · S with S = bytes of ``output``.
    Raises ValueError for unequal shards. α-β cost: ring (n−1)α + (n−1)/n·S·β (Thakur et al.
    2005 §4.2; JAX scaling book ch. 5)."""
    n = topo.size(axis)
    if output.numel() != shard.numel() * n:
        raise ValueError(f"all_gather: output numel {output.numel()} != {n} × shard numel "
                         f"{shard.numel()} (shards must be equal; pad them)")
    if n == 1:
        output.copy_(shard.reshape(output.shape))
    algo = _algorithm(topo, "all_gather", _nbytes(output), axis)
    if algo:
        return _ours(topo, "all_gather", axis, output, _nbytes(output), algo, tag, async_op,
                     output, lambda y, peers: algorithms.all_gather(
                         y, shard.reshape(-1), peers, algo))
    return _run(topo, "all_gather", axis, output, _nbytes(output), _ALL_GATHER.__name__, tag,
                async_op,
                lambda a: _ALL_GATHER(output, shard, group=topo.group(axis), async_op=a))


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, topo, axis: str, op: str = "sum", *,
                   tag: str = "", async_op: bool = False):
    """Reduce ``full`` [n·k, ...] over ``axis`` and leave rank i's chunk (rows i·k:(i+1)·k) in
    ``output`` [k, ...]. ``op`` "sum" or "avg". Books (n−1)/n · S with S = bytes of ``full``.
    Raises ValueError unless numel(full) = n · numel(output). α-β cost: ring (n−1)α +
    (n−1)/n·S·β (Patarasuk & Yuan 2009). gloo's own is built on all-reduce (about twice the
    bytes: benchmarks/README.md, "Collectives")."""
    n = topo.size(axis)
    if full.numel() != output.numel() * n:
        raise ValueError(f"reduce_scatter: input numel {full.numel()} != {n} × output numel "
                         f"{output.numel()} (pad the input to a multiple of the group size)")
    if n == 1:
        output.copy_(full.reshape(output.shape))
    after = (lambda: output.div_(n)) if op == "avg" and n > 1 else None
    algo = _algorithm(topo, "reduce_scatter", _nbytes(full), axis)
    if algo:
        return _ours(topo, "reduce_scatter", axis, full, _nbytes(full), algo, tag, async_op,
                     output, lambda y, peers: algorithms.reduce_scatter(
                         y, full.reshape(-1), peers, algo), after)
    return _run(topo, "reduce_scatter", axis, full, _nbytes(full), _REDUCE_SCATTER.__name__, tag,
                async_op,
                lambda a: _REDUCE_SCATTER(output, full, op=dist.ReduceOp.SUM,
                                          group=topo.group(axis), async_op=a),
                after, reduce=op)


def broadcast(tensor: torch.Tensor, topo, axis: str, src: int = 0, *, tag: str = "",
              async_op: bool = False):
    """Broadcast ``tensor`` in place from the rank with index ``src`` *within* ``axis``.
    Books (n−1)/n · S on every rank (the per-rank average of a pipelined chain broadcast).
    α-β cost: chain (n−2+C)(α + S/C·β) with C chunks, binomial tree ⌈log₂n⌉(α + S·β)
    (Thakur et al. 2005 §4.1)."""
    algo = _algorithm(topo, "broadcast", _nbytes(tensor), axis)
    if algo:
        return _ours(topo, "broadcast", axis, tensor, _nbytes(tensor), algo, tag, async_op,
                     tensor, lambda y, peers: algorithms.broadcast(y, peers, algo, src))
    src_global = topo.global_rank(axis, src)
    return _run(topo, "broadcast", axis, tensor, _nbytes(tensor), "broadcast", tag, async_op,
                lambda a: dist.broadcast(tensor, src=src_global, group=topo.group(axis),
                                         async_op=a), src=src)


def broadcast_coalesced(tensors: list[torch.Tensor], topo, axis: str, src: int = 0, *,
                        tag: str = "") -> None:
    """Broadcast several tensors in place from index ``src`` of ``axis`` in one call per dtype
    (flattened into one buffer, sent, copied back): the same bytes as one :func:`broadcast`
    per tensor, (n−1)/n · Σ S, booked once per dtype. Every rank passes tensors of the same
    shapes and dtypes in the same order (e.g. a model's parameters at construction)."""
    if topo.size(axis) == 1 or not tensors:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast(flat, topo, axis, src, tag=tag)
        with torch.no_grad():
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view_as(t))


def all_to_all(output: torch.Tensor, input: torch.Tensor, topo, axis: str, *, tag: str = "",
               async_op: bool = False):
    """Split ``input`` [n·k, ...] into n chunks, send chunk j to rank j of ``axis``, receive into
    ``output`` [n·k, ...] (chunk i from rank i). Books (n−1)/n · S with S = bytes of ``input``.
    α-β cost: pairwise exchange (n−1)α + (n−1)/n·S·β (Thakur et al. 2005 §4.5)."""
    n = topo.size(axis)
    if n == 1:
        output.copy_(input)
    algo = _algorithm(topo, "all_to_all", _nbytes(input), axis)
    if algo:
        if input.numel() % n or output.numel() != input.numel():
            raise ValueError(f"all_to_all: input numel {input.numel()} must be a multiple of the "
                             f"group size {n} and equal output numel {output.numel()}")
        return _ours(topo, "all_to_all", axis, input, _nbytes(input), algo, tag, async_op,
                     output, lambda y, peers: algorithms.all_to_all(
                         y, input.reshape(-1), peers, algo))
    return _run(topo, "all_to_all", axis, input, _nbytes(input), "all_to_all_single", tag,
                async_op,
                lambda a: dist.all_to_all_single(output, input, group=topo.group(axis),
                                                 async_op=a))


class _Rows:
    """What the fingerprint of an uneven all-to-all names: the dtype and the row shape, with
    the row count (different on every rank) written ``v``."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, ("v", *t.shape[1:])


def all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                 input_splits: list[int], topo, axis: str, *, tag: str = "",
                 async_op: bool = False):
    """All-to-all with uneven splits along dim 0 (MoE token dispatch): rows
    ``input[Σ input_splits[:j] : …+input_splits[j]]`` go to rank j of ``axis``; ``output``'s
    rows from rank j land at ``Σ output_splits[:j]`` (``output_splits[j]`` = what rank j sends
    here; every rank must agree, e.g. from a count all-to-all first). ``input`` [Σ
    input_splits, ...], ``output`` [Σ output_splits, ...], same dtype and row shape.

    Books S = the bytes of the rows this rank sends to the *other* ranks (its own block stays),
    as op ``all_to_all_v`` (wire = S exactly: uneven blocks have no (n−1)/n average). torch's
    ``all_to_all_single`` with split sizes runs on gloo and NCCL; ``--collectives ring|tree``:
    pairwise exchange of the uneven blocks (:func:`.algorithms.all_to_all_v`). Raises
    ``ValueError`` when the splits do not add up to the tensors' rows."""
    n, i = topo.size(axis), topo.index(axis)
    if len(input_splits) != n or len(output_splits) != n or \
            sum(input_splits) != input.shape[0] or sum(output_splits) != output.shape[0]:
        raise ValueError(f"all_to_all_v over {n} ranks: input_splits {input_splits} (Σ must be "
                         f"{input.shape[0]}) and output_splits {output_splits} (Σ must be "
                         f"{output.shape[0]}) need one entry per rank")
    per_row = math.prod(input.shape[1:])  # elements of one row (an empty input has rows too)
    row = per_row * input.element_size()
    sent = (sum(input_splits) - input_splits[i]) * row
    like = _Rows(input)
    if n == 1:
        output.copy_(input)
    algo = _algorithm(topo, "all_to_all_v", sent, axis)
    if algo:
        def bounds(splits):
            out = [0]
            for k in splits:
                out.append(out[-1] + k * per_row)
            return out

        return _ours(topo, "all_to_all_v", axis, like, sent, algo, tag, async_op, output,
                     lambda y, peers: algorithms.all_to_all_v(
                         y, input.reshape(-1), peers, algo, bounds(input_splits),
                         bounds(output_splits)))
    return _run(topo, "all_to_all_v", axis, like, sent, "all_to_all_single", tag, async_op,
                lambda a: dist.all_to_all_single(output, input, output_splits, input_splits,
                                                 group=topo.group(axis), async_op=a))


def reduce(tensor: torch.Tensor, topo, axis: str, dst: int = 0, op: str = "sum", *,
           tag: str = "", async_op: bool = False):
    """Reduce ``tensor`` (any shape) over ``axis`` into the rank with index ``dst`` within
    ``axis``, in place there (other ranks' tensors: unchanged by ours, unspecified by the
    backend's). ``op``: "sum", "max", "min". Books (n−1)/n · S on every rank (the average of
    n−1 ranks sending S). α-β cost: chain (n−2+C)(α + S/C·β), binomial ⌈log₂n⌉(α + S·β)
    (Thakur et al. 2005 §4.1)."""
    algo = _algorithm(topo, "reduce", _nbytes(tensor), axis)
    if algo:
        return _ours(topo, "reduce", axis, tensor, _nbytes(tensor), algo, tag, async_op,
                     tensor, lambda y, peers: algorithms.reduce(y, peers, algo, dst, op))
    dst_global = topo.global_rank(axis, dst)
    return _run(topo, "reduce", axis, tensor, _nbytes(tensor), "reduce", tag, async_op,
                lambda a: dist.reduce(tensor, dst=dst_global, op=_OPS[op],
                                      group=topo.group(axis), async_op=a), reduce=op)


def send(tensor: torch.Tensor, topo, axis: str, dst: int, *, tag: str = "",
         async_op: bool = False):
    """Send ``tensor`` to the rank with index ``dst`` within ``axis``. Books S bytes."""
    peer = topo.global_rank(axis, dst)
    if _skip_send_for_test(tag):
        return Handle(None, lambda: None) if async_op else None
    return _run(topo, "send", axis, tensor, _nbytes(tensor), "isend", tag, async_op,
                lambda a: _p2p(dist.isend, tensor, peer, topo.group(axis), a),
                sent=float(_nbytes(tensor)), peer=peer)


def recv(tensor: torch.Tensor, topo, axis: str, src: int, *, tag: str = "",
         async_op: bool = False):
    """Receive into ``tensor`` from the rank with index ``src`` within ``axis``. Books 0 bytes
    (the sender books them)."""
    peer = topo.global_rank(axis, src)
    return _run(topo, "recv", axis, tensor, _nbytes(tensor), "irecv", tag, async_op,
                lambda a: _p2p(dist.irecv, tensor, peer, topo.group(axis), a), sent=0.0,
                peer=peer)


_SKIPPED: dict = {}  # tag → sends of this process with that tag (SHARDWISE_TEST_SKIP_SEND)


def _skip_send_for_test(tag: str) -> bool:
    """``SHARDWISE_TEST_SKIP_SEND=RANK:TAG:K`` (tests only; docs/troubleshooting.md): global
    rank RANK skips its K-th send with tag TAG (counted from 1 in this process), as a pipeline
    stage with a stage-conditional send would: nothing is sent or booked. Unset: False."""
    spec = os.environ.get("SHARDWISE_TEST_SKIP_SEND")
    if not spec:
        return False
    rank, want, k = spec.split(":")
    if tag != want or not dist.is_initialized() or dist.get_rank() != int(rank):
        return False
    _SKIPPED[tag] = _SKIPPED.get(tag, 0) + 1
    if _SKIPPED[tag] != int(k):
        return False
    print(f"[test] SHARDWISE_TEST_SKIP_SEND={spec}: rank {rank} skips send {tag} #{k}",
          flush=True)
    return True


def _p2p(fn, tensor, peer, group, async_op):
    claim_p2p(group, "single")  # never mixed with batch_isend_irecv here (NCCL hazard 3)
    work = fn(tensor, peer, group=group)
    if not async_op:
        work.wait()
        return None
    return work


def broadcast_object(obj, topo, axis: str = "world", src: int = 0, *, tag: str = ""):
    """Broadcast a picklable ``obj`` from index ``src`` of ``axis``; returns it on every rank.
    Books the pickled size as S (used for run metadata, e.g. the output folder name)."""
    import pickle

    t0 = time.perf_counter()
    box = [obj]
    if topo.size(axis) > 1:
        if getattr(topo, "checks", None) is not None:  # fingerprinted without a shape
            topo.checks.issue("broadcast_object", axis, None, tag, src=src)
        with _naming_timeouts(topo, "broadcast", axis, "a pickled object", tag):
            dist.broadcast_object_list(box, src=topo.global_rank(axis, src),
                                       group=topo.group(axis))
    payload = torch.empty(len(pickle.dumps(box[0])), dtype=torch.uint8)
    _book(topo, "broadcast", axis, payload, payload.numel(), t0, "broadcast_object_list", tag)
    return box[0]
