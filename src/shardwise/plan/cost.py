"""The analytical cost model: per-GPU memory, step time, tokens/s and MFU of one layout.

Symbols: ``L`` layers, ``d`` width, ``h`` heads, ``hd = d/h``, ``kvd`` = kv heads · hd, ``f`` MLP
hidden size, ``V`` vocabulary, ``s`` sequence length, ``b`` sequences per micro-batch, ``G``
sequences per optimizer step (all replicas), ``n`` = dp, ``t`` = tp, ``p`` = pp, ``c`` = cp,
``v`` virtual stages per pipeline rank (interleaved 1F1B), ``m = G/(n·b)`` micro-batches per
step and replica,
``a`` bytes per activation element, ``Ψ`` parameters, ``Ψ_s`` parameters held by one GPU's pipeline
stage after TP sharding.

Memory per GPU (bytes), for the first and the last pipeline stage (the two that peak)
------------------------------------------------------------------------------------------
* **Model state** (Rajbhandari et al. 2020, ZeRO, §5.1 and Fig. 1) with P, G, K bytes per
  parameter for parameters, gradients, optimizer state (:data:`PRECISIONS`)::

      zero 0: (P + G + K)·Ψ_s     zero 1: (P + G)·Ψ_s + K·Ψ_s/n
      zero 2: P·Ψ_s + (G + K)·Ψ_s/n     zero 3: (P + G + K)·Ψ_s/n

  (+ G·Ψ_s for zero 2/3 accumulating full gradients over several micro-batches)

  plus 4 bytes per parameter tensor: PyTorch's AdamW keeps a float32 ``step`` per tensor.
  TP shards every matmul weight and the vocabulary (Megatron-LM, Shoeybi et al. 2019 §3);
  norms and biases are replicated.
* **Activations** kept for backward, per layer and micro-batch: :func:`layer_activation_bytes`
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  §4, eqs. 1–6), times the micro-batches in flight on the first stage (§4.2.3: 1F1B keeps ``p``
  of them, so the first stage holds ``L`` layers' worth; interleaving multiplies by
  ``1 + (p−1)/(p·v)``; GPipe keeps all ``m``; ZB-H1 keeps as many as 1F1B, Qi et al. 2023 §3.1).
  The last stage adds the final norm and the fp32 log-probabilities of the loss, ``4·b·s·V/t``
  (§4.3), plus the ``a·b·s·V/t`` logits before the cast.
* **Buffers**: ZeRO-3 gathers two layers at a time (current + prefetch), ``(P + G)·2·layer/t``;
  a pipeline stage keeps one send and one receive buffer of ``a·b·s·d/t``; with
  ``grad_bucket_copy`` (shardwise's explicit DP) the gradient buckets are a second copy of the
  gradients, ``G·Ψ_s``.
* A layout fits when the larger of the two stages ≤ HBM·(1 − ``memory_reserve``) (CUDA context,
  NCCL buffers, allocator fragmentation).

Compute
-------
Model FLOPs per token (the MFU numerator): ``6·N + 12·L·d·s``, with ``N`` the matmul weights
(every layer's plus the output projection V·d; :meth:`ModelSpec.matmul_params`) and ``12·L·d·s``
the attention scores and the weighted sum over values, forward ×3 for forward + backward, counted
over the full ``s × s`` square (Chowdhery et al. 2022, PaLM, App. B; Korthikanti et al. 2022,
App. A eq. 7; Kaplan et al. 2020 §2.1 count the same terms). Hardware FLOPs add what a recompute
runs again: full recomputation one more forward (``2·N_layer + 4·d·s`` per token per layer),
selective recomputation the attention core when it is not a flash kernel (``4·d·s``, eq. 8).
MFU = model FLOPs per step / (step time · GPUs · dense bf16 peak), for every precision.

Time of a layer (:func:`layer_seconds`), per token on one GPU, as a roofline of three parts:

* dense matmuls: their FLOPs / (peak · ``gemm_efficiency``);
* the attention core: with a flash kernel its FLOPs / (peak · the GPU's ``flash_efficiency``,
  the kernel's published utilisation); otherwise the larger of its FLOPs at the GEMM rate and
  the bytes it moves through HBM (scores, softmax, dropout and their gradients: ``6a + 1`` bytes
  per score element forward, ``9a + 1`` backward, ``4a`` / ``7a`` without dropout) over the HBM
  bandwidth;
* element-wise operations (norms, residual adds, RoPE, the MLP activation): the bytes they read
  and write over the HBM bandwidth (:func:`elementwise_bytes`);
* per micro-batch, adding the new weight gradients into the accumulated ones (``wgrad_bytes``
  per parameter of the stage over the HBM bandwidth) — PyTorch autograd and FSDP do it as a
  separate kernel (Llama 3 §3.3.2 accumulates in fp32 across micro-batches); Megatron-LM fuses it
  into the weight-gradient GEMM (``grad_accum_fused``), where it costs nothing measurable.

``gemm_efficiency`` (default 0.676) is not fitted to the runs we validate against: it is one
published per-layer measurement read through this model. Korthikanti et al. 2022 Table 4: one
layer of their 22B model (A100, t = 8, b = 4, s = 2048, no recomputation, no SP) takes 19.6 ms
forward + backward; taking away what this model charges for its four TP all-reduces, its
attention core and its element-wise traffic leaves the dense matmuls at 0.676 of peak
(:func:`shardwise.plan.published.derive_gemm_efficiency` repeats the computation).

Communication (time = ring steps · latency + bytes sent per rank / (bandwidth · ``link_efficiency``))
-------------------------------------------------------------------------------------------------
Bytes sent per rank come from :func:`shardwise.comm.ledger.ring_bytes`, the formulas the ledger
books (2(n−1)/n·S for all-reduce, (n−1)/n·S for all-gather and reduce-scatter; Patarasuk & Yuan
2009; JAX scaling book, "How to Parallelize a Transformer for Training"). Placement follows the
rank grid (pp, dp, tp), TP innermost: a group whose ranks share a node uses NVLink; a group that
spans nodes with k members per node runs k rings side by side, one per NIC, so its bandwidth per
GPU is min(intra, k·inter) with the inter-node latency.

* TP (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2): per layer and micro-batch, 2
  all-reduces of ``a·b·s·d`` in forward and 2 in backward (with SP, all-gathers + reduce-scatters of
  the same total bytes); full recomputation repeats the forward two. The vocabulary-parallel
  embedding adds one forward all-reduce on the first stage; the output layer one all-gather
  forward and one reduce-scatter backward on the last (SP), or one all-reduce backward (no SP).
  **Not overlapped** (exposed on the critical path).
* DP / ZeRO over the dp axis, per optimizer step (Rajbhandari et al. 2020 §7): zero 0 one
  all-reduce of the gradients (``G_c·Ψ_s``, ``G_c`` bytes per communicated gradient); zero 1 and
  2 a reduce-scatter of the gradients and an all-gather of the updated parameters (``P·Ψ_s``);
  zero 3 per micro-batch an all-gather of the parameters for forward and another for backward,
  and the reduce-scatter. With several micro-batches, zero 2/3 either accumulate full local
  gradients and reduce-scatter once (``grad_reduce="step"``: shardwise's ZeRO engine, FSDP's
  ``no_sync``; the full gradients are held) or reduce-scatter after every micro-batch
  (``"micro"``: DeepSpeed; m × the bytes, gradients stay sharded). Zero 1–3 add one fp64
  all-reduce for the global gradient norm; every layout the two fp64 scalar all-reduces of
  ``train_step`` (token count, loss), 8 bytes each.
  **Overlap**: gradient reduction runs under the backward of the (last) micro-batch, the
  parameter all-gather of zero 1/2 under the next step's first forward (Megatron-LM's
  overlapped param gather), zero 3's gathers under the forward/backward they prefetch for; only
  what exceeds that window is exposed.
* PP (Narayanan et al. 2021 §2.2, §4.1): each micro-batch sends ``a·b·s·d/t`` forward and the
  same backward at every stage boundary (the scatter/gather optimisation splits it over the TP
  ranks), ``2·m·v`` sends per rank. With ``p2p_overlap`` (asynchronous sends, as Llama 3 §3.3.2
  uses) they run under compute in the steady state and only the ``2(p−1)`` hops of the fill and
  the drain are exposed; without it (Megatron-LM's synchronous send/receive, which MegaScale,
  Jiang et al. 2024 §3.2, had to overlap) every send is on the critical path.

Context parallelism (cp > 1; :mod:`shardwise.parallel.cp`)
---------------------------------------------------------
The rank grid is (pp, dp, cp, tp), TP innermost, CP next (:func:`axis_link`): the cp group of a
rank is its tp peers' stride apart, on NVLink while ``t·c`` ≤ GPUs per node, across nodes
(min(NVLink, k·NIC) with k cp members per node) beyond. Each rank holds ``s/c`` tokens of every
sequence (the zig-zag split: seq_len must be divisible by 2c; Llama-style models only), so:

* **memory**: every activation is per token, so activations, the loss's log-probabilities and
  the pipeline buffers are those of ``b·s/c`` tokens (÷ c); the all-gather method also keeps the
  gathered K/V of the whole sequence for attention's backward, ``c·KV`` per layer
  (KV = :func:`cp_kv_bytes` = ``2·b·(s/c)·(k/t)·hd·a``) in place of its local KV, i.e.
  ``(c−1)·KV`` more; one layer's transfer buffers (ring:
  2·KV + 2·KV·4/a; all-gather: the c·KV gradient of the gathered K/V) are buffers;
* **compute**: per token unchanged (each local query still attends to its causal prefix of the
  whole sequence; ``12·d·s`` model FLOPs per token and layer, PaLM's full-square count), over
  ``b·s/c`` tokens per micro-batch;
* **traffic** per layer and micro-batch: :func:`cp_layer_bytes`, the bytes of our engine's
  ring and all-gather attention (:func:`shardwise.parallel.cp.cp_attention_bytes`, checked
  against the ledger at 1.0000); their time and overlap: :func:`cp_collectives` (the ring hides
  each block's transfer under the previous block's attention when that is longer; the
  all-gather is exposed, as Llama 3 §3.3.2 accepts for its small GQA K/V); full recomputation
  repeats the forward's traffic;
* **gradients**: parameters are replicated over cp, so DP/ZeRO run over the flattened dp × cp
  group (torchtitan's ``dp_shard_cp``): model state with ZeRO is sharded over ``n·c`` ranks,
  the gradient reduce-scatter / all-reduce and the parameter all-gathers span ``n·c`` ranks
  (stride t on the grid), and the optimizer step updates a ``1/(n·c)`` shard.

Not modelled: the lower efficiency of a flash kernel on the smaller ``s/(2c)`` blocks the ring
computes, link contention between the ring and TP/DP traffic, and document masks.

Mixture of experts and expert parallelism (``model.n_experts`` > 0, ``ep`` ≥ 1)
-------------------------------------------------------------------------------
An MoE layer (:mod:`shardwise.plan.models`: E experts of width f_e, top_k k, n_shared shared
experts) holds every expert but runs k of them per token, so **memory counts total parameters
and FLOPs active ones**: model FLOPs per token ``6·N_active + 12·L·d·s`` with N_active the
attention, the router (d·E), the shared experts and k experts per MoE layer (Megatron-LM's
``num_floating_point_operations``, Mixtral's "active parameters").

Expert parallelism shares the experts out over ``ep`` ranks of the data axes (EP ⊆ dp × cp:
Megatron-Core's tp-cp-ep-dp-pp order, torchtitan, :class:`shardwise.topology.Topology`; ep
divides dp·cp and E): each rank holds E/ep experts of every MoE layer. The ep group is ep
consecutive ranks of the data line (stride tp), the expert-data-parallel group "edp" the
dp·cp/ep ranks that hold the same experts (stride tp·ep) (:func:`axis_link`).

* **memory**: expert weights, gradients and optimizer state ÷ ep, and ZeRO shards them over
  edp (so with ZeRO-3, P·E_layer/(ep·dp·cp/ep) = P·E_layer/(dp·cp): EP saves their gathers,
  not their shards); router, shared experts and every dense weight as before over dp·cp.
  Activations of an MoE layer: :func:`layer_activation_bytes` (``moe``); one layer's receive
  buffer of dispatched rows, ``T·k·d·a``, is a buffer.
* **compute**: under uniform routing every rank computes as many expert rows (T·k per
  micro-batch) as its tokens sent, so the time per token is that of the active FLOPs, ep or
  not (:func:`layer_seconds`).
* **all-to-all** per MoE layer and micro-batch: dispatch and combine forward, and both again
  backward, each moving ``(ep−1)/ep · T·k·d·a`` per rank in each direction (T tokens the rank
  routes, :func:`ep_tokens`) — the uniform-routing expectation of the bytes the engine's
  formula counts from the actual routing (:func:`ep_layer_bytes`,
  :func:`shardwise.parallel.ep.ep_bytes_formula`); plus the E int64 routing counts. Timed over
  the link the ep group spans and **exposed** (:func:`ep_collectives`).
* **gradients**: expert gradients are summed (reduce-scattered under ZeRO) over edp, dense ones
  over dp·cp, under the same tags, in the same backward window (:func:`dp_collectives`).
* **TP** (:func:`etp`): with SP, experts split over tp and the dispatched copies gathered over
  it (Megatron-Core's expert tensor parallelism = tp: the MoE layer's TP collectives carry
  k copies, the shared experts one more pair); without SP the MoE feed-forward is whole on
  every tp rank (shardwise's engine: one f/g pair per MoE block, expert FLOPs not ÷ tp).

Not modelled: routing imbalance (the busiest rank sets the pace of every all-to-all), token
dropping, all-to-all overlap with compute (DeepSeek-V3's DualPipe, Megatron-Core ≥ v0.14),
grouped-GEMM efficiency below the dense GEMMs', MoE parallel folding (an ep group that spans
tp ranks, ETP ≠ TP), the dispatcher's host synchronisation for dropless splits.

Hybrid sharded data parallelism (HSDP: ``dp_replicate`` R > 1, ZeRO ≥ 1)
------------------------------------------------------------------------
PyTorch FSDP's "hybrid sharding" (Zhao et al. 2023, "PyTorch FSDP", §3.2.3; FSDP1's
``HYBRID_SHARD``, pytorch/pytorch#89915: "zero-3 style sharding within a node, and data parallel
across"), torchtitan's and FSDP2's ``fully_shard`` on a 2-D (replicate, shard) mesh; for ZeRO-1,
Megatron-Core's ``num_distributed_optimizer_instances`` = R. dp = R × S, the mesh (pp,
dp_replicate, dp_shard, cp, tp), replicas outermost (:func:`axis_link`). ZeRO runs over the
shard group, the S·cp ranks of one replica ("dp_shard_cp"; S·cp = dp·cp without HSDP), and the
R shard groups hold the same shards. With Ψ_s a rank's parameters and S' = S·cp:

* **memory**: the ZeRO formulas above with n·c → S' (each state is R× what ZeRO over all of
  dp·cp holds): zero 3 ``(P + G + K)·Ψ_s/S'``; expert state over S'/ep ranks;
* **bytes per step** (ZeRO §7's formulas within the group, plus one all-reduce across groups;
  :func:`dp_collectives`): gradients reduce-scattered in the shard group,
  ``(S'−1)/S'·G_c·Ψ_s``, then this rank's 1/S' shard all-reduced over the R replicas,
  ``2(R−1)/R·G_c·Ψ_s/S'``; parameters all-gathered in the shard group only,
  ``(S'−1)/S'·P·Ψ_s`` (zero 1/2 once per step; zero 3 before every micro-batch's forward and
  again before its backward);
* **links**: each term over the link its group spans — the shard group on NVLink while
  S'·tp ≤ GPUs per node, the replicas (stride S'·tp) across nodes — and in the same overlap
  windows as ZeRO's (the all-reduce after the last micro-batch's reduce-scatter, under its
  backward). With ``grad_reduce="micro"`` the shard is all-reduced once, after the last
  micro-batch: FSDP2's "reduce-scatter but no all-reduce" accumulation,
  ``set_requires_all_reduce(False)`` on the others (pytorch/pytorch#126166); FSDP2's default
  all-reduces after every micro-batch, m× that term;
* **optimizer**: updates a 1/S' shard.

So against ZeRO-3 over all of dp, HSDP with an intra-node shard group takes every parameter
gather and the reduce-scatter off the inter-node links and sends ``2(R−1)/R·G_c·Ψ_s/S'`` per
step across them instead, for R× the model state (:func:`hsdp_comparison`).

Pipeline bubble (idle time per step, ``t_mb`` = one micro-batch's forward + backward on a stage)
-----------------------------------------------------------------------------------------------
GPipe and 1F1B ``(p−1)·t_mb`` (Huang et al. 2019; Narayanan et al. 2021 §2.2.1: fraction
``(p−1)/m``); interleaved 1F1B ``(p−1)·t_mb/v`` (§2.2.2); ZB-H1 ``(p−1)·(t_F + t_B − t_W)`` with
``t_F = t_B = t_W = t_mb/3`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1), i.e. a
third of 1F1B's. Step time = m·t_mb + bubble + exposed DP and PP communication + the optimizer
step (memory-bound: ``adam_bytes`` per parameter of its shard over the HBM bandwidth).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ..comm.ledger import ring_bytes
from ..errors import ShardwiseConfigError
from ..parallel.cp import cp_attention_bytes, validate_cp
from ..parallel.layout import Layout
from .hardware import Cluster
from .models import ModelSpec
from ..models.sdpa import SDPA_GQA


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter of parameters ``P``, gradients ``G``, optimizer state ``K``; bytes per
    communicated gradient element ``grad_comm``; bytes per activation element ``act``;
    ``compute`` dtype of the matmuls; ``adam_bytes`` read + written per parameter by the
    optimizer step; ``wgrad_bytes`` read + written per parameter and micro-batch to add a new
    weight gradient into the accumulated one when that is a separate element-wise kernel (bf16:
    write and read the bf16 gradient, read and write the fp32 sum; fp32: 4 × 4)."""

    name: str
    param: int
    grad: int
    optim: int
    grad_comm: int
    act: int
    compute: str
    adam_bytes: int
    wgrad_bytes: int


