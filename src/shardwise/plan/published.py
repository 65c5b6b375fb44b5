"""Published large runs the cost model is checked against, and the table of predicted vs
published MFU (``shardwise plan --validate``; ``docs/planner.md``).

Each run names the model, GPU, GPU count, batch, and the layout the paper reports; whatever the
paper does not state (micro-batch size, virtual stages, ZeRO stage, recomputation where not given)
the planner chooses, exactly as it would for a user who fixes dp/tp/pp: the prediction is the best
fitting layout with the published dimensions. MFU is always model FLOPs (6·N + 12·L·d·s per
token) over dense bf16 peak, the convention of these papers (Korthikanti et al. 2022 App. A;
Llama 3 §3.3.2 cites PaLM's MFU).

* ``llama3-405b-8k`` / ``-16k`` — Llama Team 2024, "The Llama 3 Herd of Models", arXiv 2407.21783,
  Table 4: H100 80 GB, sequence 8,192, 16M tokens per batch; TP 8, CP 1, PP 16, DP 64 on 8,192
  GPUs → 43 % BF16 MFU; DP 128 on 16,384 GPUs → 41 %. §3.3.1: 400 Gb/s RoCE per GPU, 8 GPUs per
  server over NVLink. §3.3.2: interleaved pipeline schedule, FSDP sharding optimizer states and
  gradients with parameters kept after forward (zero 1 here).
* ``llama3-405b-128k`` — the long-context stage, same Table 4: sequence 131,072, 16M tokens per
  batch, 16,384 GPUs, TP 8, CP 16, PP 16 → 380 TFLOPs/GPU, 38 % BF16 MFU. The table prints DP 4;
  TP·CP·PP·DP must be 16,384 and DP · batch size/DP (16) · 131,072 must be 16M, so DP is 8, as a
  Meta author confirmed: "this should be a typo. DP should be 8, so we have TP * CP * PP *
  DP=16384, and DP * Batch size/DP * Seq.Len. = 16M" (jianyuh, github.com/meta-llama/llama3
  issue #324, 2024-08-30). §3.3.2: context parallelism all-gathers K and V (GQA keeps them
  small) and computes the local queries' attention, the all-gather exposed on the critical path
  (``cp_method="allgather"`` here); the same interleaved schedule and FSDP as the 8K stage.
  The planner chooses the virtual stages and the recomputation, as for the 8K rows.
* ``gpt3-175b-64`` / ``mt-nlg-530b-280`` / ``megatron-1t-512`` / ``megatron-22b-8`` — Korthikanti
  et al. 2022, arXiv 2205.05198, Tables 3 and 5 (A100 80 GB, s = 2048, v = 51,200, no data
  parallelism, sequence parallelism + selective recomputation, interleaving with 3 stages for
  175B and 530B): MFU 51.4 %, 56.0 %, 56.3 %, 41.5 %. §6.3: the 530B model on 2,240 GPUs (8-way
  data parallelism, batch × 8) → 54.2 % (``mt-nlg-530b-2240``). The 22B layer time of their
  Table 4 is where ``gemm_efficiency`` comes from, so that row is a consistency check, not an
  independent one.
* ``mixtral-8x7b-64`` — a mixture of experts: Megatron-Core's MoE README
  (github.com/NVIDIA/Megatron-LM, ``megatron/core/transformer/moe/README.md``), "Reference Best
  Parallel Mapping": Mixtral 8x7B, dropless, all-to-all dispatcher, BF16, 64 H100 (8 × H100
  80GB HBM3 per server, NVLink 4, 8 × 400 Gbit/s InfiniBand), sequence 4,096, TP 1, EP 8, PP 4,
  VP 8, micro-batch 1, global batch 256; "This boosts Mixtral 8X7B bf16 training to achieve 468
  TFLOPS as of MCore v0.9" (commit c230e0d7, 2024-11-21, which also moved the table's benchmark
  image to PyTorch 24.09 with TransformerEngine 1.11; the v0.8 text of 2024-08-02, commit
  0b981f9c, gave 438 TFLOPS for the same mapping on PyTorch 24.04 / TE 1.9). VP is the number
  of virtual stages, 8 one-layer chunks per rank: the maintainers' Megatron-MoE-ModelZoo
  (github.com/yanring/Megatron-MoE-ModelZoo, ``runtime_configs/benchmarking/runtime.conf``)
  lists Mixtral-8x7B as TP 1 PP 4 EP 8 VPP 8 MBS 1 GBS 256 and sets LAYERS_PER_VP =
  NUM_LAYERS / PP / VPP. Megatron's TFLOPS are its ``num_floating_point_operations``: 6 × the
  top-k active matmul weights + 12·L·d·s, the convention here (less the router's 0.01 %).
  ZeRO 1 (``--use-distributed-optimizer`` with ``--overlap-grad-reduce`` /
  ``--overlap-param-gather`` in the README's recipe), Megatron's fused gradient accumulation,
  overlapped pipeline sends with VPP; recomputation is not stated (the planner chooses).
"""

