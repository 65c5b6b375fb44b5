"""The explicit pipeline runner: executes one pp rank's actions of a :class:`~.schedules.Schedule`.

The step's loss is the token-weighted mean over the global batch, L = (1/T) Σ_t ℓ_t, T the
counted tokens of all microbatches of all dp ranks: the last stage back-propagates
``loss_sum(microbatch) / T`` for each microbatch, so the gradients accumulated over the m
microbatches are ∇L, with no second division by m ("double scaling").

A mixture of experts: every stage's MoE layers, not only the last stage's, have auxiliary losses
(load balance, router z-loss; token sums). The runner puts them in *attach mode* for the step
(:func:`~shardwise.models.moe.set_aux_grad_scale` with 1/T; Megatron-Core's
``MoEAuxLossAutoScaler``): each layer's output carries its aux loss's gradient 1/T, so the
backward of any stage reaches its routers with no loss of its own, and each forward's aux value
(detached) joins this rank's loss sum, which the engine reduces over pp and the data axis.

What moves over pp: per SEND_F/RECV_F one activation (tag ``pp_fwd``), per SEND_B/RECV_B its
gradient (``pp_bwd``), on two channels (:mod:`.comms` has the bytes). The actions, zero bubble's
I/W (Qi et al. 2023 §2) and why they cannot deadlock: docs/pipeline-parallel.md §4.
"""

from __future__ import annotations

import time

import torch

from ... import comm
from ...errors import ShardwiseConfigError
from ...models import positions_kw
from ...models.moe import moe_layers, set_aux_grad_scale
from ..engine import autocast
from .comms import GradTraffic
from .split import first_stage_input

KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")

# autograd nodes of the collectives that end a TP region (parallel/tp/comms.py): zb-h1's W pass
# starts below them (see ZeroBubbleCapture.record)
_TP_EXIT_NODES = ("ReduceScatterToSPBackward", "ReduceFromTPBackward")


class ZeroBubbleCapture:
    """zb-h1's split backward: during ``F`` a forward hook records the output of every module
    that owns parameters; ``I`` differentiates with respect to those outputs, ``W`` from each
    output to its own weights (for a Linear, dW = dYᵀX), so I + W cost what B costs. Raises
    :class:`ShardwiseConfigError` if a parameter belongs to no such module."""

    def __init__(self, module: torch.nn.Module):
        owners = [m for m in module.modules() if list(m.parameters(recurse=False))]
        covered = {id(p) for m in owners for p in m.parameters(recurse=False)}
        if covered != {id(p) for p in module.parameters()}:
            raise ShardwiseConfigError("zb-h1 needs every parameter to belong to a module whose "
                                       "output carries its whole gradient")
        self.active: list | None = None
        for m in owners:
            m.register_forward_hook(self.record)

    def record(self, module, args, output):
        """Record where W will start for ``module``'s weights: its output or, when the output
        leaves a TP region through a collective, the edge *into* that collective (a
        ``GradientEdge``), so the collective's backward runs once, in I."""
        if self.active is None or not isinstance(output, torch.Tensor) \
                or not output.requires_grad:
            return
        target = output
        fn = output.grad_fn
        if fn is not None and type(fn).__name__ in _TP_EXIT_NODES:
            from torch.autograd.graph import GradientEdge

            node, nr = fn.next_functions[0]
            if node is not None:
                target = GradientEdge(node, nr)
        self.active.append((list(module.parameters(recurse=False)), target))


