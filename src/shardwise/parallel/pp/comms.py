"""What crosses between pipeline stages, over pp: activations forward on the topology's ``pp``
group, gradients backward on its ``world`` group (:class:`GradTraffic`), so the two kinds never
share a FIFO between a pair of ranks (docs/pipeline-parallel.md §4); the stages' initial
parameters from pp index 0 (:func:`copy_stages_from_first`); the tied-embedding gradient swap
between the first and the last stage (:func:`swap_tied_grads`).

Bytes per step (rank r of p, v chunks, m micro-batches, A = bytes of one activation as sent):
``pp_fwd`` m·A·(v − [r = p−1]), ``pp_bwd`` m·A·(v − [r = 0]) (the V placement:
m·A·(2 − [r = 0] − [r = p−1]) each, :func:`p2p_bytes_formula`); ``tied`` the table shard once
(none under the V placement: rank 0 holds both ends).
Sources: GPipe (Huang et al. 2019) and Megatron-LM (Narayanan et al. 2021 §2.2).
"""

from __future__ import annotations

import torch

from ... import comm
from ..params import grads_or_zeros, local
from .schedules import rank_of, stages_of
from .split import stage_parameter_names


class GradTraffic:
    """The topology with the pp axis's traffic routed over its "world" group (the gradient
    channel), for :mod:`shardwise.comm`: pp sizes and ranks, booked in the same ledger as "pp"."""

    def __init__(self, topo):
        self._topo = topo
        self.ledger = topo.ledger
        self.checks = getattr(topo, "checks", None)  # its messages counted with the pp ones

    def size(self, axis):
        return self._topo.size(axis)

    def group(self, axis):
        return self._topo.group("world" if axis == "pp" else axis)

    def global_rank(self, axis, index):
        return self._topo.global_rank(axis, index)


@torch.no_grad()
def copy_stages_from_first(model: torch.nn.Module, topo, v: int, layers_per_stage=None,
                           placement: str = "loop") -> None:
    """pp index 0 sends every other pp rank its stages' parameters from its own plain ``model``
    (full shapes, before TP; one flat send per rank and dtype, phase and tag ``init``), so the
    stages start as one plain model whatever the ranks' seeds. Each rank receives only what it
    keeps (:func:`.split.stage_parameter_names`): rank 0 sends Ψ minus its own. Collective over
    pp; nothing for pp = 1."""
    p, index = topo.size("pp"), topo.index("pp")
    if p == 1:
        return
    params = dict(model.named_parameters())

    def flat_by_dtype(r):
        by_dtype: dict = {}
        for n in stage_parameter_names(model, r, p, v, layers_per_stage, placement):
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
    """Sum the tied embedding's gradient [V_pad/tp, d] between the first and the last stage
    (each tp index its own shard): the first rank sends then receives, the last receives then
    sends (safe even if sends block until matched); both end with g_first + g_last, bit for bit
    (addition commutes). ``weight``: this rank's copy; a missing gradient counts as zeros. Tag
    ``tied``."""
    (g,) = grads_or_zeros([weight])  # bf16 storage: the fp32 main gradient
    buf = torch.empty_like(g)
    peer = p - 1 if is_first else 0
    if is_first:
        comm.send(g, topo, "pp", peer, tag="tied")
        comm.recv(buf, topo, "pp", peer, tag="tied")
    else:
        comm.recv(buf, topo, "pp", peer, tag="tied")
        comm.send(g, topo, "pp", peer, tag="tied")
    g.add_(buf)


def p2p_bytes_formula(pp_index: int, p: int, v: int, m: int, act_bytes: int,
                      placement: str = "loop") -> dict[str, int]:
    """``{"pp_fwd": m·A·n_fwd, "pp_bwd": m·A·n_bwd}`` bytes for rank ``pp_index`` of p, A =
    ``act_bytes`` of one activation [b, s, d]: every stage sends its output once per microbatch
    to the next stage's rank and its input gradient to the previous one's, except across no
    boundary (the first stage has no previous, the last no next) and to itself (the V's stages
    p−1 and p on rank p−1). Loop placement: n_fwd = v − [r = p−1], n_bwd = v − [r = 0]; V:
    n_fwd = n_bwd = 2 − [r = 0] − [r = p−1]. Unequal microbatches: pass m = 1 and
    ``act_bytes`` = Σ_b A_b."""
    n_stages, fwd, bwd = p * v, 0, 0
    for s in stages_of(pp_index, p, v, placement):
        fwd += s < n_stages - 1 and rank_of(s + 1, p, placement) != pp_index
        bwd += s > 0 and rank_of(s - 1, p, placement) != pp_index
    return {"pp_fwd": m * act_bytes * fwd, "pp_bwd": m * act_bytes * bwd}


class TiedSwap:
    """The tied-embedding finisher of a pipeline (p > 1, a tied Llama): the first stage's
    ``tok_embeddings.weight`` and the last stage's own copy (:attr:`.split.StageModule.
    tied_output`) start equal (:meth:`copy_initial`, the first rank sends its shard, tag and
    phase ``init``) and, after every backward, hold the sum of both gradients
    (:func:`swap_tied_grads`, tag ``tied``). ``active``: whether this rank takes part (it holds
    the first or the last stage of a tied model, not both: under the V placement rank 0 holds
    both and the one parameter gathers both gradients itself); a finisher that does nothing
    elsewhere."""

    def __init__(self, stage, topo):
        self.topo, self.p = topo, topo.size("pp")
        self.is_first = stage.holds_embedding
        self.active = bool(stage.tied and self.p > 1
                           and stage.holds_embedding != stage.holds_head)
        self.weight = (stage.tok_embeddings.weight if self.is_first else stage.tied_output) \
            if self.active else None
        self.elem = local(next(iter(stage.parameters()))).element_size()

    @torch.no_grad()
    def copy_initial(self) -> None:
        """The last stage's copy := the first stage's table shard (a send over pp)."""
        if not self.active:
            return
        with self.topo.ledger.phase("init"):
            if self.is_first:
                comm.send(local(self.weight.data), self.topo, "pp", self.p - 1, tag="init")
            else:
                comm.recv(local(self.weight.data), self.topo, "pp", 0, tag="init")

    def __call__(self) -> None:
        if self.active:
            swap_tied_grads(self.weight, self.topo, self.is_first, self.p)

    def bytes_formula(self) -> dict[str, float]:
        """``tied``: the table shard's gradient [V_pad/tp, d] once (0 on the other stages)."""
        return {"tied": float(local(self.weight).numel() * self.elem) if self.active else 0.0}
