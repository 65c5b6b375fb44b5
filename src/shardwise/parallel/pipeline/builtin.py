"""``--engine torch`` for pipelines: the same stage split, run by ``torch.distributed.pipelining``.

Schedule mapping: gpipe → ``ScheduleGPipe``, 1f1b → ``Schedule1F1B``, interleaved-1f1b →
``ScheduleInterleaved1F1B`` (v stages per rank, stage s on rank s % p), zb-h1 →
``ScheduleInterleavedZeroBubble`` with one stage per rank (its placement of the W passes is
ZB-H1's: rank r delays them by r microbatches).

What PyTorch does and we do not: it splits the concatenated batch back into microbatches
(``tensor_split`` on dim 0, so equal-size microbatches come back unchanged), exchanges tensor
metadata between stages on the first step, and sends activations and gradients with its own
``batch_isend_irecv`` calls on the pp group: that traffic bypasses :mod:`shardwise.comm` and is
**not** in the ledger (like DDP's construction broadcast). Loss: our ``loss_fn`` returns the
microbatch's token-loss sum divided by the global token count, with ``scale_grads=False``, so
gradients are ∇ of the global mean, as in the explicit engine. Everything after the pipeline —
the tied-embedding gradient swap, the dp all-reduce, the global norm, the optimizer — is the
explicit engine's (:class:`.runtime.PipelineParallel`), through :mod:`shardwise.comm`.
"""

from __future__ import annotations

import torch

from ..engine import autocast
from .runtime import PipelineParallel
from .split import activation_shape, first_stage_input, loss_sum


def _schedule_class(name: str):
    from torch.distributed import pipelining as pl

    return {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
            "interleaved-1f1b": pl.ScheduleInterleaved1F1B,
            "zb-h1": pl.ScheduleInterleavedZeroBubble}[name]


class TorchPipelineParallel(PipelineParallel):
    """:class:`.runtime.PipelineParallel` whose :meth:`forward_backward` is PyTorch's schedule.

    Same constructor arguments and the same interface; ``timeline`` holds one event per step
    ("STEP") rather than per action (PyTorch does not expose its action timestamps)."""

    def __init__(self, model, topo, **kw):
        super().__init__(model, topo, **kw)
        self._torch_schedules = {}
        self._denom, self._loss, self._dtype = 1.0, None, "fp32"

    def _stages(self, mb: dict, dtype: str):
        """One ``PipelineStage`` per local chunk, with *static* tensor metadata (meta tensors of
        this microbatch's shapes). Without it PyTorch infers the shapes by running a real
        forward and backward of the first microbatch, whose loss and gradients would be added to
        the step's."""
        from torch.distributed.pipelining import PipelineStage

        device = next(self.module.parameters()).device
        hidden = activation_shape(mb, self.module.config)
        x = first_stage_input(mb)
        stages = []
        for c in self.chunks:
            if c.is_first:
                example_in = torch.empty(x.shape, dtype=x.dtype, device="meta")
            else:
                example_in = torch.empty(hidden, dtype=torch.float32, device="meta",
                                         requires_grad=True)
            if c.is_last and self.module.is_llama:  # logits, in the autocast dtype
                out_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                example_out = torch.empty((*x.shape, self.module.config.vocab_size),
                                          dtype=out_dtype, device="meta", requires_grad=True)
            else:
                example_out = torch.empty(hidden, dtype=torch.float32, device="meta",
                                          requires_grad=True)
            stages.append(PipelineStage(c, c.index, self.p * self.v, device,
                                        input_args=(example_in,), output_args=(example_out,),
                                        group=self.topo.group("pp")))
        return stages

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        key = "labels" if self.module.is_llama else "targets"
        with autocast(self._dtype, output.device):
            s = loss_sum(output, {key: target})
        self._loss += s.detach().double()
        return s / self._denom

    def _torch_schedule(self, microbatches: list[dict], dtype: str):
        m, mb = len(microbatches), microbatches[0]
        key = (m, tuple(first_stage_input(mb).shape), dtype)
        if key not in self._torch_schedules:
            self.schedule(m)  # validates (same rules as the explicit engine)
            cls = _schedule_class(self.schedule_name)
            stages = self._stages(mb, dtype)
            if self.schedule_name in ("gpipe", "1f1b"):
                stages = stages[0]
            self._torch_schedules[key] = cls(stages, m, loss_fn=self._loss_fn, scale_grads=False)
        return self._torch_schedules[key]

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """PyTorch's schedule over the concatenated microbatches (equal sizes required; they
        are split back identically). Returns the loss sum, fp64 [1] (0 except on the last
        rank)."""
        import time

        sizes = {tuple(first_stage_input(mb).shape) for mb in microbatches}
        if len(sizes) != 1:
            raise ValueError(f"--engine torch needs equal-size microbatches, got {sizes}")
        sched = self._torch_schedule(microbatches, dtype)
        device = next(self.module.parameters()).device
        self._denom, self._dtype = denom, dtype
        self._loss = torch.zeros(1, dtype=torch.float64, device=device)
        args, kw = (), {}
        if self.is_first:
            args = (torch.cat([first_stage_input(mb) for mb in microbatches]).to(device),)
        if self.is_last:
            key = "labels" if self.module.is_llama else "targets"
            kw["target"] = torch.cat([mb[key] for mb in microbatches]).to(device)
        t0 = time.time()
        with autocast(dtype, device):
            sched.step(*args, return_outputs=False, **kw)
        self.timeline = [("STEP", 0, 0, -1, t0, time.time())]
        return self._loss

    def step_bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                           **kw) -> dict[str, float]:
        """As :meth:`.runtime.PipelineParallel.step_bytes_formula`, with ``pp_fwd``/``pp_bwd``
        = 0: PyTorch's own point-to-point traffic does not go through the ledger."""
        out = super().step_bytes_formula(micro_steps, sequences, seq_len, **kw)
        out["pp_fwd"] = out["pp_bwd"] = 0.0
        return out
