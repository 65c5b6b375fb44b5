"""The pages' example commands, for tests/test_doc_commands.py and test_doc_commands_part2.py:
every example command in the README and docs/ runs as written (issue 23).

The commands are read from the pages themselves: each line of a fenced code block, and each
inline code span, that starts with ``shardwise <subcommand>`` (or ``python``). Each is then

* **run**, in a scratch folder, one page's commands in order (a page's ``export`` reads the run
  its ``train`` wrote), made small without changing what it shows: ``train`` runs 2 steps,
  ``verify`` 1 step, ``bench`` 1 step of 1 round, ``plan --plot`` the first two of its
  ``--plot-gpus`` (each count is a whole layout search, ~10 s), and ``tiny`` replaces the
  default model of train and bench where the command's own validator accepts it (its 2 kv heads do not split
  over tp = 4; ``trace`` already defaults to tiny, with layers enough for its stages);
* or, for a template (a placeholder such as ``[flags]``, ``FILE.toml``, ``RUN``, ``…``),
  **parsed**: every ``--flag`` it names must be a flag of its subcommand;
* or **named elsewhere**, with the reason: another machine (``--device cuda``, torchrun over
  nodes), the test suite itself (``pytest``; the README's ``make`` targets are run by the
  fresh-clone check), or a
  command another test runs whole, named in ``NAMED`` with that test (``verify --nproc 8
  --bounded``: tests/test_verify_n8.py; ``verify --json``, the whole N = 4 matrix:
  tests/test_verify_n4.py; …), and checked: the named test calls ``run_cli`` with the same
  arguments, as the CLI's parser reads them, outputs (``--out``, ``--json``'s file) aside;
  ``verify`` over the whole N = 4 matrix, or a part of it by engine, model or layouts of the
  matrix: tests/test_verify_n4.py, and of the bounded N = 8 one: tests/test_verify_n8.py;
  or, listed by hand in ``BY_HAND``, a command too long for the suite
  (the whole matrix under another collective algorithm) with the test of its parts;
* or **run on an earlier page**: a command shown on several pages runs once, on the first
  page (README first, then docs/ by name) — unless it reads a path (``--resume runs/a``,
  ``--data examples/…``) or a later command of its page reads its ``--out``, since then it is
  a step of that page's sequence (:func:`runs_of`).

The pages' runs are split over two test files (``PART2``: pages run by
tests/test_doc_commands_part2.py; the rest by tests/test_doc_commands.py) so that pytest-xdist's
``--dist loadfile``, which keeps a file on one worker, runs them on both (~200 s each alone on
this machine, 2026-12-03).

A bare name in running text (``shardwise train``) is a mention, not an example: a command has
at least one argument after its subcommand.

A page that gains a command gains a run: nothing is listed by hand except the exceptions.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("train", "verify", "trace", "bench", "plan", "export", "doctor", "learn")
TEMPLATE = re.compile(r"\[|…|\bFILE\b|FILE\.toml|\bRUN\b|\bOUT\b|\bDIR\b|\bLAYOUT\b|\bN\b|\|")
# run by another test with the same arguments (outputs aside; test_doc_commands checks it):
# the command and that test
NAMED = {
    "shardwise verify --nproc 8 --bounded":
        "tests/test_verify_n8.py::test_verify_bounded_8_rank_compositions",
    "shardwise verify --json":  # report.md: the whole N = 4 matrix (--nproc 4 is the default)
        "tests/test_verify_n4.py::test_verify_passes_every_layout_that_fits_both_engines",
    "shardwise trace --dp 2": "tests/test_learn.py::test_the_readme_trace_output_is_current",
    "shardwise learn fsdp --nproc 2": "tests/test_learn.py::test_shardwise_learn_command",
    "shardwise trace --collectives ring --dp 2 --zero 3":
        "tests/test_cli.py::test_trace_with_our_ring_expands_each_collective_into_its_sends",
    "shardwise trace --pp 4 --schedule 1f1b --microbatches 8":
        "tests/test_cli.py::test_trace_of_a_pipeline_draws_the_real_timeline",
    "shardwise trace --cp 2 --model tiny --seq-len 64":
        "tests/test_cli.py::test_trace_cp_prints_the_ring_block_by_block",
    "shardwise trace --dp-replicate 2 --dp-shard 2 --zero 3":
        "tests/test_hsdp.py::test_trace_shows_each_axis_equal_to_the_formula",
}
# the pages whose runs tests/test_doc_commands_part2.py holds (balanced by their time alone:
# planner 70 s, collectives 35, pipeline-parallel 21, checkpointing 20, expert-parallel 16,
# zero 14, report 9, tensor-parallel 1; the other file: composition 81, README 71, interop 23,
# context-parallel 12, post-training 6, data-parallel 4)
PART2 = {"planner.md", "collectives.md", "pipeline-parallel.md", "checkpointing.md",
         "expert-parallel.md", "zero.md", "report.md", "tensor-parallel.md"}
# the pages whose runs are ``@pytest.mark.slow`` (``make test-slow``; ``make test`` keeps the
# others, the shortest: data-parallel, optimizers and post-training of test_doc_commands.py's,
# tensor-parallel of PART2's): the eleven longest, whose commands the suite also runs in
# process — composition (the layouts' parity: test_compose_2d, test_verify_n4), README
# (test_cli's runs), planner (test_plan, test_plan_train), collectives (test_collectives),
# interop (test_hf, test_export_tokenizer), pipeline-parallel (test_pipeline_parity),
# checkpointing (test_checkpoint), context-parallel (test_context_parallel, test_cp_pack,
# test_cp_memory), expert-parallel (test_expert_parallel, test_ep_zero, test_ep_pp), report
# (test_report, test_report_browser), zero (test_zero, test_verify_n4)
SLOW_PAGES = {"composition.md", "README.md", "planner.md", "collectives.md", "interop.md",
              "pipeline-parallel.md", "checkpointing.md", "context-parallel.md",
              "expert-parallel.md", "report.md", "zero.md"}


def page_params(pages: list[Path]) -> list:
    """``pages`` as pytest params named by file, those of :data:`SLOW_PAGES` marked slow."""
    import pytest

    return [pytest.param(p, id=p.name, marks=pytest.mark.slow if p.name in SLOW_PAGES else ())
            for p in pages]
# too long for `make test` (the whole N = 4 matrix again, ~3.5 min each), run by hand before a
# change to what they cover lands: the command and the test of its parts in the suite
BY_HAND = {
    "shardwise verify --collectives ring --nproc 4": "tests/test_collectives.py",
    "shardwise verify --nproc 4 --collectives ring": "tests/test_collectives.py",
}


def _commands(page: Path) -> list[str]:
    """The commands shown on ``page``, in order: fenced code lines (``\\`` continuations joined,
    a leading ``$ `` and a trailing ``# comment`` dropped) and inline code spans."""
    text = page.read_text()
    found: list[tuple[int, str]] = []
    for block in re.finditer(r"```[^\n]*\n(.*?)```", text, re.S):
        lines = block.group(1).splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].rstrip()
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            found.append((block.start(), line.strip().removeprefix("$ ")))
            i += 1
    fenced = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)
    found += [(m.start(), m.group(1)) for m in re.finditer(r"`([^`\n]+)`", fenced)]
    out = []
    for _, cmd in sorted(found, key=lambda x: x[0]):
        cmd = re.sub(r"\s+#.*$", "", cmd).strip()
        if _is_example(cmd) and cmd not in out:
            out.append(cmd)
    return out


