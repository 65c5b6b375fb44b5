"""Activation memory of context parallelism: bytes each cp rank saves for backward (issue 15).

For each cp in ``--cps`` a local gloo world of cp ranks is spawned (forked). In it, for each
sequence length s and method (``ring``, ``allgather``; cp = 1 is the plain model), a Llama
preset built with ``max_seq_len`` = the longest s is turned into an engine by
:func:`shardwise.parallel.apply.parallelize` with ``Layout(cp=cp, cp_method=method)``, a
[b, s] batch is cut with :func:`~shardwise.parallel.cp.shard_sequence` (as ``train_step``
does), and one forward runs under a ``torch.autograd.graph.saved_tensors_hooks`` pair that
records every tensor saved for backward. Saved bytes = the sum of the distinct storages among
them, leaving out the model's parameters and buffers (held anyway): the method of
``benchmarks/ac_memory.py``. Then backward runs (so the ring, or the reduce-scatter, runs
back) and the loss, the global token mean, is checked finite. Every rank measures; rank 0's
bytes are reported and all ranks must agree (the zig-zag split gives every rank the same
shapes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cp_memory.py [--model small] [--batch 1]
        [--seq-lens 1024 2048 4096] [--cps 1 2 4] [--budget-mib 128 --budget-seq 4096]
        [--json benchmarks/results/cp_memory.json]

Prints two Markdown tables: measured vs formula per (s, cp, method), and the budget
demonstration. Exit code 1 when a measurement differs from the formula by more than 5 %, the
ranks disagree, or a loss is not finite.

**The formula** (bytes per rank, derived from what ``models/llama.py`` and ``parallel/cp/
attention.py`` save; fp32 activations, e = 4 bytes; the log-sum-exp is fp32 in every case).
t = b·s/cp tokens on this rank; d model width, f SwiGLU width, h heads, k kv heads, hd = d/h,
V vocab, L layers. Per layer, in the order the forward saves them:

=================  ======================================================  ==================
op                 saved tensors                                           bytes
=================  ======================================================  ==================
attention_norm     its input x [b, t, d] (for x² and x·r); r = rsqrt(mean   e·t·(2d + 1)
                   x² + ε) [b, t, 1]; x·r [b, t, d] (for ·weight)
wq, wk, wv         their one input, the norm's output [b, t, d]            e·t·d
RoPE               nothing new per layer (cos, sin: below)                 0
core, cp = 1       SDPA (CPU flash kernel): q after RoPE [b, h, t, hd];    e·t·4d + 4·t·h
                   K and V repeated to h heads (GQA) [b, h, t, hd] each;
                   out [b, h, t, hd]; lse [b, h, t] fp32
core, ring         ``_RingAttention``: q [b, h, t, hd]; k [b, k, t, hd]     e·t·(2d + 2k·hd)
                   (after RoPE), v [b, k, t, hd] (a view of wv's output),  + 4·t·h
                   not repeated; out [b, h, t, hd]; lse [b, h, 2, t/2]
core, allgather    q, out, lse as the ring; K and V all-gathered and put   e·t·2d + 4·t·h
                   in position order, at k heads (SDPA's ``enable_gqa``):  + 2·e·b·s·k·hd
                   [b, k, s, hd] each, over the whole sequence s (the
                   additive mask and the order: once per forward, below)
wo                 its input, y = out as [b, t, h·hd]: out is laid out     0
                   [b, t, h, hd] (SDPA's kernel; the ring's zeros_like of
                   q keeps q's strides), so y is a view of out
ffn_norm           as attention_norm, on x + attention                     e·t·(2d + 1)
w1, w3             their one input, the norm's output [b, t, d]            e·t·d
SwiGLU, w2         w1's output [b, t, f] (silu's input); silu(·) and w3's  e·t·4f
                   output [b, t, f] (the product); the product [b, t, f]
                   (w2's input)
residuals          the adds and dropout (p = 0) save nothing               0
=================  ======================================================  ==================

So per layer (K/V term: 2k·hd for ring and for cp = 1 with SDPA's native GQA; 2d for cp = 1
on a torch without ``enable_gqa``, whose SDPA saves the repeated copies, as written below):

    cp = 1:     e·t·(10d + 4f + 2) + 4·t·h
    ring:       e·t·(8d + 2k·hd + 4f + 2) + 4·t·h
    allgather:  e·t·(8d + 4f + 2) + 4·t·h + 2·e·b·s·k·hd

Once per forward: the embedding's indices (``input_ids``, int64) 8·t; the final norm
e·t·(2d + 1) and the output projection's input e·t·d (the first layer's x is the embedding's
output, counted in the layer; tied embeddings: no new parameter); the loss: log-softmax's
output [b·t, V] fp32 4·t·V, nll's target (``labels``, int64) 8·t and its total weight (a fp32
scalar, 4 bytes). cp > 1 only: RoPE's cos and sin rows gathered at this rank's positions,
[b, 1, t, hd] fp32 each, built once and shared by every layer, 2·4·t·hd (at cp = 1 they are
views of the model's buffers, not counted); the all-gather method only: its additive causal
mask [s/cp, s] (e bytes) and the gathered rows' order [s] (int64), built once and shared by
every layer (``attention._gathered_layout``)::

    total = L·layer + 8·t + e·t·(3d + 1) + 4·t·V + 8·t + 4 + [cp > 1]·8·t·hd
            + [allgather]·(e·(s/cp)·s + 8·s)

Memory ÷ cp: every term is ∝ t = b·s/cp except the all-gather's K/V (∝ s, at k heads), its
mask (∝ s²/cp, once) and its order (∝ s, once); the ring's per-token cost is a little below
cp = 1's because it keeps K/V at k heads where SDPA keeps h (here k = h/2) and above it by the
RoPE rows. So the ring's per-rank bytes × cp / cp = 1's bytes is slightly below 1, and
all-gather's grows with s and cp: it holds every layer's K/V for the whole sequence, which
Llama 3 accepted because GQA makes them small (k/h of the activations). The same accounting
as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
§4.1: per-layer bytes
s·b·h·(34 + 5·a·s/h) in their notation, 16-bit with dropout), counted per tensor for this
model and its kernels (a fused attention kernel saves no s×s scores).

**The budget** (``--budget-mib`` B, ``--budget-seq`` L): the same hooks, armed with a limit,
raise :class:`SavedBytesBudgetExceeded` the moment the distinct saved storages of one forward
exceed B bytes on a rank. It is a saved-activation budget, not an allocator limit: parameters,
gradients, optimizer state and transient buffers are outside it (an ``RLIMIT_AS`` limit is not
robust with torch's virtual reservations, and the CPU allocator has no statistics). Each cp
runs one whole ``train_step`` (AdamW) at seq L under the armed hooks, and cp = 1 also at
L / max(cp): refused (and where), or completed with its loss. The demonstration holds when
cp = 1 is refused at L and the largest cp trains L with the ring. The zig-zag split gives
every rank the same saved tensors in the same order, so all ranks of a world refuse at the
same tensor, before any further collective.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.models import build_model, preset_config
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.cp import shard_sequence
from shardwise.topology import Topology, free_port
from shardwise.train.step import train_step

METHODS = ("ring", "allgather")


# -- the formula --------------------------------------------------------------------------------
def formula_bytes(cfg, batch: int, seq: int, cp: int, method: str = "ring",
                  elem: int = 4) -> dict[str, int]:
    """{"layers", "once", "total": bytes} saved for backward on one cp rank by one forward of
    ``batch`` sequences of ``seq`` tokens (the module docstring's table). ``cfg``: a
    :class:`~shardwise.models.LlamaConfig`; ``method`` is ignored at cp = 1 (plain model);
    ``elem``: activation bytes per element (4: fp32)."""
    d, f, h, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size
    kvd, hd = cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
    t = batch * seq // cp
    e = elem
    lse = 4 * t * h
    from shardwise.models.sdpa import SDPA_GQA  # native GQA: SDPA saves K/V at k heads

    if cp == 1 and not SDPA_GQA:
        layer = e * t * (10 * d + 4 * f + 2) + lse
    elif cp == 1 or method == "ring":
        layer = e * t * (8 * d + 2 * kvd + 4 * f + 2) + lse
    else:
        layer = e * t * (8 * d + 4 * f + 2) + lse + 2 * e * batch * seq * kvd
    once = 8 * t + e * t * (3 * d + 1) + 4 * t * V + 8 * t + 4
    if cp > 1:
        once += 2 * 4 * t * hd
    if cp > 1 and method == "allgather":  # the mask and the order, shared by every layer
        once += e * (seq // cp) * seq + 8 * seq
    layers = cfg.n_layers * layer
    return {"layers": layers, "once": once, "total": layers + once}


# -- the measurement ----------------------------------------------------------------------------
class SavedBytesBudgetExceeded(RuntimeError):
    """The distinct storages saved for backward on this rank exceeded the budget."""


class SavedBytes:
    """Context: count the distinct storages saved for backward while inside (excluding the
    parameters and buffers of ``module``), in :attr:`total` bytes; with ``limit`` (bytes),
    raise :class:`SavedBytesBudgetExceeded` as soon as the total exceeds it. Saved tensors stay
    alive until backward, so a storage's address cannot be reused while the count runs."""

    def __init__(self, module: torch.nn.Module, limit: int | None = None):
        self.state = {t.untyped_storage().data_ptr()
                      for t in [*module.parameters(), *module.buffers()]}
        self.seen: dict[int, int] = {}
        self.what: list[tuple] = []  # (storage bytes, shape, dtype, producer) in saved order
        self.total, self.limit = 0, limit
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.state and ptr not in self.seen and s.nbytes():
            self.seen[ptr] = s.nbytes()
            self.what.append((s.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""),
                              type(t.grad_fn).__name__ if t.grad_fn is not None else "-"))
            self.total += s.nbytes()
            if self.limit is not None and self.total > self.limit:
                raise SavedBytesBudgetExceeded(
                    f"{self.total:,} bytes saved for backward > budget {self.limit:,} (at "
                    f"storage {len(self.seen)}, a {tuple(t.shape)} "
                    f"{str(t.dtype).replace('torch.', '')} tensor)")
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


