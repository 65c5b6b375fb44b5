"""What crosses between pipeline stages: the two point-to-point channels, the tied-embedding
gradient swap, and the bytes both send.

* Activations travel forward on the topology's ``pp`` process group, gradients backward on its
  ``world`` group (:class:`GradTraffic`, booked as axis "pp"), so the two kinds never share a
  FIFO between a pair of ranks (needed for interleaving with pp = 2 and for NCCL; no group of our
  own: docs/pipeline-parallel.md §4 says why).
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
