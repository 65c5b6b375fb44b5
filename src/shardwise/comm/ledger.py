"""The ledger: one record per collective, with the bytes this rank puts on the wire.

What we count
-------------
``S`` is the size in bytes of the *full* logical tensor of the collective (for all_gather the
gathered output, for reduce_scatter the unreduced input, for all_reduce the buffer). For a group of
``n`` ranks, each rank sends, by the bandwidth-optimal ring algorithms
(Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations";
Thakur, Rabenseifner & Gropp 2005; JAX scaling book, "Sharded Matrices" chapter, collective costs):

=================  ===================  ==============================================
op                 bytes sent per rank  why
=================  ===================  ==============================================
all_reduce         2(n−1)/n · S         reduce-scatter then all-gather, each (n−1)/n · S
all_gather         (n−1)/n · S          n−1 steps, each forwarding one S/n shard
reduce_scatter     (n−1)/n · S          n−1 steps, each forwarding one partial S/n shard
all_to_all         (n−1)/n · S          every rank keeps 1/n of its input, sends the rest
all_to_all_v       S                    uneven splits (MoE dispatch): S is already the bytes
                                        of the rows this rank addresses to the others
broadcast          (n−1)/n · S          pipelined chain: n−1 of the n ranks forward S;
                                        we book the per-rank average so every rank agrees
reduce             (n−1)/n · S          the chain backwards: n−1 ranks send S (average)
send / recv        S / 0                point to point: the sender books S
=================  ===================  ==============================================

These are the textbook numbers, not what a particular backend's algorithm happens to do (NCCL
may pick trees, gloo may pick other schedules); they are what the formulas in the papers use, so
the ledger can be compared with them exactly. They are booked in ``wire_bytes``. Next to them,
``sent_bytes`` holds what this rank really handed to ``send`` when the collective ran over our
own point-to-point algorithms (:mod:`shardwise.comm.algorithms`, ``--collectives
ring|tree|auto``): equal to ``wire_bytes`` for the ring on even blocks, different, as derived
there, for halving-doubling, trees and chains (docs/collectives.md). ``seconds`` is wall time from launch to completion
(for an async op: until its ``wait()`` returned), so it includes any time spent waiting for peers.

Records carry a ``phase`` (``"step"`` for the optimizer step being measured, ``"init"``,
``"eval"``, ``"verify"``, ``"order_check"`` for the first step's ZeRO-3/FSDP2 unit-order agreement
...) and a ``tag`` saying why the collective ran (``"grad"`` for gradient sync, ``"loss"`` for
loss bookkeeping...). :meth:`Ledger.step_records` returns one step's records (phase ``"step"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import defaultdict


def ring_bytes(op: str, size_bytes: float, n: int) -> float:
    """Bytes one rank sends for collective ``op`` over ``n`` ranks on a buffer of ``size_bytes``.

    ``size_bytes`` is the full logical tensor (see the module docstring for which one). Returns
    bytes (float: (n−1)/n is not an integer in general). Raises ``ValueError`` for an unknown op.
    """
    if n <= 1 and op not in ("send", "recv"):
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * size_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
        return (n - 1) / n * size_bytes
    if op in ("send", "all_to_all_v"):
        return float(size_bytes)
    if op in ("recv", "barrier"):
        return 0.0
    raise ValueError(f"unknown collective {op!r}")


@dataclasses.dataclass
class CommRecord:
    """One collective as this rank saw it. ``size_bytes`` = full logical tensor S; ``wire_bytes`` =
    bytes this rank sent by the ring formula (booked); ``seconds`` = wall time launch →
    completion. ``sent_bytes``: the bytes this rank actually handed to ``send`` — measured when
    the collective ran over point-to-point sends (``--collectives ring|tree|auto``, and
    send/recv), None when the backend's own collective ran (its wire is not visible from here;
    ``shardwise bench --suite collectives`` measures it on the loopback interface). ``sends``:
    those sends, one ``(step, peer index on the axis, bytes)`` per algorithm step and peer.
    ``issued``: ``time.perf_counter()`` when this rank launched it (records are booked when
    they complete, so an async receive posted first can be booked after later sends; sorting
    by ``issued`` gives the order this rank issued them); None where the booker did not say.
    ``note``: what the strategy said the collective is for when it launched it
    (:meth:`Ledger.note`, e.g. ZeRO-3's ``"layers.2 fwd"``); "" where it said nothing."""

    op: str
    axis: str
    group_size: int
    dtype: str
    shape: tuple
    size_bytes: int
    wire_bytes: float
    seconds: float
    phase: str
    tag: str
    impl: str  # the torch call that carried it out, e.g. "all_gather_single", or our algorithm
    sent_bytes: float | None = None
    sends: tuple = ()
    issued: float | None = None
    note: str = ""


class Ledger:
    """Collects :class:`CommRecord` s for one rank. Not thread-safe; one per topology."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._phase = "step"
        self._note = ""
        self._step_start = 0

    # -- recording ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Book every collective issued inside the block under phase ``name``."""
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    @contextlib.contextmanager
    def note(self, text: str):
        """Note ``text`` on every collective launched inside the block (``CommRecord.note``:
        which unit or block, which direction; ``shardwise trace`` prints it)."""
        prev, self._note = self._note, text
        try:
            yield
        finally:
            self._note = prev

    @property
    def current_note(self) -> str:
        return self._note

    def add(self, rec: CommRecord) -> None:
        self.records.append(rec)

    @property
    def current_phase(self) -> str:
        return self._phase

    def begin_step(self) -> None:
        """Mark the start of an optimizer step: :meth:`step_records` returns what follows."""
        self._step_start = len(self.records)

    def clear(self) -> None:
        self.records.clear()
        self._step_start = 0

    # -- reading -----------------------------------------------------------------------------
    def step_records(self) -> list[CommRecord]:
        """Records of phase ``"step"`` since the last :meth:`begin_step`."""
        return [r for r in self.records[self._step_start:] if r.phase == "step"]

    def step_bytes(self, tag: str | None = None) -> float:
        """Bytes this rank sent in the current step (optionally only records with ``tag``)."""
        return sum(r.wire_bytes for r in self.step_records() if tag is None or r.tag == tag)

    @staticmethod
    def summarize(records: list[CommRecord]) -> list[dict]:
        """Group records by (op, axis, tag, dtype, shape, impl): count, bytes, seconds;
        ``sent_bytes`` is the measured sum, None if any record of the group was not measured."""
        groups: dict[tuple, dict] = defaultdict(
            lambda: {"count": 0, "size_bytes": 0, "wire_bytes": 0.0, "seconds": 0.0,
                     "sent_bytes": 0.0}
        )
        for r in records:
            key = (r.op, r.axis, r.group_size, r.tag, r.dtype, tuple(r.shape), r.impl)
            g = groups[key]
            g["count"] += 1
            g["size_bytes"] += r.size_bytes
            g["wire_bytes"] += r.wire_bytes
            g["seconds"] += r.seconds
            g["sent_bytes"] = None if r.sent_bytes is None or g["sent_bytes"] is None \
                else g["sent_bytes"] + r.sent_bytes
        out = []
        for (op, axis, n, tag, dtype, shape, impl), g in groups.items():
            out.append({"op": op, "axis": axis, "group_size": n, "tag": tag, "dtype": dtype,
                        "shape": list(shape), "impl": impl, **g})
        return out

    def to_json(self, path, extra: dict | None = None) -> None:
        """Write this step's per-collective summary (plus ``extra``, e.g. the formula) to ``path``:
        ``collectives``, ``total_wire_bytes`` (booked), ``total_seconds``, ``total_sent_bytes``
        (measured: None unless every record was)."""
        recs = self.step_records()
        payload = {
            "collectives": self.summarize(recs),
            "total_wire_bytes": sum(r.wire_bytes for r in recs),
            "total_seconds": sum(r.seconds for r in recs),
            "total_sent_bytes": sent_total(recs),
            **(extra or {}),
        }
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def sent_total(records: list[CommRecord]) -> float | None:
    """Σ ``sent_bytes`` of ``records``, or None if any of them was not measured."""
    if any(r.sent_bytes is None for r in records):
        return None
    return float(sum(r.sent_bytes for r in records))
