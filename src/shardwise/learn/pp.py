"""Pipeline parallelism (GPipe and 1F1B) on the stacked MLP, every message written out.

Scaling book ch. 5 (pipelining), mesh axis P = the p ranks. Rank r holds blocks r·L/p … of the
model (a "stage") and the whole batch is cut into m micro-batches of B/m rows:

    forward   stage r receives In[B/m, D] from r − 1, runs its blocks, sends Out[B/m, D] to r + 1;
              the last stage computes the loss
    backward  stage r receives ∂Out[B/m, D] from r + 1, runs its blocks' backward (its weight
              gradients add up over the m micro-batches), sends ∂In[B/m, D] to r − 1
    update    AdamW on my blocks: no communication

Per rank and step: m sends of 4·(B/m)·D bytes forward (all but the last stage), m backward (all
but the first) — activations at the cut only, the least traffic of all strategies.

Two orders of the same work (Huang et al. 2019, GPipe §2.3; Narayanan et al. 2021, PipeDream-
flush/1F1B §3.1). GPipe: all m forwards, then all m backwards — every micro-batch's activations
are alive at once. 1F1B: p − 1 − r forwards to fill the pipe, then one forward, one backward,
…: at most p − r micro-batches alive. Both leave each rank idle for the same (p − 1) slots of
m + p − 1: the bubble (p − 1)/(m + p − 1), with equal stages and free messages.

Sends are ``isend`` (they never wait), receives wait: so no order of messages can deadlock.

Run:  shardwise learn pp --nproc 2 [--schedule gpipe|1f1b]
      torchrun --nproc-per-node 2 -m shardwise.learn.pp --schedule 1f1b
Next: docs/pipeline-parallel.md → src/shardwise/parallel/pp/ (its __init__: "From learn/") →
      shardwise.parallel.pp.schedules.build_schedule, shardwise.parallel.pp.runner.ScheduleRunner →
      shardwise trace --pp 2 --schedule 1f1b --microbatches 4 --model mlp-tiny
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardwise.learn._common import (B, D, L, NAMES, STEPS, adamw, batch, block, book, finish,
                                     init_params, need, run, setup)

M = 4  # micro-batches per step


def schedule(kind: str, p: int, r: int, m: int) -> list[tuple[str, int]]:
    """Rank r's program: ("F", i) forward / ("B", i) backward of micro-batch i, in order."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(p - 1 - r, m)  # 1F1B: fill the pipe, then alternate, then drain
    out = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(m - warm, m)]


def check(p: int) -> None:
    """A bad rank count: one line, exit 2, before any collective (also run by the CLI)."""
    need(L % p == 0 and B % M == 0, f"pp={p} must divide the L={L} blocks: use --nproc 2 or 4")


def main(argv: list[str] | None = None) -> None:
    rank, p, device, out = setup(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    kind = ap.parse_known_args(argv)[0].schedule
    check(p)
    first, last = rank == 0, rank == p - 1
    mine = range(rank * L // p, (rank + 1) * L // p)  # my blocks
    blocks = [{k: t.to(device).requires_grad_() for k, t in init_params()[i].items()}
              for i in mine]
    opt = adamw([b[k] for b in blocks for k in NAMES])
    program = schedule(kind, p, rank, M)
    if rank == 0:
        print(f"{kind}, p = {p}, m = {M}: bubble (p−1)/(m+p−1) = {(p - 1) / (M + p - 1):.3f}")
    print(f"rank {rank} runs " + " ".join(f"{a}{i}" for a, i in program), flush=True)
    losses = []
    for step in range(STEPS):
        show = rank == 0 and step == 0  # the first stage: the sends forward, receives back
        x_all, y_all = (t.to(device).chunk(M) for t in batch(step))  # M × [B/M, D]
        inputs, outputs, pending = {}, {}, []
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        for action, i in program:
            if action == "F":
                if first:
                    h = x_all[i]
                else:  # In[B/m, D] from the stage before
                    h = torch.empty(B // M, D, device=device)
                    dist.recv(h, rank - 1)
                    book("recv", h, p, "pp_fwd", f"In[B/m, D] {rank - 1} → {rank}", show)
                    h.requires_grad_()
                x = h
                for b in blocks:
                    x = block(x, b)
                inputs[i], outputs[i] = h, x
                if last:  # the loss of micro-batch i, over the global count B·D
                    outputs[i] = ((x - y_all[i]) ** 2).sum() / (B * D)
                    loss_sum += outputs[i].detach().double()
                else:  # Out[B/m, D] to the next stage: sends 4·(B/m)·D bytes
                    pending.append(dist.isend(x.detach().contiguous(), rank + 1))
                    book("send", x, p, "pp_fwd", f"Out[B/m, D] {rank} → {rank + 1}", show)
            else:
                if last:
                    outputs[i].backward()
                else:  # ∂Out[B/m, D] from the stage after
                    g = torch.empty(B // M, D, device=device)
                    dist.recv(g, rank + 1)
                    book("recv", g, p, "pp_bwd", f"∂Out[B/m, D] {rank + 1} → {rank}", show)
                    outputs[i].backward(g)  # weight gradients add up over micro-batches
                if not first:  # ∂In[B/m, D] to the stage before: sends 4·(B/m)·D bytes
                    pending.append(dist.isend(inputs[i].grad.contiguous(), rank - 1))
                    book("send", inputs[i].grad, p, "pp_bwd", f"∂In[B/m, D] {rank} → {rank - 1}",
                         show)
                del inputs[i], outputs[i]  # this micro-batch's activations are freed
        for work in pending:
            work.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # the last stage's loss (0 elsewhere), for the printout
        book("all_reduce", loss_sum, p, "loss", "loss from the last stage", show and rank == 0)
        losses.append(loss_sum.item())
    finish(rank, losses, {f"layers.{j}.{k}": b[k].detach() for j, b in zip(mine, blocks)
                          for k in NAMES}, f"pp_{kind}", out)


if __name__ == "__main__":
    run(main)
