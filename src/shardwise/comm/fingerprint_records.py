"""What a rank of a :class:`~shardwise.comm.fingerprint.CollectiveChecks` publishes about itself,
for its peers and the launcher: its *position* (its position file or the store's ``pos/{r}``),
its full report (``f/{epoch}/{r}``), its flight record (``flight_dir/rank{r}.json``), and the
topology's one diagnosis (the ``abort`` key: first writer wins, every rank raises it)."""

from __future__ import annotations

import json
import os
import time

from ..errors import CollectiveHang, CollectiveMismatch
from .positions import PositionFile, read_positions


class RankRecords:
    """The records part of :class:`~shardwise.comm.fingerprint.CollectiveChecks` (a base class
    of it: its state, ``store()`` and ``_rank`` are the checks')."""

    def _position(self, where: str | None = None) -> None:
        """Publish ``pos/{rank}``: this rank's step, its last issued op (history entry), where
        it is (``where``: e.g. "at the check before step 3", "in all_reduce(dp, grad,
        float32[4]) #5" while it waits in its last op; None: running, past it), its point-to-point
        counts, its flight folder and its process id (the local launcher maps the exit statuses
        it recorded to ranks with it), with the wall time (s since the epoch): into this rank's
        position file under the local launcher, else (or when it does not fit) in the store."""
        last = self.history[-1] if self.history else None
        # json.dumps of {rank, pid, step, epoch, last, where, sent, recvd, flight_dir, t}, from
        # parts kept while they hold (a collective publishes twice with one entry): ~3 µs, not ~9
        key = (self.step, self.epoch, self.flight_dir, self._p2p, os.getpid())
        try:
            if self._pos_parts[0] != key:
                self._pos_parts = (key, json.dumps(
                    {"rank": self._rank, "pid": os.getpid(), "step": self.step,
                     "epoch": self.epoch})[:-1], json.dumps(
                    {"sent": self.sent, "recvd": self.recvd, "flight_dir": self.flight_dir})[1:-1])
            if self._pos_last[0] is not last:
                self._pos_last = (last, json.dumps(last))
            _, head, tail = self._pos_parts
            text = (f'{head}, "last": {self._pos_last[1]}, "where": {json.dumps(where)}, '
                    f'{tail}, "t": {time.time()!r}}}')
            s = self.store()
            if self._posfile is None:
                self._posfile = PositionFile.open(self._prefix, self._rank) or False
            if not (self._posfile and self._posfile.write(text)):
                s.set(f"pos/{self._rank}", text)
        except Exception:  # noqa: BLE001 - positions are best effort; the check is not
            pass

    def _positions(self) -> dict:
        """rank → its published position (its file or ``pos/{r}``), for the ranks that
        published one."""
        return read_positions(self.store(), self._prefix, self.topo.ranks)

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

    def _flight_record(self, what: str | None = None, waited: float | None = None,
                       diagnosis: str | None = None) -> None:
        """Write ``flight_dir/rank{r}.json``: this rank's last
        :data:`~shardwise.comm.fingerprint.HISTORY` fingerprints (collectives and point-to-point
        messages), what it waits for (default: the current wait), for how long (s), the
        point-to-point counts per channel, the ``diagnosis`` it raises, and its Python stack.
        Nothing without a ``flight_dir``."""
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

    def _raise(self, msg: str, kind: str = "mismatch", cause: BaseException | None = None):
        """Publish ``msg`` as the topology's one diagnosis (unless another rank was first) and
        raise it (``kind`` "mismatch": :class:`CollectiveMismatch`; "hang":
        :class:`CollectiveHang`), after writing this rank's flight record."""
        self.store().compare_set("abort", "", f"{kind}|{msg}")
        self._raise_known(cause)

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


__all__ = ["RankRecords"]
