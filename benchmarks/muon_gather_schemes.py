"""Muon under ZeRO: what the all-gather scheme (shardwise's) and an owner scheme would move and
compute, from the flat-buffer layout alone (issue 41; docs/optimizers.md §5). No process group.

Each block is one ZeRO unit: its parameters flattened in module order, padded to P = ⌈Ψ/n⌉·n,
rank r owning [r·P/n, (r+1)·P/n) (parallel/zero/flat.py). All-gather (what shardwise does): every
rank receives each unit's whole U, (n−1)/n·4P bytes sent per rank, and orthogonalises every
hidden matrix it holds a piece of. Owner: each matrix is orthogonalised once, by the rank holding
most of it; the other ranks holding a piece send it there and get O's piece back (2 × 4 bytes per
element not on the owner; nothing moves for a matrix inside one slice).

    python benchmarks/muon_gather_schemes.py --model small --ranks 2 4 8
"""

import argparse
import math

from shardwise.models import build_model
from shardwise.parallel.muon import is_hidden_matrix, ns_flops


def schemes(model, n: int) -> dict:
    out = {"matrices": 0, "pairs": 0, "ns_total": 0.0, "ns_max_rank": 0.0, "allgather_bytes": 0.0,
           "owner_bytes": 0.0, "owner_ns_max_rank": 0.0}
    ns_rank, owner_rank = [0.0] * n, [0.0] * n
    for i, block in enumerate(model.layers):
        named = [(f"layers.{i}.{k}", p) for k, p in block.named_parameters()]
        padded = math.ceil(sum(p.numel() for _, p in named) / n) * n
        k, off = padded // n, 0
        out["allgather_bytes"] += n * (n - 1) / n * 4 * padded  # all ranks together
        for fqn, p in named:
            a, b = off, off + p.numel()
            off = b
            if not is_hidden_matrix(fqn, p):
                continue
            f = ns_flops(p.shape)
            pieces = [max(0, min(b, (r + 1) * k) - max(a, r * k)) for r in range(n)]
            out["matrices"] += 1
            out["ns_total"] += f
            for r in range(n):
                if pieces[r]:
                    out["pairs"] += 1
                    ns_rank[r] += f
            owner = max(range(n), key=lambda r: pieces[r])
            owner_rank[owner] += f
            out["owner_bytes"] += 2 * 4 * (p.numel() - pieces[owner])
    out["ns_max_rank"], out["owner_ns_max_rank"] = max(ns_rank), max(owner_rank)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    model = build_model(args.model, vocab_size=4096)
    print("| n | hidden matrices | (rank, matrix) NS runs, all-gather | NS GFLOP, busiest rank: "
          "all-gather / owner (of the total) | bytes per step, all ranks: all-gather / owner |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        s = schemes(model, n)
        print(f"| {n} | {s['matrices']} | {s['pairs']} ({s['pairs'] / s['matrices']:.2f}×) | "
              f"{s['ns_max_rank'] / 1e9:.1f} / {s['owner_ns_max_rank'] / 1e9:.1f} "
              f"({s['ns_total'] / 1e9:.1f}) | {s['allgather_bytes'] / 1e6:.2f} MB / "
              f"{s['owner_bytes'] / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