def _batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict:
    """The same [b, s] token batch on every rank (input_ids and labels in separate storages)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}


def _engine(args, topo, cp: int, method: str):
    torch.manual_seed(0)
    model = build_model(args.model, vocab_size=args.vocab, max_seq_len=args.max_seq)
    return parallelize(model, topo, Layout(cp=cp, cp_method=method))


def measure(args, topo, cp: int, seq: int, method: str) -> dict:
    """One forward under :class:`SavedBytes` on this rank, then backward: saved bytes, global
    mean loss, forward+backward seconds."""
    engine = _engine(args, topo, cp, method)
    mb = shard_sequence(_batch(args.vocab, args.batch, seq), topo)
    denom = float(args.batch * seq)
    t0 = time.perf_counter()
    with SavedBytes(engine) as saved:
        loss_sum = engine.loss_fn.loss_sum(mb)  # the forward: every saved tensor counted
    (loss_sum / denom).backward()  # the ring (or reduce-scatter) runs back
    engine.finish_gradient_sync()
    seconds = time.perf_counter() - t0
    total = loss_sum.detach().double().reshape(1)
    dist.all_reduce(total)  # the token-loss sums of every rank's chunks
    grads_finite = all(torch.isfinite(p.grad).all() for p in engine.module.parameters()
                       if p.grad is not None)
    if args.list and topo.index("cp") == 0:
        print(f"saved storages, cp={cp} s={seq} {method if cp > 1 else '-'} (rank 0; bytes, "
              "shape saved, dtype, the op that made it):")
        for row in saved.what:
            print("   ", *row)
    return {"saved_bytes": saved.total, "storages": len(saved.seen),
            "loss": float(total) / denom, "grads_finite": bool(grads_finite),
            "fwd_bwd_s": seconds}


def budget_step(args, topo, cp: int, method: str, seq: int) -> dict:
    """One ``train_step`` at ``seq`` with the budget armed: refused (where), or its loss."""
    engine = _engine(args, topo, cp, method)
    opt = engine.make_optimizer([{"params": list(engine.module.parameters())}], lr=1e-3)
    batch = _batch(args.vocab, args.batch, seq, seed=1)
    limit = int(args.budget_mib * 2**20)
    t0 = time.perf_counter()
    try:
        with SavedBytes(engine, limit) as saved:
            res = train_step(engine, [batch], opt, topo, max_norm=1.0)
    except SavedBytesBudgetExceeded as e:
        return {"ok": False, "why": str(e), "saved_bytes": saved.total,
                "seconds": time.perf_counter() - t0}
    return {"ok": math.isfinite(res.loss), "loss": res.loss, "saved_bytes": saved.total,
            "seconds": time.perf_counter() - t0}


def _worker(rank: int, cp: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(cp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology(cp=cp, timeout_s=600)
    rows = []
    for seq in args.seq_lens:
        for method in (METHODS if cp > 1 else ("-",)):
            if cp > 1 and method not in args.methods:
                continue
            r = measure(args, topo, cp, seq, "ring" if method == "-" else method)
            per_rank = [None] * cp
            dist.all_gather_object(per_rank, r["saved_bytes"])
            rows.append({"seq": seq, "cp": cp, "method": method, **r, "per_rank": per_rank})
            if rank == 0:
                print(f"  cp={cp} s={seq} {method}: {r['saved_bytes']:,} B "
                      f"({r['fwd_bwd_s']:.1f} s)", flush=True)
    budget = []
    # cp = 1 also at L / max(cp): the budget is one that a shorter sequence fits
    seqs = [args.budget_seq] + ([args.budget_seq // max(args.cps)] if cp == 1 else [])
    for seq in (seqs if args.budget_mib and cp in args.budget_cps else []):
        for method in (METHODS if cp > 1 else ("-",)):
            if cp > 1 and method not in args.methods:
                continue
            b = budget_step(args, topo, cp, "ring" if method == "-" else method, seq)
            oks = [None] * cp
            dist.all_gather_object(oks, b["ok"])
            budget.append({"seq": seq, "cp": cp, "method": method, **b, "all_ranks_ok": oks})
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"rows": rows, "budget": budget}, fh)
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> dict:
    """Every cp world in turn; rows with the formula and the ratios added."""
    cfg = preset_config(args.model, args.vocab, max_seq_len=args.max_seq)
    rows, budget = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cps:
            out = os.path.join(tmp, f"cp{cp}.json")
            mp.start_processes(_worker, args=(cp, free_port(), args, out), nprocs=cp,
                               start_method="fork")
            with open(out) as fh:
                got = json.load(fh)
            rows += got["rows"]
            budget += got["budget"]
    rows.sort(key=lambda r: (r["seq"], r["cp"], r["method"] != "ring"))
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        f = formula_bytes(cfg, args.batch, r["seq"], r["cp"], r["method"])
        r["formula_bytes"] = f["total"]
        r["measured_over_formula"] = r["saved_bytes"] / f["total"]
        r["ranks_equal"] = len(set(r["per_rank"])) == 1
        b1 = base.get(r["seq"])
        if b1 is not None:
            r["vs_cp1"] = r["saved_bytes"] / b1["saved_bytes"]
            r["vs_cp1_times_cp"] = r["vs_cp1"] * r["cp"]  # 1.0 = exactly ÷ cp
            r["loss_minus_cp1"] = r["loss"] - b1["loss"]
    for b in budget:
        f = formula_bytes(cfg, args.batch, b["seq"], b["cp"], b["method"])
        b["formula_bytes"] = f["total"]
    return {"model": args.model, "batch": args.batch, "vocab": args.vocab,
            "max_seq_len": args.max_seq, "budget_mib": args.budget_mib,
            "budget_seq": args.budget_seq, "rows": rows, "budget": budget}


# -- the report ---------------------------------------------------------------------------------
def table(res: dict) -> str:
    out = [f"model {res['model']} (max_seq_len {res['max_seq_len']}, vocab {res['vocab']}), "
           f"batch {res['batch']}, fp32, one forward: bytes saved for backward on one cp rank "
           "(rank 0; excluding parameters and buffers)", "",
           "| seq | cp | method | measured (MiB) | formula (MiB) | measured / formula "
           "| ranks equal | vs cp = 1 | × cp | loss − cp = 1 | fwd+bwd (s) |",
           "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        vs = f"{r['vs_cp1']:.4f}" if "vs_cp1" in r else "—"
        x = f"{r['vs_cp1_times_cp']:.3f}" if "vs_cp1" in r else "—"
        dl = f"{r['loss_minus_cp1']:+.1e}" if "vs_cp1" in r and r["cp"] > 1 else "—"
        out.append(f"| {r['seq']} | {r['cp']} | {r['method']} | "
                   f"{r['saved_bytes'] / 2**20:,.2f} | {r['formula_bytes'] / 2**20:,.2f} | "
                   f"{r['measured_over_formula']:.4f} | "
                   f"{'yes' if r['ranks_equal'] else 'NO'} | {vs} | {x} | {dl} | "
                   f"{r['fwd_bwd_s']:.1f} |")
    if res["budget"]:
        out += ["", f"budget: {res['budget_mib']:g} MiB of saved activations per rank, one "
                f"train_step (AdamW, clip 1.0) per row, batch {res['batch']}", "",
                "| seq | cp | method | formula (MiB) | result | saved when it ended (MiB) "
                "| loss |", "|---:|---:|---|---:|---|---:|---:|"]
        for b in sorted(res["budget"], key=lambda b: (-b["seq"], b["cp"])):
            what = ("**trains**" if b["ok"] and all(b["all_ranks_ok"]) else
                    "refused" if "why" in b else "NOT FINITE")
            loss = f"{b['loss']:.4f}" if "loss" in b else "—"
            out.append(f"| {b['seq']} | {b['cp']} | {b['method']} | "
                       f"{b['formula_bytes'] / 2**20:,.2f} | {what} | "
                       f"{b['saved_bytes'] / 2**20:,.2f} | {loss} |")
    return "\n".join(out)


def verdicts(res: dict) -> list[tuple[str, bool]]:
    """(target, met) for the issue's targets, over every row (the ÷ cp target per method)."""
    rows = res["rows"]
    out = [("measured / formula within 5 % (every row)",
            all(abs(r["measured_over_formula"] - 1) <= 0.05 for r in rows)),
           ("every rank saves the same bytes", all(r["ranks_equal"] for r in rows)),
           ("loss and gradients finite", all(math.isfinite(r["loss"]) and r["grads_finite"]
                                             for r in rows))]
    for m in METHODS:
        xs = [r["vs_cp1_times_cp"] for r in rows if r["method"] == m and "vs_cp1" in r]
        if xs:
            out.append((f"{m}: per-rank bytes / cp = 1's within 10 % of 1/cp "
                        f"(× cp in {min(xs):.3f} … {max(xs):.3f})",
                        all(abs(x - 1) <= 0.10 for x in xs)))
    if res["budget"]:
        L, top = res["budget_seq"], max(b["cp"] for b in res["budget"])
        refused = [b for b in res["budget"] if b["cp"] == 1 and b["seq"] == L and not b["ok"]]
        trains = [b for b in res["budget"] if b["cp"] == top and b["seq"] == L
                  and b["method"] == "ring" and b["ok"] and all(b["all_ranks_ok"])]
        out.append((f"budget {res['budget_mib']:g} MiB: cp = 1 refused at seq {L}, cp = {top} "
                    "(ring) trains it", bool(refused and trains and top > 1)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--budget-mib", type=float, default=128.0,
                   help="saved-activation budget per rank (0: no budget demonstration)")
    p.add_argument("--budget-seq", type=int, default=4096)
    p.add_argument("--budget-cps", type=int, nargs="+", default=None,
                   help="the cps that run the budget step (default: all of --cps)")
    p.add_argument("--list", action="store_true",
                   help="print every saved storage of rank 0 (the formula's table, checked)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    a.budget_cps = a.budget_cps or a.cps
    a.max_seq = max([*a.seq_lens, a.budget_seq if a.budget_mib else 0])
    res = run(a)
    res["targets"] = verdicts(res)
    print(table(res))
    print("")
    for what, met in res["targets"]:
        print(f"- {'met' if met else 'MISSED'}: {what}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    # the exit code: the measurement itself (formula, ranks, finite) and the demonstration;
    # the ÷ cp target is reported, not enforced (all-gather misses it by construction)
    return 0 if all(met for what, met in res["targets"] if "within 10 %" not in what) else 1


if __name__ == "__main__":
    raise SystemExit(main())
