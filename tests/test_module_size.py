"""No module in ``src/shardwise`` is over :data:`LIMIT` lines unless :data:`ALLOWED` names it with
the reason it earns its size (a data table, a single algorithm: issue 37). A module that grows
past the limit is a room holding several jobs; split it by job, or add it here with its reason.
An entry that no longer exists or has shrunk under the limit fails too, so the list stays true.

The same for functions (≤ 80 lines) and classes (≤ 300), with no exception in ``parallel/`` and
``comm/`` and the largest module of ``parallel/`` ≤ 400 lines (issue 52; section "the length
budget" below)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
LIMIT = 600  # lines per module (issue 37: "no module in src/ over ~600 lines")

# path relative to src/shardwise → why it may exceed LIMIT (today none needs it)
ALLOWED: dict[str, str] = {}


def sizes(root: Path = SRC) -> dict[str, int]:
    """Module path relative to ``root`` → its number of lines."""
    return {f.relative_to(root).as_posix(): len(f.read_text(encoding="utf-8").splitlines())
            for f in sorted(root.rglob("*.py"))}


def test_no_module_over_the_limit_without_a_reason():
    over = {p: n for p, n in sizes().items() if n > LIMIT and p not in ALLOWED}
    assert not over, (
        f"modules over {LIMIT} lines: "
        + ", ".join(f"{p} ({n})" for p, n in sorted(over.items()))
        + ": split each by job, or list it in tests/test_module_size.py ALLOWED with the reason")


def test_allow_list_is_true():
    found = sizes()
    stale = {p: found.get(p) for p in ALLOWED if found.get(p, 0) <= LIMIT}
    assert not stale, f"ALLOWED entries missing or under {LIMIT} lines, remove them: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values()), "every ALLOWED entry needs a reason"


def test_the_count_by_hand(tmp_path):
    """The counter against files whose line counts are known: 601 lines, 600 lines with a final
    newline, and an empty file."""
    (tmp_path / "big.py").write_text("x = 1\n" * 601)
    (tmp_path / "edge.py").write_text("x = 1\n" * 600)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "empty.py").write_text("")
    assert sizes(tmp_path) == {"big.py": 601, "edge.py": 600, "sub/empty.py": 0}


# --------------------------------------------------------------------------------------------
# the length budget of functions and classes (issue 52)
#
# A function over FUNCTION_LIMIT lines or a class over CLASS_LIMIT holds several steps a reader
# has to keep apart by hand. Lines of a ``def``/``class`` node: ``end_lineno - lineno + 1``
# (decorators not counted, docstring and comments counted); a nested function or a method is
# measured as its own definition too (``qualname`` "Outer.inner"), and still counts in its
# outer one's lines. In ``parallel/`` and ``comm/`` (the core every strategy crosses) no
# exception (the last ones were split for issue 52). Elsewhere each longer
# function is in LONG_FUNCTIONS with its reason; the list only shrinks (an entry gone or now
# within the budget fails, so whoever splits one removes it).

FUNCTION_LIMIT, CLASS_LIMIT = 80, 300
CORE = ("parallel/", "comm/")  # no exception allowed here
PARALLEL_FILE_LIMIT = 400  # lines of the largest module in parallel/ (issue 52)

# "path::qualname" outside parallel/ and comm/ → why it is longer than FUNCTION_LIMIT for now
LONG_FUNCTIONS: dict[str, str] = {
    "checkpoint/save.py::Checkpointer.save":
        "gather, finite check, write and async hand-off in one collective order; to split with "
        "the checkpoint's next change",
    "cli.py::_parser": "an argparse builder: one add_argument after another",
    "config/checks.py::validate":
        "the config's checks one after another; to split by section with its next change",
    "data/dataset.py::prepare_lm_data":
        "load, split, tokenize, pack and cache in order; to split with the data's next change",
    "interop/hf_config.py::hf_to_llama_config":
        "a field-by-field mapping with one refusal per unsupported field",
    "launch.py::spawn":
        "the elastic agent's set-up, signal handling and exit codes together; to split with "
        "the launcher's next change",
    "parity.py::compare":
        "one check per recorded quantity (loss, norm, grads, params, state); to split with the "
        "parity rule's next change",
    "plan/comm.py::dp_collectives":
        "the dp collectives of every ZeRO stage and HSDP; with the planner's next change",
    "plan/cost.py::estimate": "with the planner's next change (issue 52)",
    "plan/search.py::candidates":
        "nested loops over the degrees; with the planner's next change",
    "report/compare.py::compare_sections":
        "one report section after another; to split with the report's next change",
    "report/svg.py::line_chart": "axes, ticks, series and marks of one SVG; a drawing routine",
    "tools/bench/collectives.py::bench_zero_collectives":
        "a benchmark worker: set-up, alternating rounds, table; split with its next change",
    "tools/bench/gpu.py::run_one":
        "a benchmark worker: set-up, timed steps, numbers; split with its next change",
    "tools/bench/layouts.py::bench_one_layout":
        "a benchmark worker running both engines; split with its next change",
    "tools/bench/suites.py::bench_pp":
        "a benchmark worker (bubble, then every schedule); split with its next change",
    "tools/estimate.py::estimate_memory":
        "fake-rank set-up, one step and the byte table; split with its next change",
    "tools/plan_explain.py::explain": "with the planner's next change (issue 52)",
    "tools/trace.py::trace_worker": "a tool worker: set-up, one step, printing; split with its "
                                    "next change",
    "tools/trace.py::_print_rank": "one printed section after another; split with its next "
                                   "change",
    "tools/trace.py::ring_section": "the ring steps, counts and byte checks printed in order; "
                                    "split with its next change",
    "tools/verify.py::verify_worker": "every verify case, then the table and the JSON; split "
                                      "with its next change",
    "train/loop.py::setup": "to split with the loop's next change (issue 52)",
}


def long_definitions(root: Path = SRC) -> dict[str, int]:
    """``"path::qualname"`` → lines, for every function over :data:`FUNCTION_LIMIT` lines and
    every class over :data:`CLASS_LIMIT` under ``root`` (nested definitions measured as their
    own, named "Outer.inner")."""
    out = {}

    def visit(node, rel, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                limit = CLASS_LIMIT if isinstance(child, ast.ClassDef) else FUNCTION_LIMIT
                if n > limit:
                    out[f"{rel}::{name}"] = n
                visit(child, rel, f"{name}.")
            else:
                visit(child, rel, prefix)

    for f in sorted(root.rglob("*.py")):
        visit(ast.parse(f.read_text(encoding="utf-8"), str(f)), f.relative_to(root).as_posix(),
              "")
    return out


def _in_core(key: str) -> bool:
    return key.startswith(CORE)


def budget_breaches(found: dict[str, int], long_functions: dict[str, str]) -> list[str]:
    """What :func:`long_definitions` ``found`` breaks: any long definition in the core, or
    elsewhere one not in ``long_functions``."""
    return [f"{k} ({n} lines)" for k, n in sorted(found.items())
            if _in_core(k) or k not in long_functions]


def stale_entries(found: dict[str, int], listed) -> list[str]:
    """Entries of ``listed`` that are gone or now within the budget (remove them)."""
    return sorted(k for k in listed if k not in found)


def test_no_long_function_or_class_without_a_reason():
    bad = budget_breaches(long_definitions(), LONG_FUNCTIONS)
    assert not bad, (
        f"functions over {FUNCTION_LIMIT} lines / classes over {CLASS_LIMIT}: "
        + ", ".join(bad) + f": split them (in {' and '.join(CORE)} no exception; elsewhere, or "
        "list it in tests/test_module_size.py LONG_FUNCTIONS with its reason)")


def test_long_function_list_only_shrinks():
    found = long_definitions()
    stale = stale_entries(found, LONG_FUNCTIONS)
    assert not stale, f"LONG_FUNCTIONS entries gone or within the budget, remove them: {stale}"
    assert not [k for k in LONG_FUNCTIONS if _in_core(k)], "no exception in parallel/ or comm/"
    assert all(r.strip() for r in LONG_FUNCTIONS.values()), "every entry needs a reason"


def large_modules(root: Path, limit: int) -> dict[str, int]:
    """Modules of ``root`` over ``limit`` lines → their lines."""
    return {p: n for p, n in sizes(root).items() if n > limit}


def test_the_largest_module_of_parallel_is_small():
    over = large_modules(SRC / "parallel", PARALLEL_FILE_LIMIT)
    over = {f"parallel/{p}": n for p, n in over.items()}
    assert not over, f"modules of parallel/ over {PARALLEL_FILE_LIMIT} lines: {over}: split by job"


def test_planted_long_definitions(tmp_path):
    """The budget on a fake package: a long function and class in the core always fail, a long
    function elsewhere fails unless listed, a nested long function is its own entry, a
    function of exactly the limit passes, and a listed entry that shrank is stale."""
    body = "    x = 1\n"
    (tmp_path / "parallel").mkdir()
    (tmp_path / "comm").mkdir()
    (tmp_path / "parallel" / "a.py").write_text(
        "def long():\n" + body * FUNCTION_LIMIT            # 81 lines
        + "def edge():\n" + body * (FUNCTION_LIMIT - 1))   # 80 lines: within
    (tmp_path / "comm" / "b.py").write_text(
        "class Big:\n" + "    def m(self):\n        pass\n" * (CLASS_LIMIT // 2))  # 301 lines
    (tmp_path / "tools.py").write_text(
        "def outer():\n    def inner():\n" + "        y = 2\n" * FUNCTION_LIMIT
        + "    return inner\n"
        "def short():\n    pass\n")
    found = long_definitions(tmp_path)
    assert found == {"parallel/a.py::long": 81, "comm/b.py::Big": 301,
                     "tools.py::outer": 83, "tools.py::outer.inner": 81}
    assert budget_breaches(found, {}) == [
        "comm/b.py::Big (301 lines)", "parallel/a.py::long (81 lines)",
        "tools.py::outer (83 lines)", "tools.py::outer.inner (81 lines)"]
    # listing a core definition in LONG_FUNCTIONS does not excuse it
    listed = {"tools.py::outer": "r", "tools.py::outer.inner": "r", "parallel/a.py::long": "r"}
    assert budget_breaches(found, listed) == [
        "comm/b.py::Big (301 lines)", "parallel/a.py::long (81 lines)"]
    assert stale_entries(found, {"tools.py::short": "r", "tools.py::gone": "r",
                                 "tools.py::outer": "r"}) == ["tools.py::gone", "tools.py::short"]
    (tmp_path / "parallel" / "big.py").write_text("x = 1\n" * (PARALLEL_FILE_LIMIT + 1))
    assert large_modules(tmp_path / "parallel", PARALLEL_FILE_LIMIT) == {"big.py": 401}
