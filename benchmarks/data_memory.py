"""Peak memory of building the token cache: one huge single-line ``.txt`` vs the same text as
many documents.

Builds ~``--mb`` MB of text in a temporary folder from the embedded default corpus (the stdlib's
``.py`` sources, repeated as needed) and writes it twice: as one ``.txt`` file holding a single
line (every newline turned into a space: one document of ~24 M characters), and as a folder of
~10 KB ``.txt`` files cut from that same line at spaces (one document each). For each, a fresh
child process runs :func:`shardwise.data.prepare_lm_data` (tokenizer training for ``bpe`` and the
encode of the whole corpus, into an empty cache folder) and the parent reads that child's peak
resident set size with ``os.wait4`` (``ru_maxrss``). A child that only imports
``shardwise.data`` gives the floor.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_memory.py [--mb 24] [--tokenizer bpe]
        [--vocab-size 4096] [--chunk-chars N] [--cases line,docs] [--json PATH]

``--chunk-chars N`` sets :data:`shardwise.data.tokenizer.LONG_TEXT_CHUNK_CHARS` in the children
(0 = no chunking: every document is trained on and encoded whole, the behaviour before chunking
was added). Prints a Markdown table: peak RSS (MiB), wall time, documents and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
import shardwise.data as data
import shardwise.data.tokenizer as tokmod
if args["chunk_chars"] is not None:
    tokmod.LONG_TEXT_CHUNK_CHARS = args["chunk_chars"]
if args["data"] is None:
    print(json.dumps({}))
    raise SystemExit(0)
t0 = time.perf_counter()
d = data.prepare_lm_data(args["data"], args["tokenizer"], args["vocab_size"], seq_len=128,
                         cache_dir=args["cache"])
print(json.dumps({"seconds": time.perf_counter() - t0, "documents": d.stats["documents"],
                  "tokens": d.stats["train_tokens"] + d.stats["val_tokens"]}))
"""


def build_text(mb: float) -> str:
    """~``mb`` MB of stdlib source as one line (newlines → spaces)."""
    from shardwise.data import stdlib_corpus_files

    want = int(mb * 1_000_000)
    parts, total = [], 0
    files = stdlib_corpus_files()
    while total < want:
        for p in files:
            t = p.read_bytes().decode("utf-8", errors="replace")
            t = t.replace("\r", " ").replace("\n", " ")
            parts.append(t)
            total += len(t) + 1
            if total >= want:
                break
    return " ".join(parts)[:want]


def split_documents(text: str, size: int = 10_000) -> list[str]:
    """``text`` cut at the first space after every ``size`` characters."""
    docs, start = [], 0
    while start < len(text):
        cut = text.find(" ", start + size)
        cut = len(text) if cut < 0 else cut
        docs.append(text[start:cut])
        start = cut
    return docs


def run_child(data: str | None, cache: str, args) -> dict:
    """Run one preparation in a fresh process; returns its JSON plus ``peak_rss_mib``."""
    spec = {"data": data, "cache": cache, "tokenizer": args.tokenizer,
            "vocab_size": args.vocab_size, "chunk_chars": args.chunk_chars}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"child failed ({proc.returncode}):\n{err}")
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    res["wall_s"] = time.perf_counter() - t0
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=24.0, help="text size, MB (default 24)")
    p.add_argument("--tokenizer", default="bpe", help="bpe | bytes | FILE.json")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--chunk-chars", type=int, default=None,
                   help="override LONG_TEXT_CHUNK_CHARS in the children (0 = no chunking)")
    p.add_argument("--cases", default="line,docs", help="comma-separated: line, docs")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()

    rows = {}
    with tempfile.TemporaryDirectory(prefix="shardwise-datamem-") as tmp:
        tmp = Path(tmp)
        text = build_text(args.mb)
        (tmp / "line.txt").write_text(text, encoding="utf-8")
        (tmp / "docs").mkdir()
        for i, doc in enumerate(split_documents(text)):
            (tmp / "docs" / f"doc_{i:06d}.txt").write_text(doc, encoding="utf-8")
        del text
        rows["import only"] = run_child(None, str(tmp / "cache0"), args)
        names = {"line": ("one line (1 document)", tmp / "line.txt"),
                 "docs": ("same text, ~10 KB documents", tmp / "docs")}
        for i, case in enumerate(c.strip() for c in args.cases.split(",")):
            label, path = names[case]
            rows[label] = run_child(str(path), str(tmp / f"cache{i + 1}"), args)

    print(f"\n{args.mb:g} MB of text, --tokenizer {args.tokenizer}, chunk_chars="
          f"{'default' if args.chunk_chars is None else args.chunk_chars}\n")
    print("| input | peak RSS (MiB) | prepare (s) | documents | tokens |")
    print("|---|---:|---:|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['peak_rss_mib']:,.0f} | {r.get('seconds', 0):.1f} | "
              f"{r.get('documents', '—')} | {r.get('tokens', '—')} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