from __future__ import annotations

import dataclasses

from .layout import Assumptions
from .hardware import get_cluster
from .models import get_model
from .search import Fixed, search


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    key: str
    model: str
    gpu: str
    gpus: int
    global_batch: int  # sequences
    fixed: Fixed
    mfu: float  # published, fraction
    source: str
    independent: bool = True  # False: the run fed one of the model's constants
    p2p_overlap: bool = True  # the paper's software overlapped pipeline sends with compute
    megatron: bool = False  # Megatron-LM: weight-gradient accumulation fused into the GEMM
    seq_len: int | None = None  # the run's sequence length, when not the model preset's
    tflops: float | None = None  # published model TFLOP/s per GPU, when the paper gives it


_K = "Korthikanti et al. 2022 (arXiv 2205.05198), Table 5"
_L3 = "Llama 3 (arXiv 2407.21783), Table 4"
RUNS = (
    PublishedRun("llama3-405b-8k", "llama3-405b", "h100-sxm", 8192, 2048,
                 Fixed(tp=8, pp=16, dp=64, microbatches=32, schedule="interleaved-1f1b",
                       zero=1), 0.43, _L3, tflops=430),
    PublishedRun("llama3-405b-16k", "llama3-405b", "h100-sxm", 16384, 2048,
                 Fixed(tp=8, pp=16, dp=128, microbatches=16, schedule="interleaved-1f1b",
                       zero=1), 0.41, _L3, tflops=400),
    PublishedRun("llama3-405b-128k", "llama3-405b", "h100-sxm", 16384, 128,
                 Fixed(tp=8, cp=16, pp=16, dp=8, microbatches=16, schedule="interleaved-1f1b",
                       zero=1, cp_method="allgather"), 0.38,
                 _L3 + " (DP 8: meta-llama/llama3#324), §3.3.2", seq_len=131072, tflops=380),
    PublishedRun("gpt3-175b-64", "gpt3-175b", "a100-sxm-80gb", 64, 64,
                 Fixed(tp=8, pp=8, dp=1, micro_batch=1, schedule="interleaved-1f1b",
                       virtual_stages=3, ckpt="selective", sp=True), 0.514, _K,
                 p2p_overlap=False, megatron=True),
    PublishedRun("mt-nlg-530b-280", "mt-nlg-530b", "a100-sxm-80gb", 280, 280,
                 Fixed(tp=8, pp=35, dp=1, micro_batch=1, schedule="interleaved-1f1b",
                       virtual_stages=3, ckpt="selective", sp=True), 0.560, _K,
                 p2p_overlap=False, megatron=True),
    PublishedRun("mt-nlg-530b-2240", "mt-nlg-530b", "a100-sxm-80gb", 2240, 2240,
                 Fixed(tp=8, pp=35, dp=8, micro_batch=1, schedule="interleaved-1f1b",
                       virtual_stages=3, ckpt="selective", sp=True, zero=0), 0.542,
                 "Korthikanti et al. 2022, §6.3", p2p_overlap=False, megatron=True),
    PublishedRun("megatron-1t-512", "megatron-1t", "a100-sxm-80gb", 512, 512,
                 Fixed(tp=8, pp=64, dp=1, micro_batch=1, schedule="1f1b", ckpt="selective",
                       sp=True), 0.563, _K, p2p_overlap=False, megatron=True),
    PublishedRun("mixtral-8x7b-64", "mixtral-8x7b", "h100-sxm", 64, 256,
                 Fixed(tp=1, pp=4, ep=8, dp=16, micro_batch=1, schedule="interleaved-1f1b",
                       virtual_stages=8, zero=1), 468 / 989,
                 "Megatron-Core MoE README, MCore v0.9 (Reference Best Parallel Mapping)",
                 megatron=True, tflops=468),
    PublishedRun("megatron-22b-8", "megatron-22b", "a100-sxm-80gb", 8, 4,
                 Fixed(tp=8, pp=1, dp=1, micro_batch=4, ckpt="selective", sp=True), 0.415, _K,
                 independent=False, p2p_overlap=False, megatron=True),
)


