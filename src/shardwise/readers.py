"""Three small readers for the files shardwise reads: JSON, JSON lines and TOML, each with one
error that names the file.

Every reader takes ``path``, ``what`` (the flag or the role of the file, e.g. ``"--config"`` or
``"checkpoint"``: the message starts with it) and an optional ``fix`` (how to fix it, appended
after a colon), and raises :class:`~shardwise.errors.ShardwiseFileError` (a
:class:`~shardwise.errors.ShardwiseConfigError`) for a missing file, one that cannot be read,
or one that does not parse, e.g. ``--config run.toml: not valid TOML (Expected '=' after a key
in a key/value pair (at line 2, column 5))``. Nothing else is caught: a reader never returns
a partial or empty result in place of an error.

Two keywords serve callers with their own errors: ``error`` is the class raised (e.g.
:class:`~shardwise.checkpoint.format.CheckpointError`, which ``--resume auto`` catches), and
``fix`` may be a dict with one fix per problem, keys ``"missing"``, ``"unreadable"``,
``"encoding"`` and ``"syntax"`` (a problem without a key gets no fix). JSON lines are read one
line at a time (:func:`iter_jsonl`), so a large file is never held whole.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Iterator

from .errors import ShardwiseFileError


def _fail(what: str, path, problem: str, fix, kind: str, error: type[Exception]):
    fix = fix.get(kind, "") if isinstance(fix, dict) else fix
    return error(f"{what} {path}: {problem}" + (f": {fix}" if fix else ""))


def _text(path, what: str, fix, error) -> str:
    if not os.path.isfile(path):
        raise _fail(what, path, "no such file", fix, "missing", error)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise _fail(what, path, f"not UTF-8 (byte offset {e.start})", fix, "encoding",
                    error) from None
    except OSError as e:
        raise _fail(what, path, f"cannot be read ({e.strerror})", fix, "unreadable",
                    error) from None


def read_json(path, what: str, fix: str | dict = "", *,
              error: type[Exception] = ShardwiseFileError):
    """The JSON value in file ``path`` (any JSON type).

    Raises:
        ShardwiseFileError (or ``error``): no such file, unreadable, not UTF-8, or not valid
            JSON (line and column).
    """
    text = _text(path, what, fix, error)
    try:
        return json.loads(text)
    except ValueError as e:
        raise _fail(what, path, f"not valid JSON ({e})", fix, "syntax", error) from None


def iter_jsonl(path, what: str, fix: str | dict = "", *, skip_torn_last: bool = False,
               bad_line: Callable[[int, json.JSONDecodeError], str] | None = None,
               error: type[Exception] = ShardwiseFileError) -> Iterator[tuple[int, object]]:
    """``(line number, JSON value)`` for every non-blank line of file ``path``, in file order,
    read one line at a time. ``skip_torn_last``: end at a last line that does not parse (a
    crash mid-write leaves one, as in ``metrics.jsonl``) instead of raising. ``bad_line(line
    number, JSON error)``: the caller's own message for a line that does not parse (raised as
    ``error``), e.g. to keep a message its users know; by default ``WHAT PATH:LINE: not valid
    JSON (MSG at column N)``.

    Raises:
        ShardwiseFileError (or ``error``): no such file, unreadable, not UTF-8 (byte offset in
            the file), or a line that is not valid JSON (named as ``path:line``).
    """
    if not os.path.isfile(path):
        raise _fail(what, path, "no such file", fix, "missing", error)
    torn = None  # the error of a bad line, raised when a non-blank line follows it
    try:
        with open(path, "rb") as f:
            offset = 0
            for no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _fail(what, path, f"not UTF-8 (byte offset {offset + e.start})", fix,
                                "encoding", error) from None
                offset += len(raw)
                if not line.strip():
                    continue
                if torn is not None:
                    raise torn from None
                try:
                    value = json.loads(line)
                except ValueError as e:
                    err = (error(bad_line(no, e)) if bad_line is not None else
                           _fail(what, f"{path}:{no}", f"not valid JSON ({e.msg} at column "
                                 f"{e.colno})", fix, "syntax", error))
                    if not skip_torn_last:
                        raise err from None
                    torn = err
                    continue
                yield no, value
    except OSError as e:
        raise _fail(what, path, f"cannot be read ({e.strerror})", fix, "unreadable",
                    error) from None


def read_jsonl(path, what: str, fix: str | dict = "", *, skip_torn_last: bool = False,
               numbered: bool = False, error: type[Exception] = ShardwiseFileError) -> list:
    """The JSON values of file ``path``, one per non-blank line, in file order (with
    ``numbered``: ``(line number, value)`` pairs, for messages that name a record's line).
    ``skip_torn_last`` and the errors: :func:`iter_jsonl`."""
    pairs = iter_jsonl(path, what, fix, skip_torn_last=skip_torn_last, error=error)
    return list(pairs) if numbered else [value for _, value in pairs]


def read_toml(path, what: str, fix: str | dict = "", *,
              error: type[Exception] = ShardwiseFileError) -> dict:
    """The table of TOML file ``path`` (a dict).

    Raises:
        ShardwiseFileError (or ``error``): no such file, unreadable, or not valid TOML (line
            and column).
    """
    if not os.path.isfile(path):
        raise _fail(what, path, "no such file", fix, "missing", error)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise _fail(what, path, f"not valid TOML ({e})", fix, "syntax", error) from None
    except OSError as e:
        raise _fail(what, path, f"cannot be read ({e.strerror})", fix, "unreadable",
                    error) from None


__all__ = ["ShardwiseFileError", "iter_jsonl", "read_json", "read_jsonl", "read_toml"]
