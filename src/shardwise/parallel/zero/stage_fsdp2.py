"""``--engine torch`` ZeRO-2/3 inside pipeline stages: FSDP2 on each chunk that
``torch.distributed.pipelining`` runs (torchtitan's FSDP + PP): :class:`StageFSDP2`.

Each chunk (a ``PipelineStage``'s module) is wrapped as torchtitan's ``apply_fsdp`` does, over
the dp mesh: ``fully_shard`` on every block, then on the chunk (the embedding, the final norm,
the head: the chunk's own parameters) (:func:`.torch_zero.apply_fsdp`). ``PipelineStage`` sees
an ``FSDPModule``: every backward runs with ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)``, and ``perform_reduce_grad`` runs FSDP2's
``post_backward`` (the reduce-scatter, then the reshard) once, after the last backward. So per
step, P_u a unit's elements with FSDP2's dim-0 padding to the n dp ranks:

* ``grad``: one reduce-scatter per unit, (n−1)/n·ΣP_u·b_r, inside the schedule's step (before
  the pipeline's finishers: the tied swap then sums the two stages' *reduced* shards, the same
  sum);
* ``param``: ZeRO-2 (``reshard_after_forward=False``, torchtitan's PP default) one all-gather per
  unit at its first forward, held to the end; ZeRO-3 each block is freed after every forward and
  stays gathered after a backward (no reshard after backward), so a block is gathered by every
  ``B`` that follows an ``F`` and every ``F`` that does not follow a ``B`` (of its chunk, in
  the rank's schedule) — :func:`block_gathers`; the chunk's own unit (FSDP2's root) once.

HSDP (``--dp-replicate R``): FSDP2's 2-D mesh (dp_replicate, dp_shard); the reduce-scatter runs
within dp_shard (n = S), then FSDP2 all-reduces the shards over dp_replicate with c10d
(``grad_replicate``, 2(R−1)/R·ΣP_u·b_r/S, booked by the runner's ``c10d_tag``); ZeRO-1 under
HSDP runs as ZeRO-2. Not here: tp > 1 and split-backward schedules (``Layout.check``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import comm
from ...comm.ledger import ring_bytes
from ...precision import FP32, Precision
from ..params import mark_duplicate, reduce_bytes
from .formulas import hsdp_replicate_bytes
from ..sync import Sync
from .torch_zero import apply_fsdp


def block_gathers(kinds: list[str]) -> int:
    """All-gathers of a block resharded after forward but not after backward, over its
    chunk's F/B sequence ``kinds`` in one step (starting sharded): an F gathers unless a B
    left it gathered; a B gathers after an F (which freed it)."""
    gathered, count = False, 0
    for kind in kinds:
        count += not gathered
        gathered = kind == "B"
    return count


class StageFSDP2(Sync):
    """FSDP2 on ``stage``'s chunks over ``topo``'s dp mesh for ZeRO ``zero`` (2: no reshard
    after forward; 3: ``reshard_after_forward``). ``order(m)``: this rank's schedule for m
    micro-batches as [(kind, chunk)] (its F and B actions), for the formula. The replicas
    are made equal first (a broadcast over dp, phase ``init``): FSDP2 shards what it is given."""

    def __init__(self, stage: nn.Module, topo, zero: int, order, *,
                 reshard_after_forward: bool = True, precision: Precision = FP32,
                 offload: str = "none"):
        super().__init__(stage, topo)
        with topo.ledger.phase("init"), torch.no_grad():
            for p in stage.parameters():
                comm.broadcast(p.data, topo, "dp", src=0, tag="init")
        dup = stage.tied_output is not None
        self.order, self.reduce_dtype, self.zero = order, precision.reduce_dtype, zero
        self.param_bytes, self.offload = precision.param, offload  # gathered in 2 B under bf16
        self.fsdp2_state = True  # AdamW on FSDP2's shards (..storage.fsdp2_state)
        self.shapes = [[tuple(p.shape) for p in c.parameters()] for c in stage.chunks]
        self.block_shapes = [[[tuple(p.shape) for p in b.parameters()] for b in c.layers]
                             for c in stage.chunks]
        self.fsdp = [apply_fsdp(c, topo, zero, precision, units=list(c.layers),
                                reshard_after_forward=reshard_after_forward,
                                what=f"FSDP2 (pipeline stage, --zero {zero} --engine torch)",
                                offload=offload)
                     for c in stage.chunks]
        self.reshard_after_forward = self.fsdp[0].reshard_after_forward
        self.replicate_axis = self.fsdp[0].replicate_axis  # HSDP: "dp_replicate"
        if dup:  # FSDP2 made new parameters: the tied copy is marked again
            mark_duplicate(stage.output.weight)

    @property
    def sliced(self) -> tuple[str, ...]:
        return (self.topo.shard_axis,)

    def _modules(self):
        return [m for f in self.fsdp for m in f.modules]

    def after_evaluation(self) -> None:
        """Reshard what an evaluation left gathered (the next step must gather it again)."""
        for m in self._modules():
            m.reshard()

    def named_params(self):
        self.after_evaluation()  # the registered parameters: the sharded DTensors
        return super().named_params()

    def _padded(self, shapes) -> int:
        n = self.topo.size(self.topo.shard_axis)
        return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """``grad``, ``param``, HSDP's ``grad_replicate`` (module docstring) and the norm's
        scalar over the shard group."""
        n, b_r = self.topo.size(self.topo.shard_axis), reduce_bytes(self.reduce_dtype)
        actions = self.order(micro_steps)
        psi = sum(self._padded(s) for s in self.shapes)
        gathered = psi
        if self.reshard_after_forward:
            for c, blocks in enumerate(self.block_shapes):
                kinds = [k for k, chunk in actions if chunk == c]
                again = block_gathers(kinds) - 1
                gathered += again * sum(self._padded(b) for b in blocks)
        out = {"grad": ring_bytes("reduce_scatter", psi * b_r, n),
               "param": ring_bytes("all_gather", gathered * self.param_bytes, n),
               "grad_norm": ring_bytes("all_reduce", 8, n)}
        if self.replicate_axis:
            out["grad_replicate"] = hsdp_replicate_bytes(psi, n, self.topo.size(
                self.replicate_axis), b_r)
        return out
