"""The pieces of the GPU path that need no GPU: the ``llama-1b`` preset (models and planner),
native-GQA attention against the repeated-K/V path, the SDPA kernel probe, device memory keys."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import build_model, preset_config
from shardwise.models.llama import PRESET_VOCAB, CoreAttention
from shardwise.models.sdpa import SDPA_GQA, sdpa_backend


def test_llama_1b_has_1_1_to_1_3_billion_parameters_counted_alike_everywhere():
    """The config's closed form, the module built on the meta device (no allocation) and the
    planner's ModelSpec give one count, inside the issue's 1.1-1.3 B."""
    from shardwise.plan.models import get_model

    vocab = PRESET_VOCAB["llama-1b"]
    cfg = preset_config("llama-1b", vocab)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, vocab) == \
        (16, 2048, 32, 8, 8192, 32000)
    assert not cfg.tie_embeddings
    with torch.device("meta"):
        model = build_model("llama-1b", vocab_size=vocab)
    assert all(p.device.type == "meta" for p in model.parameters())
    counted = sum(p.numel() for p in model.parameters())
    spec = get_model("llama-1b")
    assert counted == cfg.num_params() == spec.num_params()
    assert 1.1e9 <= counted <= 1.3e9
    assert (spec.vocab_size, spec.seq_len, spec.tie_embeddings) == (vocab, 2048, False)


@pytest.mark.skipif(not SDPA_GQA, reason="this torch's SDPA has no enable_gqa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_gqa_equals_repeated_kv(dtype):
    """CoreAttention with k < h kv heads (enable_gqa) against SDPA on K/V repeated to h heads,
    output and the q, k, v gradients. Each output row is the same softmax-weighted sum of the
    same value rows; only the kernel's blocking may differ, so they agree to a few ulps of the
    output's scale: rtol = atol = 16·eps of the dtype (measured: bitwise on CPU)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 40, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 40, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 40, 16, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(2, 8, 40, 16, generator=g, dtype=dtype)
    out = CoreAttention()(q, k, v)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                         is_causal=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    tol = 16 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def test_sdpa_backend_names_a_cpu_kernel():
    """On CPU the dispatcher chooses between its flash kernel and math; fp32 and bf16 causal
    attention at these shapes take the flash kernel."""
    for dtype in (torch.float32, torch.bfloat16):
        assert sdpa_backend(4, 2, 16, 64, dtype=dtype) in ("flash", "math")


def test_device_memory_is_not_measured_on_cpu():
    from shardwise.train.device import accelerator_type, memory_record, reset_peak

    assert accelerator_type(torch.device("cpu")) is None
    reset_peak(torch.device("cpu"))  # a no-op
    assert memory_record(torch.device("cpu"), topo=None) == {}  # no collective, nothing fake
