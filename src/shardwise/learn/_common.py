"""What the learner's scripts share: the stacked MLP, its synthetic task, AdamW, and a printer
that books each collective (op, the tensor's sharding, its shape, the textbook bytes).

The model is the JAX scaling book's training MLP (ch. 5, "How to Parallelize a Transformer for
Training"), L residual blocks ``x ← x + gelu(x·W_in + b_in)·W_out + b_out`` with
``In[B, D] · W_in[D, F] → Tmp[B, F]``, ``Tmp[B, F] · W_out[F, D] → Out[B, D]``: the framework's
``mlp-tiny`` (:mod:`shardwise.models.mlp`, D = 16, F = 32, L = 4; its ``nn.Linear`` stores
``W_in`` transposed, as ``[F, D]``). The task: regress ``y = tanh(x·T)`` for a fixed random
``T[D, D]``, loss = mean squared error over the global batch's B·D numbers. Every rank can build
every global batch itself (seeded by the step), so no data is ever sent.

Bytes are the textbook ring numbers (Patarasuk & Yuan 2009; scaling book ch. 3, "Sharded
Matrices"), per rank, for a group of n and S = the full tensor's bytes: all-reduce 2(n−1)/n·S,
all-gather (S = the gathered output) and reduce-scatter (S = the unreduced input) (n−1)/n·S,
broadcast (n−1)/n·S (a pipelined chain, averaged over the ranks), send S, recv 0 — what
:mod:`shardwise.comm.ledger` books, so the two can be compared.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F_

D, F, L = 16, 32, 4  # d_model, d_ff, blocks: mlp-tiny
B, STEPS, LR = 8, 6, 1e-2  # rows per global batch, optimizer steps, AdamW's learning rate
NAMES = ("w_in", "b_in", "w_out", "b_out")
LEDGER: list[dict] = []  # every collective this rank booked: {op, tag, shape, bytes}
HISTORY: list[dict] = []  # per optimizer step: {"grads", "params"} by data_ptr (for the tests)


def setup(argv: list[str] | None) -> tuple[int, int, torch.device, str | None]:
    """Join the world torchrun (or ``shardwise learn``) started: (rank, world size, device,
    ``--out`` folder or None). ``--device cpu|cuda`` (default cpu: gloo; else the device's
    backend). Clears :data:`LEDGER`. Outside a world: exit 2 with how to start one."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="save each rank's results here (the tests)")
    args, _ = ap.parse_known_args(argv)
    need("WORLD_SIZE" in os.environ, "not in a world of ranks: start with shardwise learn "
         "NAME --nproc N, or torchrun --nproc-per-node N -m shardwise.learn.NAME")
    LEDGER.clear()
    HISTORY.clear()
    device = torch.device(args.device)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else None)
    return dist.get_rank(), dist.get_world_size(), device, args.out


def run(main) -> None:
    """A script's entry under torchrun: ``main()``, then the process group destroyed and the
    process left at once (``os._exit(0)``, output flushed), skipping the interpreter's teardown:
    there gloo's threads sometimes abort the C++ destructors after a run that finished
    ('terminate called without an active exception', exit -6: about 1 in 10 torchrun starts
    on this 2-core machine, torch 2.13). An error in ``main`` still raises as usual."""
    main()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def need(ok: bool, message: str) -> None:
    """Bad input: print one line (the constraint and the fix) and exit 2, before any
    collective."""
    if not ok:
        print(f"shardwise learn: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def init_params(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The whole model: L blocks of {w_in [D, F], b_in [F], w_out [F, D], b_out [D]}, each
    element ~ N(0, 0.1²) from one seeded generator (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"w_in": (D, F), "b_in": (F,), "w_out": (F, D), "b_out": (D,)}
    return [{k: torch.randn(shapes[k], generator=g) * 0.1 for k in NAMES} for _ in range(L)]


def block(x: torch.Tensor, p: dict) -> torch.Tensor:
    """One residual block on x [b, D] → [b, D]."""
    return x + F_.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: inputs [B, D] ~ N(0, 1), targets tanh(inputs·T) [B, D]."""
    t = torch.randn(D, D, generator=torch.Generator().manual_seed(1234)) / D ** 0.5
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(100 + step))
    return x, torch.tanh(x @ t)


def adamw(tensors: list[torch.Tensor]) -> torch.optim.AdamW:
    """AdamW as docs/parity.md's reference runs it: weight decay 0.1 on matrices (dim ≥ 2),
    none on biases, betas (0.9, 0.95), eps 1e-8. A shard keeps its parameter's dimension.
    Each step's gradients (what the step used) and parameters after it go to :data:`HISTORY`,
    which :func:`finish` saves for the tests."""
    opt = torch.optim.AdamW([{"params": [t for t in tensors if t.dim() >= 2]},
                             {"params": [t for t in tensors if t.dim() < 2],
                              "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.register_step_pre_hook(lambda *_: HISTORY.append(
        {"grads": {t.data_ptr(): t.grad.detach().clone() for t in tensors}}))
    opt.register_step_post_hook(lambda *_: HISTORY[-1].update(
        params={t.data_ptr(): t.detach().clone() for t in tensors}))
    return opt


def textbook_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` (S) over ``n`` ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "broadcast": (n - 1) / n, "send": 1.0,
            "recv": 0.0}[op] * nbytes


def book(op: str, full: torch.Tensor, n: int, tag: str, what: str, show: bool) -> None:
    """Record one collective on ``full`` (the tensor of S bytes) over n ranks and, if
    ``show``, print it: op, what (the sharding, e.g. ``W_in[D_X, F]``), shape, bytes."""
    nbytes = full.numel() * full.element_size()
    sent = textbook_bytes(op, nbytes, n)
    LEDGER.append({"op": op, "tag": tag, "shape": tuple(full.shape), "bytes": sent})
    if show:
        if len(LEDGER) == 1 or not any(r.get("shown") for r in LEDGER[:-1]):
            print(f"  {'op':<15} {'tag':<8} {'tensor (scaling-book sharding)':<46} "
                  f"{'shape':<10} {'S = full bytes':>14} {'sent (textbook)':>16}")
        LEDGER[-1]["shown"] = True
        print(f"  {op:<15} {tag:<8} {what:<46} {str(list(full.shape)):<10} {nbytes:>12,} B"
              f" {sent:>14,.1f} B", flush=True)


def finish(rank: int, losses: list[float], params: dict[str, torch.Tensor], name: str,
           out: str | None) -> None:
    """Rank 0 prints the losses and the bytes it sent; with ``out`` (the tests) every rank
    saves {losses, ledger, grads and params per step by name (its local values)} to
    ``out/<name>_rank<r>.pt``."""
    if rank == 0 and losses:
        print(f"{name}: loss " + " → ".join(f"{x:.5f}" for x in losses)
              + f"; rank 0 sent {sum(r['bytes'] for r in LEDGER):,.1f} B in {len(LEDGER)} "
              "collectives", flush=True)
    if out:
        named = [{k: {n: h[k][t.data_ptr()] for n, t in params.items()} for k in h}
                 for h in HISTORY]
        torch.save({"losses": losses, "ledger": list(LEDGER),
                    "grads": [h["grads"] for h in named], "params": [h["params"] for h in named]},
                   os.path.join(out, f"{name}_rank{rank}.pt"))
