"""Which ``scaled_dot_product_attention`` this torch offers, and which kernel it picks.

Grouped-query attention (Ainslie et al. 2023): k kv heads serve h query heads. torch ≥ 2.5's SDPA
takes ``enable_gqa=True`` and attends each group of h/k query heads to its kv head inside the
kernel, so the repeated K/V ``[b, h, s, hd]`` are never materialised (h/k times less K/V in memory
and in the bytes saved for backward). :data:`SDPA_GQA` says whether the installed torch has it;
without it :class:`~.llama.CoreAttention` repeats K/V (``repeat_interleave``), as before.

SDPA dispatches each call to one of several kernels ("backends"): FlashAttention-2
(``FLASH_ATTENTION``; Dao 2023), memory-efficient attention (``EFFICIENT_ATTENTION``; Rabe &
Staats 2021, xFormers), cuDNN's fused attention (``CUDNN_ATTENTION``) or the unfused ``MATH``
reference (which materialises the s × s scores). On CPU there are two: ``FLASH_ATTENTION``
(a blocked, online-softmax C++ kernel, ``_scaled_dot_product_flash_attention_for_cpu``) and
``MATH``. :func:`sdpa_backend` asks the dispatcher which one it chooses for given shapes, dtype
and device (``torch._fused_sdp_choice``, the function SDPA itself calls), so the training loop
can log the kernel that actually runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _has_enable_gqa() -> bool:
    """Whether this torch's SDPA accepts ``enable_gqa`` (torch ≥ 2.5): one 1-element CPU call."""
    q, kv = torch.zeros(1, 2, 1, 2, device="cpu"), torch.zeros(1, 1, 1, 2, device="cpu")
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


SDPA_GQA: bool = _has_enable_gqa()

_NAMES = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_backend(n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 batch: int = 1, dropout_p: float = 0.0, masked: bool = False) -> str:
    """The SDPA kernel the dispatcher picks for causal attention of q ``[batch, n_heads, seq_len,
    head_dim]`` to k, v ``[batch, n_kv_heads, seq_len, head_dim]`` in ``dtype`` on ``device``,
    as :class:`~.llama.CoreAttention` calls it (native GQA where :data:`SDPA_GQA`, else K/V
    repeated to ``n_heads``): "flash" | "memory-efficient" | "cudnn" | "math" | "overrideable",
    or "unknown (…)" when this torch has no ``torch._fused_sdp_choice``. Allocates the three
    inputs (``batch`` · (h + 2k) · s · hd elements) on ``device`` once. ``masked``: with a
    boolean [batch, 1, s, s] mask instead (a packed row's document mask)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown (this torch has no torch._fused_sdp_choice)"
    gqa = SDPA_GQA and n_kv_heads != n_heads
    kv_heads = n_kv_heads if gqa else n_heads
    q = torch.empty(batch, n_heads, seq_len, head_dim, device=device, dtype=dtype)
    kv = torch.empty(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
    kw = {"enable_gqa": True} if gqa else {}
    try:
        mask = torch.ones(batch, 1, seq_len, seq_len, dtype=torch.bool, device=device) \
            if masked else None
        idx = int(choose(q, kv, kv, mask, dropout_p, not masked, **kw))
    except (TypeError, RuntimeError) as e:  # an older signature, or no kernel fits
        return f"unknown ({type(e).__name__}: {e})"
    return _NAMES.get(idx, f"backend {idx}")
