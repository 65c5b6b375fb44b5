"""The interface every parallel wrapper implements, with the defaults a replicated model needs.

The training step (``train/step.py``) talks to a model only through this interface, so each
strategy decides how its micro-batches run and where its collectives go:

===========================  ================================================================
``module``                   the plain model (its submodules may be sharded/parallel versions)
``forward_backward``         run the step's micro-batches forward and backward; returns this
                             rank's loss sum (fp64, [1]); gradient sync may start inside
``finish_gradient_sync``     wait for / issue the remaining gradient collectives
``clip_grad_norm_``          the *global* gradient L2 norm over every axis, clipping in place
``make_optimizer``           the optimizer (ZeRO returns a sharded one)
``reduce_loss_axes``         axes over which the loss sum is all-reduced for the log line
``count_axes``               axes over which the step's token count is all-reduced
``named_full_parameters``    {FQN of the plain model: full-shape tensor} for the parameters this
                             rank's stage holds, gathered over dp/tp shards (for parity checks)
``named_full_gradients``     the same for gradients (after ``finish_gradient_sync``)
``model_state_bytes``        bytes this rank holds: parameters, gradients, optimizer state
``loss_sum_and_count``       evaluation: (loss sum, counted items) of one batch, no backward
``full_model``               context: the plain model with full weights and full logits, for
                             sampling (collective where the weights are sharded; None when this
                             rank holds only a pipeline stage); every rank enters it together
``full_optimizer_state``     {FQN: {"step", "exp_avg", "exp_avg_sq"}} in full parameter shape,
                             gathered like ``named_full_parameters`` (checkpoints: layout-free)
``load_full_optimizer_state``  the inverse: slice full-shape state into this rank's shards
``bytes_formula`` (optional) {tag: bytes} one rank sends per step, for composed engines; used by
                             :func:`shardwise.formulas.step_bytes_formula` when present
===========================  ================================================================
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..models import loss_sum_and_count


def autocast(dtype: str, device: torch.device):
    """bf16 mixed precision: matmuls in bf16, master weights/grads/optimizer state stay fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def clip_replicated_grad_norm_(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of ``module``'s gradients, clipping them to ``max_norm`` if it is > 0.

    For replicated gradients only (plain DP, after the all-reduce): every replica holds the same
    full gradients, so the local norm *is* the global norm and no collective is needed. Sharded
    strategies (ZeRO, TP, PP) must all-reduce squared norms instead."""
    params = [p for p in module.parameters() if p.grad is not None]
    if max_norm and max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params])


class Engine(nn.Module):
    """Base class: a replicated model whose micro-batches run one after another on this rank."""

    count_axes: tuple[str, ...] = ("dp",)
    reduce_loss_axes: tuple[str, ...] = ("dp",)

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self, enabled: bool):
        """Context: inside ``sync_gradients(False)`` backward only accumulates locally."""
        return contextlib.nullcontext()

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """Forward + backward each micro-batch; the loss back-propagated is its token-loss sum
        divided by ``denom`` (the global token count), so gradients sum to ∇ of the global mean.
        Gradient sync is enabled on the last micro-step only. Returns the loss sum, fp64 [1]."""
        device = next(self.module.parameters()).device
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        for i, mb in enumerate(microbatches):
            mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
            with self.sync_gradients(i == len(microbatches) - 1):
                with autocast(dtype, device):
                    s, _ = loss_sum_and_count(self, mb)
                (s / denom).backward()
            loss_sum += s.detach().double()
        return loss_sum

    def finish_gradient_sync(self) -> None:
        pass

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_replicated_grad_norm_(self.module, max_norm)

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over ``param_groups`` (parameters of ``self.module``) with ``adamw`` kwargs
        (lr, betas, eps). Sharded strategies override this to shard the optimizer state."""
        return torch.optim.AdamW(param_groups, **adamw)


    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, counted items) of ``batch`` — for evaluation (call under no_grad)."""
        return loss_sum_and_count(self, batch)

    @contextlib.contextmanager
    def full_model(self):
        yield self.module

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def named_full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank (each tensor
        counted once, by storage size actually allocated)."""
        return model_state_bytes(self.module.parameters(), optimizer)

    def full_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN of the plain model: {state key: tensor}} for the parameters this rank's stage
        holds: AdamW's ``exp_avg``/``exp_avg_sq`` in the parameter's *full* shape (gathered over
        dp/tp shards exactly as :meth:`named_full_parameters` gathers the parameter) and its
        ``step`` (fp32 []). Parameters with no state yet (never stepped) are absent. Collective
        wherever :meth:`named_full_parameters` is. This base version serves engines whose
        optimizer holds the plain module's full parameters (DP, DDP, a pipeline stage)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state:
                    out[names[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                         for k, v in state.items()}
        return out

    def load_full_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Set ``optimizer``'s state from :meth:`full_optimizer_state`'s form (possibly saved
        under another layout): each tensor is sliced to this rank's shard of its parameter.
        Raises ``KeyError`` naming the FQNs this rank's parameters need but ``state`` lacks."""
        named = dict(self.module.named_parameters())
        missing = [n for n in named if n not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. "
                           f"{missing[:3]}")
        for n, p in named.items():
            optimizer.state[p] = {k: (self._state_to_local(v, p, k) if torch.is_tensor(v)
                                      else v) for k, v in state[n].items()}

    def _state_to_local(self, full: torch.Tensor, p: nn.Parameter, key: str) -> torch.Tensor:
        """One full-shape optimizer-state tensor of ``p`` → the copy this rank keeps (here: the
        whole tensor on ``p``'s device; ``step`` stays where it is). Sharded engines slice."""
        return full.detach().clone().to(p.device if key != "step" else full.device)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def model_state_bytes(params, optimizer=None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} bytes for ``params`` and ``optimizer``'s state
    (scalar step counters included)."""
    params = list(dict.fromkeys(params))  # tied parameters once
    out = {"params": sum(_nbytes(p) for p in params),
           "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
           "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(_nbytes(v) for v in state.values())
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class Local(Engine):
    """The single-process reference "engine": the plain model, no communication."""