PRECISIONS = {
    # bf16 weights, fp32 main gradients (Megatron-LM's accumulation buffer, reduced in fp32 as
    # Llama 3 §3.3.2 does), fp32 master weights + Adam m, v: 2 + 4 + 12 = 18 bytes/parameter
    # (Megatron-LM distributed-optimizer table; ZeRO §3.1 counts 2 + 2 + 12 with fp16 gradients)
    "bf16": Precision("bf16", 2, 4, 12, 4, 2, "bf16", 30, 12),
    # shardwise's --dtype bf16: fp32 weights, gradients and Adam state, bf16 autocast compute
    "amp": Precision("amp", 4, 4, 8, 4, 2, "bf16", 28, 16),
    # everything fp32 (the CPU tests): 4 + 4 + 8 = 16 bytes/parameter
    "fp32": Precision("fp32", 4, 4, 8, 4, 4, "fp32", 28, 16),
}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
CKPT = ("none", "selective", "full")
STEP_COUNTER_BYTES = 4  # torch.optim.AdamW: one float32 `step` tensor per parameter tensor


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The constants that are not datasheet numbers (see the module docstring)."""

    gemm_efficiency: float = 0.676
    link_efficiency: float = 0.8
    memory_reserve: float = 0.10
    grad_bucket_copy: bool = False  # True for shardwise's explicit DP engine
    p2p_overlap: bool = True  # pipeline sends run under compute except in the fill and drain
    grad_accum_fused: bool = False  # weight gradients accumulate inside the GEMM (Megatron-LM)


@dataclasses.dataclass(frozen=True)
class PlanLayout(Layout):
    """One way to run a step: a :class:`~shardwise.parallel.layout.Layout` (dp, cp, tp, pp,
    zero, sp, schedule, ``virtual_stages``: model chunks per pipeline rank, interleaved-1f1b
    only, 0 = the schedule's default, read through ``chunks``; ``cp`` ranks split every
    sequence, ``cp_method`` "ring" or "allgather") plus the knobs only the planner
    varies. ``schedule`` is ignored when pp == 1; ``microbatches`` stays 0: m follows from the
    global batch, m = G/(dp·b). ``micro_batch``: sequences per micro-batch (b). ``ckpt``:
    activation checkpointing (none | selective | full). ``precision``: a key of
    :data:`PRECISIONS`. ``grad_reduce`` (zero 2 and 3 with several micro-batches): "step" — the
    micro-batches accumulate full local gradients and one reduce-scatter runs after the last
    (shardwise's ZeRO engine, FSDP under ``no_sync``); "micro" — a reduce-scatter after every
    micro-batch, gradients stay sharded (DeepSpeed ZeRO-2, FSDP without ``no_sync``).
    ``dp_replicate`` R (HSDP, hybrid sharded data parallelism): dp = R × S, ZeRO shards over the
    shard group of S = :attr:`dp_shard` ranks (× cp) and the R shard groups replicate each other
    (module docstring, section "HSDP"); R = 1 is ZeRO over all of dp. R must divide dp and needs
    ZeRO ≥ 1 (:func:`check_layout`)."""

    micro_batch: int = 1
    ckpt: str = "none"
    precision: str = "bf16"
    grad_reduce: str = "step"  # zero 2/3: "step" (once, after accumulating) or "micro"
    # (``dp_replicate`` and ``dp_shard``: the engine's Layout fields, inherited)

    def name(self) -> str:
        """:meth:`Layout.name` (the format of verify and bench), then the planner's knobs, e.g.
        ``"dp=64,tp=8,pp=16,zero=1,sp,interleaved-1f1b,v=8,b=1,ckpt=selective"``;
        ``reduce/micro-batch`` marks ZeRO-2/3 reducing after every micro-batch; an HSDP layout
        has ``dp_replicate=R`` after its degrees, e.g. ``"dp=16,pp=4,dp_replicate=2,zero=3,…"``
        (the format of the engine's ``Layout.name``)."""
        base = super().name()
        if self.dp_replicate > 1 and "dp_replicate=" not in base:
            # the engine's Layout.name format: after the degrees (dp, cp, tp, pp)
            head = base.split(",")
            k = 0
            while k < len(head) and head[k].split("=")[0] in ("dp", "cp", "tp", "pp"):
                k += 1
            base = ",".join(head[:k] + [f"dp_replicate={self.dp_replicate}"] + head[k:])
        parts = [base, f"b={self.micro_batch}"]
        if self.ckpt != "none":
            parts.append(f"ckpt={self.ckpt}")
        if self.zero >= 2 and self.grad_reduce == "micro":
            parts.append("reduce/micro-batch")
        return ",".join(parts)


# ---------------------------------------------------------------------------------------------
# activations


def layer_activation_bytes(model: ModelSpec, tokens: int, *, tp: int = 1, sp: bool = False,
                           ckpt: str = "none", act_bytes: int = 2, moe: bool = False) -> float:
    """Bytes one transformer layer keeps for backward for a micro-batch of ``tokens`` = b·s
    tokens (each sequence ``model.seq_len`` long), on one TP rank.

    Korthikanti et al. 2022 §4.1 count, per layer and with ``a`` bytes per element: each norm keeps
    its input and its output (the next matmul's input); attention keeps Q, K, V and its output
    (the projection's input), plus — without a flash kernel — the softmax output (``a·h·s`` per
    token), its dropout mask (``h·s``) and the dropout output (``a·h·s``); the MLP keeps its
    intermediate tensors of width f; dropout keeps 1-byte masks after attention and MLP. For a
    GPT layer (GeLU, f = 4d, MHA, dropout, a = 2) this is their ``sbh(34 + 5as/h)`` (eq. 1).

    ``kernels="fused"`` (ModelSpec): norms keep 2 tensors, K and V are ``kvd`` wide (GQA), SwiGLU
    keeps 3·f (its fused input [w1x, w3x] and output), GeLU 2·f (fc1 out, GeLU out); a flash
    kernel adds its fp32 log-sum-exp (4·h bytes per token). ``kernels="eager"`` (our Llama in
    PyTorch eager mode, exact in fp32 — checked under FakeTensorMode by
    :mod:`shardwise.plan.estimate`): RMSNorm keeps x, x·rstd and the output (3·d) plus rstd
    (4 bytes); K and V are ``kvd`` wide where SDPA attends them natively (``enable_gqa``,
    torch ≥ 2.5, :mod:`shardwise.models.sdpa`), else repeated to all h heads (d each); SwiGLU
    keeps w1x, silu(w1x), w3x and their product (4·f).

    TP (eq. 2): attention and MLP tensors are split over ``tp``; the norms' tensors and the
    dropout masks are replicated unless ``sp`` (sequence parallelism, eq. 4: everything / t).

    ``moe``: an MoE layer, whose MLP part is, per token, the router's fp32 probabilities
    (4·E), the k dispatched copies of the token the experts multiply (a·k·d), each copy's
    expert intermediates (the MLP's count with f_e), the k expert outputs the combine weights
    (their gradient needs them: a·k·d) and the shared experts' intermediates. All but the
    dispatched copies are split over the expert-tensor-parallel degree ``etp`` (:func:`etp`:
    t with SP, Megatron-Core's expert TP; 1 without, shardwise's whole MoE feed-forward per tp
    rank); the copies are whole on every tp rank (with SP they are all-gathered over tp before
    the experts). Selective recomputation keeps the copies, the experts' pre-activations and
    outputs; full keeps the layer input.

    ``ckpt``: "none"; "selective" — recompute every FLOP-light operation in backward (the norms'
    outputs, the MLP activation function, a non-flash attention core; Korthikanti §5 applied to
    every such operation): keep the two norm inputs, Q, K, V, the attention output and the MLP's
    pre-activations (SwiGLU 2·f, GeLU f), and the dropout masks; "full" — keep only the layer's
    input (``a·d`` per token, split by SP).
    """
    m, a, d = model, act_bytes, model.d_model
    # eager: K and V repeated to h heads only where this torch's SDPA lacks native GQA
    kv_stored = d if m.kernels == "eager" and not SDPA_GQA else m.kv_dim
    rep = tp if sp else 1  # divisor of the parts TP replicates
    masks = 2 * d if m.dropout else 0  # bytes per token, 1-byte masks
    lse = 4 * m.n_heads if m.flash_attention else 0
    core = 0.0
    if not m.flash_attention:
        core = a * m.n_heads * m.seq_len + ((1 + a) * m.n_heads * m.seq_len if m.dropout else 0)
    if ckpt == "full":
        return tokens * a * d / rep
    if ckpt == "selective":
        replicated = 2 * a * d + masks
        mlp = 2 if m.mlp == "swiglu" else 1
        split = a * (2 * d + 2 * kv_stored) + lse
    elif ckpt == "none":
        if m.kernels == "eager":
            replicated = 2 * (3 * a * d + 4) + masks
            mlp = 4 if m.mlp == "swiglu" else 2
        else:
            replicated = 2 * (2 * a * d) + masks
            mlp = 3 if m.mlp == "swiglu" else 2
        split = a * (2 * d + 2 * kv_stored) + lse + core
    else:
        raise ShardwiseConfigError(f"--ckpt {ckpt!r}: choose from {CKPT}")
    if not moe:
        return tokens * (replicated / rep + (split + a * m.d_ff * mlp) / tp)
    k, f_e, e = m.top_k, m.expert_ff, etp(tp, sp)
    experts = 4 * m.n_experts + a * (k * mlp * f_e + k * d + m.n_shared_experts * mlp * f_e)
    return tokens * (replicated / rep + split / tp + a * k * d + experts / e)


def etp(tp: int, sp: bool) -> int:
    """The expert-tensor-parallel degree an MoE layer runs with under ``tp``: with sequence
    parallelism the experts are split over the tp ranks and the dispatched tokens gathered over
    them (Megatron-Core's default ``expert_tensor_parallel_size`` = tp, which needs SP with
    EP); without it the MoE feed-forward is whole on every tp rank, which routes the same
    tokens (shardwise's engine, :mod:`shardwise.parallel.ep`): 1."""
    return tp if sp else 1


def head_activation_bytes(model: ModelSpec, tokens: int, *, tp: int = 1, sp: bool = False,
                          act_bytes: int = 2) -> float:
    """Bytes the last stage keeps for the final norm and the loss of one micro-batch: the norm
    (as in :func:`layer_activation_bytes`), the fp32 log-probabilities ``4·V/t`` per token
    (Korthikanti §4.3) and, when activations are not fp32, the ``a·V/t`` logits before the
    cast. Eager kernels also keep the int64 labels (8 bytes per token)."""
    m, a, d = model, act_bytes, model.d_model
    rep = tp if sp else 1
    if m.kernels == "eager":
        norm, labels = 3 * a * d + 4, 8
    else:
        norm, labels = 2 * a * d, 0
    logits = 4 * m.vocab_size + (a * m.vocab_size if a != 4 else 0)
    return tokens * (norm / rep + logits / tp + labels)


def embedding_activation_bytes(model: ModelSpec, tokens: int) -> float:
    """What the first stage keeps for the embedding: eager kernels keep the int64 token ids
    (8 bytes per token) for the embedding's backward; fused kernels: negligible."""
    return tokens * 8.0 if model.kernels == "eager" else 0.0


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak (Korthikanti §4.2.3;
    Narayanan et al. 2021 §2.2): GPipe m; 1F1B and ZB-H1 min(m, p); interleaved 1F1B
    min(m, p)·(1 + (p−1)/(p·v)). One when p = 1 (gradient accumulation runs them one by one)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zb-h1"):
        return float(min(m, p))
    if schedule == "interleaved-1f1b":
        return min(m, p) * (1 + (p - 1) / (p * v))
    raise ShardwiseConfigError(f"--schedule {schedule!r}: choose from {SCHEDULES}")


def bubble_time(schedule: str, p: int, t_mb: float, v: int = 1, m: int | None = None) -> float:
    """Idle time per step on the critical stage (seconds), ``t_mb`` = forward + backward of one
    micro-batch on one stage (see the module docstring for the sources). With fewer micro-batches
    than stages (``m < p``) interleaving and ZB-H1 have nothing to fill the bubble with: they
    are charged as 1F1B, (p−1)·t_mb."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * t_mb
    if m is not None and m < p:  # too few micro-batches to fill the pipeline: as 1F1B
        return (p - 1) * t_mb
    if schedule == "interleaved-1f1b":
        return (p - 1) * t_mb / v
    if schedule == "zb-h1":
        t_f = t_b = t_w = t_mb / 3
        return (p - 1) * (t_f + t_b - t_w)
    raise ShardwiseConfigError(f"--schedule {schedule!r}: choose from {SCHEDULES}")


def elementwise_bytes(model: ModelSpec, *, tp: int = 1, sp: bool = False, ckpt: str = "none",
                      act_bytes: int = 2, moe: bool = False) -> float:
    """HBM bytes per token one layer's element-wise operations read and write, forward +
    backward, on one TP rank (``a`` = ``act_bytes``).

    On d-wide tensors (split over tp by SP, else replicated): forward 10 passes (each norm reads
    and writes, each residual add reads two and writes one), backward 12 (each norm reads input
    and gradient and writes one; each residual sums two gradients); full recomputation repeats the
    forward 10, selective recomputation the norms' 4. RoPE reads and writes Q and K forward and
    backward (4·(d + kvd)). On f-wide tensors (split over tp): SwiGLU 3 forward + 5 backward,
    GeLU 2 + 3, plus the forward again under any recomputation. Dropout writes and reads a 1-byte
    mask after attention and after the MLP.

    ``moe``: the f-wide passes run on (k + n_shared) experts' f_e-wide tensors per token, split
    over :func:`etp`; the permutation that sorts the k copies by expert and the combine that
    sums them back read and write k·d per token each (4·k·d forward, the same backward: the
    "permute/unpermute" kernels of Megatron-Core), on the rank's share (÷ etp)."""
    m, a, d = model, act_bytes, model.d_model
    rep = tp if sp else 1
    d_passes = 22 + {"none": 0, "selective": 4, "full": 10}[ckpt]
    f_fwd, f_bwd = (3, 5) if m.mlp == "swiglu" else (2, 3)
    f_passes = f_fwd + f_bwd + (f_fwd if ckpt != "none" else 0)
    rope = 0 if m.learned_positions else 4 * (d + m.kv_dim) * (1.5 if ckpt == "full" else 1)
    masks = 4 * d if m.dropout else 0
    if moe:
        e, k = etp(tp, sp), m.top_k
        width = (k + m.n_shared_experts) * m.expert_ff
        mlp = a * f_passes * width / e + a * 8 * k * d * (1.5 if ckpt == "full" else 1) / e
    else:
        mlp = a * f_passes * m.d_ff / tp
    return a * d_passes * d / rep + a * rope / tp + mlp + masks / rep


def attention_core_bytes(model: ModelSpec, *, tp: int = 1, ckpt: str = "none",
                         act_bytes: int = 2) -> float:
    """HBM bytes per token of a non-flash attention core (0 with a flash kernel), forward +
    backward, on one TP rank: the (h/t)·s score elements per token are written by QKᵀ, read and
    written by the softmax, by dropout (plus its 1-byte mask) and read by the product with V —
    ``6a + 1`` bytes forward — and ``9a + 1`` backward (``4a`` and ``7a`` without dropout); a
    recomputation (selective or full) runs the forward again."""
    m, a = model, act_bytes
    if m.flash_attention:
        return 0.0
    fwd, bwd = (6 * a + 1, 9 * a + 1) if m.dropout else (4 * a, 7 * a)
    per_elem = fwd * (2 if ckpt != "none" else 1) + bwd
    return m.n_heads / tp * m.seq_len * per_elem


def layer_seconds(model: ModelSpec, layout: PlanLayout, gpu, assumptions: "Assumptions",
                  moe: bool = False) -> dict:
    """Seconds per token of one layer's forward + backward (recomputation included) on one GPU
    of ``layout``, by part: "dense", "core", "elementwise", and their sum "total" (the module
    docstring gives the roofline). Communication is not included. ``moe``: an MoE layer —
    the attention matmuls split over tp, the router, the shared experts and top_k experts per
    token (every token's k copies run on some rank: under uniform routing each rank computes
    as many copies as it sent, so expert parallelism leaves the FLOPs per rank unchanged) split
    over :func:`etp`; all at the same ``gemm_efficiency``."""
    m, lay, A = model, layout, assumptions
    prec = PRECISIONS[lay.precision]
    peak = gpu.bf16_flops if prec.compute == "bf16" else gpu.fp32_flops
    t, d, s = lay.tp, m.d_model, m.seq_len
    if moe:
        ffn = m.layer_active_matmul_params(moe=True) - m.attention_matmul_params()
        matmuls = m.attention_matmul_params() / t + ffn / etp(t, lay.sp)
    else:
        matmuls = m.layer_matmul_params() / t
    dense = 6 * matmuls * (4 / 3 if lay.ckpt == "full" else 1)
    core_flops = 12 * d * s / t
    if lay.ckpt == "full" or (lay.ckpt == "selective" and not m.flash_attention):
        core_flops *= 4 / 3
    t_dense = dense / (peak * A.gemm_efficiency)
    if m.flash_attention:
        t_core = core_flops / (peak * gpu.flash_efficiency)
    else:
        t_core = max(core_flops / (peak * A.gemm_efficiency),
                     attention_core_bytes(m, tp=t, ckpt=lay.ckpt, act_bytes=prec.act)
                     / gpu.hbm_bandwidth)
    t_elem = elementwise_bytes(m, tp=t, sp=lay.sp, ckpt=lay.ckpt, act_bytes=prec.act,
                               moe=moe) / gpu.hbm_bandwidth
    return {"dense": t_dense, "core": t_core, "elementwise": t_elem,
            "total": t_dense + t_core + t_elem}


def head_seconds(model: ModelSpec, layout: PlanLayout, gpu, assumptions: "Assumptions") -> float:
    """Seconds per token of the output layer and the loss on one GPU: 6·V·d/t FLOPs at the GEMM
    rate, plus the logits (``a``) and four fp32 passes over them (cast, log-softmax, and their
    gradients) over the HBM bandwidth."""
    prec = PRECISIONS[layout.precision]
    peak = gpu.bf16_flops if prec.compute == "bf16" else gpu.fp32_flops
    v = model.vocab_size / layout.tp
    return (6 * v * model.d_model / (peak * assumptions.gemm_efficiency)
            + (prec.act + 16) * v / gpu.hbm_bandwidth)


# ---------------------------------------------------------------------------------------------
# parameters and model state


def partition_layers(n_layers: int, p: int, head_cost: float) -> list[int]:
    """Layers per pipeline stage, contiguous, minimising the slowest stage when a layer costs 1
    and the last stage also runs the output layer (``head_cost`` layers' worth). Llama 3 §3.3.2
    does the same by giving the first and the last stage one layer less. Raises when p > L."""
    return list(_partition(n_layers, p, head_cost))


@functools.lru_cache(maxsize=4096)
def _partition(n_layers: int, p: int, head_cost: float) -> tuple[int, ...]:
    if p == 1:
        return (n_layers,)
    if p > n_layers:
        raise ShardwiseConfigError(f"--pp {p} exceeds the model's {n_layers} layers: choose "
                                   f"pp ≤ {n_layers}")
    best = None
    for last in range(0, math.ceil(n_layers / p) + 1):
        rest = n_layers - last
        if rest < p - 1:
            continue
        q, r = divmod(rest, p - 1)
        stages = [q + 1] * r + [q] * (p - 1 - r) + [last]
        if min(stages) < 1:
            continue
        slowest = max(max(stages[:-1]), last + head_cost)
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, tuple(stages))
    return best[1]


def stage_param_split(model: ModelSpec, layers: int, *, tp: int, first: bool, last: bool,
                      pp: int, start: int = 0, ep: int = 1, sp: bool = False
                      ) -> tuple[float, float]:
    """(dense, expert): parameters one GPU of a pipeline stage holds with ``layers`` layers
    from layer ``start`` on. Dense: matmul weights and the vocabulary split over tp,
    norms/biases replicated; the first stage holds the embedding, the last the final norm and
    the output projection (with tied embeddings and pp > 1, a copy of the embedding, as
    Megatron-LM keeps one on both ends); an MoE layer's router (replicated, as Megatron-Core
    keeps it) and shared experts (÷ :func:`etp`). Expert: the routed experts of the stage's MoE
    layers, E/ep of them per rank, each split over :func:`etp` — ``L_m·E·(2|3)·d·f_e/(ep·etp)``
    (0 for a dense model)."""
    m = model
    n_moe = m.moe_layers_in(start, layers)
    e = etp(tp, sp)
    n = (layers - n_moe) * (m.layer_matmul_params() / tp + m.layer_small_params())
    n += n_moe * (m.attention_matmul_params() / tp + m.layer_small_params()
                  + m.router_params() + m.shared_params() / e)
    if first:
        n += m.vocab_size * m.d_model / tp + m.learned_positions * m.d_model
    if last:
        n += m.d_model * (2 if m.norm == "layernorm" else 1)
        if not m.tie_embeddings or (pp > 1 and not first):
            n += m.vocab_size * m.d_model / tp
    return n, n_moe * m.n_experts * m.expert_params() / (ep * e)


def stage_params(model: ModelSpec, layers: int, *, tp: int, first: bool, last: bool,
                 pp: int, start: int = 0, ep: int = 1, sp: bool = False) -> float:
    """Parameters one GPU of a pipeline stage holds: dense + expert of
    :func:`stage_param_split` (the same arguments)."""
    return sum(stage_param_split(model, layers, tp=tp, first=first, last=last, pp=pp,
                                 start=start, ep=ep, sp=sp))


def stage_tensors(model: ModelSpec, layers: int, *, first: bool, last: bool, pp: int,
                  start: int = 0) -> int:
    """Parameter tensors on a stage (for the optimizer's step counters); a rank's slice of
    stacked experts is still one tensor per matrix."""
    m = model
    if pp == 1:
        return m.num_tensors()
    n_moe = m.moe_layers_in(start, layers)
    n = (layers - n_moe) * m.layer_tensors() + n_moe * m.layer_tensors(moe=True)
    if first:
        n += 1 + (1 if m.learned_positions else 0)
    if last:
        n += (2 if m.norm == "layernorm" else 1) + 1
    return n


def model_state_bytes(params: float, tensors: int, zero: int, dp: int, prec: Precision,
                      full_grads: bool = False) -> dict[str, float]:
    """{"params", "grads", "optimizer"} bytes one GPU holds for ``params`` parameters under ZeRO
    stage ``zero`` over ``dp`` ranks (ZeRO §5.1), plus one fp32 step counter per tensor.
    ``full_grads``: zero 2/3 accumulating full local gradients over micro-batches before one
    reduce-scatter — the full gradients and the reduced shard are held at the peak."""
    P, G, K = prec.param, prec.grad, prec.optim
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}
    if zero not in shard:
        raise ShardwiseConfigError(f"--zero {zero}: choose from 0, 1, 2, 3")
    sp, sg, so = shard[zero]
    grads = G * params / sg + (G * params if full_grads and zero >= 2 else 0.0)
    return {"params": P * params / sp, "grads": grads,
            "optimizer": K * params / so + STEP_COUNTER_BYTES * tensors}


