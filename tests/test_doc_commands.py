"""Every example command in the README and docs/ runs as written (issue 23): the extraction and
each command's kind, the templates' flags, and the runs of the pages not in ``PART2`` (those are
tests/test_doc_commands_part2.py's, so that the two run on both xdist workers). How commands are
found, shrunk, classified and run: tests/doc_commands.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from doc_commands import (BY_HAND, COMMANDS, NAMED, PAGES, PART2, ROOT, RUN_PAGES, SLOW_PAGES,
                          SUBCOMMANDS, _kind, page_params, run_cli_argvs, run_page, runs_of,
                          same_case)


def test_the_pages_show_commands_and_each_has_a_kind():
    """The extraction finds the pages' commands (a regex that found nothing would pass the rest
    vacuously), and nothing falls through as unclassified; a command named to another test is
    run there with the same arguments; a command left to an earlier page is run there; every
    page with runs is in one of the two files."""
    runs = [c for _, c in COMMANDS if _kind(c) == "run"]
    subs = {shlex.split(c)[1] for c in runs if c.startswith("shardwise ")}
    assert {"train", "verify", "trace", "bench", "plan", "export"} <= subs, subs
    assert len(runs) >= 30, runs
    for cmd, test in BY_HAND.items():
        assert any(c == cmd for _, c in COMMANDS), f"{cmd} is no longer on a page: drop it"
        assert (ROOT / test).exists()
    for cmd, test in NAMED.items():
        assert any(c == cmd for _, c in COMMANDS), f"{cmd} is no longer on a page: drop it"
        argvs = run_cli_argvs(test)
        assert any(same_case(cmd, argv) for argv in argvs), \
            f"{test} does not run {cmd} (it runs {argvs}): run it there or drop it from NAMED"
    ran = []
    for page in RUN_PAGES:
        mine = runs_of(page)
        for cmd in [c for c in _commands_of(page) if _kind(c) == "run" and c not in mine]:
            assert cmd in ran, f"{page.name}: {cmd} is left to an earlier page that runs it not"
        ran += mine
    assert PART2 <= {p.name for p in RUN_PAGES}, PART2 - {p.name for p in RUN_PAGES}
    assert SLOW_PAGES <= {p.name for p in RUN_PAGES}, SLOW_PAGES - {p.name for p in RUN_PAGES}
    # `make test` keeps a page of each file (the rest: `make test-slow`)
    assert {p.name for p in RUN_PAGES} - PART2 - SLOW_PAGES and PART2 - SLOW_PAGES
    for _, cmd in COMMANDS:  # a page's pytest line names test files that exist
        for name in re.findall(r"tests/\S+\.py", cmd) if "pytest" in cmd else []:
            assert (ROOT / name).exists(), cmd


def _commands_of(page: Path) -> list[str]:
    return [c for p, c in COMMANDS if p == page]


@pytest.mark.parametrize("page,cmd", [(p, c) for p, c in COMMANDS if _kind(c) == "template"],
                         ids=lambda x: x.name if isinstance(x, Path) else x[:60])
def test_a_template_names_only_real_flags(page, cmd):
    """A template cannot run as written, but each ``--flag`` it shows must exist."""
    from shardwise.cli import _parser

    argv = shlex.split(cmd.replace("[", " ").replace("]", " ").replace("|", " "))
    if "torchrun" in argv:  # torchrun [its flags] -m shardwise <sub> [ours]
        argv = argv[argv.index("-m") + 1:]
    if argv[0].startswith("shardwise.learn."):  # torchrun … -m shardwise.learn.NAME [flags]
        argv = ["shardwise", "learn", argv[0].rsplit(".", 1)[1], *argv[1:]]
    if argv[:3] == ["python", "-m", "shardwise.tools.plan"]:
        argv = ["shardwise", "plan", *argv[3:]]
    assert argv[0] == "shardwise" and argv[1] in SUBCOMMANDS, cmd
    sub = argv[1]
    if len(argv) == 2 or argv[2:] == ["…"]:
        pytest.fail(f"{page.name}: {cmd}: a template with nothing to check: show flags")
    choices = _parser()._subparsers._group_actions[0].choices
    known = {o for a in choices[sub]._actions for o in a.option_strings}
    flags = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
    assert set(flags) <= known, f"{page.name}: {cmd}: unknown {set(flags) - known}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", page_params([p for p in RUN_PAGES if p.name not in PART2]))
def test_each_command_on_the_page_runs(page, cache_dir, tmp_path):
    """One page's runnable commands, in order, in one scratch folder: each exits 0."""
    run_page(page, cache_dir, tmp_path)
