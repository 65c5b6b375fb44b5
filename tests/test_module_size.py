"""No module in ``src/shardwise`` is over :data:`LIMIT` lines unless :data:`ALLOWED` names it with
the reason it earns its size (a data table, a single algorithm: issue 37). A module that grows
past the limit is a room holding several jobs; split it by job, or add it here with its reason.
An entry that no longer exists or has shrunk under the limit fails too, so the list stays true."""

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
