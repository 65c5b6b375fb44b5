"""Activation memory of ``--ac none | selective | full``: bytes autograd keeps for backward.

For each mode, one forward of a Llama-style preset on a [b, s] batch runs under a
``torch.autograd.graph.saved_tensors_hooks`` pair that records every tensor saved for backward,
plus (``selective``) every op output PyTorch's selective-checkpoint cache keeps
(:func:`shardwise.models.ac.observe_selective_saves`; that cache is invisible to the hooks).
Saved bytes = the sum of the distinct storages among them (a tensor saved by two ops counts once),
leaving out the model's parameters and buffers (held anyway). A checkpointed block keeps its
inputs through PyTorch's ``_NoopSaveInputs`` node, which the outer hooks do see, so they are
counted. Then backward runs, and the gradients are compared with ``none`` (bitwise).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ac_memory.py [--model small] [--batch 4]
        [--seq-len 128] [--repeats 3] [--json benchmarks/results/ac_memory.json]

Prints a Markdown table: saved bytes per mode (and per block / per token), the ratio to
``none``, and the median forward+backward time (the recompute's cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardwise.models import build_model, loss_sum_and_count, set_activation_checkpointing
from shardwise.models.ac import AC_MODES, observe_selective_saves


def saved_activation_bytes(model: torch.nn.Module, batch: dict, mode: str) -> tuple[int, dict]:
    """(bytes of distinct storages saved for backward by one forward of ``batch`` under ``mode``,
    excluding parameters and buffers; {name: grad} after the backward)."""
    set_activation_checkpointing(model, mode)
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def note(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in state and s.nbytes():
                seen[s.data_ptr()] = s.nbytes()
        elif isinstance(t, (tuple, list)):
            for x in t:
                note(x)

    def pack(t):
        note(t)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_selective_saves(note):
        loss, _ = loss_sum_and_count(model, batch)
    total = sum(seen.values())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return total, grads


def timed_step(model, batch, mode: str) -> float:
    set_activation_checkpointing(model, mode)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss, _ = loss_sum_and_count(model, batch)
    loss.backward()
    return time.perf_counter() - t0


def run(model_name="small", batch=4, seq_len=128, vocab=4096, repeats=3, seed=0) -> list[dict]:
    torch.manual_seed(seed)
    model = build_model(model_name, vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    rows, ref = [], None
    for mode in AC_MODES:
        nbytes, grads = saved_activation_bytes(model, mb, mode)
        if ref is None:
            ref = grads
        same = all(torch.equal(grads[n], ref[n]) for n in ref)
        times = [timed_step(model, mb, mode) for _ in range(repeats)]
        rows.append({"mode": mode, "saved_bytes": nbytes,
                     "per_token": nbytes / (batch * seq_len),
                     "grads_bitwise_equal_to_none": same,
                     "fwd_bwd_s": statistics.median(times)})
    for r in rows:
        r["ratio"] = r["saved_bytes"] / rows[0]["saved_bytes"]
        r["time_ratio"] = r["fwd_bwd_s"] / rows[0]["fwd_bwd_s"]
    return rows


def table(rows, model_name, batch, seq_len) -> str:
    out = [f"model {model_name}, batch {batch} × {seq_len} tokens, fp32, one forward "
           "(bytes saved for backward, excluding parameters and buffers)", "",
           "| --ac | saved bytes | per token | vs none | fwd+bwd (ms) | time vs none "
           "| grads = none |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "bitwise" if r["grads_bitwise_equal_to_none"] else "NO"
        out.append(f"| {r['mode']} | {r['saved_bytes']:,} | {r['per_token']:,.0f} | "
                   f"{r['ratio']:.3f} | {r['fwd_bwd_s'] * 1e3:.0f} | {r['time_ratio']:.2f} | "
                   f"{same} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(a.model, a.batch, a.seq_len, a.vocab, a.repeats)
    print(table(rows, a.model, a.batch, a.seq_len))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "batch": a.batch, "seq_len": a.seq_len, "rows": rows},
                      f, indent=2)
    return 0 if all(r["grads_bitwise_equal_to_none"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
