"""Expert parallelism (EP): each of ``ep`` ranks of the data axis holds E/ep of every MoE
layer's experts, and the tokens travel to their experts and back by all-to-all.

Why EP rides on the data axes (Megatron-Core, torchtitan; "EP ⊆ dp × cp"): the ranks of the
data axis already hold *different tokens* and identical dense weights, so splitting the experts
among them costs no extra ranks, and every expert still sees tokens from all of them. The ep
ranks of one group are consecutive on the data line (``topo.group("ep")``); the dp·cp/ep ranks
that hold the *same* experts form the expert-data-parallel group ("edp"), over which expert
gradients are summed — dense gradients are summed over the whole data axis, as without EP.

One MoE layer's forward on rank i of an ep group (:class:`~.dispatch.AllToAllDispatcher`):

1. the router's copies sorted by expert give ``counts[E]``; as ``[ep, E/ep]`` its row j is what
   this rank sends to rank j's local experts. An even all-to-all of these counts (E int64, tag
   ``ep_counts``) tells each rank what it will receive: ``recv[j, l]``.
2. dispatch: ``all_to_all_single`` of the token rows with uneven splits (rows to rank j:
   Σ_l counts[j, l]; tag ``ep_dispatch``); the received rows are regrouped by local expert.
3. the local experts compute (a loop per expert; a grouped GEMM on GPU where available).
4. combine: the reverse all-to-all of the expert outputs (tag ``ep_combine``); the MoE layer
   weights and sums them per token as without EP.

Backward mirrors both token all-to-alls (the gradient of a dispatch is a combine-shaped
all-to-all and vice versa; booked under the same tags). Bytes this rank sends per layer and
micro-batch, with ``S_i`` = rows it sends to others and ``R_i`` = rows it receives from others
(d_model · 4 bytes each, fp32 activations; the combine's rows are the expert outputs, 2 bytes
per element under bf16 autocast): dispatch S_i + combine R_i forward, and R_i + S_i backward,
i.e. 2·(S_i + R_i)·d·4, plus (ep−1)/ep · E · 8 for the counts
(:func:`ep_bytes_formula`: from the step's *actual* routing, so the ledger equals it every
step, however skewed the routing). Uniform routing makes S_i = R_i = (ep−1)/ep · T·k.

With TP (no SP) the MoE layer's input is replicated over tp: every tp rank routes the same
tokens and runs its own ep exchange with the ranks of its tp index; the experts are whole on
each rank (not tp-split) and their gradients equal on the tp ranks. Pitfalls this guards
against: docs/expert-parallel.md.

From learn/ (no script has an all-to-all yet: the nearest ideas, and docs/expert-parallel.md):

* ``learn/collectives.py`` builds collectives from ``dist.isend`` / ``dist.recv`` → so does
  :func:`shardwise.comm.algorithms.pairwise.all_to_all_v` (under ``--collectives ring``); EP
  calls :func:`shardwise.comm.all_to_all_v`
* the router's counts, dispatch and combine (docs §4) → :class:`~.dispatch.AllToAllDispatcher`;
  each token all-to-all is a :class:`~.dispatch._AllToAllV` (backward: the reverse all-to-all)
* E/ep experts per rank (docs §3) → :func:`parallelize_experts`, :func:`~..params.mark_ep_shard`
* ``learn/dp.py``'s ``dist.all_reduce(flat)`` over every rank → expert gradients summed over
  "edp" only: :class:`~..dp.data_parallel.GradSync`, one reduction per axis
* bytes from the step's actual routing (docs §4) → :func:`ep_bytes_formula`
"""

from __future__ import annotations

from torch import nn

from ...errors import ShardwiseConfigError
from ...topology import check_ep_degree
from ..params import mark_ep_shard


def is_moe_model(cfg) -> bool:
    """Whether model config ``cfg`` has mixture-of-experts layers (an ``n_experts`` field)."""
    return getattr(cfg, "n_experts", None) is not None


def check_experts_split(ep: int, n_experts: int, data_ranks: int, *, model: str = "",
                        fix: str = " or change --n-experts") -> None:
    """E/ep experts per rank, the rule written once (:func:`validate_ep`, the engine's, and
    ``shardwise.plan.layout.check_ep``, the planner's): raise :class:`ShardwiseConfigError`
    unless ``ep`` divides ``n_experts``. The message offers the ep that divide both n_experts
    and ``data_ranks`` (dp × cp); ``model`` names the model in it (the planner's presets),
    ``fix`` ends it (the engine's config has ``--n-experts``; the planner's presets do not)."""
    if n_experts % ep:
        named = f" ({model})" if model else ""
        ok = [k for k in range(1, n_experts + 1) if n_experts % k == 0 and data_ranks % k == 0]
        raise ShardwiseConfigError(
            f"--ep {ep} must divide n_experts = {n_experts}{named}: each rank holds "
            f"n_experts / ep experts; choose --ep from {ok}{fix}")


