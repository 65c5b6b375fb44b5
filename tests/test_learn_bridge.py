"""The staircase from learn/ to parallel/ (issue 52): what the bridge text names exists. Text and
imports only, no run.

* each strategy folder's ``__init__`` docstring (parallel/dp, zero, tp, pp, cp, ep), and
  parallel/__init__.py's, has a "From learn/" section: its bullets map the learner's names
  (double-backquoted, left of "→") to the code here (``:class:`` / ``:func:`` / ``:meth:`` /
  ``:mod:`` / ``:attr:`` references). Every reference resolves (the module imports, the name is
  an attribute of it); every learner name appears, exactly as quoted, in the script last cited
  before it (``learn/NAME.py``, in the heading or the bullet);
* parallel/__init__.py's other references (the core files to read first) resolve too;
* each learn script's "Next:" line (and its indented continuation) names files that exist and
  at least one dotted ``shardwise.…`` name of a class or function, which resolves; each script
  but collectives.py is cited by some "From learn/" section.

The helpers are tried on made-up text with wrong names: they must catch them.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "src" / "shardwise" / "learn"
PACKAGES = ["shardwise.parallel"] + [f"shardwise.parallel.{s}"
                                     for s in ("dp", "zero", "tp", "pp", "cp", "ep")]
SCRIPTS = ("collectives", "dp", "fsdp", "tp", "fsdp_tp", "pp")

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):`([^`]+)`")
LITERAL = re.compile(r"``([^`]+)``")
SCRIPT = re.compile(r"learn/(\w+)\.py")
TOKEN = re.compile(r"``([^`]+)``|(?<![\w/])learn/(\w+)\.py")  # a literal, or a script in prose
DOTTED = re.compile(r"(?<![\w./])shardwise(?:\.\w+)+")
PATH = re.compile(r"(?<![\w/])(?:src/shardwise|docs)/[\w/.-]*")


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""


def package_file(package: str) -> Path:
    return ROOT / "src" / Path(*package.split(".")) / "__init__.py"


def resolve(name: str, package: str) -> str | None:
    """None when ``name`` (a Sphinx reference: a leading ``~`` dropped; leading dots relative
    to ``package``, one dot = ``package`` itself; a bare name an attribute of ``package``; or an
    absolute ``shardwise.…``) names an importable module or an attribute of one; else what is
    wrong."""
    bare = name.lstrip("~")
    if bare.startswith("."):
        dots = len(bare) - len(bare.lstrip("."))
        base = package.split(".")[:len(package.split(".")) - (dots - 1)]
        full = ".".join(base + [bare[dots:]])
    elif bare.startswith("shardwise."):
        full = bare
    else:
        full = f"{package}.{bare}"
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # not a module: try the parent, the rest as attributes
            raise
        for k, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                return f"{name!r} ({full}): {'.'.join(parts[:i + k])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"{name!r} ({full}): no such module"


def bridge_section(doc: str) -> str:
    """The "From learn/" section of ``doc``: its heading line to the first blank line after a
    bullet ("" when there is none)."""
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("From learn/")), None)
    if start is None:
        return ""
    out, bullets = [], False
    for ln in lines[start:]:
        if not ln.strip() and bullets:
            break
        bullets = bullets or ln.lstrip().startswith("* ")
        out.append(ln)
    return "\n".join(out)


def path_problems(text: str) -> list[str]:
    """Every ``src/shardwise/…`` and ``docs/…`` path in ``text`` exists."""
    return [f"{p}: no such file or folder" for p in PATH.findall(text)
            if not (ROOT / p.rstrip(".,;:)")).exists()]


def bridge_problems(section: str, package: str) -> list[str]:
    """What is wrong with a "From learn/" ``section`` of ``package``'s docstring: a reference
    that does not resolve, a cited script that does not exist, a learner name (a ``literal``
    left of "→") missing from the script cited last before it (an identifier as a whole word)."""
    problems = [p for ref in ROLE.findall(section) if (p := resolve(ref, package))]
    problems += path_problems(section)
    if not section.strip():
        return [f"{package}: no 'From learn/' section"]
    script = None
    for chunk in re.split(r"\n\s*\* ", section):  # the heading, then each bullet
        mapping = "→" in chunk
        for m in TOKEN.finditer(chunk.split("→", 1)[0]):  # left of "→", in order
            lit = m.group(1)
            name = m.group(2) or (c.group(1) if lit and (c := SCRIPT.fullmatch(lit)) else None)
            if name is not None:  # a script citation: ``learn/NAME.py`` or learn/NAME.py
                script = LEARN / f"{name}.py"
                if not script.exists():
                    problems.append(f"learn/{script.name}: no such script")
                    script = None
            elif lit is None or not mapping:
                continue
            elif script is None:
                problems.append(f"``{lit}``: no learn script cited before it")
            elif not re.search(rf"(?<!\w){re.escape(lit)}(?!\w)" if lit.isidentifier()
                               else re.escape(lit), script.read_text(encoding="utf-8")):
                problems.append(f"``{lit}`` is not in learn/{script.name}")
    return problems


def next_block(doc: str) -> str:
    """A learn script docstring's "Next:" line with its indented continuation lines."""
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Next:")), None)
    if start is None:
        return ""
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    return "\n".join(lines[start:end])


