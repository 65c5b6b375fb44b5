"""What crosses between pipeline stages: the two point-to-point channels, the tied-embedding
gradient swap, and the bytes both send.

* Activations travel forward on the topology's ``pp`` process group, gradients backward on its
  ``world`` group (:class:`GradTraffic`, booked as axis "pp"), so the two kinds never share a
  FIFO between a pair of ranks (needed for interleaving with pp = 2 and for NCCL; no group of our
  own: docs/pipeline-parallel.md §4 says why).
* At construction, pp index 0 sends every other rank its stages' parameters
  (:func:`copy_stages_from_first`), so the stages start as one model whatever the ranks' seeds.
* Tied embeddings across stages: the first and the last stage each hold a copy of the table
  (:mod:`.split`); after backward they swap their gradients so both apply g_first + g_last.

Bytes per step (rank r of p, v chunks, m micro-batches, A = bytes of one activation as sent):
forward ``m·A·(v − [r = p−1])`` (tag ``pp_fwd``), backward ``m·A·(v − [r = 0])`` (``pp_bwd``);
the swap sends the table shard once (``tied``). Sources: GPipe (Huang et al. 2019) and
Megatron-LM (Narayanan et al. 2021 §2.2) for the point-to-point pattern.
"""

from __future__ import annotations

import torch

from ... import comm
from ..params import local
from .split import stage_parameter_names


class GradTraffic:
    """The topology with the pp axis's point-to-point traffic routed over its "world" process
    group (the gradient channel: every rank of the layout, so it holds the pp peers).
    Duck-types what :mod:`shardwise.comm` needs: sizes and global ranks are the pp axis's,
    records go to the same ledger as axis "pp"."""

    def __init__(self, topo):
        self._topo = topo
        self.ledger = topo.ledger

    def size(self, axis):
        return self._topo.size(axis)

    def group(self, axis):
        return self._topo.group("world" if axis == "pp" else axis)

    def global_rank(self, axis, index):
        return self._topo.global_rank(axis, index)


@torch.no_grad()
def copy_stages_from_first(model: torch.nn.Module, topo, v: int, layers_per_stage=None) -> None:
    """pp index 0 sends every other pp rank its stages' parameters from its own plain ``model``
    (full shapes, before TP; one flat send per rank and dtype, phase and tag ``init``), so the
    stages start as one plain model even when the ranks' seeds differ — as DP broadcasts from dp
    index 0 and TP from tp index 0; with those, every layout starts from world rank 0's model.
    Each rank receives only what it keeps (:func:`.split.stage_parameter_names` with ``v``
    chunks per rank and ``layers_per_stage``): rank 0 sends Ψ minus its own. A tied
    embedding's copy on the last rank follows from the first rank's (the ``init`` send after
    this). Collective over pp; nothing for pp = 1."""
    p, index = topo.size("pp"), topo.index("pp")
    if p == 1:
        return
    params = dict(model.named_parameters())

    def flat_by_dtype(r):
        by_dtype: dict = {}
        for n in stage_parameter_names(model, r, p, v, layers_per_stage):
            by_dtype.setdefault(params[n].dtype, []).append(params[n].data)
        return by_dtype.values()

    with topo.ledger.phase("init"):
        if index == 0:
            for r in range(1, p):
                for group in flat_by_dtype(r):
                    comm.send(torch.cat([t.reshape(-1) for t in group]), topo, "pp", r,
                              tag="init")
            return
        for group in flat_by_dtype(index):
            flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype,
                               device=group[0].device)
            comm.recv(flat, topo, "pp", 0, tag="init")
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view_as(t))


@torch.no_grad()
def swap_tied_grads(weight: torch.nn.Parameter, topo, is_first: bool, p: int) -> None:
    """Sum the tied embedding's gradient between the first and the last stage (each tp index
    with its own shard, [V_pad/tp, d]): the first rank sends then receives, the last receives
    then sends (safe even if sends block until matched); both end with g_first + g_last
    (addition commutes exactly). ``weight``: this rank's copy (first: the embedding, last: the
    head's); a missing gradient counts as zeros. Tag ``tied``."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    g = local(weight.grad)
    buf = torch.empty_like(g)
    peer = p - 1 if is_first else 0
    if is_first:
        comm.send(g, topo, "pp", peer, tag="tied")
        comm.recv(buf, topo, "pp", peer, tag="tied")
    else:
        comm.recv(buf, topo, "pp", peer, tag="tied")
        comm.send(g, topo, "pp", peer, tag="tied")
    g.add_(buf)


def p2p_bytes_formula(pp_index: int, p: int, v: int, m: int, act_bytes: int) -> dict[str, int]:
    """Bytes this pp rank sends per step through point-to-point activations and gradients:
    ``{"pp_fwd": m·A·(v − [r = p−1]), "pp_bwd": m·A·(v − [r = 0])}`` for p > 1, A = bytes of one
    activation [b, s, d]. Every stage except the last sends its output once per microbatch, every
    stage except the first its input gradient (GPipe/1F1B/ZB-H1: v = 1; interleaving: each of the
    v chunks on a rank is a stage). Microbatches of unequal rows: m·A becomes Σ_b A_b; pass
    m = 1 and ``act_bytes`` = that sum."""
    if p == 1:
        return {"pp_fwd": 0, "pp_bwd": 0}
    return {"pp_fwd": m * act_bytes * (v - (pp_index == p - 1)),
            "pp_bwd": m * act_bytes * (v - (pp_index == 0))}