def predict(run: PublishedRun, assumptions: Assumptions = Assumptions()):
    """The planner's best fitting estimate for ``run``'s published dimensions (or the best
    non-fitting one if none fits)."""
    model, cluster = get_model(run.model), get_cluster(run.gpu)
    if run.seq_len is not None:
        model = dataclasses.replace(model, seq_len=run.seq_len)
    assumptions = dataclasses.replace(assumptions, p2p_overlap=run.p2p_overlap,
                                      grad_accum_fused=run.megatron)
    # the runs as published: bf16 parameters with fp32 master weights (Megatron-LM's recipe),
    # no offload, every layout the cost model prices, whether or not shardwise train runs it
    fixed = run.fixed if run.fixed.offload else dataclasses.replace(run.fixed, offload="none")
    return search(model, cluster, run.gpus, run.global_batch, fixed, "bf16",
                  assumptions=assumptions, runnable=False)[0]


def validation_rows(assumptions: Assumptions = Assumptions()) -> list[dict]:
    """One row per published run: predicted and published MFU (fractions), the difference in
    points, the layout the planner chose, whether it fits and its memory per GPU (bytes), and
    model TFLOP/s per GPU (predicted: MFU × the dense bf16 peak; published where given)."""
    rows = []
    for run in RUNS:
        e = predict(run, assumptions)
        rows.append({"run": run.key, "model": run.model, "gpu": run.gpu, "gpus": run.gpus,
                     "seq_len": e.model.seq_len, "layout": e.layout.name(), "fits": e.fits,
                     "mem_bytes_per_gpu": e.mem_bytes_per_gpu, "predicted": e.mfu,
                     "published": run.mfu, "diff_points": 100 * (e.mfu - run.mfu),
                     "tflops_predicted": e.mfu * e.cluster.gpu.bf16_flops / 1e12,
                     "tflops_published": run.tflops,
                     "independent": run.independent, "source": run.source})
    return rows


def derive_gemm_efficiency(layer_seconds_measured: float = 19.6e-3) -> float:
    """The ``gemm_efficiency`` that makes this model reproduce Korthikanti et al. 2022 Table 4:
    one layer of their 22B GPT (A100 80 GB, t = 8, micro-batch 4 × 2048 tokens, no
    recomputation, no sequence parallelism) takes 19.6 ms forward + backward. Subtract the four
    TP all-reduces, the attention core and the element-wise traffic as this model charges them;
    the dense matmuls' FLOPs over the remaining time, over the peak, is the efficiency."""
    from .comm import _coll
    from .compute import layer_seconds
    from .layout import PlanLayout

    model, cluster = get_model("megatron-22b"), get_cluster("a100-sxm-80gb")
    lay = PlanLayout(dp=1, tp=8, pp=1, micro_batch=4, ckpt="none", sp=False)
    tokens = 4 * model.seq_len
    parts = layer_seconds(model, lay, cluster.gpu, Assumptions(gemm_efficiency=1.0))
    tp = _coll(cluster, lay, "tp", "all_reduce", "act", 2 * tokens * model.d_model, 4,
               Assumptions())
    dense_at_peak = tokens * parts["dense"]
    left = layer_seconds_measured - tp.seconds - tokens * (parts["core"] + parts["elementwise"])
    return dense_at_peak / left
