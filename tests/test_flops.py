"""FLOPs per token against PyTorch's FlopCounterMode on a tiny config, a hand count of the
`small` preset, MFU arithmetic, the peak override and the cached CPU probe."""

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardwise import flops
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, loss_sum_and_count, preset_config

aten = torch.ops.aten


def _count(model, batch):
    """Per-op FLOPs of one forward + backward (SDPA forced to its math path, which runs the
    attention core as matmuls FlopCounterMode can see; the fused CPU kernel is not counted)."""
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        loss, _ = loss_sum_and_count(model, batch)
        loss.backward()
    return {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides", [dict(), dict(n_heads=8, n_kv_heads=4, tie_embeddings=False)])
def test_llama_flops_match_flop_counter(overrides):
    b, s, V = 3, 24, 67
    cfg = preset_config("tiny", V, **overrides)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=V, **overrides)
    ids = torch.randint(0, V, (b, s + 1), generator=torch.Generator().manual_seed(0))
    counts = _count(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    tokens = b * s
    # linears are mm/addmm: 6·N_mm per token; the attention core's QKᵀ and A·V are bmm:
    # 12·L·d·s per token (full s × s, as PaLM counts it)
    linear = sum(v for k, v in counts.items() if k in ("aten.mm", "aten.addmm"))
    attn = counts.get("aten.bmm", 0)
    assert linear == 6 * flops.matmul_params(cfg) * tokens
    assert attn == 12 * cfg.n_layers * cfg.d_model * s * tokens
    assert sum(counts.values()) == flops.flops_per_token(cfg, s) * tokens
    assert flops.step_flops(cfg, b, s) == sum(counts.values())


@pytest.mark.timeout(60)
def test_mlp_flops_match_flop_counter():
    cfg = preset_config("mlp-tiny")
    torch.manual_seed(0)
    model = build_model("mlp-tiny")
    x = torch.randn(5, cfg.d_model)
    counts = _count(model, {"inputs": x, "targets": torch.randn(5, cfg.d_model)})
    # addmm counts only its matmul: the bias add is element-wise, outside the convention.
    # 6N per sample = 6 · (4 layers · 2 · 16 · 32) = 24,576. The data input needs no gradient,
    # so the first W_in's input-gradient matmul (2·D·F = 1,024 per sample) never runs: the
    # convention overcounts by exactly that.
    assert flops.flops_per_token(cfg, 1) == 6 * 4 * 2 * 16 * 32
    assert sum(counts.values()) == flops.flops_per_token(cfg, 1) * 5 - 2 * 16 * 32 * 5


def test_small_preset_by_hand():
    """small: d=256, L=4, h=8 (hd 32), k=4 (kv 128), f=688, V=4096, tied.
    per block: wq+wo 2·256² = 131,072; wk+wv 2·256·128 = 65,536; w1,w2,w3 3·256·688 = 528,384
    → 724,992; ×4 = 2,899,968; head 256·4096 = 1,048,576 → N_mm = 3,948,544.
    At s = 128: 6·N_mm = 23,691,264 and 12·4·256·128 = 1,572,864 → 25,264,128 FLOPs/token."""
    cfg = preset_config("small", 4096)
    assert flops.matmul_params(cfg) == 3_948_544
    assert flops.flops_per_token(cfg, 128) == 25_264_128
    # 16 sequences × 128 tokens per step
    assert flops.step_flops(cfg, 16, 128) == 25_264_128 * 2048


def test_mfu_arithmetic_and_override():
    # 1e12 FLOPs in 2 s on 4 ranks of 1 TFLOP/s peak: 0.5e12 / 4e12 = 12.5 %
    assert flops.mfu(1e12, 2.0, 1e12, 4) == pytest.approx(0.125)
    assert flops.mfu(1e12, 0.0, 1e12, 4) == 0.0
    assert flops.peak_flops("cpu", "fp32", override_tflops=989) == (989e12, "--peak-tflops")


def test_gpu_table_names():
    assert flops._gpu_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert flops._gpu_key("NVIDIA H200") == "h200-sxm"
    assert flops._gpu_key("NVIDIA A100-SXM4-80GB") == "a100-sxm-80gb"
    assert flops._gpu_key("NVIDIA B200") == "b200"
    assert flops._gpu_key("Tesla T4") is None


@pytest.mark.timeout(60)
def test_cpu_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    calls = []

    def fake(dtype="fp32", n=512, seconds=0.5):
        calls.append((dtype, n))
        return {256: 1.0e10, 512: 1.5e10, 1024: 1.2e10}[n]

    monkeypatch.setattr(flops, "measure_matmul_flops", fake)
    assert flops.cpu_peak_flops("fp32") == 1.5e10  # the best of the three sizes
    assert flops.cpu_peak_flops("fp32") == 1.5e10  # from the cache file: no new probe
    assert calls == [("fp32", 256), ("fp32", 512), ("fp32", 1024)]
    table = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(table.values()) == [1.5e10]


@pytest.mark.timeout(60)
def test_matmul_probe_is_plausible():
    """The real probe: 2n³ FLOPs per matmul, a positive rate below 10 TFLOP/s for one thread."""
    rate = flops.measure_matmul_flops("fp32", n=128, seconds=0.1)
    assert 1e8 < rate < 1e13


def test_negative_peak_is_a_config_error():
    from shardwise.config import TrainConfig, validate

    with pytest.raises(ShardwiseConfigError, match="--peak-tflops"):
        validate(TrainConfig(peak_tflops=-1.0))


def test_peak_devices_counts_gpus_or_shared_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    assert flops.peak_devices("cpu", 1) == 1
    assert flops.peak_devices("cpu", cores + 3) == cores  # oversubscribed ranks share cores
    assert flops.peak_devices("cuda", 8) == 8