class ScheduleRunner:
    """Runs one pp rank's action list for a step. ``chunks``: this rank's model chunks in stage
    order (:class:`.split.Chunk`); ``split_backward``: zb-h1 (I/W instead of B) over ``module``.
    After :meth:`run`, ``timeline`` holds (kind, microbatch, chunk, peer, t_start, t_end) per
    action (seconds, ``time.time()``) and ``peak_alive`` the most (microbatch, chunk) pairs that
    held activations at once."""

    def __init__(self, chunks, topo, module: torch.nn.Module, *, split_backward: bool):
        self.chunks, self.topo, self.module = chunks, topo, module
        self.grad_topo = GradTraffic(topo)  # gradients: the other channel (.comms)
        self.zb = ZeroBubbleCapture(module) if split_backward else None
        self.moe = [moe_layers(c) for c in chunks]  # each chunk's MoE layers (maybe none)
        self.timeline: list[tuple] = []
        self.peak_alive = 0

    def run(self, actions, microbatches: list[dict], denom: float, dtype: str, *,
            act_shape, loss_sum) -> torch.Tensor:
        """Execute ``actions`` (this rank's row of the schedule) for ``microbatches`` (the same
        list on every pp rank, on this rank's device). ``act_shape(mb)``: the shape of the
        tensor between stages for ``mb`` (each receive is sized from its own microbatch, so
        unequal rows send no shape); ``loss_sum(y, mb)``: the last stage's token-loss sum.
        ``denom``: the global count of counted tokens. Returns this rank's loss sum, fp64 [1]:
        the last stage's token losses plus, with MoE layers, every forward's aux loss sums
        (0 on a stage with neither). RuntimeError if the schedule leaves state behind. Sends
        are ``isend``, waited at the end of the step; receives block. MoE layers are in attach
        mode (aux gradient 1/``denom``) during the step and back in plain mode after it."""
        mbs = microbatches
        shapes = [act_shape(mb) for mb in mbs]
        first = next(self.module.parameters())
        device, act_dtype = first.device, first.dtype
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        inputs, outputs, out_grads, in_grads, wgrad, captures = {}, {}, {}, {}, {}, {}
        sends, alive = [], set()
        self.timeline, self.peak_alive = [], 0
        topo, grad_topo = self.topo, self.grad_topo
        set_aux_grad_scale(self.module, 1.0 / denom)  # each MoE layer's aux gradient: 1/T
        for a in actions:
            key = (a.microbatch, a.chunk)
            chunk = self.chunks[a.chunk]
            t0 = time.time()
            if a.kind == "RECV_F":
                buf = torch.empty(shapes[a.microbatch], dtype=act_dtype, device=device)
                comm.recv(buf, topo, "pp", a.peer, tag="pp_fwd")
                inputs[key] = buf.requires_grad_()
            elif a.kind == "RECV_B":
                buf = torch.empty(shapes[a.microbatch], dtype=act_dtype, device=device)
                comm.recv(buf, grad_topo, "pp", a.peer, tag="pp_bwd")
                out_grads[key] = buf
            elif a.kind == "SEND_F":
                t = outputs[key].detach().to(act_dtype).contiguous()
                sends.append((comm.send(t, topo, "pp", a.peer, tag="pp_fwd", async_op=True), t))
            elif a.kind == "SEND_B":
                t = in_grads.pop(key).to(act_dtype).contiguous()
                sends.append((comm.send(t, grad_topo, "pp", a.peer, tag="pp_bwd",
                                        async_op=True), t))
            elif a.kind == "F":
                x = first_stage_input(mbs[a.microbatch]) if chunk.is_first else inputs[key]
                if self.zb is not None:
                    self.zb.active = []
                with autocast(dtype, device):
                    y = chunk(x, **positions_kw(mbs[a.microbatch]))
                    for m in self.moe[a.chunk]:  # this forward's aux sums, for the log line
                        loss += m.aux.detach().double()
                    if chunk.is_last:
                        s = loss_sum(y, mbs[a.microbatch])
                        loss += s.detach().double()
                        y = s / denom  # back-propagate the share of the global mean
                if self.zb is not None:
                    captures[key], self.zb.active = self.zb.active, None
                outputs[key] = y
                alive.add(key)
                self.peak_alive = max(self.peak_alive, len(alive))
            elif a.kind == "B":
                y = outputs.pop(key)
                g = None if chunk.is_last else out_grads.pop(key).to(y.dtype)
                torch.autograd.backward(y, g)
                if not chunk.is_first:
                    in_grads[key] = inputs.pop(key).grad
                alive.discard(key)
            elif a.kind == "I":
                y = outputs.pop(key)
                g = None if chunk.is_last else out_grads.pop(key).to(y.dtype)
                roots = [] if chunk.is_first else [inputs.pop(key)]
                cap = captures.pop(key)
                grads = torch.autograd.grad(y, roots + [out for _, out in cap], g,
                                            retain_graph=True, allow_unused=True)
                if not chunk.is_first:
                    in_grads[key] = grads[0]
                wgrad[key] = [(ps, out, gout) for (ps, out), gout
                              in zip(cap, grads[len(roots):]) if gout is not None]
            elif a.kind == "W":
                for ps, out, gout in wgrad.pop(key):
                    for p, gp in zip(ps, torch.autograd.grad(out, ps, gout, retain_graph=True)):
                        if p.grad is None:
                            p.grad = gp
                        else:
                            p.grad.add_(gp)
                alive.discard(key)
            self.timeline.append((a.kind, a.microbatch, a.chunk,
                                  -1 if a.peer is None else a.peer, t0, time.time()))
        for handle, _ in sends:
            handle.wait()
        set_aux_grad_scale(self.module, None)
        leftover = [d for d in (inputs, outputs, out_grads, in_grads, wgrad) if d]
        if leftover:  # a schedule bug; the simulator should have caught it
            raise RuntimeError(f"pipeline step left state behind: {leftover}")
        return loss
