"""ZeRO-1 for one pipeline stage: AdamW state sharded over dp, gradients reduce-scattered once.

Why only stage 1 with PP (ZeRO paper, Rajbhandari et al. 2019, §5.1; Megatron-LM's distributed
optimizer; DeepSpeed refuses ZeRO-2/3 with its pipeline engine): a pipeline step runs m
microbatches through each stage. ZeRO-1 touches the wire only once per step — after the last
microbatch's backward — so its traffic is the DP all-reduce's, split in its two halves
(§7.2.1): a reduce-scatter of the stage's gradients, Ψ_s·b·(n−1)/n, and after the optimizer step
an all-gather of the updated parameters, Ψ_s·4·(n−1)/n (Ψ_s = this stage's padded flat size, b
bytes per element of the reduction dtype). Its memory saving is the 8Ψ_s of AdamW moments
divided by n — the largest part of the model state.

The mechanism is :mod:`..zero`'s ZeRO-1, written small and self-contained for a stage (that
module's engine owns a whole model's forward and hooks; a stage's forward belongs to the
schedule): the stage's parameters become views of one flat fp32 buffer padded to a multiple of
n, their ``.grad`` views of a second one; dp rank i owns the flat range [i·k, (i+1)·k),
k = P/n. The optimizer is PyTorch's AdamW over the *pieces* of that range that fall inside each
parameter (views, so the weight-decay groups are kept and the update is element for element the
one AdamW applies to whole tensors).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import comm


class StageZero1:
    """The flat buffers and sharded optimizer of one stage over ``topo``'s "dp" axis.

    ``params``: the stage's trainable parameters (each once, in a fixed order that every dp
    rank shares). ``reduce_dtype``: "fp32" | "bf16", the dtype of the gradient reduce-scatter.
    Sizes in elements: ``numel`` Ψ, ``padded`` P = ⌈Ψ/n⌉·n, ``shard_numel`` k = P/n.
    ``full`` [P] (the parameters are views of it), ``grad_full`` [P] (their ``.grad`` are views),
    ``shard`` / ``shard_grad`` [k]: this rank's range of each."""

    def __init__(self, params: list[nn.Parameter], topo, reduce_dtype: str = "fp32"):
        self.topo, self.params = topo, list(params)
        self.n, self.rank = topo.size("dp"), topo.index("dp")
        self.reduce_dtype = torch.bfloat16 if reduce_dtype == "bf16" else None
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:j]) for j in range(len(self.params))]
        self._offset_of = {id(p): o for p, o in zip(self.params, self.offsets)}
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / self.n) * self.n
        self.shard_numel = self.padded // self.n
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        p0 = self.params[0]
        self.full = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        self.grad_full = torch.zeros_like(self.full)
        with torch.no_grad():
            for p, view in self._views(self.full):
                view.copy_(p.detach())
                p.data = view  # same Parameter object; storage = the flat buffer
        self.shard, self.shard_grad = self.full[self.lo:self.hi], self.grad_full[self.lo:self.hi]
        self.piece_of: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) → (piece, start)
        self.zero_grad()

    def _views(self, flat: torch.Tensor):
        return [(p, flat[o: o + k].view_as(p))
                for p, o, k in zip(self.params, self.offsets, self.numels)]

    def pieces(self):
        """(param, flat start, flat end) of every piece of this rank's range, in order."""
        out = []
        for p, off, k in zip(self.params, self.offsets, self.numels):
            a, b = max(off, self.lo), min(off + k, self.hi)
            if a < b:
                out.append((p, a, b))
        return out

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.grad_full.zero_()
        for p, view in self._views(self.grad_full):
            p.grad = view

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """SUM the stage's flat gradient over dp, leaving this rank's range in ``shard_grad``
        (tag ``grad``; in ``reduce_dtype`` if bf16). Gradients autograd did not write into the
        views (a replaced ``.grad``) are copied in first."""
        for p, view in self._views(self.grad_full):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        src = self.grad_full if self.reduce_dtype is None else self.grad_full.to(self.reduce_dtype)
        out = torch.empty(self.shard_numel, dtype=src.dtype, device=src.device)
        comm.reduce_scatter(out, src, self.topo, "dp", tag="grad")
        self.shard_grad.copy_(out)

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """After the optimizer step: every rank's updated range into ``full`` (tag ``param``)."""
        comm.all_gather(self.full, self.shard.clone(), self.topo, "dp", tag="param")

    @torch.no_grad()
    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """[k] from every dp rank → [P] (phase ``gather``: parity checks, checkpoints)."""
        out = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        with self.topo.ledger.phase("gather"):
            comm.all_gather(out, shard.contiguous(), self.topo, "dp", tag="gather")
        return out

    def full_gradients(self) -> dict[int, torch.Tensor]:
        """{id(param): summed gradient in the parameter's (local) shape}; collective over dp."""
        flat = self.gather_flat(self.shard_grad)
        return {id(p): v.clone() for p, v in self._views(flat)}

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over this rank's pieces, grouped as ``param_groups`` groups the parameters;
        ``zero_grad`` re-arms the flat gradient buffer, ``step`` ends with
        :meth:`all_gather_params`."""
        group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        pieces = [[] for _ in param_groups]
        self.piece_of.clear()
        for p, a, b in self.pieces():
            if id(p) not in group_of:
                continue
            piece = self.shard[a - self.lo: b - self.lo]
            piece.grad = self.shard_grad[a - self.lo: b - self.lo]
            pieces[group_of[id(p)]].append(piece)
            self.piece_of[id(p)] = (piece, a - self._offset_of[id(p)])
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                  for g, ps in zip(param_groups, pieces)]
        return _Zero1AdamW(self, groups, **adamw)

    # -- optimizer state in full parameter shape (checkpoints) --------------------------------
    def full_state(self, optimizer) -> dict[int, dict]:
        """{id(param): {"step", "exp_avg", "exp_avg_sq"}} in the parameter's local shape,
        gathered over dp (collective). Empty before the first step."""
        keys = ("exp_avg", "exp_avg_sq")
        bufs = {k: torch.zeros(self.shard_numel, dtype=self.full.dtype, device=self.full.device)
                for k in keys}
        step = torch.zeros((), dtype=torch.float32)
        have = torch.zeros(1, dtype=torch.float64, device=self.full.device)
        for p, a, b in self.pieces():
            piece = self.piece_of[id(p)][0] if id(p) in self.piece_of else None
            st = optimizer.state.get(piece) if piece is not None else None
            if st:
                have += 1
                step = st["step"]
                for k in keys:
                    bufs[k][a - self.lo: b - self.lo] = st[k]
        comm.all_reduce(have, self.topo, "dp", op="max", tag="gather")
        if not have.item():
            return {}
        flats = {k: self.gather_flat(bufs[k]) for k in keys}
        step_t = torch.tensor([float(step)], dtype=torch.float64, device=self.full.device)
        comm.all_reduce(step_t, self.topo, "dp", op="max", tag="gather")
        out = {}
        for j, p in enumerate(self.params):
            o, k = self.offsets[j], self.numels[j]
            out[id(p)] = {"step": torch.tensor(float(step_t.item())),
                          **{key: flats[key][o: o + k].view_as(p).clone() for key in keys}}
        return out

    def load_state(self, optimizer, local: dict[int, dict]) -> None:
        """Set the pieces' AdamW state from {id(param): state in the parameter's local shape}."""
        for p, a, b in self.pieces():
            if id(p) not in self.piece_of:
                continue
            piece, start = self.piece_of[id(p)]
            st = local[id(p)]
            n = b - a
            optimizer.state[piece] = {
                "step": torch.tensor(float(st["step"])),
                **{k: st[k].reshape(-1)[start: start + n].clone().to(piece.device)
                   for k in ("exp_avg", "exp_avg_sq")}}


class _Zero1AdamW(torch.optim.AdamW):
    """AdamW over a stage's ZeRO-1 pieces (see :class:`StageZero1`)."""

    def __init__(self, owner: StageZero1, groups, **adamw):
        self.owner = owner
        super().__init__(groups, **adamw)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.owner.zero_grad()

    def step(self, closure=None):
        loss = super().step(closure)
        self.owner.all_gather_params()
        return loss
