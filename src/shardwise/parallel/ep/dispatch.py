"""The all-to-all token dispatcher of expert parallelism (:mod:`shardwise.parallel.ep`).

:class:`AllToAllDispatcher` replaces the plain model's ``LocalDispatcher`` in every MoE layer:
same call, same result (the expert output of every routed row, in the caller's order), but the
rows travel to the rank that holds their expert and back. Each token all-to-all is
:class:`_AllToAllV`, whose backward is the reverse all-to-all of the gradients; all four go
through :func:`shardwise.comm.all_to_all_v` and the ledger.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import comm
from ...models.moe import _in_backward


class _AllToAllV(torch.autograd.Function):
    """rows [Σ send, d] → [Σ recv, d] over "ep" (uneven splits); backward: the gradient rows go
    back the same way reversed (recv splits out, send splits in), under the same tag."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], topo, tag: str):
        ctx.send, ctx.recv, ctx.topo, ctx.tag = send, recv, topo, tag
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        comm.all_to_all_v(out, rows.contiguous(), recv, send, topo, "ep", tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        comm.all_to_all_v(out, grad.contiguous(), ctx.send, ctx.recv, ctx.topo, "ep",
                          tag=ctx.tag)
        return out, None, None, None, None


class AllToAllDispatcher(nn.Module):
    """Dispatch over ``topo``'s "ep" axis for a layer of ``n_experts`` E experts, E/ep of them
    local (this rank's ep index i holds experts [i·E/ep, (i+1)·E/ep)).

    ``records``: one dict per forward (not recomputes) since :meth:`reset`: ``counts`` [E] rows
    this rank routed to each expert, ``received`` [ep] rows each ep rank sent here,
    ``row_bytes`` bytes of one dispatched row (the activations' dtype) and
    ``combine_row_bytes`` of one expert output row (bf16 under autocast) — what
    :func:`~shardwise.parallel.ep.ep_bytes_formula` computes the step's bytes from."""

    def __init__(self, topo, n_experts: int):
        super().__init__()
        self.topo, self.n_experts = topo, n_experts
        self.ep = topo.size("ep")
        self.records: list[dict] = []

    def reset(self) -> None:
        self.records = []

    def forward(self, rows: torch.Tensor, counts: list[int], experts: nn.Module) -> torch.Tensor:
        """``rows`` [N, d] sorted by global expert, ``counts`` [E] (Σ = N) → expert outputs
        [N, d] in the same order. Collective over "ep": one count all-to-all, two token
        all-to-alls (and two more in backward)."""
        ep, per = self.ep, self.n_experts // self.ep
        send_counts = torch.tensor(counts, dtype=torch.long, device=rows.device).view(ep, per)
        recv_counts = torch.empty_like(send_counts)  # [ep, per]: rows from rank j for expert l
        comm.all_to_all(recv_counts, send_counts, self.topo, "ep", tag="ep_counts")
        recv = recv_counts.tolist()
        send_rows = [sum(r) for r in send_counts.tolist()]
        recv_rows = [sum(r) for r in recv]
        record = {"counts": list(counts), "received": recv_rows,
                  "row_bytes": rows.shape[1] * rows.element_size()}
        if not _in_backward():
            self.records.append(record)
        got = _AllToAllV.apply(rows, send_rows, recv_rows, self.topo, "ep_dispatch")
        # the received rows come as blocks (source j, local expert l), j-major: regroup them
        # l-major so each local expert's rows are contiguous
        starts, off = {}, 0
        for j in range(ep):
            for l in range(per):
                starts[j, l] = off
                off += recv[j][l]
        order = [torch.arange(starts[j, l], starts[j, l] + recv[j][l]) for l in range(per)
                 for j in range(ep)]
        perm = torch.cat(order).to(rows.device) if order else \
            torch.zeros(0, dtype=torch.long, device=rows.device)
        local_counts = [sum(recv[j][l] for j in range(ep)) for l in range(per)]
        y = experts(got[perm], local_counts)  # [M, d], l-major
        back = torch.empty_like(y).index_copy(0, perm, y) if y.shape[0] else y  # j-major again
        # the expert outputs travel in their own dtype (bf16 under autocast)
        record["combine_row_bytes"] = y.shape[1] * y.element_size()
        return _AllToAllV.apply(back, recv_rows, send_rows, self.topo, "ep_combine")
