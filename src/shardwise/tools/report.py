"""``shardwise report RUN [RUN …] [--out FILE.html]`` and the report ``shardwise train`` writes.

One run folder → its page (default ``RUN/report.html``); two or more → the comparison
(default ``./report.html``); a ``.json`` argument is read as ``shardwise verify --json``
output and drawn as the parity matrix, on its own or below the runs.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..errors import ShardwiseConfigError
from ..readers import read_json

log = logging.getLogger("shardwise")


def add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="one self-contained HTML page for a run folder, or "
                       "comparing several (curves overlaid, per-step |Δloss|); a verify "
                       "--json file adds the parity matrix")
    r.add_argument("paths", nargs="+", metavar="RUN",
                   help="run folders (runs/<timestamp>), and/or verify.json files")
    r.add_argument("--out", metavar="FILE.html", default=None,
                   help="where to write (default: RUN/report.html for one run, else "
                        "./report.html)")
    r.add_argument("--threshold", type=float, default=None,
                   help="|Δloss| the comparison calls equal (default 1e-5)")
    r.set_defaults(func=lambda args, argv: main(args.paths, args.out, args.threshold))


def build(paths: list[str], out: str | None = None, threshold: float | None = None) -> Path:
    """Write the page for ``paths`` and return its path. Raises ShardwiseConfigError for a
    path that is neither a folder nor a readable verify JSON."""
    from ..report import data as rd
    from ..report.compare import compare_page
    from ..report.html import run_page

    runs, verify = [], []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            runs.append(rd.load_run(path))
        elif path.is_file() and path.suffix == ".json":
            v = read_json(path, "shardwise report", "give a run folder or a `shardwise verify "
                          "--json` file")
            if not isinstance(v, dict) or "cases" not in v:
                raise ShardwiseConfigError(f"{p}: no \"cases\" list: not `shardwise verify "
                                           "--json` output")
            v.setdefault("source", str(path))
            verify.append(v)
        else:
            raise ShardwiseConfigError(f"{p}: no such run folder or verify JSON file: give "
                                       "runs/<timestamp> folders (or a verify.json)")
    th = rd.THRESHOLD if threshold is None else threshold
    if len(runs) >= 2:
        html = compare_page(runs, verify, th)
    elif runs:
        html = run_page(runs[0], verify)
    else:
        from ..report.page import page, verify_section

        html = page("shardwise verify", ", ".join(v["source"] for v in verify),
                    [verify_section(v, sid=f"verify{'' if i == 0 else i}")
                     for i, v in enumerate(verify)])
    target = Path(out) if out else (Path(runs[0]["path"]) / "report.html" if len(runs) == 1
                                    else Path("report.html"))
    _write_page(target, html, given=out is not None)
    return target


def _write_page(target: Path, html: str, given: bool) -> None:
    """``html`` into ``target`` (its folders created), or one :class:`ShardwiseConfigError`
    naming the path and the fix: a file where a folder of the path should be, no permission, a
    full disk. A partial page is removed."""
    flag = f"--out {target}" if given else str(target)
    anc = target.parent.absolute()
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ShardwiseConfigError(f"{flag}: cannot be written because {anc} is a file, not a "
                                   "folder: choose another --out")
    if target.is_dir():
        raise ShardwiseConfigError(f"{flag} is a folder: give a file path, e.g. "
                                   f"{target / 'report.html'}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
    except OSError as e:
        try:
            target.unlink(missing_ok=True)
        except OSError:
            pass
        raise ShardwiseConfigError(f"{flag}: cannot write there ({e.strerror or e}): choose "
                                   "a writable --out (or free space)") from None


# what a run folder holds (any one will do: a crashed run may have written only some)
RUN_FILES = ("metrics.jsonl", "config.toml", "summary.json", "ledger.json", "checkpoints",
             "flight", "report_data.json")


def check_run_folders(paths: list[str]) -> None:
    """Raise ShardwiseConfigError (exit 2, before anything is written) for a folder argument
    that holds none of :data:`RUN_FILES`: an empty or unrelated folder would give a report of
    nothing."""
    for p in paths:
        path = Path(p)
        if path.is_dir() and not any((path / f).exists() for f in RUN_FILES):
            what = "is empty" if not any(path.iterdir()) else "holds no run files"
            raise ShardwiseConfigError(
                f"{p} {what} (none of {', '.join(RUN_FILES)}): give a folder that shardwise "
                "train wrote (its --out, e.g. runs/<timestamp>)")


def main(paths: list[str], out: str | None, threshold: float | None) -> int:
    check_run_folders(paths)
    target = build(paths, out, threshold)
    print(f"shardwise report: {target} ({target.stat().st_size / 1024:,.0f} KiB, "
          "self-contained; open it in a browser)")
    return 0


def recorded_since(run, t0: float) -> bool:
    """Whether the run folder's ``report_data.json`` was written at or after ``t0`` (epoch
    seconds): the launcher's test that its workers got as far as recording this run."""
    from ..report.record import FILE

    try:
        return (Path(run) / FILE).stat().st_mtime >= t0
    except OSError:
        return False


def write_run_report(run, quiet: bool = False) -> Path | None:
    """``RUN/report.html`` for the run folder ``run``, best effort: any error is logged as one
    line and swallowed (the report must never hide how the run ended). Returns the path, or
    None when nothing was written."""
    try:
        if not Path(run).is_dir():
            return None
        path = build([str(run)])
        if not quiet:
            log.info(f"report: {path}")
        return path
    except Exception as e:  # noqa: BLE001 — best effort by design
        print(f"shardwise: could not write the report of {run}: {e!r}", file=sys.stderr)
        return None


def train_with_report(cfg) -> dict:
    """:func:`shardwise.train.loop.train`, then (rank 0) ``RUN/report.html``; on an exception
    rank 0 writes what the run folder holds and the exception propagates unchanged."""
    import dataclasses
    import os

    from ..train.loop import default_out_dir, train

    if not cfg.out:  # the folder the report goes to must be known before train() runs
        cfg = dataclasses.replace(cfg, out=default_out_dir())
    if cfg.wandb:  # every rank: the same clear error before any collective
        from ..report.wandb_log import require_wandb

        require_wandb()
    main_rank = int(os.environ.get("RANK", "0")) == 0
    from ..report.record import started_here

    try:
        summary = train(cfg)
    except BaseException:
        if main_rank and started_here(cfg.out):  # not a folder the run was refused
            write_run_report(cfg.out, quiet=True)
        raise
    if main_rank:
        write_run_report(cfg.out)
    return summary
