"""GPUs and clusters the planner knows: peak FLOP/s, memory, links.

Every number is per GPU. FLOP/s are **dense** (no 2:4 sparsity): NVIDIA's datasheets print the
sparse figure for tensor cores with a footnote, and the dense one is half of it. Memory sizes are
the datasheet's "GB", which NVIDIA means as binary units (an "80 GB" H100 reports 81,559 MiB):
``hbm_bytes = GB · 2**30``. Link bandwidths are bytes per second **per direction** (NVLink's
datasheet figure is both directions added, so it is halved here).

Sources (datasheets, as printed):

* A100 SXM4 80 GB — NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor 312 TFLOP/s (624 with
  sparsity), FP32 19.5 TFLOP/s, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s. DGX A100 node: 8 GPUs,
  8 × 200 Gb/s HDR InfiniBand (one per GPU).
* H100 SXM5 80 GB — NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor 1,979 TFLOP/s with sparsity
  (989 dense), FP32 67 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s. DGX H100 node: 8 GPUs,
  8 × 400 Gb/s ConnectX-7 (one per GPU).
* H200 SXM 141 GB — NVIDIA H200 Tensor Core GPU datasheet: BF16 tensor 1,979 TFLOP/s with sparsity
  (989 dense), FP32 67 TFLOP/s, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. HGX H200 node: 8 GPUs,
  400 Gb/s per GPU.
* B200 (HGX B200, 1,000 W) — NVIDIA HGX B200 datasheet (per-GPU = the 8-GPU figure / 8): BF16
  tensor 4.5 PFLOP/s with sparsity (2.25 dense), FP32 80 TFLOP/s, 180 GB HBM3e at 8 TB/s, NVLink 5
  1.8 TB/s. DGX B200: 8 × 400 Gb/s ConnectX-7.

Host side (for ``--offload``: :mod:`.offload`). ``pcie_bandwidth`` is one GPU's host link per
direction (the datasheet prints both directions added: A100 SXM4 "PCIe Gen4: 64 GB/s" → 32;
H100 SXM5 and H200 SXM "PCIe Gen5: 128 GB/s" → 64; B200: PCIe Gen5 x16 assumed, 64). We assume
each GPU gets its own x16 link at that rate; on a node where two GPUs share one switch uplink
to the CPU, give half with ``pcie_gbps`` in a cluster file. The node's host memory
(``host_bytes``, the datasheet's "TB" as binary units, like HBM) and its DRAM bandwidth
(``host_mem_bandwidth``: channels × transfer rate × 8 bytes, both sockets; the GPUs of a node
share it): DGX A100 — 2 TB, dual AMD EPYC 7742, 8 channels DDR4-3200 each: 409.6 GB/s;
DGX H100 and DGX H200 — 2 TB, dual Intel Xeon Platinum 8480C, 8 channels DDR5-4800 each:
614.4 GB/s; DGX B200 — 2 TB (configurable to 4 TB), dual Xeon Platinum 8570, 8 channels
DDR5-5600 each: 716.8 GB/s (NVIDIA DGX A100 / H100 / H200 / B200 datasheets and user guides;
Intel and AMD product specifications for the channels).

Flash-attention utilisation (``flash_efficiency``) is a kernel measurement, not a datasheet
number: FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023,
arXiv 2307.08691, abstract; we take the low end for forward + backward) and "only 35%
utilization on H100" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, §1). H200 and B200
use the H100 figure (same FlashAttention-2 code path; an assumption).

Latencies (per ring step) are assumptions, not datasheet numbers: 1 µs inside a node (NVLink +
NVSwitch), 5 µs between nodes (InfiniBand/RoCE through one or two switches; Llama 3 §3.3.3 reports
"up to tens of microseconds" on its largest cluster).

A custom GPU or cluster comes from a TOML file (:func:`load_cluster`)::

    [gpu]                       # or: gpu = "h100-sxm" at the top level to start from a preset
    name = "my-gpu"
    bf16_tflops = 989           # dense
    fp32_tflops = 67
    hbm_gb = 80                 # GB as on the datasheet (binary)
    hbm_tbps = 3.35             # TB/s
    nvlink_gbps = 450           # GB/s per direction
    flash_efficiency = 0.35     # fraction of peak a flash-attention kernel sustains

    [cluster]
    gpus_per_node = 8
    intra_node_gbps = 450       # GB/s per GPU per direction (default: the GPU's NVLink)
    inter_node_gbps = 50        # GB/s per GPU per direction (its NIC)
    intra_node_latency_us = 1
    inter_node_latency_us = 5
    host_memory_gb = 2048       # host RAM per node, GB (binary)
    host_memory_gbps = 614.4    # host DRAM bandwidth per node, GB/s
    pcie_gbps = 64              # one GPU's host link, GB/s per direction
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ShardwiseConfigError
from ..readers import read_toml

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator. ``bf16_flops``/``fp32_flops``: dense peak FLOP/s; ``hbm_bytes``: memory
    in bytes; ``hbm_bandwidth``: bytes/s; ``nvlink_bandwidth``: bytes/s per direction;
    ``flash_efficiency``: the fraction of the bf16 peak a flash-attention kernel sustains
    forward + backward (see the module docstring)."""

    name: str
    bf16_flops: float
    fp32_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    source: str = ""
    flash_efficiency: float = 0.35
    pcie_bandwidth: float = 64e9  # bytes/s per direction to the host (module docstring)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs in nodes. Bandwidths: bytes/s per GPU per direction; latencies: seconds per ring step.

    ``inter_bw`` is one GPU's share of the node's network (one NIC per GPU on DGX-style nodes).
    ``host_bytes``: host memory per node (bytes); ``host_mem_bw``: its DRAM bandwidth (bytes/s,
    shared by the node's GPUs; the module docstring)."""

    gpu: GPU
    gpus_per_node: int = 8
    intra_bw: float = 0.0  # 0 = the GPU's NVLink bandwidth
    inter_bw: float = 50e9
    intra_latency: float = 1e-6
    inter_latency: float = 5e-6
    name: str = ""
    host_bytes: float = 2 * 2**40
    host_mem_bw: float = 614.4e9

    def __post_init__(self):
        if self.intra_bw == 0.0:
            object.__setattr__(self, "intra_bw", self.gpu.nvlink_bandwidth)
        if not self.name:
            object.__setattr__(self, "name", f"{self.gpu.name} ×{self.gpus_per_node}/node")
        if self.gpus_per_node < 1:
            raise ShardwiseConfigError(f"gpus_per_node = {self.gpus_per_node} must be ≥ 1")
        for key in ("intra_bw", "inter_bw", "host_bytes", "host_mem_bw"):
            if getattr(self, key) <= 0:
                raise ShardwiseConfigError(f"cluster {key} = {getattr(self, key)} must be > 0 "
                                           "bytes/s")

    def describe(self) -> str:
        g = self.gpu
        return (f"{g.name}: {g.bf16_flops / 1e12:,.0f} TFLOP/s bf16 dense, "
                f"{g.hbm_bytes / GiB:,.0f} GiB HBM; {self.gpus_per_node} GPUs/node, "
                f"intra {self.intra_bw / 1e9:,.0f} GB/s, inter {self.inter_bw / 1e9:,.0f} GB/s, "
                f"host link {g.pcie_bandwidth / 1e9:,.0f} GB/s per GPU per direction; host "
                f"{self.host_bytes / GiB:,.0f} GiB at {self.host_mem_bw / 1e9:,.1f} GB/s per node")


GPUS: dict[str, GPU] = {
    "a100-sxm-80gb": GPU("A100 SXM4 80GB", 312e12, 19.5e12, 80 * GiB, 2.039e12, 300e9,
                         "NVIDIA A100 Tensor Core GPU datasheet", flash_efficiency=0.50,
                         pcie_bandwidth=32e9),
    "h100-sxm": GPU("H100 SXM5 80GB", 989e12, 67e12, 80 * GiB, 3.35e12, 450e9,
                    "NVIDIA H100 Tensor Core GPU datasheet", pcie_bandwidth=64e9),
    "h200-sxm": GPU("H200 SXM 141GB", 989e12, 67e12, 141 * GiB, 4.8e12, 450e9,
                    "NVIDIA H200 Tensor Core GPU datasheet", pcie_bandwidth=64e9),
    "b200": GPU("B200 (HGX, 1000 W)", 2250e12, 80e12, 180 * GiB, 8.0e12, 900e9,
                "NVIDIA HGX B200 datasheet", pcie_bandwidth=64e9),
}
ALIASES = {"a100": "a100-sxm-80gb", "a100-80gb": "a100-sxm-80gb", "h100": "h100-sxm",
           "h100-sxm5": "h100-sxm", "h200": "h200-sxm", "b200-sxm": "b200"}
# per-GPU network share of the reference node of each GPU (one NIC per GPU)
_NIC = {"a100-sxm-80gb": 25e9, "h100-sxm": 50e9, "h200-sxm": 50e9, "b200": 50e9}
# the reference node's host memory (bytes) and DRAM bandwidth (bytes/s): the module docstring
_HOST = {"a100-sxm-80gb": (2 * 2**40, 409.6e9), "h100-sxm": (2 * 2**40, 614.4e9),
         "h200-sxm": (2 * 2**40, 614.4e9), "b200": (2 * 2**40, 716.8e9)}


def gpu_names() -> list[str]:
    return sorted(GPUS)


def get_cluster(name: str, gpus_per_node: int | None = None) -> Cluster:
    """The reference 8-GPU node of GPU preset ``name`` (see :data:`GPUS`, aliases allowed).
    Raises ShardwiseConfigError for an unknown name."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ShardwiseConfigError(f"--gpu {name!r} is not a preset: choose from "
                                   f"{gpu_names()} or give --cluster FILE.toml")
    return Cluster(GPUS[key], gpus_per_node=gpus_per_node or 8, inter_bw=_NIC[key],
                   name=f"{GPUS[key].name} ×{gpus_per_node or 8}/node",
                   host_bytes=_HOST[key][0], host_mem_bw=_HOST[key][1])


def load_cluster(path: str) -> Cluster:
    """A cluster from a TOML file (format in the module docstring). Raises ShardwiseConfigError
    on a missing file, bad TOML, unknown keys or non-positive numbers."""
    data = read_toml(path, "--cluster")
    unknown = set(data) - {"gpu", "cluster"}
    if unknown:
        raise ShardwiseConfigError(f"--cluster {path}: unknown keys {sorted(unknown)}; use a "
                                   "[gpu] table (or gpu = \"preset\") and a [cluster] table")
    base = None
    g = data.get("gpu", {})
    if isinstance(g, str):
        base = get_cluster(g)
        gpu = base.gpu
    else:
        keys = {"name", "bf16_tflops", "fp32_tflops", "hbm_gb", "hbm_tbps", "nvlink_gbps",
                "flash_efficiency", "preset", "pcie_gbps"}
        _check_keys(path, "gpu", g, keys)
        if "preset" in g:
            base = get_cluster(g["preset"])
        ref = base.gpu if base else None
        need = [k for k in ("bf16_tflops", "hbm_gb") if k not in g and ref is None]
        if need:
            raise ShardwiseConfigError(f"--cluster {path}: [gpu] needs {need} (or preset = "
                                       f"one of {gpu_names()})")
        gpu = GPU(name=g.get("name", ref.name if ref else "custom"),
                  bf16_flops=_pos(path, g, "bf16_tflops", ref and ref.bf16_flops / 1e12) * 1e12,
                  fp32_flops=_pos(path, g, "fp32_tflops", ref.fp32_flops / 1e12 if ref else
                                  g.get("bf16_tflops", 1) / 16) * 1e12,
                  hbm_bytes=_pos(path, g, "hbm_gb", ref and ref.hbm_bytes / GiB) * GiB,
                  hbm_bandwidth=_pos(path, g, "hbm_tbps", ref.hbm_bandwidth / 1e12 if ref
                                     else 2.0) * 1e12,
                  nvlink_bandwidth=_pos(path, g, "nvlink_gbps", ref.nvlink_bandwidth / 1e9
                                        if ref else 300) * 1e9,
                  source=f"custom ({path})",
                  flash_efficiency=_pos(path, g, "flash_efficiency",
                                        ref.flash_efficiency if ref else 0.35),
                  pcie_bandwidth=_pos(path, g, "pcie_gbps",
                                      ref.pcie_bandwidth / 1e9 if ref else 64) * 1e9)
    c = data.get("cluster", {})
    _check_keys(path, "cluster", c, {"gpus_per_node", "intra_node_gbps", "inter_node_gbps",
                                     "intra_node_latency_us", "inter_node_latency_us", "name",
                                     "host_memory_gb", "host_memory_gbps", "pcie_gbps"})
    gpn = c.get("gpus_per_node", base.gpus_per_node if base else 8)
    if not isinstance(gpn, int) or gpn < 1:
        raise ShardwiseConfigError(f"--cluster {path}: gpus_per_node = {gpn!r} must be a "
                                   "positive integer")
    out = Cluster(
        gpu=gpu, gpus_per_node=gpn,
        intra_bw=_pos(path, c, "intra_node_gbps", gpu.nvlink_bandwidth / 1e9) * 1e9,
        inter_bw=_pos(path, c, "inter_node_gbps", base.inter_bw / 1e9 if base else 50) * 1e9,
        intra_latency=_pos(path, c, "intra_node_latency_us", 1.0) * 1e-6,
        inter_latency=_pos(path, c, "inter_node_latency_us", 5.0) * 1e-6,
        name=c.get("name", f"{gpu.name} ×{gpn}/node"),
        host_bytes=_pos(path, c, "host_memory_gb", base.host_bytes / GiB if base else 2048)
        * GiB,
        host_mem_bw=_pos(path, c, "host_memory_gbps", base.host_mem_bw / 1e9 if base
                         else 614.4) * 1e9)
    if "pcie_gbps" in c:  # the node's host links, as a cluster property
        out = dataclasses.replace(out, gpu=dataclasses.replace(
            gpu, pcie_bandwidth=_pos(path, c, "pcie_gbps", None) * 1e9))
    return out


def _check_keys(path, table, d, allowed):
    if not isinstance(d, dict):
        raise ShardwiseConfigError(f"--cluster {path}: [{table}] must be a table")
    bad = set(d) - allowed
    if bad:
        raise ShardwiseConfigError(f"--cluster {path}: unknown key(s) {sorted(bad)} in "
                                   f"[{table}]; valid: {sorted(allowed)}")


def _pos(path, d, key, default):
    """``d[key]`` (else ``default``) as a float, refused unless a finite number > 0 (TOML has
    ``nan`` and ``inf`` literals: a NaN peak printed "nan%" MFU, an infinite HBM made every
    layout fit); ``flash_efficiency``, a fraction of the peak, also ≤ 1."""
    v = d.get(key, default)
    if v is None:
        raise ShardwiseConfigError(f"--cluster {path}: {key} is required")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ShardwiseConfigError(f"--cluster {path}: {key} = {v!r} must be a finite positive "
                                   f"number: give the datasheet's value")
    if key == "flash_efficiency" and v > 1:
        raise ShardwiseConfigError(f"--cluster {path}: flash_efficiency = {v!r} is a fraction of "
                                   "the bf16 peak: give a number in (0, 1], e.g. 0.35")
    return float(v)
