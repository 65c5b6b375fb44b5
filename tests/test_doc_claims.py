"""What the README and docs/ say is built, and not built, matches the CLI (issue 51). Text only,
no run: the pages are tests/doc_commands.py's ``PAGES``; the flags are those of every subcommand
of ``shardwise.cli._parser()``. tests/test_doc_commands.py already checks each *command* a page
shows (run, or its flags against its own subcommand); this checks the prose and tables around
them:

* every ``--flag`` a page names exists in some subcommand (or is another tool's, in ``FOREIGN``
  with its owner: torchrun, pytest, pip, Slurm, …);
* nothing a page calls "not built" is a flag that exists: a "not built" claim (each bullet's
  head in a section headed "Not built", a paragraph that starts "Not built:", the sentence
  around any other "not built": :func:`not_built_statements`) names no existing ``--flag``, no
  feature one of ``train``'s on/off flags turns on (its name as a word: ``--pack`` ↔ "pack",
  "packing", "packed") and no pipeline schedule ``--schedule`` offers;
* docs/interop.md still heads a section "one example per row" (the padded rows ``--pack`` is
  measured against).
"""

from __future__ import annotations

import argparse
import re
from functools import cache
from pathlib import Path

import pytest

from doc_commands import PAGES, ROOT

# flags of other tools that the pages show beside ours: the flag and whose it is
FOREIGN = {
    "--nproc-per-node": "torchrun", "--nnodes": "torchrun", "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun", "--rdzv-id": "torchrun", "--standalone": "torchrun",
    "--log-dir": "torchrun", "--node-rank": "torchrun", "--master-addr": "torchrun",
    "--master-port": "torchrun", "--redirects": "torchrun", "--tee": "torchrun",
    "--local-ranks-filter": "torchrun",
    "--world-size": "python -m shardwise.tools.estimate (its own parser)",
    "--run": "benchmarks/host_memory.py (its own parser)",
    "--durations": "pytest", "--dist": "pytest-xdist", "--no-loadscope-reorder": "pytest-xdist",
    "--maxfail": "pytest", "--lf": "pytest",
    "--quiet": "pip", "--no-compile": "pip", "--index-url": "pip", "--extra-index-url": "pip",
    "--kill-on-bad-exit": "srun", "--requeue": "sbatch", "--nodes": "sbatch",
    "--ntasks-per-node": "sbatch", "--gpus-per-node": "sbatch", "--cpus-per-task": "sbatch",
    "--time": "sbatch", "--output": "sbatch", "--job-name": "sbatch",
    "--logdir": "tensorboard", "--pid": "py-spy", "--native": "py-spy",
}
NOT_BUILT = re.compile(r"not built", re.I)


@cache
def subcommands() -> dict[str, argparse.ArgumentParser]:
    from shardwise.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@cache
def our_flags() -> frozenset[str]:
    return frozenset(o for p in subcommands().values() for a in p._actions
                     for o in a.option_strings if o.startswith("--"))


def feature_words() -> dict[str, str]:
    """What a "not built" statement must not name: a word (or words) → the flag that builds it.
    ``train``'s on/off flags by their name (``--async-save`` ↔ "async save"/"async-save") with
    its -ing/-ed/-s forms, and the pipeline schedules ``--schedule`` offers."""
    words = {}
    for a in subcommands()["train"]._actions:
        if isinstance(a, argparse.BooleanOptionalAction) or a.nargs == 0 and a.option_strings \
                and not isinstance(a, argparse._HelpAction):
            name = a.option_strings[0][2:]
            if len(name) < 4:  # --sp: too short to tell from other words
                continue
            stem = name[:-1] if name.endswith("e") else name
            for form in (name, name + "s", stem + "ing", stem + "ed"):
                words[form] = a.option_strings[0]
                words[form.replace("-", " ")] = a.option_strings[0]
        if a.dest == "schedule":
            words.update({c: f"--schedule {c}" for c in a.choices})
    return words


def flags_named(text: str) -> list[str]:
    """The ``--flags`` in ``text`` (a name cut short, ``--no-…``, is not one)."""
    return re.findall(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])", text)