def next_problems(block: str) -> list[str]:
    """What is wrong with a "Next:" ``block``: a missing file, no parallel/ (or comm/) folder
    named, no dotted name of a class or function, a dotted name that does not resolve."""
    if not block:
        return ["no 'Next:' line"]
    problems = path_problems(block)
    if not re.search(r"src/shardwise/(parallel|comm)/", block):
        problems.append("names no folder of src/shardwise/parallel/ (or comm/)")
    names = DOTTED.findall(block)
    if not names:
        problems.append("names no shardwise.… class or function")
    problems += [p for n in names if (p := resolve(n, "shardwise"))]
    return problems


# -- the helpers catch what they should ------------------------------------------------------
def test_resolve_catches_a_wrong_reference():
    assert resolve("~.comms.CopyToTP", "shardwise.parallel.tp") is None
    assert resolve("..model.ParallelModel", "shardwise.parallel.zero") is None
    assert resolve("GradBuckets", "shardwise.parallel.dp") is None
    assert resolve("shardwise.parallel.zero.zero3.Zero3Sync._free", "x") is None
    assert "has no 'NoSuchOp'" in resolve("~.comms.NoSuchOp", "shardwise.parallel.tp")
    assert resolve("~.nosuchmodule.F", "shardwise.parallel.tp") is not None
    assert resolve("..nosuch", "shardwise.parallel.tp") is not None


def test_bridge_problems_catches_planted_errors():
    good = ("From learn/ (``learn/tp.py``):\n\n"
            "* ``F_op`` (f) → :class:`~.comms.CopyToTP`\n"
            "* ``learn/dp.py``'s ``x.chunk(n)[rank]`` → :func:`~.apply.apply_tp`\n\n"
            "Not in the section: ``Z_op`` → :class:`~.comms.Nope`\n")
    section = bridge_section(good)
    assert "Not in the section" not in section
    assert bridge_problems(section, "shardwise.parallel.tp") == []
    planted = {"``F_op`` (f) → :class:`~.comms.CopyToTP`":
               "``F_op`` (f) → :class:`~.comms.CopyTo_TP`",  # a wrong class
               "``x.chunk(n)[rank]``": "``x.chunk(m)[rank]``",  # not in learn/dp.py
               "* ``learn/dp.py``'s": "* ``learn/dq.py``'s",  # no such script
               "``F_op`` (f)": "``F_o`` (f)"}  # a piece of a name, not a name
    for old, new in planted.items():
        bad = bridge_section(good.replace(old, new))
        assert bridge_problems(bad, "shardwise.parallel.tp"), new
    # a name quoted from the wrong script: F_op is tp.py's, not dp.py's
    wrong = bridge_section(good.replace("``learn/tp.py``", "``learn/dp.py``"))
    assert any("``F_op`` is not in learn/dp.py" in p
               for p in bridge_problems(wrong, "shardwise.parallel.tp"))
    assert bridge_problems("", "shardwise.parallel.tp")


def test_next_problems_catches_planted_errors():
    good = ("Run:  x\nNext: docs/tensor-parallel.md → src/shardwise/parallel/tp/ →\n"
            "      shardwise.parallel.tp.comms.CopyToTP → shardwise trace --tp 2\n")
    block = next_block(good)
    assert block.endswith("shardwise trace --tp 2") and next_problems(block) == []
    for old, new in (("CopyToTP", "CopyTo"), ("tensor-parallel.md", "tensor-paralel.md"),
                     ("parallel/tp/", "parallel/tq/"),
                     ("shardwise.parallel.tp.comms.CopyToTP", "CopyToTP")):
        assert next_problems(next_block(good.replace(old, new))), new
    assert next_problems(next_block("no next line here"))


# -- the real text ---------------------------------------------------------------------------
@pytest.mark.parametrize("package", PACKAGES)
def test_from_learn_sections_resolve(package):
    section = bridge_section(docstring(package_file(package)))
    assert len(section.splitlines()) <= 16, f"{package}: the section is over ~15 lines"
    assert bridge_problems(section, package) == [], package


def test_the_core_reading_list_resolves():
    doc = docstring(package_file("shardwise.parallel"))
    for core in ("apply", "model", "runner", "loss", "sync", "params", "layout"):
        assert f":mod:`.{core}`" in doc, core
    assert [p for ref in ROLE.findall(doc) if (p := resolve(ref, "shardwise.parallel"))] == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_next_lines_resolve(script):
    assert next_problems(next_block(docstring(LEARN / f"{script}.py"))) == [], script


def test_every_strategy_script_is_cited_by_a_bridge():
    cited = {m for p in PACKAGES
             for m in SCRIPT.findall(bridge_section(docstring(package_file(p))))}
    assert set(SCRIPTS) - {"collectives"} <= cited, set(SCRIPTS) - cited
