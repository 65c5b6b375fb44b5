"""What ``--optimizer muon`` adds to a planned layout: the bytes its Newton–Schulz gathers send and
the FLOPs Newton–Schulz runs, per GPU per step (:mod:`shardwise.parallel.muon`'s formula, on a
:class:`~.models.ModelSpec` instead of a built model).

Per GPU of layout (dp, tp, pp, zero, ep) with Ψ_M the hidden-matrix elements of its stage (L/pp
blocks; an MoE block's experts ÷ ep, whole on their ep rank):

* dp (ZeRO ≥ 1, over the shard group n = dp_shard·cp): 8·(n−1)/n² · Ψ_M/t — the owner exchange
  (docs/optimizers.md §5) when every matrix is cut over all n slices, each holder sending its
  piece of U and getting O's back, averaged over the ranks: the most it can send (matrices that
  fit in one slice send nothing; the all-gather scheme would send (n−1)/n · 4Ψ_M/t);
* tp (t > 1): (t−1)/t · 4Ψ_M, or ÷ n under ZeRO (only the matrices this GPU holds a piece of);
* NS FLOPs: Σ 5·(4m²M + 2m³) over the matrices this GPU orthogonalises (every one of its stage,
  redundantly over tp; under ZeRO those it holds a piece of, ≈ 1/n of them).

Sources: Liu et al., "Muon is Scalable for LLM Training" (arXiv 2502.16982) §2 "Distributed
Muon"; the NS cost: :func:`shardwise.parallel.muon.ns_flops`.
"""

from __future__ import annotations

from ..parallel.muon import ns_flops
from .models import ModelSpec


def hidden_matrices(model: ModelSpec, moe: bool) -> list[tuple[int, int, int, bool]]:
    """``[(count, A, B, routed expert)]`` of one block's hidden matrices: wq [H·hd, d], wk, wv
    [k·hd, d], wo [d, H·hd], the MLP's (2 or 3) [f, d]; an MoE block: each routed expert's MLP
    (E of them, f_e; split over ep), the shared experts' and the router [E, d] instead."""
    d, q, kv = model.d_model, model.n_heads * model.head_dim, model.kv_dim
    out = [(1, q, d, False), (2, kv, d, False), (1, d, q, False)]
    if moe:
        m, f = model.n_mlp_mats, model.expert_ff
        out += [(model.n_experts * m, f, d, True), (model.n_shared_experts * m, f, d, False),
                (1, model.n_experts, d, False)]
    else:
        out.append((model.n_mlp_mats, model.d_ff, d, False))
    return [x for x in out if x[0]]


def muon_cost(model: ModelSpec, layout) -> dict[str, float]:
    """{"dp", "tp": bytes per GPU per step, "ns_flops": FLOPs per GPU per step, "matrix_elems":
    Ψ_M of a stage} for ``layout`` (a :class:`~.layout.PlanLayout`), module docstring."""
    per_stage = model.n_layers / layout.pp
    moe_share = model.n_moe_layers / model.n_layers
    psi = flops = 0.0
    for moe, share in ((False, 1 - moe_share), (True, moe_share)):
        if share <= 0:
            continue
        for count, a, b, routed in hidden_matrices(model, moe):
            k = count * per_stage * share / (layout.ep if routed else 1)
            psi += k * a * b
            flops += k * ns_flops((a, b))
    t, n = layout.tp, (layout.dp_shard * layout.cp if layout.zero >= 1 else 1)
    held = psi / n  # the matrices this GPU holds a piece of (under ZeRO ≈ 1/n)
    return {"dp": 8 * (n - 1) / n ** 2 * psi / t if n > 1 else 0.0,
            "tp": (t - 1) / t * 4 * held if t > 1 else 0.0,
            "ns_flops": flops / n, "matrix_elems": psi}
