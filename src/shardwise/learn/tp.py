"""Tensor parallelism (Megatron) on the stacked MLP, every collective written out.

Scaling book ch. 5 (tensor parallelism), mesh axis Y = the n ranks; Shoeybi et al. 2019
(Megatron-LM) §3. Every rank sees the whole batch; each block's hidden dimension F is split
(F_Y: F split over Y, F/n units per rank; {U_Y}: a partial sum still to be summed over Y):

    stored    W_in[D, F_Y] (columns), b_in[F_Y], W_out[F_Y, D] (rows), b_out[D] (replicated)
    forward   In[B, D] · W_in[D, F_Y] → Tmp[B, F_Y]           no communication (column-parallel)
              Tmp[B, F_Y] · W_out[F_Y, D] → Out[B, D] {U_Y}   a partial sum (row-parallel)
              AllReduce_Y → Out[B, D]                          Megatron's g
    backward  ∂Out[B, D] is the same on every rank; ∂W_out[F_Y, D], ∂W_in[D, F_Y], ∂b_in[F_Y] are
              local; ∂In[B, D] {U_Y} = ∂Tmp[B, F_Y] (through the GELU) · W_in[D, F_Y]ᵀ is a
              partial sum: AllReduce_Y → ∂In[B, D]            Megatron's f (its backward)
    update    AdamW on my columns/rows: no communication; b_out's gradient is the same everywhere

One g per block and one f per block but the first (block 0's input is the batch, which needs no
gradient, so autograd never calls its f's backward): per rank and step (2L − 1) · 2(n−1)/n ·
4·B·D bytes (activations, not weights: TP's traffic grows with the batch, DP's with the model).
The loss needs no collective: every rank computes the same one. Names: F is d_ff, F_ is
torch.nn.functional, F_op and G_op are Megatron's f and g.

Run:  shardwise learn tp --nproc 2      or     torchrun --nproc-per-node 2 -m shardwise.learn.tp
Next: docs/tensor-parallel.md → src/shardwise/parallel/tp/ (its __init__: "From learn/") →
      shardwise.parallel.tp.comms.CopyToTP, then shardwise.parallel.tp.mlp.TensorParallelMLPBlock →
      shardwise trace --tp 2 --model mlp-tiny --micro-batch 8   (B = 8 rows in one micro-batch,
      as here: the same 7 all-reduces of [8, 16] per step)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F_

from shardwise.learn._common import (F, NAMES, STEPS, adamw, batch, book, finish, init_params,
                                     need, run, setup)

SHOW = [False]  # print the collectives of the first step (rank 0)


class F_op(torch.autograd.Function):
    """Megatron's f: identity in forward; AllReduce_Y of ∂In[B, D] {U_Y} in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)  # ∂In[B, D] {U_Y} → ∂In[B, D]: sends 2(n−1)/n · 4BD bytes
        book("all_reduce", grad, dist.get_world_size(), "tp_bwd", "f: ∂In[B, D] {U_Y}", SHOW[0])
        return grad


class G_op(torch.autograd.Function):
    """Megatron's g: AllReduce_Y of Out[B, D] {U_Y} in forward; identity in backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)  # Out[B, D] {U_Y} → Out[B, D]: sends 2(n−1)/n · 4BD bytes
        book("all_reduce", x, dist.get_world_size(), "tp_fwd", "g: Out[B, D] {U_Y}", SHOW[0])
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_block(x: torch.Tensor, p: dict) -> torch.Tensor:
    """One residual block on x [B, D] with my F/n hidden units; returns [B, D]."""
    h = F_op.apply(x)
    tmp = F_.gelu(h @ p["w_in"] + p["b_in"])  # In[B, D] · W_in[D, F_Y] → Tmp[B, F_Y]
    out = G_op.apply(tmp @ p["w_out"])  # Tmp[B, F_Y] · W_out[F_Y, D] → Out[B, D]
    return x + out + p["b_out"]  # the bias once, after the sum


def check(n: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    need(F % n == 0, f"tp={n} must divide the hidden size F={F}: use --nproc 2, 4 or 8")


def main(argv: list[str] | None = None) -> None:
    rank, n, device, out = setup(argv)
    check(n)
    cols = slice(rank * F // n, (rank + 1) * F // n)  # my hidden units
    blocks = [{"w_in": b["w_in"][:, cols], "b_in": b["b_in"][cols],
               "w_out": b["w_out"][cols, :], "b_out": b["b_out"]} for b in init_params()]
    blocks = [{k: t.clone().to(device).requires_grad_() for k, t in b.items()} for b in blocks]
    opt = adamw([b[k] for b in blocks for k in NAMES])
    losses = []
    for step in range(STEPS):
        SHOW[0] = rank == 0 and step == 0
        x, y = (t.to(device) for t in batch(step))  # In[B, D]: the whole batch on every rank
        for p in blocks:
            x = tp_block(x, p)
        loss = ((x - y) ** 2).mean()  # the same on every rank: no collective
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    finish(rank, losses, {f"layers.{i}.{k}": b[k].detach() for i, b in enumerate(blocks)
                          for k in NAMES}, "tp", out)


if __name__ == "__main__":
    run(main)
