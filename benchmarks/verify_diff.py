"""Compare two ``shardwise verify --json`` reports case by case: the before/after check of a
refactor that must leave behaviour unchanged (issue: one parallel core).

    python benchmarks/verify_diff.py benchmarks/baselines/verify_n4.json after_n4.json

For each case (layout, engine, model) in either report it checks that

- it is in both, and passes in both;
- its losses are equal step by step: bitwise, or (``--rtol``) within a relative tolerance, which
  a change of summation order needs (default 0: bitwise);
- its wire bytes per kind of traffic (``"<tag> <op> <axis>"``, last step, summed over the ranks)
  are equal. A tag renamed by the change shows as one key gone and one key new with the same
  bytes: listed as a rename. ``--renames old=new,...`` accepts one; ``old`` is a tag (renamed on
  every axis) or a whole key (``"grad all_reduce tp=sp_grad all_reduce tp"``: only there).
  Bytes moved between tags with the case's total unchanged are a *retag*, listed as such
  (``--allow-retag`` accepts them).

Prints one line per difference and a summary; exit status 0 when nothing differs (accepted
renames and retags aside), 1 otherwise, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def load(path: str) -> dict[tuple, dict]:
    """The report's cases keyed by (layout, engine, model)."""
    with open(path) as f:
        report = json.load(f)
    return {(c["layout"], c["engine"], c["model"]): c for c in report["cases"]}


def split_key(key: str) -> tuple[str, str]:
    """``"<tag> <op> <axis>"`` → (tag, "<op> <axis>")."""
    tag, _, rest = key.partition(" ")
    return tag, rest


def diff_bytes(before: dict, after: dict, renames: dict[str, str]) -> list[str]:
    """The differences between two ``bytes_per_tag`` maps, ``before``'s tags renamed first."""
    mapped: dict[str, float] = {}
    for key, b in before.items():
        tag, rest = split_key(key)
        k = renames[key] if key in renames else f"{renames.get(tag, tag)} {rest}"
        mapped[k] = mapped.get(k, 0.0) + b
    out = []
    gone = {k: b for k, b in mapped.items() if k not in after}
    new = {k: b for k, b in after.items() if k not in mapped}
    for k in sorted(set(mapped) & set(after)):
        if mapped[k] != after[k]:
            out.append(f"{k}: {mapped[k]:,.0f} B → {after[k]:,.0f} B")
    for k, b in sorted(gone.items()):
        twin = [n for n, nb in new.items() if nb == b and split_key(n)[1] == split_key(k)[1]]
        if twin:
            out.append(f"{k}: renamed to {twin[0]}? ({b:,.0f} B; pass --renames "
                       f"{split_key(k)[0]}={split_key(twin[0])[0]} to accept)")
            new.pop(twin[0])
        else:
            out.append(f"{k}: {b:,.0f} B → gone")
    for k, b in sorted(new.items()):
        out.append(f"{k}: new, {b:,.0f} B")
    return out


def compare(before: dict, after: dict, rtol: float, renames: dict[str, str],
            allow_retag: bool = False) -> tuple[list[str], list[str]]:
    """(differences, retags): one line each, per case."""
    lines, retags = [], []
    for key in sorted(set(before) | set(after)):
        name = " ".join(key)
        if key not in after or key not in before:
            lines.append(f"{name}: only in the {'before' if key in before else 'after'} report")
            continue
        b, a = before[key], after[key]
        if not (b["pass"] and a["pass"]):
            lines.append(f"{name}: pass {b['pass']} → {a['pass']}")
        lb, la = b.get("losses", []), a.get("losses", [])
        if len(lb) != len(la):
            lines.append(f"{name}: {len(lb)} losses → {len(la)}")
        for step, (x, y) in enumerate(zip(lb, la)):
            if not (x == y or (rtol and math.isclose(x, y, rel_tol=rtol, abs_tol=0.0))):
                lines.append(f"{name}: step {step} loss {x!r} → {y!r} "
                             f"(relative {abs(y - x) / max(abs(x), 1e-30):.2e})")
        bb, ab = b.get("bytes_per_tag", {}), a.get("bytes_per_tag", {})
        diffs = diff_bytes(bb, ab, renames)
        if diffs and sum(bb.values()) == sum(ab.values()):  # bytes moved between tags only
            retags += [f"{name}: retag (total {sum(ab.values()):,.0f} B unchanged): {d}"
                       for d in diffs]
            if not allow_retag:
                lines += [f"{name}: retag: {d}" for d in diffs]
        else:
            lines += [f"{name}: {d}" for d in diffs]
    return lines, retags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/verify_diff.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="relative tolerance on losses (default 0: bitwise)")
    ap.add_argument("--renames", default="",
                    help="accepted tag renames, old=new,old2=new2 (a tag, or a whole key)")
    ap.add_argument("--allow-retag", action="store_true",
                    help="accept bytes moved between tags when a case's total is unchanged")
    a = ap.parse_args(argv)
    try:
        before, after = load(a.before), load(a.after)
        renames = dict(p.split("=", 1) for p in a.renames.split(",") if p)
    except (OSError, ValueError, KeyError) as e:
        print(f"verify_diff: error: {e}", file=sys.stderr)
        return 2
    lines, retags = compare(before, after, a.rtol, renames, a.allow_retag)
    for line in lines:
        print(line)
    if a.allow_retag:
        for line in retags:
            print(line)
    n = len(set(before) | set(after))
    print(f"verify_diff: {n} cases, {len(lines)} difference(s)"
          + (f"; accepted renames {a.renames}" if renames else "")
          + (f"; accepted retags: {len(retags)}" if a.allow_retag else ""))
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
