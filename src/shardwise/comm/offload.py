"""Host ↔ device copies booked in the ledger beside the collectives (``--offload``).

A copy is not a collective, but it is traffic the step pays for (PCIe / C2C instead of the
network): one :class:`~.ledger.CommRecord` per copy, op ``"copy"``, axis ``"host"``, group of
one, ``wire_bytes`` = ``size_bytes`` = elements × bytes of the dtype that moves, tag
``offload_d2h`` (gradients to the host) or ``offload_h2d`` (updated parameters back). The
formula is :func:`shardwise.parallel.storage.offload_bytes_formula`. On a CPU-only machine host
= device: the copy still runs and is booked (the same code path).
"""

from __future__ import annotations

import time

import torch

from .ledger import CommRecord

D2H, H2D = "offload_d2h", "offload_h2d"


def host_empty(like: torch.Tensor, dtype: torch.dtype | None = None,
               host: torch.device | str = "cpu") -> torch.Tensor:
    """An empty tensor shaped like ``like`` on ``host``, pinned (page-locked, for fast async
    copies) when ``like`` lives on an accelerator (device type not cpu)."""
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=host,
                       pin_memory=like.device.type != "cpu" and torch.device(host).type == "cpu")


def copy_booked_(dst: torch.Tensor, src: torch.Tensor, topo, tag: str) -> torch.Tensor:
    """``dst.copy_(src)`` booked under ``tag`` (:data:`D2H` | :data:`H2D`) in ``topo``'s ledger
    with ``src.numel() × src.element_size()`` bytes (nothing booked without a topology: the
    single-process reference). Returns ``dst``."""
    t0 = time.perf_counter()
    dst.copy_(src)
    if topo is not None:
        size = src.numel() * src.element_size()
        topo.ledger.add(CommRecord(
            op="copy", axis="host", group_size=1, dtype=str(src.dtype).replace("torch.", ""),
            shape=tuple(src.shape), size_bytes=size, wire_bytes=float(size),
            seconds=time.perf_counter() - t0, phase=topo.ledger.current_phase, tag=tag,
            impl="copy_", issued=t0, note=topo.ledger.current_note))
    return dst
