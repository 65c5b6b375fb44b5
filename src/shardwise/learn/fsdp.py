"""Fully sharded data parallelism (FSDP, ZeRO-3) on the stacked MLP, every collective written out.

Scaling book ch. 5 (FSDP), mesh axis X = the n ranks. The batch is split over X as in dp.py,
and so is every parameter, its gradient and AdamW's moments: each rank keeps 1/n of each tensor
(its dim-0 slice) and gathers a block's weights just before it needs them:

    stored    W_in[D_X, F], b_in[F_X], W_out[F_X, D], b_out[D_X]      (16Ψ/n bytes in all, with
              the gradients and AdamW's two moments, against DP's 16Ψ)
    forward   AllGather_X(W_in[D_X, F]) → W_in[D, F] (and the other three), run the block on
              In[B_X, D], free the gathered weights again
    backward  AllGather them again, run the block's backward: ∂W_in[D, F] {U_X};
              ReduceScatter_X → ∂W_in[D_X, F]: the sum over X of my slice only
    update    AdamW on my slices alone (it is elementwise): no communication

Bytes per rank and step: (n−1)/n · 4Ψ gathered in forward, again in backward, and
(n−1)/n · 4Ψ reduce-scattered: 3(n−1)/n · 4Ψ, 1.5× DP's 2(n−1)/n · 4Ψ, for 1/n of the memory
(Rajbhandari et al. 2020, ZeRO §5; scaling book ch. 5). Our ``parallel/zero`` gathers each block
as one flat buffer ("unit"), which is the same bytes in fewer calls.

The numbers it prints (Ψ = 4,288, 4Ψ = 17,152 B: see dp.py): one step is 16 all-gathers in
forward (4 blocks × 4 tensors), 16 in backward, 16 reduce-scatters and the loss: 49 calls,
3 · ½ · 17,152 + 8 = 25,736 B at n = 2; the last line sums 6 steps: 294 calls, 154,416 B.
The printed losses match dp.py's: the same math, only the storage is split.

"Free" is real: the gathered tensor's storage is resized to 0 after the block's forward, and
refilled by the backward's all-gather, under the same tensors autograd saved (what FSDP does).

Run:  shardwise learn fsdp --nproc 2    or     torchrun --nproc-per-node 2 -m shardwise.learn.fsdp
Next: docs/zero.md → src/shardwise/parallel/zero/ (its __init__: "From learn/") →
      shardwise.parallel.zero.zero3.Zero3Sync → shardwise trace --dp 2 --zero 3 --model mlp-tiny
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.learn._common import (B, D, NAMES, STEPS, adamw, batch, block, book, finish,
                                     init_params, need, run, setup)

NOTATION = {"w_in": ("W_in[D_X, F]", "W_in[D, F]"), "b_in": ("b_in[F_X]", "b_in[F]"),
            "w_out": ("W_out[F_X, D]", "W_out[F, D]"), "b_out": ("b_out[D_X]", "b_out[D]")}


def gather(full: dict, shard: dict, n: int, show: bool, where: str) -> None:
    """Refill ``full``'s storage with the all-gather of every rank's ``shard`` (dim 0)."""
    for k in NAMES:
        t = full[k]
        t.untyped_storage().resize_(t.numel() * t.element_size())
        # W_in[D_X, F] → W_in[D, F]: rank r's slice lands in chunk r; sends (n−1)/n · S.
        # (.data: the same memory; refilling it is no change autograd should track)
        dist.all_gather(list(t.data.chunk(n)), shard[k].detach())
        book("all_gather", t, n, "param", f"{where}: {NOTATION[k][0]} → {NOTATION[k][1]}", show)


def free(full: dict) -> None:
    """Drop the gathered weights' memory (the tensors stay, autograd's references too)."""
    for t in full.values():
        t.untyped_storage().resize_(0)


def check(n: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    need(B % n == 0 and D % n == 0, f"fsdp={n} must divide B={B} and D={D}: use --nproc 2 or 4")


def main(argv: list[str] | None = None) -> None:
    rank, n, device, out = setup(argv)
    check(n)
    # my slice of each tensor: the rank-th of n equal pieces of dim 0 (W_in: D/n rows of D)
    shards = [{k: t.chunk(n)[rank].clone().to(device).requires_grad_() for k, t in b.items()}
              for b in init_params()]
    full = [{k: torch.empty(s.shape[0] * n, *s.shape[1:], device=device, requires_grad=True)
             for k, s in b.items()} for b in shards]  # gathered weights, storage freed between uses
    for b in full:
        free(b)
    opt = adamw([s for b in shards for s in b.values()])  # AdamW's moments: my slices only
    losses = []
    for step in range(STEPS):
        show = rank == 0 and step == 0
        x, y = batch(step)
        x, y = x.chunk(n)[rank].to(device), y.chunk(n)[rank].to(device)  # In[B_X, D]
        saved = []  # (block input, block output) per block, for the backward
        for i in range(len(shards)):
            gather(full[i], shards[i], n, show, f"block {i} forward")
            # cut autograd's graph between blocks, to run backward one block at a time below
            h = x.detach().requires_grad_(i > 0)  # block 0's ∂In: nobody needs it
            x = block(h, full[i])  # In[B_X, D] · W_in[D, F] … → Out[B_X, D]
            saved.append((h, x))
            free(full[i])
        last = x.detach().requires_grad_()
        loss = ((last - y) ** 2).sum() / (B * D)  # my part of the global mean
        loss.backward()
        dy = last.grad  # ∂Out[B_X, D]
        for i in reversed(range(len(shards))):
            # (torch FSDP may keep the last block's weights from forward; here all re-gather)
            gather(full[i], shards[i], n, show, f"block {i} backward")  # the weights again
            h, o = saved[i]
            o.backward(dy)  # ∂W_in[D, F] {U_X} … into full[i][k].grad; ∂In[B_X, D] into h.grad
            dy = h.grad
            for k in NAMES:
                g = full[i][k].grad  # ∂W_in[D, F] {U_X} → ∂W_in[D_X, F]: sends (n−1)/n · S
                shards[i][k].grad = torch.empty_like(shards[i][k])
                dist.reduce_scatter(shards[i][k].grad, list(g.chunk(n)))
                book("reduce_scatter", g, n, "grad", f"block {i}: ∂{NOTATION[k][1]} {{U_X}} → "
                     f"∂{NOTATION[k][0]}", show)
                full[i][k].grad = None
            free(full[i])
        opt.step()  # on my slices: no communication
        opt.zero_grad(set_to_none=True)
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)  # the printed loss: sends 2(n−1)/n · 8 bytes
        book("all_reduce", total, n, "loss", "loss {U_X} → loss", show)
        losses.append(total.item())
    finish(rank, losses, {f"layers.{i}.{k}": b[k].detach() for i, b in enumerate(shards)
                          for k in NAMES}, "fsdp", out)


if __name__ == "__main__":
    run(main)
