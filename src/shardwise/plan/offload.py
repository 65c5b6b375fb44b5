"""Offload (train's ``--offload``) in the cost model: which model-state bytes move from the
device to the host (:func:`offload_state`), the host↔device copies of a step
(:func:`offload_copies`) and the optimizer step on the host (:func:`host_step_seconds`).
Derivations and what is assumed: docs/planner.md, "Offload".
"""

from __future__ import annotations

from .comm import Collective
from .hardware import Cluster
from .layout import Assumptions, PlanLayout, Precision


def offload_state(state: dict[str, float], offload: str, prec: Precision,
                  updated: float) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host): the model state one GPU holds in each, from ``state``
    (:func:`~.memory.model_state_bytes`: {"params", "grads", "optimizer"} bytes) and
    ``updated``, the parameters this GPU's optimizer updates (its ZeRO shard; all it holds
    without ZeRO). ``offload`` "none": everything on the device. "optimizer" (ZeRO-Offload,
    Ren et al. 2021 §4; FSDP2's ``CPUOffloadPolicy`` for the optimizer): the optimizer state —
    Adam's m and v, the master copy, the step counters — on the host, and a host copy of the
    reduced gradient shard the step reads (``G·updated``); the parameters and the gradients
    being accumulated stay on the device. "params" (train runs it at ZeRO-3 only,
    :func:`~shardwise.parallel.storage.check_storage`): the parameter share too
    (``state["params"]``: the ZeRO-3 shard) on the host between uses, and the reduced gradient
    shard lives there instead of on the device (``G·updated`` leaves the device's gradients:
    what remains is the full gradients accumulated over micro-batches, if any)."""
    host = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if offload == "none":
        return dict(state), host
    device = {**state, "optimizer": 0.0}
    host.update(optimizer=state["optimizer"], grads=prec.grad * updated)
    if offload == "params":
        host["params"], device["params"] = state["params"], 0.0
        device["grads"] = max(0.0, state["grads"] - host["grads"])
    return device, host


def offload_copies(layout: PlanLayout, prec: Precision, updated: float, held: float, m: int,
                   cluster: Cluster, assume: Assumptions) -> list[Collective]:
    """The host↔device copies of one step on one GPU (axis "host", op "d2h" / "h2d"), each
    ``bytes / (pcie_bandwidth · link_efficiency)`` seconds and counted exposed (not overlapped:
    an upper bound on what they add). ``updated``: parameters this GPU's optimizer updates;
    ``held``: parameters of its share (the ZeRO-3 shard, else all it holds); ``m``:
    micro-batches per step. Offload "optimizer": the gradient shard to the host once per step
    (``G·updated``), the updated parameters back (``P·updated``). "params": the gradient shard
    the same; the parameters stay on the host and their share comes to the device before every
    micro-batch's forward and backward (``2m × P·held``: FSDP2's ``CPUOffloadPolicy`` and
    shardwise's ZeRO-3 copy the shard up before each all-gather; the root unit, gathered once
    per micro-batch, is counted twice: an upper bound), and the reduced gradient shard comes
    down in the reduce dtype (``grad_comm·updated``, once per step: train reduce-scatters once
    per step)."""
    if layout.offload == "none":
        return []
    bw = cluster.gpu.pcie_bandwidth * assume.link_efficiency
    link = f"host link {cluster.gpu.pcie_bandwidth / 1e9:,.0f} GB/s"

    def copy(op, tag, size, count, note):
        sec = size * count / bw
        return Collective("host", op, tag, size, 1, count, size * count, sec, sec, link, note)

    grad_b = prec.grad_comm if layout.offload == "params" else prec.grad
    out = [copy("d2h", "grad", grad_b * updated, 1,
                "the gradient shard to the host optimizer, once per step")]
    if layout.offload == "optimizer":
        out.append(copy("h2d", "param", prec.param * updated, 1,
                        "the updated parameters back to the device, once per step"))
    else:
        out.append(copy("h2d", "param", prec.param * held, 2 * m,
                        "the parameter share to the device before every micro-batch's "
                        "forward and backward"))
    return out


def host_step_seconds(prec: Precision, updated: float, cluster: Cluster) -> float:
    """Seconds of the AdamW step on the host for ``updated`` parameters: memory-bandwidth
    bound, ``adam_bytes`` read and written per parameter (:attr:`Precision.adam_bytes`) over
    this GPU's share of the node's DRAM bandwidth (``host_mem_bw / gpus_per_node``: the node's
    GPUs step at once). A lower bound: the bandwidth is the nominal peak."""
    return prec.adam_bytes * updated / (cluster.host_mem_bw / cluster.gpus_per_node)
