"""What the launcher, ``shardwise doctor`` and torchrun's stop print: the diagnosis of a desync or
a hang from what the ranks' :class:`~shardwise.comm.fingerprint.CollectiveChecks` published.

The per-step agreement check (:mod:`shardwise.comm.fingerprint`) publishes every rank's position
(its last fingerprint, step, point-to-point counts, whether it waits: in a memory-mapped file under
the local launcher, else in the store, :mod:`shardwise.comm.positions`) and, in a store, while it
waits, its full report (every fingerprint since the last check). From those this
module proves a divergence (:func:`diagnose_reports`: two ranks issued different collectives at
one sequence number of a group, or one issued one where a peer that reached the check issued
none; :func:`diagnose_positions`: from the last collective of each rank alone, for a rank that
died inside it), names an unanswered point-to-point message (:func:`p2p_findings`), words a hang
(:func:`hang_message`) and, after the job failed, composes the one line the local launcher
(:func:`diagnose_store`) or rank 0 under torchrun (:func:`diagnose_stopped`) prints. Everything
here only reads the store (and the position files) and words what it finds; nothing waits on a
collective.
"""

from __future__ import annotations

import collections
import json
import os

import torch.distributed as dist

from .positions import read_positions

TOPOLOGIES_KEY = "shardwise/topologies"  # the checks' prefixes, one a line, oldest first

DESYNC_FIX = ("every rank of a group must issue the same collectives, with the same shapes, in the "
        "same order: look for a collective under a rank-conditional branch (a save, a log line "
        "or an evaluation on one rank only) or a shape that depends on the rank's data")


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def diagnose_reports(reports: dict) -> str | None:
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
    return divergence_message(seq, g, at, none, reports)

def divergence_message(seq: int, g: str, at: dict, none: set, reports: dict) -> str:
    """The one line of :class:`~shardwise.errors.CollectiveMismatch`: at collective #``seq`` of
    group ``g`` ("axis:r0,r1,…"), ``at`` (rank → [fingerprint, phase, step, seq]) is what each
    rank issued there and ``none`` the ranks that reached the check (labels in ``reports``)
    having issued nothing there."""
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
            f"{axis} (ranks {ranks}) {where}: {DESYNC_FIX}")


def hang_message(reports: dict, positions: dict, ranks, rank: int, step: int, what: str,
                 waited: float, hang_after_s: float, flight_dir) -> str:
    """Every rank's position from ``reports`` (and, for a rank that published no report,
    its last position, from ``positions``): a receive whose message its sender never sent
    first, then where each rank waits, and who reported nothing. ``ranks``: the topology's
    global ranks; ``rank``, ``step``: the rank that waited and its step; ``what``, ``waited``
    (s): where it waited and how long; ``hang_after_s``, ``flight_dir``: named in the line."""
    states = {r: {**positions.get(r, {}), **rep} for r, rep in reports.items()}
    silent = [r for r in ranks if r not in reports]
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
            f"the check before step {step}"
        parts.append(f"rank {r} reported nothing since {since} (stuck in compute, in code "
                     f"outside shardwise.comm, or dead)")
    parts += [f"{_ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'} {w}"
              for w, rs in ((w, [r for r in rs if r not in named]) for w, rs in where.items())
              if rs]
    return (f"{'; '.join(parts)}: rank {rank} waited {waited:.1f} s (--hang-after "
            f"{hang_after_s:g}); see where a silent rank is with py-spy dump --pid PID"
            + (f"; flight records in {flight_dir}" if flight_dir else ""))


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
            return divergence_message(seq, g, entries, set(), {})
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
        msg = proven[:-len(DESYNC_FIX) - 2] + " (" + ", ".join(
            f"rank {r} was {_signal_text(c)}" for r, c in sorted(died.items())) + \
            f" inside it): {DESYNC_FIX}"
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
    return prefixes[-1], ps, ranks, read_positions(ps, prefixes[-1], ranks)


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


def diagnose_when_torchrun_stops() -> None:
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


__all__ = ["TOPOLOGIES_KEY", "diagnose_positions", "diagnose_reports", "diagnose_stopped",
           "diagnose_store", "divergence_message", "hang_message", "p2p_findings",
           "store_positions"]
