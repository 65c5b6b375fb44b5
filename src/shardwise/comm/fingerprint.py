"""Collective fingerprints, compared across ranks: a desync is one line, not a hang.

Every collective issued through :mod:`shardwise.comm.ops` on a group of more than one rank gets
a per-group sequence number (``#k``: the k-th collective on that process group since the
:class:`~shardwise.topology.Topology` was built, counted from 1) and a fingerprint, the text
``op(axis, tag, dtype[shape][, reduce op][, src=i])``, e.g. ``all_reduce(dp, grad,
float32[4096])``. A group is one line of an axis (its axis name and its global ranks). Point to
point sends and receives are not compared at the check (a send and its receive differ by
design) but counted per channel ``"src>dst:tag"`` (:meth:`CollectiveChecks.issue_p2p`) and
waited for like collectives: a receive that waits past ``--hang-after`` names the message it
waits for, and the diagnosis compares it with the sender's count
(:func:`~shardwise.comm.diagnosis.p2p_findings`).

On a host-blocking backend (gloo) every rank also publishes its *position* (its last
fingerprint, step, point-to-point counts, whether it waits in it) before each collective or
message is launched, and again when its wait returns: under the local launcher a copy into a
memory-mapped file of the launcher's (~1 µs, :mod:`~shardwise.comm.positions`), else a store
``set`` (``pos/{r}``), not waited for. A rank that dies inside a collective (gloo aborts a
receiver of more bytes than it expects, SIGABRT; a SIGKILL) leaves it behind, and the local
launcher, which serves the store (``SHARDWISE_DIAG_STORE``) and the files' folder
(``SHARDWISE_DIAG_DIR``), prints one line from every rank's position after the failure
(:func:`~shardwise.comm.diagnosis.diagnose_store`).

``--check-collectives`` (:data:`MODES`) says when ranks compare them:

``off``
    nothing is recorded or compared.
``step`` (the default)
    at every step boundary (:func:`check`, called by ``train_step`` before each step and by
    the training loop at its end) every rank of the topology publishes, in the c10d store (not
    a collective: it cannot pair with a stray collective of a peer), a summary of what it
    issued since the last check: per group the count and a CRC-32 of the fingerprints. Cost
    per step: about five store round trips, whatever the number of collectives.
``every``
    before launching each collective, its fingerprint is published in the store and compared
    with every peer's for the same sequence number; a mismatch is raised before anything is
    sent (on gloo, a collective whose peers send more bytes than it expects aborts the process
    in gloo's own check before any other check could speak). Cost: a few store round trips per
    collective; for debugging.

Why the comparison itself never hangs
-------------------------------------
A rank that issued an extra collective is blocked inside it while its peers reach the check, so
no rank ever waits on something that could itself be stuck:

* every wait here is a poll of the store (``store.check``, short sleeps), never a collective,
  and ends at the process group's timeout at the latest (then :class:`CollectiveTimeout`
  names the ranks that never reached the check);
* on gloo every collective is waited for in slices of :data:`SLICE_S` (``Work.wait(timeout)``,
  which leaves the collective running). A rank still waiting after one slice publishes its full
  report (every fingerprint since the last check, the pending one last), and so does a rank
  that waits at the check for a slow peer. From the full reports any rank can prove a
  divergence: two ranks issued different collectives at the same sequence number of a group,
  or one rank issued collective #k where a peer that reached the check issued nothing there.
  Waiting alone proves nothing (a peer may be slow, or waiting for a third rank);
* the first rank to prove a divergence writes the message under one ``abort`` key
  (``compare_set``: first writer wins), and every rank, at the check or inside its stuck
  collective's wait, raises :class:`~shardwise.errors.CollectiveMismatch` with that one message
  within about a slice. The stuck collective is left to die with the process.

A rank that waits past ``hang_after_s`` (``--hang-after``; in a collective's wait on gloo, or
at the check) writes its flight record, ``flight_dir/rank{r}.json`` (its last :data:`HISTORY`
fingerprints, what it waits for, for how long, its Python stack), and raises
:class:`~shardwise.errors.CollectiveHang` naming every rank's position from the reports in the
store: where each waits, and which ranks reported nothing (stuck in compute, or dead). A silent
rank that reaches the check later raises the same message.

On NCCL (or any backend whose collectives do not block the host) the host never blocks inside a
collective, so every rank reaches the check and the summaries alone show the divergence.

The message names the first diverging sequence number and what each rank issued there::

    rank 1 called all_reduce(dp, extra, float32[4]) where rank 0 issued no collective (it
    reached the check before step 4), at collective #7 on dp (ranks 0,1) in step 3: ...
"""

from __future__ import annotations

import collections
import json
import os
import time
import zlib

import torch.distributed as dist

