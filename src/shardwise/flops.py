"""Model FLOPs, peak FLOP/s and MFU (model FLOPs utilisation).

FLOPs per token (training = forward + backward), the convention of the PaLM paper (Chowdhery et
al. 2022, Appendix B, "Model FLOPs utilization") and of the JAX scaling book (ch. 4, "All the
Transformer Math You Need to Know")::

    F_token = 6 · N_mm  +  12 · L · d · s

* ``N_mm`` = parameters that take part in a matrix multiply per token: per block the attention
  projections wq, wo (d·d each), wk, wv (d·k·hd each) and SwiGLU's w1, w2, w3 (d·f each), plus
  the output head (d·V; counted even when tied to the embedding: the head matmul runs either
  way). The embedding *lookup* is not a matmul and norms are element-wise, so neither is in
  ``N_mm``. A matmul with a weight of N entries costs 2N FLOPs per token forward (one multiply,
  one add per entry) and 4N backward (the input gradient and the weight gradient), hence 6N
  (Kaplan et al. 2020, §2.1, Table 1: C_forward ≈ 2N; backward ≈ 2 × forward).
* ``12 · L · d · s``: the attention core. Per layer and token, QKᵀ and A·V are each 2·s·d
  multiply-adds forward (h heads × hd = d, against s keys), 4·s·d in all, ×3 for forward +
  backward = 12·s·d. PaLM's "12·L·H·Q·T" with H·Q = d and T = s. Like PaLM we count the full
  s × s score matrix, not the causal half actually needed.
* Not counted (as in PaLM and the scaling book): softmax, RMSNorm, RoPE, SiLU and every other
  element-wise op, the embedding lookup, the loss, and the optimizer update.
* MFU counts *model* FLOPs only: recomputation for activation checkpointing is not in the
  numerator (that would be hardware FLOPs utilisation, HFU; PaLM App. B, Korthikanti et al. 2022
  §5). So ``--ac full`` lowers MFU by the cost of its extra forward.

For the stacked MLP (``mlp`` presets) a "token" is one sample row of [b, D]: F = 6 · L · 2·D·F.
Its first layer's input is data, which needs no gradient, so one 2·D·F matmul per sample never
runs: the convention overcounts the MLP by 2·D·F per sample (the Llama's first matmuls read the
embedding output, which does need its gradient, so there it is exact).

MFU = achieved model FLOP/s / (peak FLOP/s per device × devices), where achieved = F_token ×
tokens processed in the step (every position of every sequence, all ranks) / step seconds, and
devices = ranks on GPUs; on a CPU node, min(ranks, cores this process may run on): ranks that
share a core share its peak (:func:`peak_devices`).

Peaks (dense, per device) come from :data:`shardwise.plan.hardware.GPUS` (A100 312, H100 SXM
989, H200 989, B200 2,250 TFLOP/s bf16; FP32 19.5, 67, 67, 80; NVIDIA datasheets), chosen by the
CUDA device name; ``--peak-tflops`` overrides. On CPU there is no datasheet number for "one
rank with one thread", so :func:`cpu_peak_flops` measures it once with a square matmul probe in
the run's dtype on one thread and caches it in the shardwise cache folder (see
:func:`shardwise.data.corpus.default_cache_dir`), keyed by CPU model, torch version and dtype.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from .errors import ShardwiseConfigError, ShardwiseFileError
from .readers import read_json


# -- FLOPs ---------------------------------------------------------------------------------------
def matmul_params(cfg) -> int:
    """``N_mm``: parameters in per-token matmuls (see the module docstring) of a
    :class:`~shardwise.models.LlamaConfig` (an MoE one: the active parameters) or
    :class:`~shardwise.models.MLPConfig`."""
    if hasattr(cfg, "vocab_size"):
        d, f, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
        kv = cfg.n_kv_heads * cfg.head_dim
        dense = L * (2 * d * d + 2 * d * kv + 3 * d * f) + d * V
        if getattr(cfg, "n_experts", None) is None:
            return dense
        # a mixture of experts: a token's MoE block runs its router, top_k routed and the
        # shared experts instead of the dense SwiGLU (the *active* parameters; Mixtral §2)
        fe = cfg.d_expert
        moe = d * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * 3 * d * fe
        return dense + cfg.n_moe_layers * (moe - 3 * d * f)
    return cfg.n_layers * 2 * cfg.d_model * cfg.d_ff


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``:
    6·N_mm + 12·L·d·s for a Llama config (PaLM App. B), 6·N_mm per sample for the MLP."""
    f = 6.0 * matmul_params(cfg)
    if hasattr(cfg, "vocab_size"):
        f += 12.0 * cfg.n_layers * cfg.d_model * seq_len
    return f


