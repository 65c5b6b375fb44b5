"""Three small readers for the files shardwise reads: JSON, JSON lines and TOML, each with one
error that names the file.

Every reader takes ``path``, ``what`` (the flag or the role of the file, e.g. ``"--config"`` or
``"meta.json of checkpoint"``: the message starts with it) and an optional ``fix`` (how to fix
it, appended after a colon), and raises :class:`~shardwise.errors.ShardwiseFileError` (a
:class:`~shardwise.errors.ShardwiseConfigError`) for a missing file, one that cannot be read,
or one that does not parse, e.g. ``--config run.toml: not valid TOML (Expected '=' after a key
in a key/value pair (at line 2, column 5))``. Nothing else is caught: a reader never returns
a partial or empty result in place of an error.
"""

from __future__ import annotations

import json
import os
import tomllib

from .errors import ShardwiseFileError


def _fail(what: str, path, problem: str, fix: str):
    return ShardwiseFileError(f"{what} {path}: {problem}" + (f": {fix}" if fix else ""))


def _text(path, what: str, fix: str) -> str:
    if not os.path.isfile(path):
        raise _fail(what, path, "no such file", fix)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise _fail(what, path, f"not UTF-8 (byte offset {e.start})", fix) from None
    except OSError as e:
        raise _fail(what, path, f"cannot be read ({e.strerror})", fix) from None


def read_json(path, what: str, fix: str = ""):
    """The JSON value in file ``path`` (any JSON type).

    Raises:
        ShardwiseFileError: no such file, unreadable, or not valid JSON (line and column).
    """
    text = _text(path, what, fix)
    try:
        return json.loads(text)
    except ValueError as e:
        raise _fail(what, path, f"not valid JSON ({e})", fix) from None


def read_jsonl(path, what: str, fix: str = "", *, skip_torn_last: bool = False) -> list:
    """The JSON values of file ``path``, one per non-blank line, in file order.
    ``skip_torn_last``: drop a last line that does not parse (a crash mid-write leaves one, as
    in ``metrics.jsonl``) instead of raising.

    Raises:
        ShardwiseFileError: no such file, unreadable, or a line that is not valid JSON (named
            as ``path:line``).
    """
    lines = _text(path, what, fix).splitlines()
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if skip_torn_last and not any(rest.strip() for rest in lines[no:]):
                break
            raise _fail(what, f"{path}:{no}", f"not valid JSON ({e})", fix) from None
    return out


def read_toml(path, what: str, fix: str = "") -> dict:
    """The table of TOML file ``path`` (a dict).

    Raises:
        ShardwiseFileError: no such file, unreadable, or not valid TOML (line and column).
    """
    if not os.path.isfile(path):
        raise _fail(what, path, "no such file", fix)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise _fail(what, path, f"not valid TOML ({e})", fix) from None
    except OSError as e:
        raise _fail(what, path, f"cannot be read ({e.strerror})", fix) from None


__all__ = ["ShardwiseFileError", "read_json", "read_jsonl", "read_toml"]
