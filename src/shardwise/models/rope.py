"""RoPE frequencies, plain and with Llama 3's long-context scaling.

Plain RoPE (Su et al. 2021, RoFormer, eq. 34): pair ``j`` of a head (rotate-half pairs
x[j], x[j + hd/2]) turns by angle ``p · θ_j`` at position ``p``, with θ_j = base^(−2j/hd).

**Llama 3 scaling** (``rope_type = "llama3"``; Meta's ``apply_scaling`` in the Llama 3.1
reference code, ``_compute_llama3_parameters`` in transformers): the model was pre-trained at
``original_max_position_embeddings`` = L tokens and extended by ``factor`` = f. With the
wavelength λ_j = 2π / θ_j and two thresholds λ_lo = L / ``low_freq_factor`` and
λ_hi = L / ``high_freq_factor`` (λ_hi < λ_lo):

* λ_j < λ_hi (high frequencies, many turns inside L): θ_j unchanged;
* λ_j > λ_lo (low frequencies, less than a turn inside L): θ_j / f;
* in between, interpolated: θ'_j = (1 − a)·θ_j / f + a·θ_j, a = (L/λ_j − low) / (high − low).

The attention scale stays 1 (no temperature), so only the frequencies change. The scaled
frequencies are a pure function of the config: every rank and every layout compute the same
tables, and the weights need no change.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ``ValueError`` unless ``scaling`` is None or a complete ``llama3`` dict (the four
    :data:`LLAMA3_KEYS`, positive, ``high_freq_factor > low_freq_factor``)."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", "llama3")
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r}: only 'llama3' is implemented")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}")
    if min(float(scaling[k]) for k in LLAMA3_KEYS) <= 0:
        raise ValueError(f"llama3 rope_scaling values must be > 0, got {scaling}")
    if float(scaling["high_freq_factor"]) <= float(scaling["low_freq_factor"]):
        raise ValueError("llama3 rope_scaling: high_freq_factor must exceed low_freq_factor")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """θ_j for j = 0 … hd/2 − 1 ([hd/2] fp32): base^(−2j/hd), scaled as the module docstring
    says when ``scaling`` is a ``llama3`` dict."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv
    f = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv  # [hd/2]
    scaled = torch.where(wavelen > ctx / low, inv / f, inv)
    a = (ctx / wavelen - low) / (high - low)
    smooth = (1 - a) * scaled / f + a * scaled
    medium = (wavelen >= ctx / high) & (wavelen <= ctx / low)
    return torch.where(medium, smooth, scaled)
