"""The textbook bytes of one optimizer step, for whatever layout an engine runs.

Each strategy owns its formula (next to its math, with its sources), and every engine answers
``bytes_formula(micro_steps, sequences, seq_len, dtype)`` with its strategy's (composed: the sum
of its parts'). This module adds the bookkeeping every step does, so ``trace``, ``verify`` and
the run folder's ``ledger.json`` compare the ledger with the same numbers:

* DP: 2(n−1)/n · gradient bytes (``parallel/dp/data_parallel.py``: ZeRO paper §7.1, scaling book ch. 5)
* ZeRO: ``ZeroSync.step_bytes_formula`` (reduce-scatter, all-gathers, one norm scalar)
* TP: ``tp_step_bytes_formula`` (Megatron f/g activations, vocab-parallel CE, norm; scaling
  book ch. 5; Korthikanti et al. 2022 for SP)
* PP: the point-to-point activations/gradients, the tied-embedding gradient, the norm scalar
* CP: the K/V blocks of ring attention (or their all-gather) and the dK/dV back, per layer
  (:mod:`shardwise.parallel.cp.attention`); every other term counts this rank's s/cp tokens
* EP: per MoE layer and micro-batch, the routing counts' all-to-all and the token rows to and
  from the other ep ranks, forward and backward, from the step's actual routing
  (:func:`shardwise.parallel.ep.ep_bytes_formula`)
* Muon (``--optimizer muon``): the update U of the matrices Newton–Schulz needs whole, gathered
  over the axes that split them (:mod:`shardwise.parallel.muon`; Liu et al. 2025 §2)
* every layout: the token count before the forward and the loss sum after the step, one fp64
  scalar all-reduce each over every axis the engine reduces them on.

All values are bytes this rank sends in one step (float).
"""

from __future__ import annotations

from .comm.ledger import ring_bytes


def _scalar_all_reduces(engine, topo) -> float:
    axes = list(engine.count_axes) + list(engine.reduce_loss_axes)
    return sum(ring_bytes("all_reduce", 8, topo.size(a)) for a in axes)


def step_bytes_formula(engine, topo, *, micro_steps: int, sequences: int, seq_len: int,
                       dtype: str = "fp32") -> dict[str, float]:
    """``{tag: bytes, ..., "total": bytes}`` one rank should send in one step of ``engine``.

    ``micro_steps``: micro-batches per rank per step; ``sequences``: sequences this rank
    processes per step (all micro-batches); ``seq_len``: tokens per sequence (the whole
    sequence: with cp > 1 the engine's terms count this rank's s/cp of them). When the
    engine's optimizer is Muon, its ``muon`` term: the gathers Newton–Schulz needs (the sync's
    ``muon_bytes``: :mod:`shardwise.parallel.muon`), where it is not 0."""
    from .parallel.cp import cp_bytes_formula
    from .parallel.ep import ep_bytes_formula

    cp = topo.size("cp")
    out = dict(engine.bytes_formula(micro_steps=micro_steps, sequences=sequences,
                                    seq_len=seq_len // cp, dtype=dtype))
    out.update(cp_bytes_formula(engine.module, topo, sequences, seq_len,
                                engine.precision.with_compute(dtype)))
    out.update(ep_bytes_formula(engine.module, topo))
    out.pop("total", None)
    out.pop("loss", None)
    muon_bytes = getattr(getattr(engine, "grad_sync", None), "muon_bytes", lambda: 0.0)()
    if muon_bytes:
        out["muon"] = muon_bytes
    from .parallel.storage import offload_bytes_formula

    out.update(offload_bytes_formula(engine, micro_steps))  # --offload: host <-> device copies
    out["loss"] = _scalar_all_reduces(engine, topo)
    out["total"] = sum(out.values())
    return out


def memory_formula(engine, topo) -> dict[str, float] | None:
    """Model-state bytes the papers predict for this rank (the engine's ``memory_formula()``:
    DP 4Ψ + 4Ψ + 8Ψ, fp32 AdamW, ZeRO paper §3.1; ZeRO 4Ψ+4Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N), or None
    where no closed form is wired."""
    return engine.memory_formula()
