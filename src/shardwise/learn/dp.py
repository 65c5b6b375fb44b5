"""Data parallelism on the stacked MLP, every collective written out.

Scaling book ch. 5 ("How to Parallelize a Transformer for Training", data parallelism), with
mesh axis X = the n ranks. The batch is split over X; every rank holds the whole model:

    forward   In[B_X, D] · W_in[D, F] → Tmp[B_X, F];  Tmp[B_X, F] · W_out[F, D] → Out[B_X, D]
              no communication: each rank runs its own B/n rows.
    backward  each rank's ∂W_in[D, F] {U_X} sums over its rows only ({U_X}: "unreduced over X",
              a partial sum). One AllReduce over X makes it the gradient of the whole batch.
    update    the same AdamW step on the same gradient on every rank: the replicas stay equal
              without ever sending a parameter.

Bytes per rank and step (ring all-reduce = reduce-scatter + all-gather, see collectives.py):
2(n−1)/n · 4Ψ for Ψ parameters, in one flat buffer here (one "bucket": DDP and our
``parallel/dp`` cut it into several, to start sending while backward still runs); plus
2(n−1)/n · 8 for the loss that is printed. Memory: every rank holds all of Ψ, its gradients
and AdamW's two moments (16Ψ bytes in fp32): what FSDP (fsdp.py) divides by n.

The numbers it prints: Ψ = L·(D·F + F + F·D + D) = 4 · 1,072 = 4,288, so S = 4Ψ = 17,152 B.
At n = 2, 2(n−1)/n = 1: "sent" equals S by coincidence (n = 4 sends 1.5 S). The table shows
step 0 only; the last line sums all 6 steps: 6 · (17,152 + 8) = 102,960 B in 6 · 2 calls.
Each step draws a new batch, so the loss can rise from one step to the next.

Run:  shardwise learn dp --nproc 2     or     torchrun --nproc-per-node 2 -m shardwise.learn.dp
Next: docs/data-parallel.md → src/shardwise/parallel/dp/ (its __init__: "From learn/") →
      shardwise.parallel.dp.data_parallel.GradBuckets → shardwise trace --dp 2 --model mlp-tiny
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.learn._common import (B, D, NAMES, STEPS, adamw, batch, block, book, finish,
                                     init_params, need, run, setup)


def check(n: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    need(B % n == 0, f"dp={n} must divide the batch B={B}: use --nproc 2, 4 or 8")


def main(argv: list[str] | None = None) -> None:
    rank, n, device, out = setup(argv)
    check(n)
    # the whole model on every rank: W_in[D, F], b_in[F], W_out[F, D], b_out[D] per block
    blocks = [{k: t.to(device).requires_grad_() for k, t in b.items()} for b in init_params()]
    params = [b[k] for b in blocks for k in NAMES]
    opt = adamw(params)
    losses = []
    for step in range(STEPS):
        show = rank == 0 and step == 0
        x, y = batch(step)
        x = x.chunk(n)[rank].to(device)  # In[B_X, D]: rows rank·B/n … (rank+1)·B/n − 1
        y = y.chunk(n)[rank].to(device)
        for p in blocks:
            x = block(x, p)  # Out[B_X, D] = In + gelu(In·W_in + b_in)·W_out + b_out
        # my rows' squared errors over the global count B·D: summed over X it is the mean
        loss = ((x - y) ** 2).sum() / (B * D)
        loss.backward()  # every p.grad is ∂p {U_X}: a partial sum over my rows

        # one all-reduce over X of every gradient, flattened into one buffer:
        # ∂W_in[D, F] {U_X}, ∂b_in[F] {U_X}, ∂W_out[F, D] {U_X}, ∂b_out[D] {U_X} → summed
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # [Ψ] fp32, S = 4Ψ bytes
        dist.all_reduce(flat)  # sends 2(n−1)/n · 4Ψ bytes
        book("all_reduce", flat, n, "grad", "∂W {U_X} → ∂W, every block", show)
        offset = 0
        for p in params:  # copy the sums back into the .grad of each parameter
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

        opt.step()  # identical on every rank: identical parameters afterwards
        opt.zero_grad(set_to_none=True)
        total = loss.detach().double().reshape(1)  # my part of the mean, [1] fp64
        dist.all_reduce(total)  # sends 2(n−1)/n · 8 bytes
        book("all_reduce", total, n, "loss", "loss {U_X} → loss", show)
        losses.append(total.item())
    finish(rank, losses, {f"layers.{i}.{k}": b[k].detach() for i, b in enumerate(blocks)
                          for k in NAMES}, "dp", out)


if __name__ == "__main__":
    run(main)