def _is_example(cmd: str) -> bool:
    """A command with something to run: ``shardwise <sub>`` with at least one argument,
    ``python -m <module>`` / ``python -c`` with one, torchrun of shardwise. A
    bare name in running text (``shardwise train``, ``torchrun --max-restarts N``,
    ``python -m shardwise.tools.plan …``) is a mention."""
    words = [w for w in cmd.split() if w != "…"]
    if re.match(rf"shardwise ({'|'.join(SUBCOMMANDS)})\b", cmd):
        return len(words) >= 3
    if re.match(r"(OMP_NUM_THREADS=1 )?(\.venv/bin/)?python (-m|-c) ", cmd):
        return len(words) >= (4 if " -m " in cmd else 3)
    if cmd.startswith("torchrun "):
        return "-m shardwise" in cmd
    return False


def _kind(cmd: str) -> str:
    """"run" | "template" | "elsewhere: <why>" for one command."""
    if cmd in NAMED:
        return f"elsewhere: {NAMED[cmd]} runs it"
    if cmd in BY_HAND:
        return f"elsewhere: by hand (long); its parts: {BY_HAND[cmd]}"
    if "pytest" in cmd:
        return "elsewhere: the test suite itself"
    if "--device cuda" in cmd or "--nnodes" in cmd:
        return "elsewhere: needs GPUs or several nodes"
    if "snapshot_download(" in cmd or "load_dataset(" in cmd:  # the Hub recipe (issue 36)
        return "elsewhere: needs the network (the Hugging Face Hub); tests/test_rough_edges.py " \
            "checks the errors that print it"
    if TEMPLATE.search(cmd) or cmd.startswith("torchrun "):
        return "template"
    argv = shlex.split(cmd)
    if argv[:2] == ["shardwise", "verify"] and "--layouts" not in argv and \
            set(a for a in argv[2:] if a.startswith("--")) <= {"--engine", "--models", "--nproc"} \
            and "--nproc 8" not in cmd:  # the matrix, or a part by engine / model
        return "elsewhere: tests/test_verify_n4.py runs the whole N = 4 matrix, all of this"
    in_matrix = _cases_of_the_matrix(argv)
    if in_matrix:
        return f"elsewhere: {in_matrix} runs each of these cases (and more steps)"
    return "run"


