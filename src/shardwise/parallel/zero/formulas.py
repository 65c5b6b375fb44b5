"""ZeRO's formulas and its refusals, as pure functions: model-state bytes per rank (ZeRO paper
§5.1–5.3, Figure 1), bytes sent per step (§7.1–7.2, JAX scaling book ch. 5), the same for a
:class:`~.zero.ZeroSync`'s flat units (:func:`units_memory_formula`,
:func:`units_step_bytes_formula`), and the stages and optimizers that can be sharded.
"""

from __future__ import annotations

import torch

from ...errors import ShardwiseConfigError
from ..master import MasterAdamW


STAGES = (1, 2, 3)
# Optimizers whose update of an element depends only on that element's own history: they can run
# on any slice of the flat buffer. Optimizers that need whole tensors (LAMB/LARS trust ratios,
# Adafactor's factored moments, Shampoo/Muon's matrix preconditioners) cannot.
SHARDABLE_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
                        "sgd": torch.optim.SGD, "masteradamw": MasterAdamW}


# -- formulas -------------------------------------------------------------------------------------
def zero_memory_formula(stage: int, psi: float, n: int, bytes_param: float = 4,
                        bytes_grad: float = 4, bytes_optim: float = 8) -> dict[str, float]:
    """Model-state bytes one rank holds at ZeRO ``stage`` (0 = plain DP) with ``psi`` parameters
    over ``n`` dp ranks: ``{"params", "grads", "optimizer", "total"}`` (bytes, float).

    Defaults are fp32 AdamW (4 + 4 + 8 bytes per parameter); pass 2, 2, 12 for the paper's mixed
    precision (ZeRO paper §3.1 and Figure 1: 2Ψ + 2Ψ + KΨ, K = 12). Stage s divides the first s of
    (optimizer, gradients, parameters) by n (§5.1–5.3). Raises ``ValueError`` for a bad stage.
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")
    out = {"params": bytes_param * psi / (n if stage >= 3 else 1),
           "grads": bytes_grad * psi / (n if stage >= 2 else 1),
           "optimizer": bytes_optim * psi / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_step_bytes_formula(stage: int, psi: float, n: int, bytes_per_elem: float = 4, *,
                            micro_steps: int = 1, regathered: float | None = None,
                            grad_bytes_per_elem: float | None = None) -> dict[str, float]:
    """Bytes one rank sends per optimizer step for the ZeRO ``stage`` (0 = DP), by ledger tag.

    ``psi``: elements that travel, i.e. Σ over units of the *padded* unit size ⌈Ψ_u/n⌉·n (the flat
    buffers travel whole; pass the plain Ψ for the paper's number). ``bytes_per_elem``: 4 for fp32.
    Returns ``{"grad", "param", "grad_norm", "total"}``:

    * ``grad``: stage 0: all_reduce of the gradients, 2(n−1)/n·Ψb; stages 1–3: one
      reduce_scatter, (n−1)/n·Ψb (once per step, whatever ``micro_steps``). Here b is
      ``grad_bytes_per_elem`` when given (the reduce dtype: 2 for bf16), else ``bytes_per_elem``.
    * ``param``: stages 1–2: one all_gather of the updated parameters after the optimizer step,
      (n−1)/n·Ψb. Stage 3: per micro-step, an all_gather of every unit before its forward and of
      ``regathered`` elements again before their backward: micro_steps·(n−1)/n·(Ψ + regathered)·b.
      ``regathered`` defaults to Ψ (the paper's 3Ψ; ZeRO paper §7.2.2); with an un-freed root unit
      it is Ψ − Ψ_root, with ``reshard_after_forward=False`` it is 0.
    * ``grad_norm``: stages 1–3: one all_reduce of one fp64 scalar (Σ g² of the local gradient
      shards): 2(n−1)/n·8. Stage 0 needs none (replicated gradients).

    Not counted: the two fp64 loss-bookkeeping all_reduces of ``train_step`` (tag ``loss``:
    token count and loss sum, 2(n−1)/n·8 each) and the init broadcast (phase ``init``).
    Raises ``ValueError`` for a bad stage.
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")
    f = (n - 1) / n if n > 1 else 0.0
    gb = bytes_per_elem if grad_bytes_per_elem is None else grad_bytes_per_elem
    if stage == 0:
        out = {"grad": 2 * f * psi * gb, "param": 0.0, "grad_norm": 0.0}
    else:
        if stage < 3:
            param = f * psi * bytes_per_elem
        else:
            again = psi if regathered is None else regathered
            param = micro_steps * f * (psi + again) * bytes_per_elem
        out = {"grad": f * psi * gb, "param": param, "grad_norm": 2 * f * 8}
    out["total"] = out["grad"] + out["param"] + out["grad_norm"]
    return out


def zero_ep_memory_formula(stage: int, psi: float, n: int, psi_experts: float, n_experts: int,
                           bytes_param: float = 4, bytes_grad: float = 4,
                           bytes_optim: float = 8) -> dict[str, float]:
    """:func:`zero_memory_formula` of a model under expert parallelism, per rank: ``psi`` dense
    parameters sharded over the ``n`` ranks of the data axis, plus ``psi_experts`` elements of
    this rank's E/ep experts sharded over the ``n_experts`` = dp·cp/ep ranks that hold the same
    experts ("edp"), each part by the ZeRO paper's rule (§5.1–5.3), summed key by key. E.g.
    ZeRO-3: (16·Ψ_dense)/n + (16·Ψ_experts)/n_e. Raises ``ValueError`` for a bad stage."""
    dense = zero_memory_formula(stage, psi, n, bytes_param, bytes_grad, bytes_optim)
    experts = zero_memory_formula(stage, psi_experts, n_experts, bytes_param, bytes_grad,
                                  bytes_optim)
    return {k: dense[k] + experts[k] for k in dense}


def zero_ep_step_bytes_formula(stage: int, psi: float, n: int, psi_experts: float,
                               n_experts: int, bytes_per_elem: float = 4, *,
                               micro_steps: int = 1, regathered: float | None = None,
                               regathered_experts: float | None = None,
                               grad_bytes_per_elem: float | None = None) -> dict[str, float]:
    """:func:`zero_step_bytes_formula` of a model under expert parallelism: the dense part
    (``psi`` padded elements over the ``n`` ranks of the data axis, ``regathered`` of them
    gathered again for backward) plus the expert part (``psi_experts`` padded elements of this
    rank's experts over the ``n_experts`` ranks of "edp", ``regathered_experts``), ``grad``
    and ``param`` summed; ``grad_norm`` is the dense part's alone (one fp64 scalar all-reduce
    over the data axis counts the expert slices too). With ``psi_experts`` = 0 this is
    :func:`zero_step_bytes_formula`. Raises ``ValueError`` for a bad stage."""
    kw = dict(micro_steps=micro_steps, grad_bytes_per_elem=grad_bytes_per_elem)
    out = zero_step_bytes_formula(stage, psi, n, bytes_per_elem, regathered=regathered, **kw)
    if psi_experts:
        experts = zero_step_bytes_formula(stage, psi_experts, n_experts, bytes_per_elem,
                                          regathered=regathered_experts, **kw)
        for k in ("grad", "param"):
            out[k] += experts[k]
        out["total"] = out["grad"] + out["param"] + out["grad_norm"]
    return out


def hsdp_replicate_bytes(psi: float, shard: int, replicate: int,
                         bytes_per_elem: float = 4) -> float:
    """Bytes one rank sends per step in HSDP's cross-replica all-reduce: its 1/S shard of the
    ``psi`` (padded) gradient elements, summed over the R = ``replicate`` replicas:
    2(R−1)/R · Ψb/S (ring all-reduce; PyTorch FSDP paper, Zhao et al. 2023, §3.2.3). Together
    with the reduce-scatter within the shard group, (S−1)/S·Ψb, a rank sends
    Ψb·((S−1)/S + 2(R−1)/(R·S)) for its gradients — the same total as an all-reduce over all
    R·S ranks when the groups are equal, but only the Ψb·2(R−1)/(R·S) part crosses between
    replicas (the inter-node links when a shard group is one node)."""
    return 2 * (replicate - 1) / replicate * psi * bytes_per_elem / shard  # R = 1: 0.0

def psi_by_axis(units, padded: bool) -> dict[str, tuple[float, int]]:
    """{axis: (Ψ of its units, elements; padded: Σ P_u), its size n} of flat ``units``
    (:class:`.flat.FlatShards`)."""
    out: dict[str, tuple[float, int]] = {}
    for u in units:
        psi, n = out.get(u.axis, (0, u.n))
        out[u.axis] = (psi + (u.padded if padded else u.numel), n)
    return out


def units_memory_formula(stage: int, units, shard_axis: str, n: int,
                         muon: int = 0) -> dict[str, float]:
    """:func:`zero_memory_formula` for a ZeRO ``stage`` over flat ``units``, Ψ their elements,
    over the ``n`` ranks of ``shard_axis`` (fp32 AdamW; ``muon``: elements of Muon's matrices,
    which keep one b-byte momentum buffer instead of AdamW's two moments); with expert
    parallelism the sum of the dense part (n = dp·cp) and the expert part (Ψ of this rank's
    experts, n = edp): :func:`zero_ep_memory_formula`."""
    b = units[0].full.element_size()
    parts = psi_by_axis(units, padded=False)
    if set(parts) <= {shard_axis}:  # (HSDP: n = dp_shard)
        numel = sum(u.numel for u in units)
        return zero_memory_formula(stage, numel, n, bytes_param=b,
                                   bytes_grad=b, bytes_optim=2 * b - b * muon / numel)
    dense, _ = parts.get(shard_axis, (0, n))
    experts, n_e = parts["edp"]
    return zero_ep_memory_formula(stage, dense, n, experts, n_e, bytes_param=b,
                                  bytes_grad=b, bytes_optim=2 * b)


def units_step_bytes_formula(stage: int, units, topo, n: int, grad_b: int, *,
                             micro_steps: int = 1, regathered: float | None = None,
                             regathered_experts: float | None = None) -> dict[str, float]:
    """:func:`zero_ep_step_bytes_formula` for a ZeRO ``stage`` over flat ``units`` (padded Ψ per
    axis; the dense part over the ``n`` ranks of ``topo``'s shard axis, experts over "edp"),
    ``grad_b`` bytes per element of the gradient reduce_scatter, ``regathered`` /
    ``regathered_experts`` the elements ZeRO-3 gathers a second time for backward; with HSDP
    the ``grad_replicate`` all-reduce of each rank's 1/S shard (:func:`hsdp_replicate_bytes`),
    added to ``total``."""
    parts = psi_by_axis(units, padded=True)
    dense, _ = parts.get(topo.shard_axis, (0, n))
    experts, n_e = parts.get("edp", (0, 1))
    out = zero_ep_step_bytes_formula(
        stage, dense, n, experts, n_e, units[0].full.element_size(),
        micro_steps=micro_steps, regathered=regathered,
        regathered_experts=regathered_experts, grad_bytes_per_elem=grad_b)
    for rep in dict.fromkeys(u.replicate_axis for u in units if u.replicate_axis):
        # HSDP: each rank's 1/S shard of the gradients of the units over those replicas
        psi = sum(u.padded for u in units if u.replicate_axis == rep)
        out["grad_replicate"] = hsdp_replicate_bytes(psi, n, topo.size(rep), grad_b)
        out["total"] += out["grad_replicate"]
    return out



def validate_zero(zero: int, dp: int, *, optimizer="adamw", engine: str = "explicit") -> None:
    """Raise :class:`ShardwiseConfigError` unless ZeRO ``zero`` can run over ``dp`` ranks with
    ``optimizer`` (a name such as ``"adamw"`` or a ``torch.optim.Optimizer`` subclass).

    ``zero=0`` (plain DP) always passes. Called before any collective."""
    if zero not in (0, *STAGES):
        raise ShardwiseConfigError(f"--zero {zero}: choose 0 (plain DP), 1, 2 or 3")
    if zero == 0:
        return
    if not isinstance(dp, int) or dp < 2:
        raise ShardwiseConfigError(
            f"--zero {zero} shards the model state over the dp ranks, but dp={dp}: there is "
            f"nothing to shard over. Use --dp 2 or more, or --zero 0")
    if engine not in ("explicit", "torch"):
        raise ShardwiseConfigError(f"--engine {engine!r}: choose explicit or torch")
    name = optimizer.__name__ if isinstance(optimizer, type) else str(optimizer)
    cls = SHARDABLE_OPTIMIZERS.get(name.lower())
    if cls is None or (isinstance(optimizer, type) and optimizer is not cls):
        raise ShardwiseConfigError(
            f"--zero {zero} with optimizer {name!r}: ZeRO shards the optimizer state element by "
            f"element, which needs an element-wise optimizer (one whose update of an element "
            f"depends on that element alone); {name!r} is not one we can shard. Choose "
            f"{' / '.join(SHARDABLE_OPTIMIZERS)} (shardwise trains with adamw), or use --zero 0")
