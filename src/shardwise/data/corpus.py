"""Where training text comes from: the embedded default corpus, or the user's files.

The embedded default is the running interpreter's own standard library (about 730 ``.py`` files,
~12 MB): it is on every machine that can run shardwise, needs no download, and is real code with a
long tail of identifiers — a fair small language-modelling corpus. Every file is one document.

User data (``--data PATH``) is a ``.txt`` file (one document per file), a ``.jsonl`` file (one
document per record, field ``text``), a ``.parquet`` file (column ``text``), or a folder holding any
of those (searched recursively, in sorted path order). ``.jsonl`` and ``.parquet`` are read through
HF ``datasets``, imported lazily because the import alone takes about a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from shardwise.errors import ShardwiseConfigError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Directory names under the stdlib that hold test suites (their data files include deliberately
# broken encodings and they would dominate the corpus) or third-party packages.
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})


def default_cache_dir() -> Path:
    """The folder shardwise caches tokenizers and token streams in.

    ``$SHARDWISE_CACHE`` if set, else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``.
    The folder is not created here.
    """
    if os.environ.get("SHARDWISE_CACHE"):
        return Path(os.environ["SHARDWISE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "shardwise"
    return Path.home() / ".cache" / "shardwise"


def stdlib_corpus_files() -> list[Path]:
    """The standard library's ``.py`` sources that make up the embedded default corpus.

    Found under ``sysconfig.get_paths()["stdlib"]``, sorted by path. Test suites (directories named
    ``test``, ``tests``, ``idle_test``; files named ``test_*.py``) and ``site-packages`` /
    ``dist-packages`` are left out. Prints nothing.

    Raises:
        ShardwiseConfigError: the interpreter ships no stdlib sources (e.g. a zip-only install).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIP_DIRS]  # prune, don't descend
        files += [Path(folder, n) for n in names if n.endswith(".py") and not n.startswith("test_")]
    if not files:
        raise ShardwiseConfigError(
            f"the embedded default corpus needs the standard library's .py sources, but {root} "
            "has none: pass --data PATH with your own text"
        )
    return sorted(files)


def source_files(data: str | os.PathLike | None) -> list[Path]:
    """The files that ``load_documents(data)`` reads, in document order.

    ``None`` means the embedded default (:func:`stdlib_corpus_files`). A file must end in ``.txt``,
    ``.jsonl`` or ``.parquet``; a folder is searched recursively for such files, sorted by their
    path relative to the folder.

    Raises:
        ShardwiseConfigError: the path does not exist, has an unsupported suffix, or is a folder
            with no supported files ("empty").
    """
    if data is None:
        return stdlib_corpus_files()
    path = Path(data).expanduser()
    if not path.exists():
        raise ShardwiseConfigError(
            f"--data {data}: no such file or folder: check the path, or leave --data out to use "
            "the embedded default corpus"
        )
    if path.is_file():
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise ShardwiseConfigError(
                f"--data {data}: unsupported file type {path.suffix!r}: use a .txt, .jsonl "
                "(field 'text') or .parquet (column 'text') file, or a folder of them"
            )
        return [path]
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES]
    if not files:
        raise ShardwiseConfigError(
            f"--data {data}: the folder is empty of supported files (no .txt, .jsonl or .parquet "
            "anywhere under it): point --data at a folder that holds some"
        )
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def corpus_fingerprint(data: str | os.PathLike | None) -> str:
    """A hex digest that changes whenever the documents ``load_documents(data)`` returns may change.

    For the embedded default: the Python version and every file's relative path and size. For user
    data: every file's resolved path, size and modification time (nanoseconds). Reads no file
    contents, so it is cheap enough to compute on every rank and every run.

    Raises:
        ShardwiseConfigError: as :func:`source_files`.
    """
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        entries = [
            (p.relative_to(root).as_posix(), p.stat().st_size) for p in stdlib_corpus_files()
        ]
        payload = {"source": "stdlib", "python": sys.version, "files": entries}
    else:
        entries = []
        for p in source_files(data):
            st = p.stat()
            entries.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
        payload = {"source": "files", "files": entries}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def load_documents(data: str | os.PathLike | None) -> list[str]:
    """Read the corpus as a list of documents (one string each), in a fixed order.

    Args:
        data: ``None`` for the embedded default (every stdlib source file is one document, decoded
            as UTF-8 with ``errors="replace"``), or a path to a ``.txt`` / ``.jsonl`` / ``.parquet``
            file or a folder of them (see :func:`source_files`).

    Returns:
        The documents; empty ones (``""``) are dropped.

    Raises:
        ShardwiseConfigError: the path is missing or holds no supported files; a ``.txt`` or
            ``.jsonl`` file is not strict UTF-8 (the message gives the byte offset of the first
            bad byte); a ``.jsonl`` record lacks ``text``; a ``.parquet`` file lacks a ``text``
            column; or no document has any text ("empty").
    """
    files = source_files(data)
    docs: list[str] = []
    if data is None:
        docs = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    else:
        for path in files:
            if path.suffix == ".txt":
                docs.append(_read_utf8(path))
            elif path.suffix == ".jsonl":
                docs.extend(_read_jsonl(path))
            else:
                docs.extend(_read_parquet(path))
    docs = [d for d in docs if d]
    if not docs:
        raise ShardwiseConfigError(
            f"--data {data}: the data is empty (no document has any text): add text to the "
            "files, or leave --data out to use the embedded default corpus"
        )
    return docs


