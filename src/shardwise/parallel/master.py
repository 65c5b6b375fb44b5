"""AdamW over master copies of the parameters it is given, optionally in host memory:
:class:`MasterAdamW`, the one optimizer-side piece of bf16 storage and offload for every
layout (plain parameters under DP / TP / CP, ZeRO's slice pieces: it is handed whatever the
sync's ``make_optimizer`` exposes).

One step per parameter p with gradient g (:func:`.storage.grad_of`: the fp32 main gradient
under Megatron's recipe):

1. g to the master's place: as is when it is there already, else copied (offload: to the host,
   booked ``offload_d2h``, g's bytes) and cast to the master dtype;
2. AdamW (Loshchilov & Hutter 2019, Alg. 2; torch's own functional ``adamw``, foreach or fused,
   the arithmetic of ``torch.optim.AdamW``) on the master, its m and v (the master dtype);
3. the master written back into p, cast to p's dtype (offload: cast on the host, copied to the
   device, booked ``offload_h2d``, p's bytes).

The master is p itself when it has the master dtype and stays on the device (fp32 storage, no
offload: plain AdamW, bitwise). State per parameter (``optimizer.state[p]``): ``step``,
``exp_avg``, ``exp_avg_sq`` and ``master`` (when it is a copy) — saved and restored with the
rest by the engines' ``full_optimizer_state``. Derivation, bytes and accuracy:
docs/precision-memory-mfu.md, "bf16 storage"; the parity rule: docs/parity.md.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from ..comm.offload import D2H, H2D, copy_booked_, host_empty
from .params import grad_of
from .storage import clear_main_grads

KEYS = ("exp_avg", "exp_avg_sq", "master")


class MasterAdamW(torch.optim.Optimizer):
    """AdamW(lr, betas, eps, weight_decay) of ``params`` stepped on master copies of dtype
    ``master_dtype`` (module docstring); ``offload``: masters, m and v in host memory (pinned
    when the parameters are on an accelerator) and the step there (foreach AdamW, one parameter
    at a time: one gradient copy and one √v temporary alive);
    ``topo``: whose ledger books the host ↔ device copies (None: none booked). ``host_params``
    (``--offload params``): the parameters it is given already live in host memory (ZeRO-3's
    host shards, :mod:`.zero.offload`): the masters, m and v beside them, no copy of its own.
    ``foreach`` / ``fused``: ``torch.optim.AdamW``'s (fused only on the device, never
    offloaded: foreach on the host).
    ``state_dtype`` / ``state_device``: where the state lives, read by ZeRO's state gathers."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, foreach: bool | None = None,
                 fused: bool | None = None, master_dtype: torch.dtype = torch.float32,
                 offload: bool = False, topo=None, host_params: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_dtype, self.offload, self.topo = master_dtype, offload, topo
        self.fused = bool(fused) and not (offload or host_params)
        self.foreach = True if offload or host_params else foreach
        self.state_dtype = master_dtype
        self.state_device = torch.device("cpu") if offload else None

    def _place(self, p) -> torch.device:
        return self.state_device or p.device

    def _state(self, p) -> dict:
        """``state[p]``, created on first use (m, v zero; the master from p) and moved to its
        place and dtype when it was loaded from elsewhere (a checkpoint of any layout)."""
        st, place = self.state[p], self._place(p)
        copy = self.offload or p.dtype != self.master_dtype
        if copy and "master" not in st:
            st["master"] = host_empty(p, self.master_dtype, place) if self.offload else \
                torch.empty(p.shape, dtype=self.master_dtype, device=place)
            st["master"].copy_(p.detach())
        master = st["master"] if copy else p
        for k in ("exp_avg", "exp_avg_sq"):
            if k not in st:
                st[k] = torch.zeros_like(master, memory_format=torch.preserve_format)
        for k in KEYS:
            if k in st and (st[k].device != place or st[k].dtype != self.master_dtype):
                st[k] = st[k].to(place, self.master_dtype)
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32,
                                     device=place if self.fused else "cpu")
        return st

    def _grad(self, g: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The gradient at the master's place and dtype (offload: one booked copy)."""
        if self.offload:
            g = copy_booked_(host_empty(g, None, master.device), g, self.topo, D2H)
        return g if g.dtype == master.dtype else g.to(master.dtype)

    def _write_back(self, p, master: torch.Tensor) -> None:
        if master is p:
            return
        if self.offload:  # cast on the host: the copy moves p's bytes, not the master's
            copy_booked_(p.data, master.to(p.dtype), self.topo, H2D)
        else:
            p.data.copy_(master)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps = [p for p in group["params"] if grad_of(p) is not None]
            if not ps:
                continue
            # on the host (offload, or a CPU run), one parameter at a time: a gradient copy and
            # foreach's temporaries (√v) of one tensor alive, not of the whole group (at
            # llama-1b, 2 × 4Ψ/n more bytes); elementwise, so bitwise the group's update
            for chunk in ([[p] for p in ps] if self._place(ps[0]).type == "cpu" else [ps]):
                self._step_params(chunk, group)
        return loss

    def _step_params(self, ps: list, group: dict) -> None:
        """AdamW on ``ps`` (module docstring's steps 1–3)."""
        states = [self._state(p) for p in ps]
        masters = [st.get("master", p) for st, p in zip(states, ps)]
        grads = [self._grad(grad_of(p), m) for p, m in zip(ps, masters)]
        beta1, beta2 = group["betas"]
        adamw(masters, grads, [st["exp_avg"] for st in states],
              [st["exp_avg_sq"] for st in states], [], [st["step"] for st in states],
              foreach=self.foreach, fused=self.fused or None, amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)
        for p, m in zip(ps, masters):
            self._write_back(p, m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``.grad`` and the main gradients of every parameter set to None."""
        super().zero_grad(set_to_none)
        clear_main_grads([p for g in self.param_groups for p in g["params"]])


def optimizer_options(precision, offload: str, topo) -> dict:
    """``make_optimizer`` keywords that select :class:`MasterAdamW` for ``precision`` and
    ``offload``, or {} where plain AdamW is the recipe (fp32 or bf16 storage without a
    master copy, nothing offloaded). ``offload`` "params": the sync put the shards on the host
    (:mod:`.zero.offload`), so the optimizer steps them in place (``host_params``), copying
    nothing itself."""
    from .storage import TORCH_DTYPES

    if precision.master_dtype is None and offload == "none":
        return {}
    master = TORCH_DTYPES[precision.master_dtype or precision.param_dtype]
    return {"optimizer_class": MasterAdamW, "master_dtype": master,
            "offload": offload == "optimizer", "host_params": offload == "params", "topo": topo}