def step_flops(cfg, sequences: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step over ``sequences`` sequences of ``seq_len`` tokens (all
    ranks together; for the MLP ``seq_len`` = 1 and ``sequences`` = samples)."""
    return flops_per_token(cfg, seq_len) * sequences * seq_len


def mfu(flops: float, seconds: float, peak_flops: float, ranks: int) -> float:
    """Model FLOPs utilisation of ``flops`` done in ``seconds`` by ``ranks`` devices of
    ``peak_flops`` FLOP/s each (a fraction, 0..1)."""
    return flops / seconds / (peak_flops * ranks) if seconds > 0 and peak_flops > 0 else 0.0


# -- peaks ---------------------------------------------------------------------------------------
def peak_devices(device: str | torch.device, ranks: int) -> int:
    """How many peak units ``ranks`` ranks have: one GPU each; on CPU (one thread per rank, one
    node) at most the cores this process may run on, since oversubscribed ranks share cores."""
    if torch.device(device).type == "cpu":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        return max(1, min(ranks, cores))
    return ranks


def _gpu_key(device_name: str) -> str | None:
    """The :data:`~shardwise.plan.hardware.GPUS` key for a CUDA device name, e.g.
    "NVIDIA H100 80GB HBM3" → "h100-sxm"."""
    n = device_name.lower()
    for token, key in (("b200", "b200"), ("h200", "h200-sxm"), ("h100", "h100-sxm"),
                       ("a100", "a100-sxm-80gb")):
        if token in n:
            return key
    return None


def peak_flops(device: str | torch.device, dtype: str = "fp32", override_tflops: float = 0.0,
               probe_seconds: float = 2.0) -> tuple[float, str]:
    """(peak dense FLOP/s of one rank, where the number comes from).

    ``override_tflops`` > 0 wins (``--peak-tflops``). CUDA: the datasheet value of the device
    for ``dtype`` ("bf16" → tensor-core bf16, "fp32" → FP32). CPU: :func:`cpu_peak_flops`.
    Raises :class:`ShardwiseConfigError` for a CUDA device not in the table and no override."""
    if override_tflops and override_tflops > 0:
        return override_tflops * 1e12, "--peak-tflops"
    device = torch.device(device)
    if device.type == "cuda":
        from .plan.hardware import GPUS

        name = torch.cuda.get_device_name(device)
        key = _gpu_key(name)
        if key is None:
            raise ShardwiseConfigError(f"no peak FLOP/s known for {name!r}: pass --peak-tflops "
                                       "(dense TFLOP/s of one device in the run's dtype)")
        gpu = GPUS[key]
        return (gpu.bf16_flops if dtype == "bf16" else gpu.fp32_flops), f"{gpu.source} ({key})"
    return cpu_peak_flops(dtype, probe_seconds), "measured: 1-thread matmul probe (cached)"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(dtype: str = "fp32", n: int = 512, seconds: float = 0.5) -> float:
    """FLOP/s of repeated ``n × n @ n × n`` matmuls (2n³ FLOPs each) on this thread's CPU
    settings, best of several timed batches after a warm-up."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dt)
    b = torch.randn(n, n, generator=g).to(dt)
    a @ b  # warm-up
    best, t_end = 0.0, time.perf_counter() + seconds
    while True:
        reps, t0 = 0, time.perf_counter()
        while reps == 0 or time.perf_counter() - t0 < 0.05:
            a @ b
            reps += 1
        best = max(best, 2.0 * n ** 3 * reps / (time.perf_counter() - t0))
        if time.perf_counter() > t_end:
            return best


def cpu_peak_flops(dtype: str = "fp32", seconds: float = 2.0) -> float:
    """The CPU peak of one rank (FLOP/s): a matmul probe on one thread (ranks run with
    ``OMP_NUM_THREADS=1``), measured once and cached in ``<cache>/peak_flops.json`` keyed by CPU
    model, torch version and dtype. On a loaded machine the probe reads low, so MFU reads high:
    delete the file (or pass ``--peak-tflops``) to measure again."""
    from .data._cache import atomic_write_bytes, file_lock
    from .data.corpus import default_cache_dir

    key = f"{_cpu_name()} | torch {torch.__version__} | {dtype} | 1 thread"
    path = default_cache_dir() / "peak_flops.json"
    with file_lock(path.with_suffix(".lock")):
        table = {}
        if path.exists():
            try:
                table = read_json(path, "peak FLOP/s cache")
            except ShardwiseFileError:  # damaged: measure again
                table = {}
        if key not in table:  # the best of three sizes (fp32 GEMM speed depends on shape)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                table[key] = max(measure_matmul_flops(dtype, n=n, seconds=seconds / 3)
                                 for n in (256, 512, 1024))
            finally:
                torch.set_num_threads(threads)
            atomic_write_bytes(path, json.dumps(table, indent=1).encode())
    return float(table[key])


__all__ = ["cpu_peak_flops", "flops_per_token", "matmul_params", "measure_matmul_flops", "mfu",
           "peak_devices", "peak_flops", "step_flops"]
