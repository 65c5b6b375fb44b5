"""``shardwise doctor RUN``: what went wrong in a run that hung, desynced or lost a rank.

It reads the run's flight records, ``RUN/flight/rank{r}.json`` (written by every rank that
raised a diagnosis of :mod:`shardwise.comm.fingerprint`, that waited past ``--hang-after``,
or whose peer died under it: its last 64 collectives and point-to-point messages, what it
waited for and for how long, the diagnosis it raised, its Python stack), and
``RUN/flight/diagnosis.json`` (written by the local launcher after a failure: every rank's
last position in the store, the ranks that failed and their exit codes, the launcher's
one-line diagnosis). It prints

1. the diagnosis, one line (the one the ranks raised, else the launcher's);
2. the likely cause and its fix, one of :data:`CAUSES`;
3. per rank, where it was (what it waited for, for how long) and the timeline of its last
   collectives and messages (step, sequence number, fingerprint, group or channel).

It needs no process group and no torch: it only reads files. Exit status 0 when it found
records, 1 when the folder holds none (nothing was recorded: the run did not hang, or ran
with ``--check-collectives off``, or its ranks were killed before they could write).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..readers import read_json

# cause → (what it means, the fix)
CAUSES = {
    "rank-conditional collective": (
        "a collective issued by some ranks of a group only (a save, a log line or an "
        "evaluation under `if rank == 0:`), or collectives issued in different orders",
        "issue every collective on every rank of the group, in the same order: gather on all "
        "ranks and write on rank 0, or move the rank-0-only work off the collectives (a file, "
        "the store)"),
    "shape mismatch": (
        "the same collective with a different shape or dtype on some ranks (a length that "
        "depends on the rank's data, a config that differs between ranks)",
        "pad to a shape every rank agrees on (all-reduce the length first), and launch every "
        "rank with the same config; on gloo rerun with --check-collectives every to have it "
        "named before anything is sent"),
    "missing pipeline send": (
        "a pipeline stage skipped a send its neighbour receives (a stage-conditional send, or "
        "schedules that differ between the stages: --schedule, --microbatches, --pp)",
        "every send must meet its receive: run the same schedule flags on every stage, and "
        "check the schedule with the simulator (docs/pipeline-parallel.md) before running it"),
    "rank stuck in compute": (
        "a rank that stopped issuing collectives while its peers wait (a long or endless "
        "computation, I/O, a lock, code outside shardwise.comm)",
        "py-spy dump --pid PID on that rank shows where it is; if the work is legitimately "
        "that long (a first step that compiles, a large checkpoint load) raise --hang-after"),
    "rank that died": (
        "a rank was killed (the kernel's OOM killer, a scheduler, a signal) or crashed; the "
        "others were stopped",
        "find why it died: dmesg for the OOM killer, its last lines; shardwise plan estimates "
        "a layout's memory; --max-restarts N --resume auto restarts the job from its last "
        "checkpoint"),
}


def flight_dir(run: str | Path) -> Path:
    """The flight folder of ``run``: ``RUN/flight``, or ``run`` itself if it holds records."""
    run = Path(run)
    return run if any(run.glob("rank*.json")) or (run / "diagnosis.json").exists() \
        else run / "flight"


def load(run: str | Path) -> tuple[dict, dict]:
    """(rank → its flight record, the launcher's diagnosis record or {}) of ``run``."""
    d = flight_dir(run)
    records = {}
    for f in sorted(d.glob("rank*.json")):
        m = re.fullmatch(r"rank(\d+)\.json", f.name)
        if m:
            records[int(m.group(1))] = read_json(f, "flight record")
    launcher = read_json(d / "diagnosis.json", "launcher's diagnosis") \
        if (d / "diagnosis.json").exists() else {}
    return records, launcher


def diagnosis(records: dict, launcher: dict) -> str | None:
    """The one line: the diagnosis most ranks raised (they raise the same), else the
    launcher's."""
    lines = [r["diagnosis"] for r in records.values() if r.get("diagnosis")
             and not r["diagnosis"].startswith("a peer's connection broke")]
    if lines:
        return max(set(lines), key=lines.count)
    return launcher.get("diagnosis")


def cause(line: str | None, records: dict, launcher: dict) -> str | None:
    """The likely cause (a key of :data:`CAUSES`) of diagnosis ``line``, from its form (the
    messages of :mod:`shardwise.comm.fingerprint`) and the exit codes the launcher saw."""
    failed = {int(r): c for r, c in (launcher.get("failed") or {}).items()}
    signalled = any(c < 0 or c > 128 for c in failed.values())
    if line is None:
        return "rank that died" if signalled else None
    if "skipped a" in line and " send to rank " in line:
        return "missing pipeline send"
    m = re.match(r"(?:ranks? [\d,]+) called (\w+)\(([^,]+), ([^,]+), ([^)]*?)\) where "
                 r"(?:ranks? [\d,]+) called (\w+)\(([^,]+), ([^,]+), ", line)
    if m:  # two fingerprints at one sequence number: same op, group and tag → a shape
        same = m.group(1) == m.group(5) and m.group(2) == m.group(6) and \
            m.group(3) == m.group(7)
        return "shape mismatch" if same else "rank-conditional collective"
    if re.match(r"ranks? [\d,]+ called ", line) and "issued no collective" in line:
        return "rank-conditional collective"
    if " died (" in line or (signalled and launcher.get("kind") == "died"):
        return "rank that died"
    if "reported nothing since" in line:
        return "rank that died" if signalled else "rank stuck in compute"
    return None


def timeline(rec: dict, last: int = 8) -> list[str]:
    """The last ``last`` collectives and messages of one flight record, oldest first."""
    rows = []
    for x in rec.get("last", [])[-last:]:
        rows.append(f"    step {x['step']:>3}  #{x['seq']:<4} {x['fingerprint']:<58} "
                    f"{x['group']}" + (f"  [{x['phase']}]" if x["phase"] != "step" else ""))
    return rows


def report(run: str | Path, last: int = 8) -> tuple[str, bool]:
    """(the text ``shardwise doctor`` prints for ``run``, whether any record was found)."""
    records, launcher = load(run)
    d = flight_dir(run)
    if not records and not launcher:
        return (f"shardwise doctor: no flight records in {d} (the run wrote none: it did not "
                f"hang, it ran with --check-collectives off, or its ranks were killed before "
                f"they could write)"), False
    line = diagnosis(records, launcher)
    why = cause(line, records, launcher)
    out = [f"flight records in {d}: "
           f"{'ranks ' + ','.join(map(str, sorted(records))) if records else 'no rank'}"
           + ("; the launcher's positions of every rank" if launcher else ""),
           "", f"diagnosis: {line or '(none recorded)'}"]
    if why:
        what, fix = CAUSES[why]
        out += ["", f"likely cause: {why}: {what}", f"fix: {fix}"]
    failed = launcher.get("failed") or {}
    if failed:
        out += ["", "failed ranks (exit codes as the launcher saw them; negative: the signal): "
                + ", ".join(f"rank {r}: {c}" for r, c in sorted(failed.items(),
                                                                key=lambda kv: int(kv[0])))]
    out += ["", f"timelines (the last {last} collectives and messages per rank, oldest first):"]
    positions = launcher.get("positions") or {}
    ranks = sorted(set(records) | {int(r) for r in positions})
    for r in ranks:
        rec = records.get(r)
        pos = positions.get(str(r)) or positions.get(r) or {}
        if rec is not None:
            out.append(f"  rank {r}: {rec['waiting']} for {rec['waited_s']:.1f} s (step "
                       f"{rec['step']})")
            out += timeline(rec, last)
        else:
            lst = pos.get("last")
            where = pos.get("where") or (f"last issued {lst[1]} #{lst[4]} in step {lst[3]}"
                                         if lst else "issued nothing")
            out.append(f"  rank {r}: no flight record; its last position in the store: {where}")
    return "\n".join(out), True


def main(run: str, last: int = 8) -> int:
    """``shardwise doctor RUN``: print :func:`report`; 0 if records were found, else 1."""
    text, found = report(run, last)
    print(text)
    return 0 if found else 1