def _read_utf8(path: Path) -> str:
    """The file's text; ShardwiseConfigError naming the first invalid byte if not strict UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        offset = err.start
        line = raw.count(b"\n", 0, offset) + 1
        bad = raw[offset : offset + 4]
        raise ShardwiseConfigError(
            f"{path}: --data files must be UTF-8, but byte offset {offset} (line {line}) starts "
            f"an invalid sequence {bad!r}: re-encode the file, e.g. "
            f"`iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"
        ) from None


def _read_jsonl(path: Path) -> list[str]:
    """The ``text`` field of every record of a JSON-lines file, through HF ``datasets``.

    Every record is checked here first, because ``datasets`` does not fail on every bad record:
    given ``"text"`` values of mixed types it silently turns them all into their JSON spelling.
    """
    raw = _read_utf8(path)  # strict UTF-8 check first: its message names the byte offset
    # one pass over the text already read (not :func:`~shardwise.readers.iter_jsonl`, which would
    # read the file a second time); blank lines are skipped, as datasets skips them
    for number, line in enumerate(raw.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ShardwiseConfigError(
                f"{path}: line {number} is not valid JSON ({err}): write one JSON object per line"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ShardwiseConfigError(
                f"{path}: line {number} has no 'text' field (or it is null or not a string): "
                'every record needs one, e.g. {"text": "..."}: rename the field that holds '
                "the document"
            )
    return _load_hf("json", path)["text"]


def _read_parquet(path: Path) -> list[str]:
    """The ``text`` column of a parquet file, through HF ``datasets``."""
    table = _load_hf("parquet", path)
    if "text" not in table:
        raise ShardwiseConfigError(
            f"{path}: no 'text' column (columns: {sorted(table)}): rename the column that holds "
            "the documents to text"
        )
    bad = _first_non_string(table["text"])
    if bad is not None:
        raise ShardwiseConfigError(
            f"{path}: row {bad} has a null or non-string 'text': fill or drop those rows"
        )
    return table["text"]


def _first_non_string(texts: list | None) -> int | None:
    """Index of the first value that is not a ``str`` (0 if there is no column), else None."""
    if texts is None:
        return 0
    return next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)


def _load_hf(builder: str, path: Path) -> dict[str, list]:
    """Load one local file with ``datasets.load_dataset(builder)``; returns ``{column: values}``.

    A local file with a packaged builder never reaches the network, so the HF offline variables
    are left as the user set them (setting them here would switch the hub off for the whole
    process, e.g. for loading model weights later). Cached under the shardwise cache folder so it
    does not depend on ``~/.cache`` state; progress bars are off for the call.
    """
    import datasets  # lazy: ~1 s to import

    bars_were_off = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            builder,
            data_files=str(path),
            split="train",
            cache_dir=str(default_cache_dir() / "hf_datasets"),
        )
        return ds.data.to_pydict()
    except Exception as err:  # pyarrow / datasets parse errors: name the file, keep the cause
        raise ShardwiseConfigError(
            f"{path}: could not be read as {builder} ({type(err).__name__}: {err}): check that it "
            f"is valid {'JSON lines' if builder == 'json' else 'parquet'}"
        ) from err
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