def _cases_of_the_matrix(argv: list[str]) -> str | None:
    """The verify test that runs every case of ``shardwise verify --nproc N --layouts …
    [--engine E] [--models M]`` itself — tests/test_verify_n4.py (N = 4, the whole matrix) or
    tests/test_verify_n8.py (N = 8 --bounded) — when each layout is in that matrix and the
    engines and models asked for are ones it runs (it runs each applicable pair of its
    layouts, as verify does); else None (the command runs here)."""
    from shardwise.parallel.layout import parse_layout
    from shardwise.tools.verify import ENGINES, MODELS, applies, layouts_that_fit

    if argv[:2] != ["shardwise", "verify"] or "--layouts" not in argv or "--nproc" not in argv:
        return None
    flags = {a for a in argv[2:] if a.startswith("--")}
    if not flags <= {"--engine", "--models", "--nproc", "--layouts"}:
        return None
    value = {f: argv[argv.index(f) + 1] for f in flags - {"--layouts"}}
    rest = argv[argv.index("--layouts") + 1:]
    texts = rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]
    n = value["--nproc"]
    matrix, test = {"4": (layouts_that_fit(4), "tests/test_verify_n4.py"),
                    "8": (layouts_that_fit(8, bounded=True), "tests/test_verify_n8.py")}.get(
                        n, (None, None))
    engines = ENGINES if value.get("--engine", "both") == "both" else (value["--engine"],)
    models = value.get("--models", ",".join(MODELS)).split(",")
    if matrix is None or not set(models) <= set(MODELS):
        return None
    for text in texts:  # the matrix runs every (model, engine) that applies to its layouts
        layout = parse_layout(text)
        if layout not in matrix or not any(applies(layout, m, e) for m in models
                                           for e in engines):
            return None
    return test


def _tiny_fits(argv: list[str]) -> bool:
    """Whether the command's layout(s) accept the tiny model, by the validator the command
    itself runs (``config.validate`` for train, ``Layout.check`` for bench layouts)."""
    from shardwise.cli import _parser
    from shardwise.config import from_args, validate
    from shardwise.errors import ShardwiseConfigError
    from shardwise.models import preset_config
    from shardwise.parallel.layout import parse_layout

    try:
        if argv[0] == "train":
            validate(from_args(_parser().parse_args([*argv, "--model", "tiny"])))
        else:
            given = [argv[i + 1] for i, a in enumerate(argv) if a == "--layout"]
            if "--layouts" in argv:
                rest = argv[argv.index("--layouts") + 1:]
                given += rest[:next((i for i, a in enumerate(rest) if a.startswith("--")),
                                    len(rest))]
            for text in given:
                parse_layout(text).check(model_cfg=preset_config("tiny", 256))
    except ShardwiseConfigError:
        return False
    return True


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]