# ---------------------------------------------------------------------------------------------
# communication


@dataclasses.dataclass
class Collective:
    """One kind of collective in a step: ``count`` calls of ``op`` on a buffer of ``size``
    bytes over ``n`` ranks of ``axis``; ``wire`` = bytes this rank sends for all of them;
    ``seconds`` = time of all of them; ``exposed`` = the part not hidden under compute."""

    axis: str
    op: str
    tag: str
    size: float
    n: int
    count: float
    wire: float = 0.0
    seconds: float = 0.0
    exposed: float = 0.0
    link: str = ""
    note: str = ""


def axis_link(cluster: Cluster, layout: PlanLayout, axis: str) -> tuple[float, float, str]:
    """(bandwidth bytes/s per GPU, latency s, description) of the groups along ``axis`` ("tp",
    "cp", "dp", "pp", or "dp_cp": the flattened data axis of dp × cp) on the rank grid
    (pp, dp, cp, tp), TP innermost and CP next: ranks r = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i,
    filled node by node. A group inside one node uses NVLink; one that spans nodes with k members
    per node gets min(intra, k·inter) (k rings side by side, one per NIC). So cp traffic stays on
    NVLink while tp·cp ≤ GPUs per node and crosses nodes beyond.

    Expert parallelism rides on the data line (dp × cp flattened, stride tp), as
    :class:`shardwise.topology.Topology` builds it and Megatron-Core's tp-cp-ep-dp-pp order
    places it: "ep", ``ep`` consecutive ranks of the line (stride tp; on NVLink while
    tp·ep ≤ GPUs per node); "edp", the S·cp/ep ranks of a shard group that hold the same
    experts (stride tp·ep; S = dp without HSDP).

    HSDP (``dp_replicate`` R > 1) splits dp into (dp_replicate, dp_shard), replicas outer — the
    mesh (pp, dp_replicate, dp_shard, cp, tp) of torchtitan and FSDP2, whose flat dp index
    r_i·S + s_i is the dp index above, so every other axis is unchanged: "dp_shard", the S
    ranks of a shard group (stride tp·cp); "dp_shard_cp", the S·cp ranks ZeRO shards over
    (stride tp: torchtitan's ``dp_shard_cp``); "dp_replicate", the R ranks that hold the same
    shard (stride tp·cp·S). The shard group is on NVLink while S·cp·tp ≤ GPUs per node."""
    c = cluster  # the cache key: the link numbers only (hashing the whole Cluster is slow)
    return _axis_link(c.gpus_per_node, c.intra_bw, c.inter_bw, c.intra_latency,
                      c.inter_latency, layout.tp, layout.cp, layout.dp, layout.pp, axis,
                      layout.ep, layout.dp_replicate)