from .groups import SHARED_GLOO
from .positions import DIR_ENV, DIR_KEY
from .diagnosis import (DESYNC_FIX, TOPOLOGIES_KEY, diagnose_reports,
                        diagnose_when_torchrun_stops, divergence_message)
from .fingerprint_records import RankRecords
from .fingerprint_waits import SLICE_S, SlicedWaits

MODES = ("off", "step", "every")
HISTORY = 64  # fingerprints kept per rank for reports (the last K)



# the launcher's store (``SHARDWISE_DIAG_STORE`` = "host:port"), connected once per process
_DIAG: dict = {}


def _diag_store(timeout_s: float):
    """A client of the local launcher's store (``SHARDWISE_DIAG_STORE`` set by
    :func:`shardwise.launch.spawn`), or None outside it (torchrun: the default store)."""
    import datetime
    import os

    addr = os.environ.get("SHARDWISE_DIAG_STORE")
    if not addr:
        return None
    if addr not in _DIAG or _DIAG[addr][0] != os.getpid():  # not a parent's connection
        host, port = addr.rsplit(":", 1)
        _DIAG[addr] = (os.getpid(), dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)))
    return _DIAG[addr][1]


def fingerprint(op: str, axis: str, tag: str, tensor_like=None, reduce: str | None = None,
                src: int | None = None) -> str:
    """The fingerprint text of one collective: ``op(axis, tag, dtype[shape][, reduce][, src=i])``
    (``tensor_like``: anything with ``dtype`` and ``shape``, or None when the receivers cannot
    know it, e.g. a pickled object). ``reduce`` is left out for "sum"."""
    parts = [axis, tag or "-"]
    if tensor_like is not None:
        parts.append(f"{str(tensor_like.dtype).replace('torch.', '')}"
                     f"[{','.join(str(d) for d in tensor_like.shape)}]")
    if reduce not in (None, "sum"):
        parts.append(reduce)
    if src is not None:
        parts.append(f"src={src}")
    return f"{op}({', '.join(parts)})"


