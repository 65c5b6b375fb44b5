"""How a rank of a :class:`~shardwise.comm.fingerprint.CollectiveChecks` waits without hanging:
a collective on a host-blocking backend (gloo) in slices of :data:`SLICE_S`, a point-to-point
message in a daemon thread, the store in short polls; after each slice it reports and raises a
divergence any rank has proven, or :class:`~shardwise.errors.CollectiveHang` past
``--hang-after``; a wait that fails because a peer died raises what the positions prove."""

from __future__ import annotations

import time

from ..errors import CollectiveTimeout
from .diagnosis import DESYNC_FIX, diagnose_positions, diagnose_reports, hang_message

SLICE_S = 0.5  # seconds a rank waits (in a collective or at the check) before it reports


class SlicedWaits:
    """The waits of :class:`~shardwise.comm.fingerprint.CollectiveChecks` (a base class of it:
    its state, and the records of :class:`~shardwise.comm.fingerprint_records.RankRecords`,
    are the checks')."""

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
                    f"in a collective its peers never issued) or died; {DESYNC_FIX}")
            if now - last >= SLICE_S:
                on_slice()
                last = now
            time.sleep(nap)
            nap = min(nap * 2, 0.02)

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
        msg = diagnose_reports(reports)
        if msg and len(reports) < self.topo.world_size and self._found != self.epoch:
            self._found = self.epoch  # proven, but wait one slice more for every rank's report
            return
        if msg:
            self._raise(msg)

    def _hang_message(self, reports: dict, what: str, waited: float) -> str:
        """:func:`~shardwise.comm.diagnosis.hang_message` for this rank's wait."""
        try:
            positions = self._positions()
        except Exception:  # noqa: BLE001 - the reports alone still name the positions
            positions = {}
        return hang_message(reports, positions, self.topo.ranks, self._rank, self.step, what,
                            waited, self.hang_after_s, self.flight_dir)


__all__ = ["SLICE_S", "SlicedWaits"]
