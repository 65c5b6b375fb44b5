"""FSDP + tensor parallelism (2-D) on the stacked MLP, every collective written out.

Scaling book ch. 5 ("Combining FSDP and tensor parallelism"), on a 2-D mesh of n = X·Y ranks:
rank = x·Y + y (TP innermost: on the fastest links). TP (tp.py) splits each block's hidden
dimension F over Y; FSDP (fsdp.py) splits the batch over X and stores 1/X of each TP shard:

    stored    W_in[D_X, F_Y]; b_in[F_Y] and W_out[F_Y, D] cut again along F_Y, F/(X·Y) each
              (we cut dim 0 everywhere; the book cuts W_out's D: the same bytes); b_out[D_X]
              (replicated over Y: its "TP shard" is all of it)
    forward   AllGather_X → W_in[D, F_Y] …;  In[B_X, D] · W_in[D, F_Y] → Tmp[B_X, F_Y];
              Tmp · W_out[F_Y, D] → Out[B_X, D] {U_Y};  AllReduce_Y → Out[B_X, D]   (g)
    backward  AllGather_X again; ∂In[B_X, D] {U_Y} → AllReduce_Y (f, not for block 0);
              ∂W_in[D, F_Y] {U_X} → ReduceScatter_X → ∂W_in[D_X, F_Y]
    update    AdamW on my slices: no communication

Per rank and step, over X: 3(X−1)/X · 4Ψ_tp (gather forward + gather backward + reduce-scatter;
Ψ_tp = L·(2·D·F/Y + F/Y + D), my TP shard's parameters, 2,176 at Y = 2); over Y: TP's
(2L − 1) · 2(Y−1)/Y · 4·(B/X)·D; plus the printed loss's 2(X−1)/X · 8. Each axis carries what
it is good at (Megatron-LM 2021 §3; scaling book ch. 5).

Run:  shardwise learn fsdp_tp --nproc 4  or  torchrun --nproc-per-node 4 -m shardwise.learn.fsdp_tp
Next: docs/composition.md → shardwise.parallel.apply.parallelize (src/shardwise/parallel/) →
      shardwise trace --dp 2 --tp 2 --zero 3 --model mlp-tiny --micro-batch 4 (B/X rows at once)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F_

from shardwise.learn._common import (B, D, F, NAMES, STEPS, adamw, batch, book, finish,
                                     init_params, need, run, setup)

TP, SHOW = 2, [False]
TP_GROUP = [None]  # this rank's group over Y (set in main)


class F_op(torch.autograd.Function):
    """Megatron's f: identity forward; AllReduce_Y of ∂In[B_X, D] {U_Y} backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=TP_GROUP[0])  # sends 2(Y−1)/Y · 4(B/X)D bytes
        book("all_reduce", grad, TP, "tp_bwd", "f over Y: ∂In[B_X, D] {U_Y}", SHOW[0])
        return grad


class G_op(torch.autograd.Function):
    """Megatron's g: AllReduce_Y of Out[B_X, D] {U_Y} forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=TP_GROUP[0])  # sends 2(Y−1)/Y · 4(B/X)D bytes
        book("all_reduce", x, TP, "tp_fwd", "g over Y: Out[B_X, D] {U_Y}", SHOW[0])
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def gather(full: dict, shard: dict, nx: int, group, where: str) -> None:
    """Refill ``full`` with the all-gather over X of ``shard`` (dim 0), e.g. W_in[D_X, F_Y] →
    W_in[D, F_Y]; sends (X−1)/X · S each. (.data: see fsdp.py)"""
    for k in NAMES:
        t = full[k]
        t.untyped_storage().resize_(t.numel() * t.element_size())
        dist.all_gather(list(t.data.chunk(nx)), shard[k].detach(), group=group)
        book("all_gather", t, nx, "param", f"{where}: {k} (my TP shard) over X", SHOW[0])


def check(n: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    nx = n // TP
    need(n % TP == 0 and nx > 0 and B % nx == 0 and D % nx == 0,
         f"fsdp_tp runs X × Y={TP} ranks: use --nproc 4 (X = 2) or 8 (X = 4)")


def main(argv: list[str] | None = None) -> None:
    rank, n, device, out = setup(argv)
    check(n)
    nx = n // TP
    x_idx, y_idx = divmod(rank, TP)
    dp_group = tp_group = None  # every rank creates every group, in the same order
    for i in range(nx):
        g = dist.new_group([i * TP + j for j in range(TP)])
        tp_group = g if i == x_idx else tp_group
    for j in range(TP):
        g = dist.new_group([i * TP + j for i in range(nx)])
        dp_group = g if j == y_idx else dp_group
    TP_GROUP[0] = tp_group
    cols = slice(y_idx * F // TP, (y_idx + 1) * F // TP)  # my hidden units over Y
    tp_shards = [{"w_in": b["w_in"][:, cols], "b_in": b["b_in"][cols],
                  "w_out": b["w_out"][cols, :], "b_out": b["b_out"]} for b in init_params()]
    shards = [{k: t.chunk(nx)[x_idx].clone().to(device).requires_grad_() for k, t in b.items()}
              for b in tp_shards]  # and my slice of that over X
    full = [{k: torch.empty(t.shape, device=device, requires_grad=True) for k, t in b.items()}
            for b in tp_shards]
    opt = adamw([s for b in shards for s in b.values()])
    losses = []
    for step in range(STEPS):
        SHOW[0] = rank == 0 and step == 0
        x, y = batch(step)
        x, y = x.chunk(nx)[x_idx].to(device), y.chunk(nx)[x_idx].to(device)  # In[B_X, D]
        saved = []
        for i, p in enumerate(full):
            gather(p, shards[i], nx, dp_group, f"block {i} forward")
            h = x.detach().requires_grad_(i > 0)  # block 0's ∂In: nobody needs it
            tmp = F_.gelu(F_op.apply(h) @ p["w_in"] + p["b_in"])  # Tmp[B_X, F_Y]
            x = h + G_op.apply(tmp @ p["w_out"]) + p["b_out"]  # Out[B_X, D]
            saved.append((h, x))
            for t in p.values():
                t.untyped_storage().resize_(0)  # free the gathered weights
        last = x.detach().requires_grad_()
        loss = ((last - y) ** 2).sum() / (B * D)  # my rows' part of the mean (same over Y)
        loss.backward()
        dy = last.grad
        for i in reversed(range(len(full))):
            gather(full[i], shards[i], nx, dp_group, f"block {i} backward")
            h, o = saved[i]
            o.backward(dy)
            dy = h.grad
            for k in NAMES:  # ∂W_in[D, F_Y] {U_X} → ∂W_in[D_X, F_Y]: sends (X−1)/X · S
                g = full[i][k].grad
                shards[i][k].grad = torch.empty_like(shards[i][k])
                dist.reduce_scatter(shards[i][k].grad, list(g.chunk(nx)), group=dp_group)
                book("reduce_scatter", g, nx, "grad", f"block {i}: ∂{k} {{U_X}} → my X slice",
                     SHOW[0])
                full[i][k].grad = None
                full[i][k].untyped_storage().resize_(0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=dp_group)  # the printed loss, over X
        book("all_reduce", total, nx, "loss", "loss {U_X} → loss", SHOW[0])
        losses.append(total.item())
    finish(rank, losses, {f"layers.{i}.{k}": b[k].detach() for i, b in enumerate(shards)
                          for k in NAMES}, "fsdp_tp", out)


if __name__ == "__main__":
    run(main)