def validate_ep(cfg, ep: int, dp: int = 1, cp: int = 1, *, engine: str = "explicit",
                sp: bool = False, tp: int = 1, pp: int = 1) -> None:
    """Raise :class:`ShardwiseConfigError` (no collective) unless ``ep`` expert-parallel ranks
    can run: ep ≥ 1 dividing dp × cp; with ep > 1 the explicit engine (PyTorch core has no
    expert-parallel module) and an MoE model (``cfg`` None: the model checks are skipped)
    whose ``n_experts`` ep divides. An MoE model with sequence parallelism or cp > 1 is refused
    (a sequence split over ranks would need its routing counts reduced for the per-sequence
    balance loss: not wired), and on the torch engine with tp > 1 (DTensor's
    ``parallelize_module`` has no plan for a router and stacked experts; pp > 1:
    :func:`~..pp.split.validate_pp_moe`)."""
    check_ep_degree(ep, dp, cp)
    if ep > 1 and engine != "explicit":
        raise ShardwiseConfigError(
            f"--engine {engine} --ep {ep}: PyTorch core has no expert-parallel module (no "
            "token all-to-all in torch.distributed's parallel APIs); use --engine explicit, "
            "or --ep 1 to run the MoE model replicated")
    if cfg is None:
        return
    moe = is_moe_model(cfg)
    if ep > 1 and not moe:
        raise ShardwiseConfigError(
            f"--ep {ep} needs a mixture-of-experts model (there are no experts to split): "
            "choose --model moe-tiny or moe-small, or drop --ep")
    if moe:
        check_experts_split(ep, cfg.n_experts, dp * cp)
    if moe and engine != "explicit" and tp > 1:  # (pp: :func:`..pp.split.validate_pp_moe`)
        raise ShardwiseConfigError(
            f"--engine {engine} --tp {tp} with a mixture-of-experts model: DTensor's "
            "parallelize_module has no plan for the router and the stacked experts; use "
            "--engine explicit (the torch engine runs an MoE model over dp / ZeRO / FSDP2)")
    if moe and (sp or cp > 1):
        what = "--sp" if sp else f"--cp {cp}"
        raise ShardwiseConfigError(
            f"a mixture-of-experts model with {what}: a sequence split over ranks would need "
            "its routing counts summed for the per-sequence balance loss, which is not wired; "
            f"drop {what} (tp without sp, dp, pp and ep compose with MoE)")


def parallelize_experts(model: nn.Module, topo) -> nn.Module:
    """Expert parallelism over ``topo``'s "ep" axis, in place: every MoE layer keeps experts
    ``[i·E/ep, (i+1)·E/ep)`` (i = this rank's ep index; ``experts.w1``/``w3`` [E/ep, f, d],
    ``w2`` [E/ep, d, f], marked as ep shards on dim 0) and dispatches through
    :class:`~.dispatch.AllToAllDispatcher`. Returns ``model``. No collective here."""
    from ...models.moe import moe_layers
    from .dispatch import AllToAllDispatcher

    ep, i = topo.size("ep"), topo.index("ep")
    for m in moe_layers(model):
        per = m.n_experts // ep
        for name in ("w1", "w2", "w3"):
            full = getattr(m.experts, name)
            part = nn.Parameter(full.detach()[i * per:(i + 1) * per].clone(),
                                requires_grad=full.requires_grad)
            setattr(m.experts, name, mark_ep_shard(part, m.n_experts))
        m.dispatcher = AllToAllDispatcher(topo, m.n_experts)
    return model


def ep_bytes_formula(module: nn.Module, topo) -> dict[str, float]:
    """{"ep_counts", "ep_dispatch", "ep_combine": bytes} this rank sends in the step just run,
    from the routing its MoE layers recorded (every forward that was not a recompute): per
    layer and micro-batch, counts (ep−1)/ep · E · 8; dispatch S·row forward + R·row backward,
    combine R·row forward + S·row backward, with S the rows this rank addressed to other ranks
    (its router's counts for the experts it does not hold), R the rows the others addressed to
    it, and row = d_model × the element size (the dispatched activations' dtype; the expert
    outputs', bf16 under autocast, for the combine). {} without expert parallelism."""
    from ...models.moe import moe_layers

    if topo is None or topo.size("ep") == 1:
        return {}
    ep, i = topo.size("ep"), topo.index("ep")
    out = {"ep_counts": 0.0, "ep_dispatch": 0.0, "ep_combine": 0.0}
    for m in moe_layers(module):
        for rec in m.dispatcher.records:
            per = m.n_experts // ep
            send = [sum(rec["counts"][j * per:(j + 1) * per]) for j in range(ep)]
            s_rows = sum(send) - send[i]
            r_rows = sum(rec["received"]) - rec["received"][i]
            out["ep_counts"] += (ep - 1) / ep * m.n_experts * 8
            out["ep_dispatch"] += (s_rows + r_rows) * rec["row_bytes"]
            out["ep_combine"] += (r_rows + s_rows) * rec["combine_row_bytes"]
    return out


def split_matrix(module: nn.Module) -> list[list[list[int]]]:
    """Per MoE layer of ``module``, the rows this rank sent to each ep rank in the step, summed
    over micro-batches (its row of the all-to-all's split matrix; [] without EP)."""
    from ...models.moe import moe_layers

    out = []
    for m in moe_layers(module):
        recs = getattr(m.dispatcher, "records", None)
        if recs is None:
            return []
        ep = m.dispatcher.ep
        per = m.n_experts // ep
        out.append([sum(sum(r["counts"][j * per:(j + 1) * per]) for r in recs)
                    for j in range(ep)])
    return out


__all__ = ["check_experts_split", "ep_bytes_formula", "is_moe_model", "parallelize_experts",
           "split_matrix", "validate_ep"]