def axis_size(layout: PlanLayout, axis: str) -> int:
    """Ranks in one group along ``axis`` (the axes of :func:`axis_link`)."""
    return _axis_geometry(layout.tp, layout.cp, layout.dp, layout.pp, axis, layout.ep,
                          layout.dp_replicate)[0]


def _axis_geometry(tp: int, cp: int, dp: int, pp: int, axis: str, ep: int = 1,
                   dpr: int = 1) -> tuple[int, int]:
    """(ranks in the group, stride between them on the rank grid) of ``axis``."""
    ds = dp // dpr  # the shard group's dp ranks (all of dp without HSDP)
    n = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "ep": ep,
         "edp": ds * cp // ep, "dp_shard": ds, "dp_shard_cp": ds * cp,
         "dp_replicate": dpr}[axis]
    stride = {"tp": 1, "cp": tp, "dp": tp * cp, "pp": tp * cp * dp, "dp_cp": tp, "ep": tp,
              "edp": tp * ep, "dp_shard": tp * cp, "dp_shard_cp": tp,
              "dp_replicate": tp * cp * ds}[axis]
    return n, stride


def members_per_node(cluster: Cluster, layout: PlanLayout, axis: str) -> int:
    """k: the members of rank 0's group along ``axis`` on its node — 0 when the whole group is
    inside one node (:func:`axis_link`'s placement)."""
    n, stride = _axis_geometry(layout.tp, layout.cp, layout.dp, layout.pp, axis, layout.ep,
                               layout.dp_replicate)
    gpn = cluster.gpus_per_node
    return 0 if (n - 1) * stride < gpn else min(n, -(-gpn // stride))


@functools.lru_cache(maxsize=8192)
def _axis_link(gpn: int, intra_bw: float, inter_bw: float, intra_lat: float, inter_lat: float,
               tp: int, cp: int, dp: int, pp: int, axis: str, ep: int = 1, dpr: int = 1):
    n, stride = _axis_geometry(tp, cp, dp, pp, axis, ep, dpr)
    if (n - 1) * stride < gpn:  # the group of rank 0: ranks 0, stride, …, (n−1)·stride
        return intra_bw, intra_lat, "intra-node"
    k = min(n, -(-gpn // stride))  # members on node 0
    return min(intra_bw, k * inter_bw), inter_lat, f"inter-node ({k}/node)"


_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
          "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
          "send": lambda n: 1}


def collective_seconds(op: str, size: float, n: int, bw: float, latency: float,
                       efficiency: float) -> tuple[float, float]:
    """(bytes sent per rank, seconds) of one ring collective: ring steps · latency + bytes /
    (bw · efficiency). Bytes are :func:`shardwise.comm.ledger.ring_bytes`."""
    wire = ring_bytes(op, size, n) if op != "send" else float(size)
    if op != "send" and n <= 1:
        return 0.0, 0.0
    return wire, _STEPS[op](n) * latency + wire / (bw * efficiency)


def _coll(cluster, layout, axis, op, tag, size, count, assume, note=""):
    n = axis_size(layout, axis)
    bw, lat, where = axis_link(cluster, layout, axis)
    wire, sec = collective_seconds(op, size, n, bw, lat, assume.link_efficiency)
    return Collective(axis, op, tag, size, n, count, wire * count, sec * count, 0.0, where, note)


def dp_collectives(layout: PlanLayout, params: float, prec: Precision, m: int, cluster: Cluster,
                   assume: Assumptions, regathered: float | None = None,
                   expert_params: float = 0.0) -> list[Collective]:
    """The dp-axis collectives of one optimizer step for a GPU holding ``params`` parameters
    (see the module docstring), over dp × cp: parameters are replicated over cp, so gradients
    are summed and ZeRO shards over the flattened (dp, cp) group ("dp_cp", torchtitan's
    ``dp_shard_cp``). ``regathered``: parameters zero 3 gathers again before backward
    (default all of them; shardwise's ZeRO engine keeps its root unit gathered).
    ``expert_params``: routed-expert parameters on this GPU; with ep > 1 their gradients are
    summed (and ZeRO shards them) over the expert-data-parallel group "edp" of dp·cp/ep ranks
    that hold the same experts, the same collectives under the same tags ("grad", "param") as
    the dense ones, as shardwise's DP engine books them; with ep = 1 they are dense
    parameters.

    HSDP (``layout.dp_replicate`` R > 1, ZeRO ≥ 1; PyTorch FSDP, Zhao et al. 2023 §3.2.3
    "hybrid sharding"; torchtitan's and FSDP2's 2-D mesh): ZeRO runs over the shard group
    ("dp_shard", or "dp_shard_cp" with cp > 1: S·cp ranks; the experts' over "edp", S·cp/ep
    ranks) exactly as over all of dp·cp without HSDP — the gradient reduce-scatter and the
    parameter all-gathers span the shard group only — and one all-reduce of this rank's
    gradient shard (1/(S·cp) of Ψ) over the R replicas ("dp_replicate", tag
    "grad_replicate", as shardwise's HSDP engines book it) follows
    the reduce-scatter, once per step (with ``grad_reduce="micro"`` the shard accumulates over
    the micro-batches and is all-reduced after the last: FSDP2's
    ``set_requires_all_reduce(False)`` on the others, pytorch/pytorch#126166). The global norm
    sums the squares over the shard group (the replicas hold the same shard); the loss and
    token count are summed over every data rank. ``exposed`` is filled in by
    :func:`estimate`."""
    z, R = layout.zero, layout.dp_replicate
    whole = "dp" if layout.cp == 1 else "dp_cp"  # every data rank (parameters replicated on cp)
    if R == 1:
        ax, rep = whole, None
    else:
        if z == 0:
            raise ShardwiseConfigError(f"dp_replicate={R} needs ZeRO ≥ 1 (with zero 0 every "
                                       "rank holds everything: plain DP)")
        ax, rep = ("dp_shard" if layout.cp == 1 else "dp_shard_cp"), "dp_replicate"
    if layout.ep == 1:
        params, expert_params = params + expert_params, 0.0
    groups = [(ax, params, params if regathered is None else regathered)]
    if expert_params:
        groups.append(("edp", expert_params, expert_params))
    rs_count = m if z >= 2 and layout.grad_reduce == "micro" else 1
    rs_note = ("gradients, after every micro-batch" if rs_count > 1 else
               "gradients, once per step")
    out = [_coll(cluster, layout, whole, "all_reduce", "loss", 8, 2, assume,
                 "token count before the forward, loss sum after the step (fp64)")]
    for axis, psi, again in groups:
        g, w = prec.grad_comm * psi, prec.param * psi
        what = "" if axis != "edp" else " of the experts (over the ranks holding the same ones)"
        if rep:
            what += " in the shard group"
        if z == 0:
            out.append(_coll(cluster, layout, axis, "all_reduce", "grad", g, 1, assume,
                             "gradients" + what + ", once per step"))
            continue
        out.append(_coll(cluster, layout, axis, "reduce_scatter", "grad", g, rs_count, assume,
                         rs_note.replace("gradients", "gradients" + what)))
        if rep:
            out.append(_coll(cluster, layout, rep, "all_reduce", "grad_replicate",
                             g / axis_size(layout, axis), 1, assume,
                             "the gradient shard" + (" of the experts" if axis == "edp"
                                                     else "")
                             + " over the replicas, once per step"))
        if z < 3:
            out.append(_coll(cluster, layout, axis, "all_gather", "param", w, 1, assume,
                             "updated parameters" + what + ", once per step"))
        else:
            c = _coll(cluster, layout, axis, "all_gather", "param", w, m, assume,
                      "parameters" + what + " before every micro-batch's forward and backward")
            if again:
                back = _coll(cluster, layout, axis, "all_gather", "param",
                             prec.param * again, m, assume)
                c.wire += back.wire
                c.seconds += back.seconds
                c.count += m
            out.append(c)
    if z:
        out.append(_coll(cluster, layout, ax, "all_reduce", "grad_norm", 8, 1, assume,
                         "sum of squares of the gradient shards, for the global norm (fp64)"))
    elif expert_params:  # each ep rank holds other experts: their squares summed over ep
        out.append(_coll(cluster, layout, "ep", "all_reduce", "grad_norm", 8, 1, assume,
                         "sum of squares of the expert gradients over ep, for the norm (fp64)"))
    return out


def cp_kv_bytes(model: ModelSpec, layout: PlanLayout) -> float:
    """KV: bytes of one rank's K and V for one layer and one micro-batch, at the activation
    dtype: ``2·b·(s/cp)·k·hd·a`` with k = n_kv_heads/tp (GQA: only the kv heads travel) and a
    the activation bytes of ``layout.precision``. The unit of the formulas of
    :mod:`shardwise.parallel.cp.attention` (its module docstring)."""
    a = PRECISIONS[layout.precision].act
    return (2.0 * layout.micro_batch * (model.seq_len // layout.cp)
            * (model.n_kv_heads // layout.tp) * model.head_dim * a)


def cp_layer_bytes(model: ModelSpec, layout: PlanLayout) -> dict[str, float]:
    """{"cp_kv", "cp_dkv": bytes} one rank sends over cp for one layer and one micro-batch,
    forward + backward (no recomputation): :func:`shardwise.parallel.cp.cp_attention_bytes`
    with KV = :func:`cp_kv_bytes`, the formula the ledger checks at 1.0000 for our engine.
    Ring: ``cp_kv`` = 2(cp−1)·KV (K/V around the ring forward, again backward), ``cp_dkv`` =
    cp·KV·4/a (the fp32 dK/dV accumulators); allgather: (cp−1)·KV each (the all-gather of K/V
    forward, the reduce-scatter of dK/dV backward). Empty when cp = 1."""
    if layout.cp == 1:
        return {}
    kv = cp_kv_bytes(model, layout)
    a = PRECISIONS[layout.precision].act
    return cp_attention_bytes(layout.cp_method, layout.cp, kv, kv * 4 / a)


def cp_collectives(model: ModelSpec, layout: PlanLayout, cluster: Cluster, assume: Assumptions,
                   t_core: float, layers: int) -> list[Collective]:
    """The cp-axis traffic of one micro-batch through ``layers`` layers, with ``exposed`` the
    part on the critical path; ``t_core``: seconds of one layer's attention core for this
    micro-batch on this rank, forward + backward, without recomputation (a third forward, two
    thirds backward, as its FLOPs 4·d·s and 8·d·s per token split).

    Ring (our engine; Liu et al. 2023 §3): cp steps per pass, each step's attention is 1/cp of
    the pass (the zig-zag split gives every step the same causal work, 2 chunk pairs), and the
    next block's transfer runs under it. Forward: cp − 1 sends of KV, each exposed only by what
    exceeds one step's forward, ``(cp−1)·max(0, t_kv − t_f/cp)``. Backward: cp − 1 steps send
    K/V and the fp32 dK/dV accumulator together under one step's backward, and the last dK/dV
    send (back to its owner) is exposed: ``(cp−1)·max(0, t_kv + t_dkv − t_b/cp) + t_dkv``.
    All-gather (Llama 3 §3.3.2): the K/V all-gather runs before the attention that needs it and
    the dK/dV reduce-scatter after its backward, both exposed. Full recomputation runs the
    forward's traffic again in backward (the recomputed forward attention needs K/V again)."""
    if layout.cp == 1 or layers == 0:
        return []
    n, A = layout.cp, assume
    kv = cp_kv_bytes(model, layout)
    a = PRECISIONS[layout.precision].act
    again = 2 if layout.ckpt == "full" else 1  # forward passes per micro-batch
    per = layers * again
    t_f, t_b = t_core / 3, 2 * t_core / 3
    if layout.cp_method == "ring":
        kvc = _coll(cluster, layout, "cp", "send", "cp_kv", kv, (n - 1) * (per + layers), A,
                    "K/V to the next cp rank, forward and again backward, under attention")
        dkv = _coll(cluster, layout, "cp", "send", "cp_dkv", kv * 4 / a, n * layers, A,
                    "fp32 dK/dV accumulators around the ring (backward); the last exposed")
        one_kv, one_dkv = kvc.seconds / kvc.count, dkv.seconds / dkv.count
        fwd = (n - 1) * max(0.0, one_kv - t_f / n)
        bwd = (n - 1) * max(0.0, one_kv + one_dkv - t_b / n) + one_dkv
        # split the exposed time between the two tags in proportion to their bytes
        exposed = per * fwd + layers * bwd
        share = kvc.wire / (kvc.wire + dkv.wire)
        kvc.exposed, dkv.exposed = exposed * share, exposed * (1 - share)
        return [kvc, dkv]
    ag = _coll(cluster, layout, "cp", "all_gather", "cp_kv", n * kv, per, A,
               "K/V of the whole sequence before attention (exposed)")
    rs = _coll(cluster, layout, "cp", "reduce_scatter", "cp_dkv", n * kv, layers, A,
               "dK/dV back to their owners after attention's backward (exposed)")
    ag.exposed, rs.exposed = ag.seconds, rs.seconds
    return [ag, rs]


def ep_tokens(model: ModelSpec, layout: PlanLayout) -> float:
    """T: tokens of one micro-batch whose routed copies this rank dispatches, b·(s/cp)/etp (with
    SP each tp rank routes its s/t share; without it every tp rank routes all of them)."""
    return layout.micro_batch * (model.seq_len // layout.cp) / etp(layout.tp, layout.sp)


def ep_layer_bytes(model: ModelSpec, layout: PlanLayout) -> dict[str, float]:
    """{"ep_dispatch", "ep_combine", "ep_counts": bytes} one rank sends over ep for one MoE
    layer and one micro-batch, forward + backward (no recomputation), under uniform routing —
    the expectation when every expert receives T·k/E of each rank's copies (a balanced router;
    Megatron-Bridge's MoE benchmarks force it): of the T·k copies a rank routes, (ep−1)/ep go
    to other ranks, and as many arrive from them. With a row of d·a bytes:

    * ``ep_dispatch`` = 2 · (ep−1)/ep · T·k·d·a: the dispatch forward, and its gradient (the
      reverse all-to-all) backward;
    * ``ep_combine`` = the same: the combine forward, its gradient backward;
    * ``ep_counts`` = (ep−1)/ep · E · 8: the all-to-all of the int64 routing counts, forward.

    These are the terms of :func:`shardwise.parallel.ep.ep_bytes_formula` (the engine's
    formula from the step's actual routing, which its ledger equals at 1.0000) with its S_i =
    R_i = (ep−1)/ep · T·k. Skewed routing moves more on the ranks that hold popular experts;
    not modelled. Empty when ep = 1 or the model is dense."""
    if layout.ep == 1 or not model.is_moe:
        return {}
    ep, a = layout.ep, PRECISIONS[layout.precision].act
    rows = (ep - 1) / ep * ep_tokens(model, layout) * model.top_k
    return {"ep_dispatch": 2 * rows * model.d_model * a,
            "ep_combine": 2 * rows * model.d_model * a,
            "ep_counts": (ep - 1) / ep * model.n_experts * 8}


def ep_collectives(model: ModelSpec, layout: PlanLayout, cluster: Cluster, assume: Assumptions,
                   moe_layers: int) -> list[Collective]:
    """The ep-axis all-to-alls of one micro-batch through ``moe_layers`` MoE layers (buffer
    S = T·k·d·a, :func:`ep_tokens`; each sends (ep−1)/ep·S, :func:`ep_layer_bytes`): per layer
    a dispatch and a combine forward and both again backward, plus the routing counts' all-to-all
    forward; full recomputation runs the forward's three again. Time: (ep−1) steps of latency +
    bytes over the link the ep group spans (:func:`axis_link`). All exposed: the dispatch sits
    between the router and the experts and the combine between the experts and the residual,
    with nothing of the same layer to hide under — Megatron-Core overlapped them only from v0.14
    (2025-09, batch-level overlap of two micro-batches; DeepSeek-V3's DualPipe, §3.2.1, does
    the same), which this model does not assume."""
    if layout.ep == 1 or not model.is_moe or moe_layers == 0:
        return []
    a = PRECISIONS[layout.precision].act
    size = ep_tokens(model, layout) * model.top_k * model.d_model * a
    again = 1 if layout.ckpt == "full" else 0
    out = [_coll(cluster, layout, "ep", "all_to_all", "ep_dispatch", size,
                 (2 + again) * moe_layers, assume,
                 "routed token copies to their experts' ranks, forward and backward (exposed)"),
           _coll(cluster, layout, "ep", "all_to_all", "ep_combine", size,
                 (2 + again) * moe_layers, assume,
                 "expert outputs back to their tokens' ranks, forward and backward (exposed)"),
           _coll(cluster, layout, "ep", "all_to_all", "ep_counts", model.n_experts * 8,
                 (1 + again) * moe_layers, assume, "routing counts before the dispatch (int64)")]
    for c in out:
        c.exposed = c.seconds
    return out


def dp_step_bytes(model: ModelSpec, layout: PlanLayout, *, m: int = 1, params: float | None = None,
                  regathered: float | None = None, by_axis: bool = False) -> dict:
    """Bytes one rank sends on the dp axis per optimizer step, by ledger tag ("grad", "param",
    "grad_norm", "loss"), for pp = tp = 1 (the whole model on every rank): the number the ledger
    books. ``params`` overrides Ψ (an engine whose flat buffers are padded to a multiple of dp
    sends the padded count); ``regathered`` as in :func:`dp_collectives`. Zero 0:
    ``grad = 2(n−1)/n · G_c·Ψ``, ``loss = 2 · 2(n−1)/n · 8``; zero 1/2: reduce-scatter + all-gather,
    (n−1)/n each, plus one fp64 all-reduce for the gradient norm; zero 3: the all-gathers per
    micro-batch. With ep > 1 a rank's E/ep experts go over "edp" (:func:`dp_collectives`), under
    the same tags. HSDP (``dp_replicate`` R > 1, S = dp/R, cp = 1): "grad" is the
    reduce-scatter over S, (S−1)/S·G_c·Ψ, "grad_replicate" the all-reduce of the shard over
    R, 2(R−1)/R·G_c·Ψ/S (:func:`shardwise.parallel.zero.formulas.hsdp_replicate_bytes`, the
    engines' tag); "param" the all-gathers over S only. ``by_axis``: {axis: {tag: bytes}}
    instead (axes "dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp", "ep"), the
    per-axis numbers a ledger that books the mesh's axes compares with. Link speeds do not
    enter (bytes only)."""
    from .hardware import get_cluster

    if layout.tp != 1 or layout.pp != 1:
        raise ValueError("dp_step_bytes: the whole model per rank only (tp = pp = 1)")
    prec = PRECISIONS[layout.precision]
    psi = model.num_params() if params is None else params
    experts = 0.0
    if params is None and layout.ep > 1:  # a rank's share of the experts, reduced over edp
        psi -= model.num_expert_params()
        experts = model.num_expert_params() / layout.ep
    out: dict = {}
    for c in dp_collectives(layout, psi, prec, m, get_cluster("h100-sxm"), Assumptions(),
                            regathered, expert_params=experts):
        into = out.setdefault(c.axis, {}) if by_axis else out
        into[c.tag] = into.get(c.tag, 0.0) + c.wire
    return out


# ---------------------------------------------------------------------------------------------
# the estimate


@dataclasses.dataclass
class Estimate:
    """Everything :func:`estimate` derives for one layout (bytes, seconds, FLOPs)."""

    model: ModelSpec
    cluster: Cluster
    layout: PlanLayout
    assumptions: Assumptions
    global_batch: int  # sequences per step
    microbatches: int  # m
    stages: list[int]  # layers per pipeline stage
    memory: dict[str, dict[str, float]]  # "first"/"last" → breakdown (bytes)
    mem_bytes_per_gpu: float
    capacity_bytes: float
    fits: bool
    flops: dict[str, float]
    times: dict[str, float]
    comm: list[Collective]
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    details: dict

    @property
    def tokens(self) -> int:
        return self.global_batch * self.model.seq_len

    def to_json(self) -> dict:
        lay = self.layout
        return {
            "dp": lay.dp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "cp_method": lay.cp_method if lay.cp > 1 else None,
            "ep": lay.ep,
            "tp": lay.tp, "pp": lay.pp, "zero": lay.zero,
            "schedule": lay.schedule if lay.pp > 1 else None,
            "microbatches": self.microbatches, "mfu": self.mfu, "step_time_s": self.step_time_s,
            "mem_bytes_per_gpu": self.mem_bytes_per_gpu, "fits": self.fits,
            "sp": lay.sp, "virtual_stages": lay.chunks,
            "micro_batch_size": lay.micro_batch, "ckpt": lay.ckpt, "precision": lay.precision,
            "tokens_per_s": self.tokens_per_s, "hfu": self.hfu, "grad_reduce": lay.grad_reduce,
            "capacity_bytes": self.capacity_bytes,
            "memory": {k: {kk: float(vv) for kk, vv in v.items()} for k, v in
                       self.memory.items()},
            "times_s": dict(self.times),
        }


def llama_style(model: ModelSpec) -> bool:
    """The shape our context-parallel attention runs on (and the estimator builds): SwiGLU,
    RMSNorm, RoPE, no biases, no dropout."""
    return (model.mlp == "swiglu" and model.norm == "rmsnorm" and not model.bias
            and not model.learned_positions and not model.dropout)


def check_cp(model: ModelSpec, cp: int, method: str = "ring") -> None:
    """Raise ShardwiseConfigError unless ``model`` can run context parallelism over ``cp`` ranks
    with ``method``: the core's own checks (:func:`shardwise.parallel.cp.validate_cp`: cp ≥ 1, a
    known method), a Llama-style model (:func:`llama_style`), and ``model.seq_len`` divisible
    by 2·cp (the zig-zag split cuts every sequence into 2·cp chunks)."""
    validate_cp(None, cp, method)
    if cp == 1:
        return
    if not llama_style(model):
        raise ShardwiseConfigError(
            f"--cp {cp}: context parallelism runs on Llama-style models (SwiGLU, RMSNorm, RoPE, "
            f"no biases, no dropout), and {model.name} is not one: choose a Llama model "
            "(llama3-8b, llama3-70b, llama3-405b, tiny, …) or --cp 1")
    if model.seq_len % (2 * cp):
        good = [k * 2 * cp for k in range(1, 4)]
        raise ShardwiseConfigError(
            f"--cp {cp} cuts each sequence into 2·cp = {2 * cp} chunks (the load-balanced causal "
            f"split), but the sequence length {model.seq_len} is not divisible by {2 * cp}: "
            f"choose a --seq-len that is a multiple of {2 * cp} (e.g. "
            f"{', '.join(map(str, good))}), or another --cp")


def check_ep(model: ModelSpec, layout: PlanLayout) -> None:
    """Raise ShardwiseConfigError unless ``layout.ep`` expert-parallel ranks can run ``model``:
    the core's own check (:func:`shardwise.parallel.ep.validate_ep` without a model: ep ≥ 1
    dividing dp × cp, EP ⊆ dp × cp), then an MoE model whose n_experts ep divides. The engine's
    refusal of MoE with SP or cp > 1 (a sequence split needs its routing counts summed for the
    per-sequence balance loss, not wired there) is not the planner's: it models those layouts
    as Megatron-Core runs them."""
    from ..parallel.ep import validate_ep

    validate_ep(None, layout.ep, layout.dp, layout.cp)
    if layout.ep > 1 and not model.is_moe:
        raise ShardwiseConfigError(
            f"--ep {layout.ep} needs a mixture-of-experts model (there are no experts to split), "
            f"and {model.name} is dense: choose an MoE model (mixtral-8x7b, mixtral-8x22b, dbrx, "
            "llama4-scout, llama4-maverick, moe-tiny, …) or --ep 1")
    if model.is_moe and model.n_experts % layout.ep:
        ok = [e for e in range(1, model.n_experts + 1) if model.n_experts % e == 0
              and (layout.dp * layout.cp) % e == 0]
        raise ShardwiseConfigError(
            f"--ep {layout.ep} must divide n_experts = {model.n_experts} ({model.name}): each "
            f"rank holds n_experts / ep experts; choose --ep from {ok}")


def check_hsdp(layout: PlanLayout) -> None:
    """Raise ShardwiseConfigError unless ``layout.dp_replicate`` R is a valid HSDP split of dp:
    a positive integer dividing dp (dp = R × S) that leaves a shard group of S·cp ≥ 2 ranks,
    with a ZeRO stage ≥ 1 when R > 1 (ZeRO-0
    shards nothing, so every rank already holds everything and all-reduces over all of dp: an
    R would change nothing but the name), and with ep > 1 an ep that divides S·cp (the expert
    group lives inside a shard group, as torchtitan carves ep out of ``dp_shard_cp``)."""
    R, dp = layout.dp_replicate, layout.dp
    if not isinstance(R, int) or R < 1:
        raise ShardwiseConfigError(f"--dp-replicate {R!r} must be a positive integer")
    if dp % R:
        ok = [r for r in range(1, dp + 1) if dp % r == 0]
        raise ShardwiseConfigError(
            f"--dp-replicate {R} must divide dp = {dp} (dp = dp_replicate × dp_shard): choose "
            f"from {ok}")
    if R > 1 and layout.zero == 0:
        raise ShardwiseConfigError(
            f"--dp-replicate {R} with --zero 0: without ZeRO every rank holds the whole model "
            "state and the gradient all-reduce already spans all of dp (plain DP); HSDP shards "
            "the state within a group and replicates it across groups: choose --zero 1, 2 or "
            "3, or --dp-replicate 1")
    shard = layout.dp_shard * layout.cp
    if R > 1 and shard < 2:
        raise ShardwiseConfigError(
            f"--dp-replicate {R} with dp = {dp} leaves a shard group of dp_shard·cp = "
            f"{layout.dp_shard}·{layout.cp} = 1 rank: nothing to shard within a replica; "
            "choose a smaller --dp-replicate (the shard group needs ≥ 2 ranks)")
    if R > 1 and layout.ep > 1 and shard % layout.ep:
        ok = [e for e in range(1, shard + 1) if shard % e == 0]
        raise ShardwiseConfigError(
            f"--ep {layout.ep} with --dp-replicate {R}: the expert group must lie inside a "
            f"shard group of dp_shard·cp = {layout.dp_shard}·{layout.cp} = {shard} ranks: "
            f"choose --ep from {ok}, or another --dp-replicate")


def check_layout(model: ModelSpec, cluster: Cluster, layout: PlanLayout, global_batch: int) -> int:
    """Validate ``layout`` for ``model`` and a step of ``global_batch`` sequences; return m, the
    micro-batches per step and replica. Raises ShardwiseConfigError naming the constraint."""
    lay = layout
    for name, v in (("dp", lay.dp), ("cp", lay.cp), ("tp", lay.tp), ("pp", lay.pp),
                    ("micro-batch", lay.micro_batch), ("virtual stages", lay.virtual_stages or 1)):
        if not isinstance(v, int) or v < 1:
            raise ShardwiseConfigError(f"{name} = {v!r} must be a positive integer")
    if lay.cp > 1:
        check_cp(model, lay.cp, lay.cp_method)
    check_hsdp(lay)
    if lay.ep != 1 or model.is_moe:
        check_ep(model, lay)
    if lay.precision not in PRECISIONS:
        raise ShardwiseConfigError(f"--precision {lay.precision!r}: choose from "
                                   f"{sorted(PRECISIONS)}")
    if lay.ckpt not in CKPT:
        raise ShardwiseConfigError(f"--ckpt {lay.ckpt!r}: choose from {CKPT}")
    if lay.zero not in (0, 1, 2, 3):
        raise ShardwiseConfigError(f"--zero {lay.zero}: choose from 0, 1, 2, 3")
    if lay.grad_reduce not in ("step", "micro"):
        raise ShardwiseConfigError(f"grad_reduce {lay.grad_reduce!r}: choose step or micro")
    if lay.schedule not in SCHEDULES:
        raise ShardwiseConfigError(f"--schedule {lay.schedule!r}: choose from {SCHEDULES}")
    if model.n_heads % lay.tp or model.n_kv_heads % lay.tp:
        ok = [t for t in range(1, model.n_kv_heads + 1) if model.n_kv_heads % t == 0]
        raise ShardwiseConfigError(f"tp={lay.tp} must divide n_heads={model.n_heads} and "
                                   f"n_kv_heads={model.n_kv_heads} ({model.name}): choose tp in "
                                   f"{ok}")
    if lay.sp and lay.tp == 1:  # the rule's one message is TP's
        from ..parallel.tp import validate_tp

        validate_tp(None, lay.tp, lay.sp)
    if lay.pp > model.n_layers:
        raise ShardwiseConfigError(f"pp={lay.pp} exceeds the model's {model.n_layers} layers: "
                                   f"choose pp ≤ {model.n_layers}")
    if lay.pp > 1 and lay.schedule != "interleaved-1f1b" and lay.chunks != 1:
        raise ShardwiseConfigError(f"virtual stages = {lay.chunks} need --schedule "
                                   "interleaved-1f1b")
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b":
        per_rank = math.ceil(model.n_layers / lay.pp)
        if lay.chunks > per_rank:
            raise ShardwiseConfigError(f"{lay.chunks} virtual stages per rank exceed the "
                                       f"{per_rank} layers per rank: choose v ≤ {per_rank}")
    per_step = lay.dp * lay.micro_batch
    if global_batch % per_step:
        raise ShardwiseConfigError(
            f"global batch of {global_batch} sequences is not divisible by dp × micro-batch = "
            f"{lay.dp} × {lay.micro_batch} = {per_step}: change --global-batch-tokens or the "
            "layout")
    return global_batch // per_step


def estimate(model: ModelSpec, cluster: Cluster, layout: PlanLayout, global_batch: int,
             assumptions: Assumptions = Assumptions()) -> Estimate:
    """Memory, time and MFU of ``layout`` training ``model`` on ``cluster`` with ``global_batch``
    sequences of ``model.seq_len`` tokens per optimizer step. Raises ShardwiseConfigError for an
    invalid layout (:func:`check_layout`). Formulas: the module docstring."""
    A, lay, M, C = assumptions, layout, model, cluster
    m = check_layout(M, C, lay, global_batch)
    prec = PRECISIONS[lay.precision]
    t, p, v, cp, ep = lay.tp, lay.pp, lay.chunks, lay.cp, lay.ep
    shard = lay.dp_shard * cp  # the ranks ZeRO shards over: dp·cp, or S·cp with HSDP
    # tokens of one micro-batch on this rank: b sequences, s/cp tokens of each (context
    # parallelism splits every sequence; every activation is per token, so all of them ÷ cp)
    a, s, tokens_mb = prec.act, M.seq_len, lay.micro_batch * (M.seq_len // lay.cp)
    peak = C.gpu.bf16_flops if prec.compute == "bf16" else C.gpu.fp32_flops
    kinds = (False, True) if M.is_moe else (False,)  # dense layers, MoE layers

    # FLOPs per token, per kind of layer (an MoE layer: its active weights)
    extra = {"none": 0.0, "selective": 0.0 if M.flash_attention else 4 * M.d_model * s,
             "full": 4 * M.d_model * s}[lay.ckpt]
    layer_model = {moe: 6 * M.layer_active_matmul_params(moe) + 12 * M.d_model * s
                   for moe in kinds}
    layer_hw = {moe: layer_model[moe] + extra
                + (2 * M.layer_active_matmul_params(moe) if lay.ckpt == "full" else 0.0)
                for moe in kinds}
    n_moe = M.n_moe_layers
    head_flops = 6 * M.vocab_size * M.d_model
    model_flops_token = ((M.n_layers - n_moe) * layer_model[False]
                         + n_moe * layer_model.get(True, 0.0) + head_flops)
    hw_flops_token = ((M.n_layers - n_moe) * layer_hw[False] + n_moe * layer_hw.get(True, 0.0)
                      + head_flops)
    lsec = {moe: layer_seconds(M, lay, C.gpu, A, moe=moe) for moe in kinds}
    hsec = head_seconds(M, lay, C.gpu, A)
    mean_layer = ((M.n_layers - n_moe) * lsec[False]["total"]
                  + n_moe * lsec.get(True, lsec[False])["total"]) / M.n_layers
    stages = partition_layers(M.n_layers, p, round(hsec / mean_layer, 6))
    starts = [sum(stages[:i]) for i in range(p)]
    moe_in = [M.moe_layers_in(starts[i], stages[i]) for i in range(p)]

    # memory of the first and the last stage
    capacity = C.gpu.hbm_bytes * (1 - A.memory_reserve)
    per_layer = {moe: layer_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, ckpt=lay.ckpt,
                                             act_bytes=a, moe=moe) for moe in kinds}
    transient = (max(layer_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, ckpt="none",
                                            act_bytes=a, moe=moe) for moe in kinds)
                 if lay.ckpt == "full" else 0.0)
    kv = cp_kv_bytes(M, lay) if cp > 1 else 0.0
    # all-gather CP: attention's backward needs the gathered K/V of the whole sequence,
    # [b, s, k/t, hd] · 2 = cp·KV per layer, kept instead of the local K/V the layer formula
    # counts (nothing else needs those: the projections keep their inputs, RoPE is linear):
    # (cp − 1)·KV more per layer, with the layer's activations (or, under full recomputation,
    # by the one layer recomputed at a time)
    gathered = (cp - 1) * kv if cp > 1 and lay.cp_method == "allgather" else 0.0
    if lay.ckpt == "full":
        transient += gathered
    else:
        per_layer = {moe: x + gathered for moe, x in per_layer.items()}
    flight = in_flight(lay.schedule, p, m, v)
    # ZeRO-3 gathers two layers at a time: the largest layer this rank gathers (an MoE layer
    # holds its router whole, its E/ep experts ÷ etp; layer 0 is always an MoE layer)
    gathered_layer = M.layer_params() / t
    if M.is_moe:
        moe_layer = sum(stage_param_split(M, 1, tp=t, first=False, last=False, pp=2, ep=ep,
                                          sp=lay.sp))
        gathered_layer = moe_layer if M.moe_every == 1 else max(gathered_layer, moe_layer)
    memory = {}
    for where, i, first, last in (("first", 0, True, p == 1), ("last", p - 1, p == 1, True)):
        layers = stages[i]
        split = stage_param_split(M, layers, tp=t, first=first, last=last, pp=p,
                                  start=starts[i], ep=ep, sp=lay.sp)
        tensors = stage_tensors(M, layers, first=first, last=last, pp=p, start=starts[i])
        full_grads = lay.grad_reduce == "step" and m > 1
        dense_split = split[0] + (split[1] if ep == 1 else 0.0)
        st = model_state_bytes(dense_split, tensors, lay.zero, shard, prec, full_grads)
        if ep > 1:  # expert weights: E/ep per rank, ZeRO over the S·cp/ep ranks that share them
            ex = model_state_bytes(split[1], 0, lay.zero, shard // ep, prec, full_grads)
            st = {key: st[key] + ex[key] for key in st}
        k = flight if first else 1.0
        act = k * ((layers - moe_in[i]) * per_layer[False]
                   + moe_in[i] * per_layer.get(True, 0.0)) + transient
        if first:
            act += k * embedding_activation_bytes(M, tokens_mb)
        if last:
            act += head_activation_bytes(M, tokens_mb, tp=t, sp=lay.sp, act_bytes=a)
        buf = 0.0
        if lay.zero == 3:
            buf += (prec.param + prec.grad) * 2 * gathered_layer
        if p > 1:
            buf += 2 * a * tokens_mb * M.d_model / t
        if cp > 1:  # one layer at a time: ring receive + send blocks (K/V, fp32 dK/dV);
            # all-gather: the gradient of the gathered K/V before its reduce-scatter
            buf += 2 * kv + 2 * kv * 4 / a if lay.cp_method == "ring" else cp * kv
        if ep > 1 and moe_in[i]:  # one MoE layer's receive buffer of dispatched rows
            buf += ep_tokens(M, lay) * M.top_k * M.d_model * a
        params = split[0] + split[1]
        if A.grad_bucket_copy and lay.zero < 2:
            buf += prec.grad * params
        memory[where] = {"params_count": params, "expert_params_count": split[1], **st,
                         "activations": act, "buffers": buf,
                         "total": st["params"] + st["grads"] + st["optimizer"] + act + buf}
        if p == 1:
            memory["last"] = memory["first"]
            break
    mem = max(memory["first"]["total"], memory["last"]["total"])

    # compute, TP and EP time per micro-batch on each stage; the slowest sets the pace
    act_size = a * tokens_mb * M.d_model  # [b, s/cp, d] activation, bytes
    tp_ops = ("all_gather", "reduce_scatter") if lay.sp else ("all_reduce",)
    # all-reduce equivalents of act_size per layer: attention's f/g pair and the MLP's, forward
    # and backward; an MoE layer's experts with SP move k copies (Megatron-Core's gather of the
    # dispatched rows over tp), the shared experts one more pair, and without SP the whole MoE
    # feed-forward needs none (shardwise's engine: one f/g pair per MoE block); full
    # recomputation repeats the forward half
    units = {False: 4.0, True: (2.0 + (2.0 * M.top_k + (2.0 if M.n_shared_experts else 0.0))
                                * (lay.sp and t > 1))}
    recompute = 1.5 if lay.ckpt == "full" else 1.0
    comm: list[Collective] = []

    def tp_time(layers, moes, first, last):
        if t == 1:
            return 0.0, []
        out = []
        count = recompute * ((layers - moes) * units[False] + moes * units[True])
        for op in tp_ops:
            out.append(_coll(C, lay, "tp", op, "act", act_size, count, A,
                             "layers: f/g of attention and MLP, forward + backward"))
        if first:
            out.append(_coll(C, lay, "tp", "reduce_scatter" if lay.sp else "all_reduce",
                             "act", act_size, 1, A, "vocabulary-parallel embedding (forward)"))
        if last:
            for op in (("all_gather", "reduce_scatter") if lay.sp else ("all_reduce",)):
                out.append(_coll(C, lay, "tp", op, "act", act_size, 1, A,
                                 "output layer input (forward gather / backward reduce)"))
        return sum(c.seconds for c in out), out

    # one layer's attention core for this micro-batch on this rank, without recomputation:
    # the window the ring's transfers hide under
    recompute_core = lay.ckpt == "full" or (lay.ckpt == "selective" and not M.flash_attention)
    t_core = tokens_mb * lsec[False]["core"] / (4 / 3 if recompute_core else 1.0)
    shapes = {}  # stages of the same (layers, MoE layers, first, last) cost the same
    for i, layers in enumerate(stages):
        key = (layers, moe_in[i], i == 0, i == p - 1)
        if key not in shapes:
            comp = tokens_mb * ((layers - moe_in[i]) * lsec[False]["total"]
                                + moe_in[i] * lsec.get(True, lsec[False])["total"]
                                + (hsec if key[3] else 0.0))
            if not A.grad_accum_fused:  # every micro-batch's weight gradients: + into .grad
                comp += (prec.wgrad_bytes * stage_params(M, layers, tp=t, first=key[2],
                                                         last=key[3], pp=p, start=starts[i],
                                                         ep=ep, sp=lay.sp)
                         / C.gpu.hbm_bandwidth)
            t_tp, colls = tp_time(*key)
            cp_colls = cp_collectives(M, lay, C, A, t_core, layers)
            t_cp = sum(c.exposed for c in cp_colls)
            ep_colls = ep_collectives(M, lay, C, A, moe_in[i])
            t_ep = sum(c.exposed for c in ep_colls)
            shapes[key] = (comp + t_tp + t_cp + t_ep, comp, t_tp, colls, i, t_cp, cp_colls,
                           t_ep, ep_colls)
    (t_mb, t_comp, t_tp, tp_colls, crit, t_cp, cp_colls, t_ep,
     ep_colls) = max(shapes.values(), key=lambda x: x[0])
    for c in tp_colls + cp_colls + ep_colls:
        c.count *= m
        c.wire *= m
        c.seconds *= m
        c.exposed = c.exposed * m if c.axis == "cp" else c.seconds
    comm += tp_colls + cp_colls + ep_colls
    bubble = bubble_time(lay.schedule, p, t_mb, v, m)
    pipeline = m * t_mb + bubble

    # DP/ZeRO: the critical stage's parameters; overlap windows (module docstring)
    dense_crit, expert_crit = stage_param_split(M, stages[crit], tp=t, first=crit == 0,
                                                last=crit == p - 1, pp=p, start=starts[crit],
                                                ep=ep, sp=lay.sp)
    params_crit = dense_crit + expert_crit
    dp_colls = dp_collectives(lay, dense_crit, prec, m, C, A, expert_params=expert_crit)
    t_f, t_b = t_mb / 3, 2 * t_mb / 3
    # dense and expert gradients, and HSDP's shard all-reduce after them, share a window
    grads = [c for c in dp_colls if c.tag in ("grad", "grad_replicate")]
    gathers = [c for c in dp_colls if c.tag == "param"]
    for c in dp_colls:
        if c.tag in ("loss", "grad_norm"):
            c.exposed = c.seconds
    if lay.zero == 3:  # per micro-batch: one gather under forward, one (+ RS) under backward
        one_ag = sum(c.seconds / c.count for c in gathers)
        _share(gathers, m * (max(0.0, one_ag - t_f) + max(0.0, one_ag - t_b)))
        _share(grads, _grad_exposed(grads, max(0.0, t_b - one_ag)))
    else:  # the gradients under the backward of the micro-batch(es) they follow; zero 1/2's
        # param all-gather under the next step's first forward
        if grads:
            _share(grads, _grad_exposed(grads, t_b))
        if gathers:
            _share(gathers, max(0.0, sum(c.seconds for c in gathers) - t_f))
    comm += dp_colls
    dp_exposed = sum(c.exposed for c in dp_colls)

    pp_exposed = 0.0
    if p > 1:
        size = a * tokens_mb * M.d_model / t
        sends = 2 * m * v  # a middle rank: one forward and one backward send per chunk
        c = _coll(C, lay, "pp", "send", "act", size, sends, A,
                  "activations forward and gradients backward at every stage boundary")
        c.exposed = 2 * (p - 1) * c.seconds / sends if A.p2p_overlap else c.seconds
        pp_exposed = c.exposed
        comm.append(c)

    if lay.zero >= 1:  # the optimizer updates its ZeRO shard: dense ÷ S·cp, experts ÷ S·cp/ep
        opt_params = ((dense_crit + (expert_crit if ep == 1 else 0.0)) / shard
                      + (expert_crit / (shard // ep) if ep > 1 else 0.0))
    else:
        opt_params = params_crit
    t_opt = prec.adam_bytes * opt_params / C.gpu.hbm_bandwidth
    step = pipeline + dp_exposed + pp_exposed + t_opt
    step_tokens = global_batch * s
    model_flops = step_tokens * model_flops_token
    hw_flops = step_tokens * hw_flops_token
    world = lay.world
    mfu = model_flops / (step * world * C.gpu.bf16_flops)
    hfu = hw_flops / (step * world * C.gpu.bf16_flops)
    times = {"compute": m * t_comp, "tp": m * t_tp, "cp_exposed": m * t_cp,
             "ep_exposed": m * t_ep, "bubble": bubble, "dp_exposed": dp_exposed,
             "pp_exposed": pp_exposed, "optimizer": t_opt, "step": step}
    flops = {"model_per_token": model_flops_token, "layer_model_per_token": layer_model[False],
             "layer_hw_per_token": layer_hw[False], "head_per_token": head_flops,
             "model_per_step": model_flops, "hw_per_step": hw_flops}
    if M.is_moe:
        flops.update(moe_layer_model_per_token=layer_model[True],
                     moe_layer_hw_per_token=layer_hw[True])
    details = {"t_mb": t_mb, "t_comp_mb": t_comp, "t_tp_mb": t_tp, "t_cp_mb": t_cp,
               "t_ep_mb": t_ep, "t_core_layer": t_core, "cp_kv_bytes": kv,
               "cp_gathered": gathered, "critical_stage": crit, "moe_layers_per_stage": moe_in,
               "in_flight": flight, "act_per_layer": per_layer[False],
               "act_per_moe_layer": per_layer.get(True, 0.0), "transient": transient,
               "layer_seconds": lsec[False], "moe_layer_seconds": lsec.get(True),
               "head_seconds": hsec, "peak": peak, "act_size": act_size,
               "ep_bytes_layer": ep_layer_bytes(M, lay), "opt_params": opt_params,
               "params_crit": params_crit, "expert_params_crit": expert_crit}
    return Estimate(M, C, lay, A, global_batch, m, stages, memory, mem, capacity, mem <= capacity,
                    flops, times, comm, step, step_tokens / step, mfu, hfu, details)


DP_AXES = ("dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp")


def inter_node_bytes(e: Estimate) -> dict[str, float]:
    """{axis: bytes} that leave one GPU's node through its NIC per step, for the collectives
    of ``e`` whose group spans nodes (:func:`axis_link`). A ring collective over a group with k
    members per node sends ``wire`` bytes per rank (the ledger's number); the model runs k rings
    side by side, each leaving the node once, one per NIC, so a node's k GPUs send k·wire, of
    which the k boundary hops — ``wire`` in all, ``wire/k`` per NIC — leave it (the time model's
    ``wire/(k·inter)`` is the same count). With one member per node (HSDP's replicas; a dp group
    at tp·cp = GPUs per node) every byte a rank sends leaves its node."""
    out: dict[str, float] = {}
    for c in e.comm:
        k = members_per_node(e.cluster, e.layout, c.axis)
        if k:
            out[c.axis] = out.get(c.axis, 0.0) + c.wire / k
    return out


def hsdp_comparison(e: Estimate) -> dict:
    """HSDP against ZeRO over all of dp, for one HSDP estimate ``e`` (``dp_replicate`` > 1):
    the same model, cluster, batch and every other degree, re-estimated with dp_replicate = 1
    at ZeRO-3 ("zero3") and, when ``e`` is ZeRO-1/2, at its own stage ("same_stage"). Returns
    {"hsdp" | "zero3" [| "same_stage"]: {"layout", "inter_node_bytes" (all axes, per GPU and
    step), "inter_node_dp_bytes" (the data-parallel axes, :data:`DP_AXES`), "by_axis",
    "model_state_bytes" (parameters + gradients + optimizer of the peak stage), "mem_bytes_per_gpu",
    "fits", "step_time_s", "dp_exposed_s", "mfu"}, "saving": zero3 / hsdp inter-node bytes,
    "saving_dp": the same on the data-parallel axes} (a ratio is ``math.inf`` when HSDP sends
    nothing across nodes, None when neither does). Raises ValueError for a layout without
    HSDP."""
    lay = e.layout
    if lay.dp_replicate == 1:
        raise ValueError("hsdp_comparison: the layout has dp_replicate = 1 (no HSDP)")
    refs = {"zero3": dataclasses.replace(lay, dp_replicate=1, zero=3)}
    if lay.zero != 3:
        refs["same_stage"] = dataclasses.replace(lay, dp_replicate=1)
    rows = {"hsdp": e}
    for key, ref in refs.items():
        rows[key] = estimate(e.model, e.cluster, ref, e.global_batch, e.assumptions)
    out: dict = {}
    for key, x in rows.items():
        by_axis = inter_node_bytes(x)
        peak = max(x.memory.values(), key=lambda mem: mem["total"])
        out[key] = {"layout": x.layout.name(), "inter_node_bytes": sum(by_axis.values()),
                    "inter_node_dp_bytes": sum(v for k, v in by_axis.items() if k in DP_AXES),
                    "by_axis": by_axis,
                    "model_state_bytes": peak["params"] + peak["grads"] + peak["optimizer"],
                    "mem_bytes_per_gpu": x.mem_bytes_per_gpu, "fits": x.fits,
                    "step_time_s": x.step_time_s, "dp_exposed_s": x.times["dp_exposed"],
                    "mfu": x.mfu}

    def ratio(ref, own):
        if own == 0:
            return None if ref == 0 else math.inf
        return ref / own

    out["saving"] = ratio(out["zero3"]["inter_node_bytes"], out["hsdp"]["inter_node_bytes"])
    out["saving_dp"] = ratio(out["zero3"]["inter_node_dp_bytes"],
                             out["hsdp"]["inter_node_dp_bytes"])
    return out


def _grad_exposed(grads: list[Collective], window: float) -> float:
    """Exposed seconds of the gradient collectives of a step, each micro-batch's under the
    ``window`` of its backward: those called once per micro-batch (count > 1: ZeRO-2/3's
    reduce-scatter with ``grad_reduce="micro"``) run under every backward, those called once
    (the reduction after accumulating, HSDP's all-reduce over the replicas) under the last
    one's, after that micro-batch's own."""
    every = [c for c in grads if c.count > 1]
    k = max((c.count for c in every), default=1)
    per = sum(c.seconds / c.count for c in every)
    once = sum(c.seconds for c in grads if c.count <= 1)
    return (k - 1) * max(0.0, per - window) + max(0.0, per + once - window)


def _share(colls: list[Collective], exposed: float) -> None:
    """Spread ``exposed`` seconds over collectives that run in one overlap window, in
    proportion to their time."""
    total = sum(c.seconds for c in colls)
    for c in colls:
        c.exposed = exposed * c.seconds / total if total else 0.0
