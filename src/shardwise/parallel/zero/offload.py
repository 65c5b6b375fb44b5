"""``--offload params`` on ZeRO-3 (explicit engine): each unit's parameter shard and its
gradient shard live in host memory, and the optimizer steps them there.

DeepSpeed ZeRO-3's ``offload_param`` and FSDP2's ``CPUOffloadPolicy``: on top of ``--offload
optimizer`` (:class:`..master.MasterAdamW`: masters, m and v on the host), a unit's shard
``shard`` [k] (the storage dtype) and ``shard_grad`` [k] (the gradient dtype) are host tensors,
pinned when the device is an accelerator (:func:`~shardwise.comm.offload.host_empty`). Per unit,
k = P_u / n elements, n the shard axis's ranks (:mod:`.flat`):

* before **each** all_gather of the unit (every micro-batch's forward, and its backward
  re-gather under ``reshard_after_forward``: :mod:`.zero3`), its shard is copied host → device
  (k·b_param bytes, tag ``offload_h2d``) and gathered from there;
* after the unit's one reduce_scatter of the step (HSDP: and its all_reduce over the replicas),
  the reduced slice is copied device → host (k·b_reduce, tag ``offload_d2h``) into
  ``shard_grad`` (cast to the gradient dtype on the host). Once per step, not per micro-batch:
  the explicit ZeRO-3 accumulates full local gradients on the device over micro-batches and
  reduce-scatters once (train's ``--grad-reduce step``), so there is one slice to move;
* the optimizer's pieces are views of the host ``shard`` and ``shard_grad``: it steps there and
  writes back into the host shard (no copy of its own: :func:`..master.optimizer_options`).

Bytes per step (:func:`offload_params_bytes`, M micro-batches): h2d = M·b_param·(Σ_u k_u +
Σ_{regathered blocks} k_u), d2h = b_reduce·Σ_u k_u. On a CPU-only machine host = device: the
copies are real ``copy_`` between two CPU tensors, booked the same (the same code path).
Derivation and pitfalls: docs/precision-memory-mfu.md, "`--offload params`".
"""

from __future__ import annotations

import torch

from ...comm.offload import D2H, H2D, copy_booked_, host_empty


class HostShards:
    """Unit ``u``'s (a :class:`.flat.FlatShards` of ZeRO-3 over more than one rank) shards moved
    to host memory: ``u.shard`` and ``u.shard_grad`` replaced by host copies (values kept), and
    the two booked copies of the module docstring, in ``topo``'s ledger."""

    def __init__(self, u, topo):
        self.u, self.topo = u, topo
        with torch.no_grad():
            u.shard = host_empty(u.shard).copy_(u.shard)  # [k], the storage dtype
            u.shard_grad = host_empty(u.shard_grad).zero_()  # [k], the gradient dtype

    def device_shard(self) -> torch.Tensor:
        """A fresh [k] device copy of the host shard (booked ``offload_h2d``): what the
        all_gather sends. Each gather gets its own, freed when the gather no longer holds it."""
        u = self.u
        dev = torch.empty(u.shard_numel, dtype=u.dtype, device=u.device)
        return copy_booked_(dev, u.shard, self.topo, H2D)

    def land_grad(self, out: torch.Tensor) -> None:
        """The reduced slice ``out`` [k] (device, reduce dtype) into the host ``shard_grad``
        (booked ``offload_d2h``, ``out``'s bytes; cast on the host)."""
        g = self.u.shard_grad
        if out.dtype == g.dtype:
            copy_booked_(g, out, self.topo, D2H)
        else:  # bf16 reduced, fp32 main gradients: the reduce dtype crosses, cast on the host
            g.copy_(copy_booked_(host_empty(out), out, self.topo, D2H))


def offload_params(sync) -> None:
    """Move every ZeRO-3 unit of ``sync`` (a :class:`.zero3.Zero3Sync`, values already filled)
    over more than one rank to the host (:class:`HostShards`, set as ``u.offload``). Units over
    one rank keep their whole buffer on the device (never gathered: nothing to copy). Raises
    ``ValueError`` for a sync that keeps full parameters (ZeRO-1/2: check_storage refuses it)."""
    if sync.keeps_full_params:
        raise ValueError("--offload params needs ZeRO-3's shards (--zero 3)")
    for u in sync.units:
        if u.n > 1:
            u.offload = HostShards(u, sync.topo)


def offload_params_bytes(sync, micro_steps: int, param_bytes: int) -> dict[str, float]:
    """``{"offload_h2d", "offload_d2h"}`` bytes this rank copies per step (module docstring):
    every offloaded unit's [k] shard up before each gather — M forward gathers, M more for the
    blocks re-gathered before backward (``sync._regathered``'s units: ``reshard_after_forward``)
    — in ``param_bytes`` per element, and its reduced slice down once, in the reduce dtype.
    Inside a pipeline stage (:class:`.stage_zero.StageZero3`: every unit a block, M the
    pipeline's micro-batches) the same: 2M gathers, or one per step without
    ``reshard_after_forward``."""
    units = [u for u in sync.units if getattr(u, "offload", None) is not None]
    k = sum(u.shard_numel for u in units)
    again = sum(u.shard_numel for u in units
                if u in sync.blocks) if sync.reshard_after_forward else 0
    if getattr(sync, "in_stage", False) and not sync.reshard_after_forward:
        micro_steps = 1  # a pipeline stage holds each unit from its first use to the step's end
    reduce_b = sync._rdtype.itemsize
    return {"offload_h2d": float(micro_steps * param_bytes * (k + again)),
            "offload_d2h": float(reduce_b * k)}
