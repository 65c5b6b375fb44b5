"""Collective fingerprints, compared across ranks: a desync is one line, not a hang.

Every collective issued through :mod:`shardwise.comm.ops` on a group of more than one rank gets
a per-group sequence number (``#k``: the k-th collective on that process group since the
:class:`~shardwise.topology.Topology` was built, counted from 1) and a fingerprint, the text
``op(axis, tag, dtype[shape][, reduce op][, src=i])``, e.g. ``all_reduce(dp, grad,
float32[4096])``. A group is one line of an axis (its axis name and its global ranks). Point to
point sends and receives are not compared at the check (a send and its receive differ by
design) but counted per channel ``"src>dst:tag"`` (:meth:`CollectiveChecks.issue_p2p`) and
waited for like collectives: a receive that waits past ``--hang-after`` names the message it
waits for, and the diagnosis compares it with the sender's count (:func:`p2p_findings`).

On a host-blocking backend (gloo) every rank also publishes its *position* (``pos/{r}``: its
last fingerprint, step, point-to-point counts, whether it waits in it) before each collective or
message is launched, and again when its wait returns: a store ``set`` each, not waited for (a
few µs). A rank that dies inside a collective (gloo aborts a receiver of more bytes than it
expects, SIGABRT; a SIGKILL) leaves it behind, and the local launcher, which serves the store
(``SHARDWISE_DIAG_STORE``), prints one line from every rank's position after the failure
(:func:`diagnose_store`).

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

from ..errors import CollectiveHang, CollectiveMismatch, CollectiveTimeout

MODES = ("off", "step", "every")
SLICE_S = 0.5  # seconds a rank waits (in a collective or at the check) before it reports
HISTORY = 64  # fingerprints kept per rank for reports (the last K)

_FIX = ("every rank of a group must issue the same collectives, with the same shapes, in the "
        "same order: look for a collective under a rank-conditional branch (a save, a log line "
        "or an evaluation on one rank only) or a shape that depends on the rank's data")


# the launcher's store (``SHARDWISE_DIAG_STORE`` = "host:port"), connected once per process
TOPOLOGIES_KEY = "shardwise/topologies"  # the checks' prefixes, one a line, oldest first
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


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


class CollectiveChecks:
    """The fingerprints of one :class:`~shardwise.topology.Topology` on this rank, and their
    comparison with its peers' (see the module docstring). ``mode``: one of :data:`MODES`;
    ``timeout_s``: the topology's process-group timeout, the longest any check waits."""

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
        :data:`TOPOLOGIES_KEY` with its ranks (for the launcher's diagnosis)."""
        if self._store is None:
            base = _diag_store(self.timeout_s) or dist.distributed_c10d._get_default_store()
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._prefix = (f"shardwise/checks/{attempt}/"
                            f"{self.topo.group('world').group_name}/")
            self._store = dist.PrefixStore(self._prefix, base)
            if self._rank == min(self.topo.ranks):
                self._store.set("ranks", json.dumps(list(self.topo.ranks)))
                base.append(TOPOLOGIES_KEY, self._prefix + "\n")
            if self._rank == 0 and "TORCHELASTIC_RUN_ID" in os.environ and \
                    not os.environ.get("SHARDWISE_DIAG_STORE"):  # torchrun, not our launcher
                _diagnose_when_torchrun_stops()
        return self._store

    # -- hooks called by comm.ops ---------------------------------------------------------------
    def issue(self, op: str, axis: str, tensor_like=None, tag: str = "",
              reduce: str | None = None, src: int | None = None) -> list | None:
        """Record a collective about to be launched on ``axis`` (a group of > 1 rank); at
        ``every``, first compare its fingerprint with the peers' (raises
        :class:`CollectiveMismatch` on a difference, before anything is sent). On a
        host-blocking backend (gloo), also publish this rank's position, "in" it (one store
        ``set``, not waited for: a few µs; :meth:`wait` publishes another when it returns), so
        that a rank that dies inside it (gloo aborts the process on a size mismatch) leaves its
        last fingerprint behind, and a rank stopped while it waits is named as waiting in it.
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
        fp = f"{fingerprint(op, axis, tag, tensor_like)[:-1]}, " \
             f"{'to' if op == 'send' else 'from'}={peer})"
        self.history.append([chan, fp, self.topo.ledger.current_phase, self.step, n])
        if self._blocks_host(axis):
            self._position(where=f"in {fp} (message #{n} of {chan})")
        return {"op": op, "chan": chan, "peer": peer, "tag": tag or "-", "n": n, "fp": fp,
                "step": self.step}

    def wait(self, work, axis: str, entry=None, p2p: dict | None = None) -> None:
        """``work.wait()`` for a collective on ``axis`` (``entry``: what :meth:`issue`
        returned; ``p2p``: what :meth:`issue_p2p` returned, for a send or receive); on a
        host-blocking backend (gloo) in slices of :data:`SLICE_S`, reporting after the first
        and raising :class:`CollectiveMismatch` as soon as any rank has proven a divergence,
        or :class:`CollectiveHang` past ``hang_after_s``; when it returns, publish this rank's
        position again (running: past it). If the wait fails because a peer died (its
        connection closed), this rank publishes where it was and raises the divergence the
        ranks' positions prove (a gloo size abort), else torch's error."""
        if not self.active or not self._blocks_host(axis):
            work.wait()
            return
        import datetime

        if p2p is not None:
            what = f"in {p2p['fp']} (message #{p2p['n']} of {p2p['chan']})"
        elif entry is not None:
            what = f"in {entry[1]} #{entry[4]}"
        else:
            what = "in a collective"
        sl = datetime.timedelta(seconds=SLICE_S)
        t0 = time.monotonic()
        self._waiting = (what, t0, p2p)
        try:
            if p2p is not None:  # gloo closes the pair when a send/recv wait times out
                self._wait_in_thread(work, t0, what)
            else:
                while True:
                    try:
                        work.wait(timeout=sl)
                        break
                    except RuntimeError as e:
                        # the collective's own error: a peer that raised the diagnosis and
                        # left, or died
                        if "Operation timed out!" not in str(e):
                            self._failed(e, what)
                    self._while_waiting(t0=t0, what=what)
        finally:
            self._waiting = None
        # past it: "last issued" now means running after it (the position at issue said "in
        # it"), so a rank stopped between two collectives is not named as waiting in the first
        self._position()

    def _failed(self, e: BaseException, what: str):
        """A wait failed with ``e`` (not a slice's timeout): raise the published diagnosis, or
        the one the positions prove, else ``e``."""
        self._raise_known(e)  # a peer that raised the diagnosis and left
        self._peer_broke(what, e)  # a peer that died
        raise e

    def _wait_in_thread(self, work, t0: float, what: str) -> None:
        """Wait for a point-to-point ``work`` (gloo cannot time such a wait out and wait again:
        a timeout closes the pair) in a daemon thread, polling it every :data:`SLICE_S` as
        :meth:`wait` does; a wait that never ends is left in its thread to die with the
        process. Costs one thread start (~0.1 ms) per send or receive waited for."""
        import threading

        done, err = threading.Event(), []

        def run():
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                err.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name="shardwise-p2p-wait", daemon=True).start()
        while not done.wait(SLICE_S):
            self._while_waiting(t0=t0, what=what)
        if err:
            self._failed(err[0], what)

    def _position(self, where: str | None = None) -> None:
        """Publish ``pos/{rank}``: this rank's step, its last issued op (history entry), where
        it is (``where``: e.g. "at the check before step 3", "in all_reduce(dp, grad,
        float32[4]) #5" while it waits in its last op; None: running, past it), its point-to-point
        counts, its flight folder and its process id (the local launcher maps the exit statuses
        it recorded to ranks with it), with the wall time (s since the epoch)."""
        rec = {"rank": self._rank, "pid": os.getpid(), "step": self.step, "epoch": self.epoch,
               "last": self.history[-1] if self.history else None, "where": where,
               "sent": self.sent, "recvd": self.recvd, "flight_dir": self.flight_dir,
               "t": time.time()}
        try:
            self.store().set(f"pos/{self._rank}", json.dumps(rec))
        except Exception:  # noqa: BLE001 - positions are best effort; the check is not
            pass

    def _peer_broke(self, what: str, cause: BaseException) -> None:
        """A wait failed with a backend error (a peer died): publish this rank's position and
        report, then raise the divergence the positions prove, if any (on gloo a size
        mismatch aborts a receiver: the survivors and the dead rank's last position show
        which rank issued which shape)."""
        try:
            self._position(where=f"{what} when a peer's connection broke")
            self._report(waiting=what)
            self._flight_record(diagnosis=f"a peer's connection broke: {cause}")
            time.sleep(SLICE_S / 5)  # the other survivors publish theirs
            msg = diagnose_positions(self._positions())
        except Exception:  # noqa: BLE001 - the store may be gone too: torch's error stands
            return
        if msg:
            self._raise(msg, cause=cause)

    def _positions(self) -> dict:
        """rank → its published position (``pos/{r}``), for the ranks that published one."""
        s = self.store()
        keys = [f"pos/{r}" for r in self.topo.ranks]
        have = [k for k in keys if s.check([k])]
        return {json.loads(v)["rank"]: json.loads(v) for v in (s.multi_get(have) if have else [])}

    def _raise_known(self, cause: BaseException | None = None) -> None:
        """Raise the topology's published diagnosis, if any (chained to ``cause``)."""
        try:
            s = self.store()
            value = s.get("abort").decode() if s.check(["abort"]) else None
        except Exception:  # noqa: BLE001 - the store is gone too: the cause stands
            return
        if value:
            kind, _, msg = value.partition("|")
            self._flight_record(diagnosis=msg)
            raise (CollectiveHang if kind == "hang" else CollectiveMismatch)(msg) from cause

    def _blocks_host(self, axis: str) -> bool:
        g = self._group(axis)
        if g not in self._host_blocking:
            self._host_blocking[g] = dist.get_backend(self.topo.group(axis)) == "gloo"
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
            self._raise(self._diagnose(self._reports()) or
                        f"the ranks issued different collectives since the check "
                        f"{summaries[self._rank]['label']}: {_FIX}")
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

    def _poll(self, ready, t0: float, what: str, on_slice) -> None:
        """Poll ``ready()`` (a store check) with short sleeps; after each :data:`SLICE_S`
        without it, call ``on_slice()``; past the timeout raise :class:`CollectiveTimeout`."""
        nap, last = 1e-4, time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - t0 > self.timeout_s:
                raise CollectiveTimeout(
                    f"not every rank of {self.topo.describe()} {what} within the process "
                    f"group's timeout of {self.timeout_s:g} s: a rank is stuck (in compute, or "
                    f"in a collective its peers never issued) or died; {_FIX}")
            if now - last >= SLICE_S:
                on_slice()
                last = now
            time.sleep(nap)
            nap = min(nap * 2, 0.02)

    def _report(self, label: str | None = None, waiting: str | None = None) -> None:
        """Publish this rank's full report of the current epoch (again only if it changed)."""
        state = (self.epoch, sum(len(v) for v in self.pending.values()), label,
                 sum(self.sent.values()) + sum(self.recvd.values()))
        if self._reported == state:
            return
        self._reported = state
        rep = {"rank": self._rank, "label": label, "waiting": waiting,
               "wait_p2p": self._waiting[2] if self._waiting and not label else None,
               "sent": self.sent, "recvd": self.recvd, "step": self.step,
               "last": self.history[-1] if self.history else None,
               "groups": {g: {"base": self.base.get(g, 0), "members": self._members[g],
                              "ops": v} for g, v in self.pending.items() if v},
               "member_of": {g: m for g, m in self._members.items()}}
        self.store().set(f"f/{self.epoch}/{self._rank}", json.dumps(rep))

    def _reports(self) -> dict:
        s = self.store()
        keys = [f"f/{self.epoch}/{r}" for r in self.topo.ranks]
        have = [k for k in keys if s.check([k])]
        return {json.loads(v)["rank"]: json.loads(v) for v in (s.multi_get(have) if have else [])}

    def _while_waiting(self, label: str | None = None, t0: float | None = None,
                       what: str = "in a collective") -> None:
        """Called after each slice spent waiting (since ``t0``, ``what``: where): report, then
        raise the divergence if any rank has proven one (or this rank can, from the reports
        published so far); past ``hang_after_s``, write the flight record and raise
        :class:`CollectiveHang` naming every rank's position. A rank that learns of a
        published diagnosis while it waits writes its flight record too."""
        waited = time.monotonic() - t0 if t0 is not None else 0.0
        if self.store().check(["abort"]):
            self._raise_known()  # writes the flight record
        self._report(label=label, waiting=None if label else what)
        reports = self._reports()
        if self.hang_after_s and waited >= self.hang_after_s:
            self._raise(self._hang_message(reports, what, waited), kind="hang")
        msg = self._diagnose(reports)
        if msg and len(reports) < self.topo.world_size and self._found != self.epoch:
            self._found = self.epoch  # proven, but wait one slice more for every rank's report
            return
        if msg:
            self._raise(msg)

    def _raise(self, msg: str, kind: str = "mismatch", cause: BaseException | None = None):
        """Publish ``msg`` as the topology's one diagnosis (unless another rank was first) and
        raise it (``kind`` "mismatch": :class:`CollectiveMismatch`; "hang":
        :class:`CollectiveHang`), after writing this rank's flight record."""
        self.store().compare_set("abort", "", f"{kind}|{msg}")
        self._raise_known(cause)

    def _hang_message(self, reports: dict, what: str, waited: float) -> str:
        """Every rank's position from ``reports`` (and, for a rank that published no report,
        its last position): a receive whose message its sender never sent first, then where
        each rank waits, and who reported nothing."""
        try:
            positions = self._positions()
        except Exception:  # noqa: BLE001 - the reports alone still name the positions
            positions = {}
        states = {r: {**positions.get(r, {}), **rep} for r, rep in reports.items()}
        silent = [r for r in self.topo.ranks if r not in reports]
        states.update({r: positions[r] for r in silent if r in positions})
        where: dict[str, list[int]] = collections.defaultdict(list)
        for r, rep in sorted(reports.items()):
            where[f"at the check {rep['label']}" if rep["label"] else rep["waiting"]].append(r)
        findings = p2p_findings(states, silent)
        named = set().union(*(rs for _, rs in findings)) if findings else set()
        parts = [text for text, _ in findings]
        for r in silent:
            if r in named:
                continue
            last = (states.get(r) or {}).get("last")
            since = f"it issued {last[1]} #{last[4]} in step {last[3]}" if last else \
                f"the check before step {self.step}"
            parts.append(f"rank {r} reported nothing since {since} (stuck in compute, in code "
                         f"outside shardwise.comm, or dead)")
        parts += [f"{_ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'} {w}"
                  for w, rs in ((w, [r for r in rs if r not in named]) for w, rs in where.items())
                  if rs]
        return (f"{'; '.join(parts)}: rank {self._rank} waited {waited:.1f} s (--hang-after "
                f"{self.hang_after_s:g}); see where a silent rank is with py-spy dump --pid PID"
                + (f"; flight records in {self.flight_dir}" if self.flight_dir else ""))

    def _flight_record(self, what: str | None = None, waited: float | None = None,
                       diagnosis: str | None = None) -> None:
        """Write ``flight_dir/rank{r}.json``: this rank's last :data:`HISTORY` fingerprints
        (collectives and point-to-point messages), what it waits for (default: the current
        wait), for how long (s), the point-to-point counts per channel, the ``diagnosis`` it
        raises, and its Python stack. Nothing without a ``flight_dir``."""
        if not self.flight_dir:
            return
        import os
        import traceback

        if what is None:
            what, since, _ = self._waiting or ("not waiting", time.monotonic(), None)
            waited = time.monotonic() - since
        os.makedirs(self.flight_dir, exist_ok=True)
        rec = {"rank": self._rank, "step": self.step, "waiting": what, "waited_s": waited or 0.0,
               "wait_p2p": self._waiting[2] if self._waiting else None,
               "diagnosis": diagnosis, "ranks": list(self.topo.ranks),
               "sent": self.sent, "recvd": self.recvd, "t": time.time(),
               "last": [{"group": g, "fingerprint": fp, "phase": ph, "step": st, "seq": n}
                        for g, fp, ph, st, n in self.history],
               "stack": traceback.format_stack()[:-2]}
        path = os.path.join(self.flight_dir, f"rank{self._rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f, indent=1)
        os.replace(path + ".tmp", path)

    def _diagnose(self, reports: dict) -> str | None:
        """The first proven divergence in ``reports`` (rank → full report), as one line, or None.
        Proof: at sequence number k of a group, two members issued different fingerprints, or
        one issued one where a member that reached the check (a final report) issued none."""
        groups = sorted({g for rep in reports.values() for g in rep["member_of"]})
        found = []
        for g in groups:
            members = next(rep["member_of"][g] for rep in reports.values()
                           if g in rep["member_of"])
            have = {r: reports[r]["groups"].get(g, {"ops": []})["ops"] for r in members
                    if r in reports}
            if len(have) < 2:
                continue
            final = {r for r in have if reports[r]["label"]}
            base = next((reports[r]["groups"][g]["base"] for r in have
                         if g in reports[r]["groups"]), 0)
            for i in range(max(len(v) for v in have.values())):
                at = {r: v[i] for r, v in have.items() if i < len(v)}
                none = {r for r in final if i >= len(have[r])}
                if len({e[0] for e in at.values()}) > 1 or (at and none):
                    found.append((base + i + 1, g, at, none, reports))
                    break
        if not found:
            return None
        seq, g, at, none, reports = min(found, key=lambda f: (f[0], f[1]))
        return self._message(seq, g, at, none, reports)

    @staticmethod
    def _message(seq: int, g: str, at: dict, none: set, reports: dict) -> str:
        by_fp: dict[str, list[int]] = collections.defaultdict(list)
        for r, e in sorted(at.items()):
            by_fp[e[0]].append(r)
        variants = [(ranks, f"called {fp}") for fp, ranks in by_fp.items()]
        if none:
            labels = sorted({reports[r]["label"] for r in none})
            variants.append((sorted(none), f"issued no collective (reached the check "
                                           f"{' / '.join(labels)})"))
        # the reference (named last): the variant with the most ranks, then the ranks that
        # issued nothing, then the one with the lowest rank
        variants.sort(key=lambda v: (len(v[0]), v[1].startswith("issued"), -min(v[0])))
        *odd, ref = variants
        odd_text = ", ".join(f"{_ranks_text(rs)} {what}" for rs, what in odd)
        e = next(iter(at.values()))
        where = f"in step {e[2]}" if e[1] == "step" else f"in phase {e[1]!r} after step {e[2]}"
        axis, ranks = g.split(":")
        return (f"{odd_text} where {_ranks_text(ref[0])} {ref[1]}, at collective #{seq} on "
                f"{axis} (ranks {ranks}) {where}: {_FIX}")

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
            self._raise(self._message(n, g, at, set(), {}))
        if n > 2:  # every member has read #n-2 (it published #n-1 after reading it)
            s.delete_key(f"e/{g}/{n - 2}/{self._rank}")


# A message with the key's tag is sent only in answer to one with the value's tag: a pipeline
# stage sends the gradient of a microbatch (pp_bwd) only after it received its activation
# (pp_fwd). In a mutual wait this names which of the two skipped its send.
ANSWERS = {"pp_bwd": "pp_fwd"}

_P2P_FIX = ("every send must meet its receive: look for a send under a stage-conditional "
            "branch, or pipeline schedules that differ between the ranks")


def _where(state: dict) -> str:
    """Where a rank is, from its report or position: "waits at the check before step 3"."""
    if state.get("label"):
        return f"waits at the check {state['label']}"
    w = state.get("waiting") or state.get("where")
    if w:
        return f"waits {w}"
    last = state.get("last")
    return f"last issued {last[1]} #{last[4]} in step {last[3]}" if last else "issued nothing"


def p2p_findings(states: dict, silent=()) -> list[tuple[str, set]]:
    """The point-to-point diagnosis from the ranks' ``states`` (rank → its report or position,
    as published in the store): for each rank waiting in a receive for message k of a channel
    whose sender sent fewer than k, one sentence naming the receive, the sender and what it
    does instead, with the ranks it names (``silent``: ranks that published no report since
    the last check: stuck in compute, or dead). In a mutual wait (each waits for a message the
    other never sent), the rank that waits for the answer (:data:`ANSWERS`) to a message it
    never sent is named as the one that skipped its send."""
    waits = {r: st["wait_p2p"] for r, st in states.items()
             if r not in silent and (st.get("wait_p2p") or {}).get("op") == "recv"}
    out = []
    for r, w in sorted(waits.items()):
        src, n, chan, tag = w["peer"], w["n"], w["chan"], w["tag"]
        st = states.get(src)
        if st is None:
            out.append((f"rank {r} waits in {w['fp']} for message #{n} of {chan}; rank {src} "
                        f"published nothing (dead before its first collective?)", {r, src}))
            continue
        sent = st.get("sent", {}).get(chan, 0)
        if sent >= n:  # sent: in flight, or received by a receive that was sized differently
            continue
        head = (f"rank {r} waits in {w['fp']} for message #{n} of {chan} (step "
                f"{w.get('step', '?')}), which rank {src} never sent (it sent {sent})")
        skipped = f"rank {src} skipped a {tag} send to rank {r}; {_P2P_FIX}"
        other = waits.get(src)
        if src in silent:
            last = st.get("last")
            out.append((head + (f"; rank {src} has issued nothing since {last[1]} #{last[4]} "
                                f"in step {last[3]}" if last else
                                f"; rank {src} reported nothing")
                        + " (stuck in compute, or dead)", {r, src}))
        elif other and other["peer"] == r and \
                states[r].get("sent", {}).get(other["chan"], 0) < other["n"]:  # a mutual wait
            if ANSWERS.get(other["tag"]) == tag:
                out.append((f"{head}; rank {src} waits in {other['fp']} for message "
                            f"#{other['n']}, the answer to it: {skipped}", {r, src}))
            elif ANSWERS.get(tag) != other["tag"] and r < src:
                out.append((f"{head}, while rank {src} waits in {other['fp']} for message "
                            f"#{other['n']}, which rank {r} never sent: the two wait for each "
                            f"other (one of them skipped a send); {_P2P_FIX}", {r, src}))
        else:
            out.append((f"{head}; rank {src} moved on (it {_where(st)}): {skipped}", {r, src}))
    return out


def diagnose_positions(states: dict) -> str | None:
    """A divergence proven by the ranks' last issued collectives (``states``: rank → its
    position or report, each with ``last`` = [group, fingerprint, phase, step, seq]): two
    ranks whose last collective has the same sequence number of one group and different
    fingerprints. The one line of :class:`CollectiveMismatch`, or None. Used when a rank died
    inside the collective (gloo aborts a receiver of more bytes than it expects)."""
    at: dict = collections.defaultdict(dict)
    for r, st in states.items():
        last = st.get("last")
        if last and ">" not in last[0]:  # a collective's group, not a channel
            at[(last[4], last[0])][r] = last[1:]
    for (seq, g), entries in sorted(at.items()):
        if len({e[0] for e in entries.values()}) > 1:
            return CollectiveChecks._message(seq, g, entries, set(), {})
    return None


def _signal_text(code: int) -> str:
    import signal

    n = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return f"killed by {signal.Signals(n).name}" if n else f"exit code {code}"
    except ValueError:
        return f"exit code {code}"


def diagnose_store(store, failed: dict, first: int | None = None) -> tuple[str | None, dict]:
    """The launcher's diagnosis after ranks failed: ``store`` the launcher's own store (every
    rank's checks published there, :func:`_diag_store`), ``failed`` global rank → exit code
    (negative: killed by that signal; 128 + N likewise) of the ranks that failed. Returns
    (one line or None when nothing was published, the record: the diagnosis, the failures,
    every rank's position and report, for ``RUN/flight/diagnosis.json`` and ``shardwise
    doctor``). The line is the diagnosis a rank published if any (a mismatch, a hang), else a
    divergence the positions prove, else who died and where every rank stands. ``first``: the
    rank known to have failed first (the launcher's :func:`~shardwise.launch._failed_first`);
    a signalled rank other than it was stopped by the launcher after that failure, and is
    named so rather than as one that died."""
    latest = _latest_topology(store, failed)
    if latest is None:
        return None, {}
    prefix, ps, ranks, states = latest
    abort = ps.get("abort").decode() if ps.check(["abort"]) else ""
    kind, _, msg = abort.partition("|")
    died = {r: c for r, c in failed.items()
            if "connection broke" not in ((states.get(r) or {}).get("where") or "")
            and (c < 0 or c > 128)}
    proven = diagnose_positions(states)
    if not msg:
        kind = "mismatch" if proven else "died"
        msg = proven
    # the positions prove it, published by a survivor that was not stopped before (the proof
    # of _peer_broke) or by nobody: "…, at collective #2 on dp (…) in step 1 (rank 0 was
    # killed by SIGABRT inside it): every rank …"
    if proven and msg == proven and died:
        msg = proven[:-len(_FIX) - 2] + " (" + ", ".join(
            f"rank {r} was {_signal_text(c)}" for r, c in sorted(died.items())) + \
            f" inside it): {_FIX}"
    if not msg and died:
        parts = []
        for r, c in sorted(died.items()):
            last = (states.get(r) or {}).get("last")
            verb = "died" if first is None or r == first else "was stopped by the launcher"
            parts.append(f"rank {r} {verb} ({_signal_text(c)}) and has issued nothing since "
                         + (f"{last[1]} #{last[4]} in step {last[3]}" if last
                            else "the start"))
        others: dict = collections.defaultdict(list)
        for r in ranks:
            if r not in died and r in states:
                w = (states[r].get("where") or "").replace(" when a peer's connection broke",
                                                           "")
                others[f"wait {w}" if w else _where(states[r]).replace("waits", "wait")
                       ].append(r)
        parts += [f"{_ranks_text(rs)} {w}" for w, rs in others.items()]
        msg = "; ".join(parts) + (": the survivors were stopped; find why it died (the kernel's "
                                  "OOM killer: dmesg; a kill by the scheduler; its last lines)")
    record = {"diagnosis": msg or None, "kind": kind or None, "failed": failed,
              "ranks": ranks, "positions": states, "prefix": prefix}
    return msg or None, record


def _latest_topology(store, failed=()):
    """(prefix, prefixed store, ranks, rank → position) of the latest topology whose checks
    published in ``store``; its ranks as it registered them, else those in ``failed``. None
    when no topology published."""
    if not store.check([TOPOLOGIES_KEY]):
        return None
    prefixes = [p for p in store.get(TOPOLOGIES_KEY).decode().splitlines() if p]
    ps = dist.PrefixStore(prefixes[-1], store)  # the latest topology
    ranks = json.loads(ps.get("ranks")) if ps.check(["ranks"]) else sorted(failed)
    states = {r: json.loads(ps.get(f"pos/{r}")) for r in ranks if ps.check([f"pos/{r}"])}
    return prefixes[-1], ps, ranks, states


def store_positions(store) -> dict:
    """Global rank → its last published position (:meth:`CollectiveChecks._position`: its last
    op, where it is, its pid, …) for the latest topology in ``store``; {} when none published."""
    latest = _latest_topology(store)
    return latest[3] if latest else {}


def diagnose_stopped(store) -> str | None:
    """The diagnosis rank 0 prints when torchrun stops the job (it SIGTERMs every survivor as
    soon as one rank fails, so no survivor's own wait can speak): from every rank's position in
    ``store`` (the c10d store the checks publish in), a divergence the positions prove or a
    message a rank published (:func:`diagnose_store`), else the ranks behind on the group of
    their last collective — they stopped issuing (failed, or stuck in compute) — and where the
    others wait. None when no rank is behind."""
    line, record = diagnose_store(store, {})
    if line:
        return line
    states = record.get("positions") or {}
    ranks = record.get("ranks") or sorted(states)
    last = {r: st["last"] for r, st in states.items() if st.get("last")}
    top: dict = {}
    for entry in last.values():  # [group, fingerprint, phase, step, seq]
        top[entry[0]] = max(top.get(entry[0], 0), entry[4])
    behind = [r for r in ranks if r not in last or last[r][4] < top.get(last[r][0], 0)]
    if not behind:
        return None
    parts = [f"rank {r} has issued nothing since "
             + (f"{last[r][1]} #{last[r][4]} in step {last[r][3]}" if r in last else "the start")
             for r in behind]
    others: dict = collections.defaultdict(list)
    for r in ranks:
        if r not in behind and r in states:
            where = _where(states[r]).replace(" when a peer's connection broke", "")
            others[where.replace("waits", "wait")].append(r)
    parts += [f"{_ranks_text(rs)} {w}" for w, rs in others.items()]
    return ("; ".join(parts) + ": torchrun stopped the job after a rank failed (its summary "
            "gives the exit code); find why the rank behind stopped issuing")


_TORCHRUN_HANDLER: list = []


def _diagnose_when_torchrun_stops() -> None:
    """On rank 0 under torchrun (main thread, once per process): a SIGTERM handler that prints
    ``[shardwise] diagnosis (rank 0, stopped by torchrun): …`` (:func:`diagnose_stopped`) to
    stderr and exits with 128 + the signal, as the default action's status would read."""
    import signal
    import sys
    import threading

    if _TORCHRUN_HANDLER or threading.current_thread() is not threading.main_thread():
        return

    def stopped(signum, frame):
        try:
            line = diagnose_stopped(dist.distributed_c10d._get_default_store())
        except Exception:  # noqa: BLE001 - a diagnosis aid: never delay the stop with ours
            line = None
        if line:
            sys.stderr.write(f"[shardwise] diagnosis (rank 0, stopped by torchrun): {line}\n")
            sys.stderr.flush()
        os._exit(128 + signum)

    _TORCHRUN_HANDLER.append(signal.signal(signal.SIGTERM, stopped))


def check(topo, step: int | None = None, label: str | None = None) -> None:
    """Compare the collectives every rank of ``topo`` issued since the last check (the step
    boundary of ``--check-collectives step|every``); a no-op for ``off``, for a world of one
    rank, or for a topology without checks. ``step``: the step about to run. Raises
    :class:`~shardwise.errors.CollectiveMismatch` (on every rank, one message) or
    :class:`~shardwise.errors.CollectiveTimeout` (a rank never reached the check)."""
    checks = getattr(topo, "checks", None)
    if checks is not None:
        checks.check(step, label)


__all__ = ["MODES", "CollectiveChecks", "check", "diagnose_positions", "diagnose_stopped",
           "diagnose_store", "fingerprint", "p2p_findings", "store_positions"]
