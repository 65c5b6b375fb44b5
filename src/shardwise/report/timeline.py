"""The pipeline's action timestamps of one step, gathered from every rank of the pp line: what
the run record (:mod:`shardwise.report.record`), ``shardwise trace`` and the pipeline benchmark
draw and measure the bubble from (:mod:`shardwise.viz.timeline`).
"""

from __future__ import annotations

import torch

from .. import comm
from ..parallel.pp import KINDS, Event


def gather_timeline(engine, topo) -> list:
    """Every pp rank's action timestamps of ``engine``'s last step, on every rank of the pp
    line, as :class:`~shardwise.parallel.pp.Event` s with times in seconds from the earliest start.

    Collective over "pp" (call it on every rank of the line): one all_reduce(max) of the row
    count and one all_gather of [rows, 6] fp64 (kind, microbatch, chunk, peer, start, end),
    booked in phase "trace". Timestamps are ``time.time()``: one host's clock is shared by its
    processes; across hosts they are only as aligned as the hosts' clocks."""
    kinds = KINDS + ("STEP",)
    rows = torch.tensor([[kinds.index(k), mb, c, peer, t0, t1]
                         for k, mb, c, peer, t0, t1 in engine.timeline],
                        dtype=torch.float64).reshape(-1, 6)
    device = next(engine.module.parameters()).device
    n = torch.tensor([float(len(rows))], dtype=torch.float64, device=device)
    p = topo.size("pp")
    with topo.ledger.phase("trace"):
        comm.all_reduce(n, topo, "pp", op="max", tag="trace")
        n = int(n.item())
        mine = torch.full((n, 6), -1.0, dtype=torch.float64)
        mine[: len(rows)] = rows
        mine = mine.to(device)
        everyone = torch.empty((p * n, 6), dtype=torch.float64, device=device)
        comm.all_gather(everyone, mine, topo, "pp", tag="trace")
    everyone = everyone.cpu()
    valid = everyone[:, 0] >= 0
    t_min = float(everyone[valid, 4].min()) if valid.any() else 0.0
    events = []
    for i, (k, mb, c, peer, t0, t1) in enumerate(everyone.tolist()):
        if k < 0:
            continue
        events.append(Event(rank=i // n, kind=kinds[int(k)], microbatch=int(mb), chunk=int(c),
                            start=t0 - t_min, end=t1 - t_min,
                            peer=None if peer < 0 else int(peer)))
    return events