def shrink(cmd: str, scratch: Path) -> list[str]:
    """The argv (after ``shardwise``) that runs ``cmd`` small (module docstring); absolute
    ``/tmp/`` paths move into ``scratch``."""
    argv = [str(scratch / a[5:]) if a.startswith("/tmp/") else a for a in shlex.split(cmd)[1:]]
    sub = argv[0]
    if "--help" in argv:
        return argv
    if sub == "train":
        argv = _set(argv, "--steps", "2")
    if sub == "train" and "--model" not in argv and _tiny_fits(argv):
        argv = _set(argv, "--model", "tiny")
    if sub == "verify":
        argv = _set(argv, "--steps", "1")
        if "--models" not in argv:
            argv = _set(argv, "--models", "tiny")
    if sub == "bench":
        argv = _set(_set(argv, "--steps", "1"), "--rounds", "1")
        if "--model" not in argv and _tiny_fits(argv):
            argv = _set(argv, "--model", "tiny")
        argv = _set(argv, "--out", str(scratch / "bench"))
        if "collectives" in argv:  # its message sizes: 1 KiB … 1 MiB, not … 64 MiB
            argv = _set(argv, "--max-mb", "1")
    if sub == "plan" and "--plot-gpus" in argv:  # the plot drawn over two GPU counts, not 8
        argv = _set(argv, "--plot-gpus", ",".join(argv[argv.index("--plot-gpus") + 1]
                                                  .split(",")[:2]))
    return argv


def runs_of(page: Path) -> list[str]:
    """The commands of ``page`` that run here, in order: its ``run`` commands, less those an
    earlier page (in ``PAGES`` order) runs already and that stand alone — no argument but
    ``--out``'s names a path, and no later command of the page names their ``--out``."""
    mine = [c for c in _commands(page) if _kind(c) == "run"]
    before = {c for p in PAGES[:PAGES.index(page)] for c in _commands(p) if _kind(c) == "run"}
    return [c for i, c in enumerate(mine) if c not in before or not _stands_alone(c, mine[i + 1:])]


def _stands_alone(cmd: str, later: list[str]) -> bool:
    argv = shlex.split(cmd)
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else None
    reads = any("/" in a for i, a in enumerate(argv) if i == 0 or argv[i - 1] != "--out")
    return not reads and not (out and any(out in c for c in later))


def same_case(cmd: str, argv: list) -> bool:
    """Whether ``shardwise *argv`` runs the case ``cmd`` runs, by the CLI's parser: every
    parsed option equal but the outputs (``--out``, ``--json``: where the report goes).
    Elements of ``argv`` that are not strings (a tmp path) read as ``PATH``."""
    from shardwise.cli import _parser

    def parsed(words):
        ns = vars(_parser().parse_args(words))
        for output in ("out", "json", "func"):
            ns.pop(output, None)
        return ns

    return parsed(shlex.split(cmd)[1:]) == parsed([a if isinstance(a, str) else "PATH"
                                                   for a in argv])


def run_cli_argvs(test: str) -> list[list]:
    """The argument lists ``tests/FILE.py::FUNCTION`` passes to ``run_cli`` as list literals
    (a non-literal element, e.g. ``tmp_path / "v.json"``, as ``None``)."""
    import ast

    path, name = test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [[e.value if isinstance(e, ast.Constant) else None for e in call.args[0].elts]
            for call in ast.walk(fn) if isinstance(call, ast.Call)
            and getattr(call.func, "id", "") == "run_cli" and call.args
            and isinstance(call.args[0], ast.List)]


COMMANDS = [(p, c) for p in PAGES for c in _commands(p)]
RUN_PAGES = [p for p in PAGES if runs_of(p)]


def run_page(page: Path, cache_dir: Path, tmp_path: Path) -> None:
    """One page's runnable commands (:func:`runs_of`), in order, in one scratch folder (with the
    repository's ``examples/`` beside it): each must exit 0."""
    import subprocess

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "docs").mkdir()
    for cmd in runs_of(page):
        if cmd.startswith("shardwise "):
            p = run_cli(shrink(cmd, tmp_path), cache_dir, timeout=400, cwd=tmp_path)
        else:
            argv = shlex.split(re.sub(r"^(OMP_NUM_THREADS=1 )?(\.venv/bin/)?python", "", cmd))
            p = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True,
                               text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                            "PATH": "/usr/bin:/bin"})
            p.stdout += p.stderr
        assert p.returncode == 0, f"{page.name}: {cmd}\n{p.stdout[-4000:]}"