class CollectiveChecks(RankRecords, SlicedWaits):
    """The fingerprints of one :class:`~shardwise.topology.Topology` on this rank, and their
    comparison with its peers' (see the module docstring). ``mode``: one of :data:`MODES`;
    ``timeout_s``: the topology's process-group timeout, the longest any check waits. What a
    rank publishes about itself (position, report, flight record, the one diagnosis) is
    :class:`~shardwise.comm.fingerprint_records.RankRecords`; how it waits (in slices, in a
    thread, polling the store) :class:`~shardwise.comm.fingerprint_waits.SlicedWaits`."""

    def __init__(self, topo, mode: str = "step", timeout_s: float = 300.0):
        if mode not in MODES:
            from ..errors import ShardwiseConfigError

            raise ShardwiseConfigError(f"--check-collectives {mode!r}: choose one of "
                                       f"{', '.join(MODES)}")
        self.topo, self.mode, self.timeout_s = topo, mode, float(timeout_s)
        self.step = 0  # the step being run (0 = before the first)
        self.epoch = 0  # checks passed
        self.seq: dict[str, int] = {}  # group key → collectives issued on it
        self.base: dict[str, int] = {}  # group key → seq at the last check
        self.pending: dict[str, list] = collections.defaultdict(list)  # since the last check
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self._store = None
        self._prefix = ""
        self._members: dict[str, list[int]] = {}  # group key → its global ranks
        self._keys: dict[str, str] = {}  # axis → this rank's group key
        self._host_blocking: dict[str, bool] = {}
        self._reported = None  # (epoch, fingerprints, label) of the last full report
        self._found = -1  # the epoch in which this rank first proved a divergence
        # --hang-after: a wait longer than this (seconds; None: only the process-group timeout)
        # writes this rank's flight record to flight_dir/rank{r}.json and ends the run
        self.hang_after_s: float | None = None
        self.flight_dir = None
        # point to point: messages issued per channel "src>dst:tag" (global ranks), cumulative
        self.sent: dict[str, int] = {}
        self.recvd: dict[str, int] = {}
        self._waiting = None  # (what, since: monotonic s, p2p wait or None) while in a wait
        self._posfile = None  # where _position writes (comm/positions.py); False: the store
        self._p2p = 0  # point-to-point messages issued (the cached parts of the position)
        self._pos_parts, self._pos_last = (None, "", ""), (None, "null")  # _position's JSON

    # -- state --------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return (self.mode != "off" and self.topo.member and self.topo.world_size > 1
                and dist.is_initialized())

    def _group(self, axis: str) -> str:
        """The key of this rank's group on ``axis``: "axis:r0,r1,…" (its global ranks)."""
        key = self._keys.get(axis)
        if key is None:
            ranks = [self.topo.global_rank(axis, i) for i in range(self.topo.size(axis))]
            key = self._keys[axis] = f"{axis}:{','.join(map(str, ranks))}"
            self._members[key] = ranks
        return key

    def store(self):
        """The store the checks use, under this topology's own prefix: the local launcher's
        (``SHARDWISE_DIAG_STORE``, :func:`shardwise.launch.spawn`: it outlives every rank, so
        the launcher reads the ranks' positions after any of them died), else the c10d store
        of the default group. The topology's first rank registers the prefix under
        :data:`TOPOLOGIES_KEY` with its ranks and the folder of the ranks' position files, if
        any (for the launcher's diagnosis)."""
        if self._store is None:
            base = _diag_store(self.timeout_s) or dist.distributed_c10d._get_default_store()
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._prefix = (f"shardwise/checks/{attempt}/"
                            f"{self.topo.group('world').group_name}/")
            self._store = dist.PrefixStore(self._prefix, base)
            if self._rank == min(self.topo.ranks):
                self._store.set("ranks", json.dumps(list(self.topo.ranks)))
                if os.environ.get(DIR_ENV):
                    self._store.set(DIR_KEY, os.environ[DIR_ENV])
                base.append(TOPOLOGIES_KEY, self._prefix + "\n")
            if self._rank == 0 and "TORCHELASTIC_RUN_ID" in os.environ and \
                    not os.environ.get("SHARDWISE_DIAG_STORE"):  # torchrun, not our launcher
                diagnose_when_torchrun_stops()
        return self._store

    # -- hooks called by comm.ops ---------------------------------------------------------------
    def issue(self, op: str, axis: str, tensor_like=None, tag: str = "",
              reduce: str | None = None, src: int | None = None) -> list | None:
        """Record a collective about to be launched on ``axis`` (a group of > 1 rank); at
        ``every``, first compare its fingerprint with the peers' (raises
        :class:`CollectiveMismatch` on a difference, before anything is sent). On a
        host-blocking backend (gloo), also publish this rank's position, "in" it (~1 µs under
        the local launcher, else a store ``set``; :meth:`wait` publishes another when it
        returns), so that a rank that dies inside it (gloo aborts the process on a size
        mismatch) leaves its last fingerprint behind, and a rank stopped while it waits is named
        as waiting in it.
        Returns the history entry ``[group, fingerprint, phase, step, seq]`` for :meth:`wait`
        (None: inactive)."""
        if not self.active:
            return None
        g = self._group(axis)
        n = self.seq.get(g, 0) + 1
        self.seq[g] = n
        entry = [fingerprint(op, axis, tag, tensor_like, reduce, src), self.topo.ledger
                 .current_phase, self.step, n]
        self.pending[g].append(entry)
        self.history.append([g, *entry])
        if self.mode == "every":
            self._check_one(g, n, entry[0])
        if self._blocks_host(axis):
            self._position(where=f"in {entry[0]} #{n}")
        return self.history[-1]

    def issue_p2p(self, op: str, axis: str, peer: int, tensor_like, tag: str = "") -> dict | None:
        """Record a point-to-point ``op`` ("send" or "recv") with global rank ``peer`` about to
        be launched on ``axis``: the k-th message of its channel ``"src>dst:tag"`` (global
        ranks, counted from 1 since the topology was built), kept in the history with the
        fingerprint ``recv(pp, pp_fwd, float32[2,16,64], from=0)``. Not compared at the check
        (a send and its receive differ by design); a receive that waits past a slice reports
        which message of which channel it waits for, and the diagnosis compares that with the
        sender's count. Returns the wait description for :meth:`wait` (None: inactive)."""
        if not self.active:
            return None
        src, dst = (self._rank, peer) if op == "send" else (peer, self._rank)
        chan = f"{src}>{dst}:{tag or '-'}"
        book = self.sent if op == "send" else self.recvd
        n = book[chan] = book.get(chan, 0) + 1
        self._p2p += 1
        fp = f"{fingerprint(op, axis, tag, tensor_like)[:-1]}, " \
             f"{'to' if op == 'send' else 'from'}={peer})"
        self.history.append([chan, fp, self.topo.ledger.current_phase, self.step, n])
        if self._blocks_host(axis):
            self._position(where=f"in {fp} (message #{n} of {chan})")
        return {"op": op, "chan": chan, "peer": peer, "tag": tag or "-", "n": n, "fp": fp,
                "step": self.step}

    def _blocks_host(self, axis: str) -> bool:
        g = self._group(axis)
        if g not in self._host_blocking:
            self._host_blocking[g] = dist.get_backend(self.topo.group(axis)) in ("gloo",
                                                                                SHARED_GLOO)
        return self._host_blocking[g]

    # -- the step-boundary check ----------------------------------------------------------------
    def check(self, step: int | None = None, label: str | None = None) -> None:
        """Compare what every rank of the topology issued since the last check (see the module
        docstring). ``step``: the step about to run (default: the last one + 1); ``label``:
        where the check stands, for the message (default "before step N").

        Raises:
            CollectiveMismatch: the ranks issued different collectives (every rank raises it,
                with one message naming the first diverging sequence number and what each
                rank issued there).
            CollectiveTimeout: a rank did not reach the check within the process-group timeout.
        """
        nxt = self.step + 1 if step is None else int(step)
        if not self.active:
            self.step = nxt
            return
        label = label or f"before step {nxt}"
        s, e = self.store(), self.epoch
        summary = {g: [len(v), zlib.crc32("\n".join(x[0] for x in v).encode())]
                   for g, v in self.pending.items() if v}
        s.set(f"b/{e}/{self._rank}", json.dumps({"label": label, "groups": summary}))
        keys = [f"b/{e}/{r}" for r in self.topo.ranks]
        t0 = time.monotonic()
        self._position(where=f"at the check {label}")
        self._waiting = (f"at the check {label}", t0, None)
        self._poll(lambda: s.check(keys), t0, f"reached the collective check {label}",
                   lambda: self._while_waiting(label=label, t0=t0, what=f"at the check {label}"))
        self._raise_known()  # a peer gave up on this rank (--hang-after) while it was away
        summaries = {r: json.loads(v) for r, v in zip(self.topo.ranks, s.multi_get(keys))}
        if any(self._disagree(g, summaries) for g in self._all_groups(summaries)):
            self._report(label=label)
            full = [f"f/{e}/{r}" for r in self.topo.ranks]
            self._poll(lambda: s.check(full), t0, "published its collectives",
                       lambda: self._while_waiting(label=label, t0=t0,
                                                   what=f"at the check {label}"))
            self._raise(diagnose_reports(self._reports()) or
                        f"the ranks issued different collectives since the check "
                        f"{summaries[self._rank]['label']}: {DESYNC_FIX}")
        if e >= 2:  # every peer has read epoch e-2's keys (it passed epoch e-1's check)
            for k in ("b", "f"):
                s.delete_key(f"{k}/{e - 2}/{self._rank}")
        self.epoch += 1
        self.base = dict(self.seq)
        self.pending.clear()
        self.step = nxt
        self._waiting = None
        self._position()

    # -- internals --------------------------------------------------------------------------------
    @property
    def _rank(self) -> int:
        return self.topo.rank

    def _all_groups(self, summaries) -> set:
        return {g for v in summaries.values() for g in v["groups"]} | set(self._members)

    def _disagree(self, g: str, summaries) -> bool:
        members = self._members.get(g)
        if members is None:  # a group this rank is not in: its members compare it
            return False
        return len({tuple(summaries[r]["groups"].get(g, [0, 0])) for r in members}) > 1

    def _check_one(self, g: str, n: int, fp: str) -> None:
        """``every``: publish this rank's fingerprint #n on group ``g`` and compare it with
        every member's before the collective is launched."""
        s = self.store()
        members = self._members[g]
        s.set(f"e/{g}/{n}/{self._rank}", fp)
        keys = [f"e/{g}/{n}/{r}" for r in members]
        t0 = time.monotonic()
        self._poll(lambda: s.check(keys), t0, f"issued collective #{n} on {g}",
                   lambda: self._while_waiting(t0=t0, what=f"before {fp} #{n}"))
        fps = dict(zip(members, (v.decode() for v in s.multi_get(keys))))
        if len(set(fps.values())) > 1:
            entry = self.pending[g][-1]
            at = {r: [fp_r, *entry[1:]] for r, fp_r in fps.items()}
            self._raise(divergence_message(n, g, at, set(), {}))
        if n > 2:  # every member has read #n-2 (it published #n-1 after reading it)
            s.delete_key(f"e/{g}/{n - 2}/{self._rank}")



def check(topo, step: int | None = None, label: str | None = None) -> None:
    """Compare the collectives every rank of ``topo`` issued since the last check (the step
    boundary of ``--check-collectives step|every``); a no-op for ``off``, for a world of one
    rank, or for a topology without checks. ``step``: the step about to run. Raises
    :class:`~shardwise.errors.CollectiveMismatch` (on every rank, one message) or
    :class:`~shardwise.errors.CollectiveTimeout` (a rank never reached the check)."""
    checks = getattr(topo, "checks", None)
    if checks is not None:
        checks.check(step, label)


__all__ = ["HISTORY", "MODES", "SLICE_S", "CollectiveChecks", "check", "fingerprint"]