def _sentence(text: str) -> str:
    """The first sentence of ``text`` (to ". " or the end), whitespace squeezed."""
    return " ".join(re.split(r"\.\s|\.$", text.strip(), maxsplit=1)[0].split())


def not_built_statements(page: Path) -> list[str]:
    """What the page says is not built, one claim each: in a section headed "Not built" (to the
    next heading as high) each bullet's head (to its first ": " or sentence end: the rest says
    why, and may name flags that do exist); in a paragraph that starts "Not built:" its first
    sentence after those words; elsewhere the sentence around "not built"."""
    text = page.read_text()
    out, taken = [], []
    for m in re.finditer(r"^(#+) [^\n]*not built[^\n]*$", text, re.I | re.M):
        end = re.compile(rf"^#{{1,{len(m.group(1))}}} ", re.M).search(text, m.end())
        stop = end.start() if end else len(text)
        for bullet in re.split(r"\n[-*] ", text[m.end():stop])[1:]:
            out.append(_sentence(bullet.split("\n\n")[0].split(": ")[0]))
        taken.append((m.start(), stop))
    for m in re.finditer(r"(?:^|\n\n)(\**not built\**:?\**)(.*?)(?=\n\n|\Z)", text,
                         re.I | re.S):
        out.append(_sentence(m.group(2)))
        taken.append((m.start(1), m.end(2)))
    for m in NOT_BUILT.finditer(text):
        if any(a <= m.start() < b for a, b in taken):
            continue
        start = max(text.rfind(". ", 0, m.start()), text.rfind("\n\n", 0, m.start())) + 2
        stop = min((i for i in (text.find(". ", m.end()), text.find("\n\n", m.end()))
                    if i >= 0), default=len(text))
        out.append(" ".join(text[start:stop].split()))
    return out


def test_the_parsers_and_the_pages_are_read():
    """The checks below are not vacuous: the CLI has its flags, the pages name many of them,
    and the README's and docs/post-training.md's "Not built" statements are found."""
    assert {"--dp", "--zero", "--pack", "--hang-after", "--layouts", "--to"} <= our_flags()
    named = {f for p in PAGES for f in flags_named(p.read_text())}
    assert len(named & our_flags()) > 100, sorted(named)
    assert "--pack" in feature_words().values() and "packing" in feature_words()
    found = {p.name for p in PAGES if not_built_statements(p)}
    assert {"README.md", "post-training.md"} <= found, found
    # the README's own statement (issue 51: it called packing "not built" while --pack works)
    readme = not_built_statements(ROOT / "README.md")
    assert any(s.startswith("a GPU/NCCL test in CI") for s in readme), readme
    post = not_built_statements(ROOT / "docs" / "post-training.md")
    assert any(s.startswith("A reference other than the initial policy") for s in post), post


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_a_page_names_exists(page):
    unknown = sorted({f for f in flags_named(page.read_text())
                      if f not in our_flags() and f not in FOREIGN})
    assert not unknown, (f"{page.name} names flags no subcommand has: {unknown} (a flag renamed "
                         "or dropped? another tool's: add it to FOREIGN with its owner)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_nothing_called_not_built_is_a_flag_that_exists(page):
    words = feature_words()
    wrong = []
    for claim in not_built_statements(page):
        wrong += [(f, claim) for f in flags_named(claim) if f in our_flags()]
        wrong += [(flag, claim) for word, flag in words.items()
                  if re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", claim)]
    assert not wrong, f"{page.name}: called not built, but the flag exists: {wrong}"


def test_interop_still_heads_a_section_one_example_per_row():
    """docs/interop.md's SFT section keeps its heading for the padded layout (one example per
    row) that --pack is measured against, a Markdown heading or a bold paragraph lead."""
    text = (ROOT / "docs" / "interop.md").read_text()
    heads = re.findall(r"^(?:#+ .*|\*\*[^*\n]+\*\*)", text, re.M)
    assert any("one example per row" in h.lower() for h in heads), heads
