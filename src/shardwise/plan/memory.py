"""Memory per GPU (bytes) of one layout: model state per parameter and ZeRO stage
(:func:`model_state_bytes`; Rajbhandari et al. 2020 §5.1), activations kept for backward per layer
and micro-batch (:func:`layer_activation_bytes`; Korthikanti et al. 2022 §4, eqs. 1–6), the head's
and the embedding's, the micro-batches in flight per schedule (:func:`in_flight`), and what one
pipeline stage holds (:func:`stage_params`, :func:`stage_tensors`). Formulas and sources:
docs/planner.md, "The cost model's formulas" (memory).
"""

from __future__ import annotations

import functools

from ..errors import ShardwiseConfigError
from ..models.sdpa import SDPA_GQA
from .layout import CKPT, SCHEDULES, STEP_COUNTER_BYTES, Precision
from .models import ModelSpec


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
    :mod:`shardwise.tools.estimate`): RMSNorm keeps x, x·rstd and the output (3·d) plus rstd
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
    return _stage_param_split(model, layers, tp, first, last, pp, start, ep, sp)


@functools.lru_cache(maxsize=4096)
def _stage_param_split(m: ModelSpec, layers: int, tp: int, first: bool, last: bool, pp: int,
                       start: int, ep: int, sp: bool) -> tuple[float, float]:
    """:func:`stage_param_split`, cached on its arguments (a frozen, hashable ModelSpec and
    numbers; the result is an immutable tuple): a search asks it several times per layout,
    over 400,000 times for Llama 3 405B on 8,192 GPUs, for a few hundred distinct stages."""
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


def startup_box_elements(model: ModelSpec, *, tp: int, ep: int = 1, sp: bool = False) -> float:
    """Elements of the largest part of one tensor a rank reads at start-up (shardwise builds
    the model on the meta device and fills what each rank holds box by box: docs/checkpointing.md,
    start-up memory): the largest matrix ÷ tp — the embedding or output ``V·d``, an attention
    or MLP matrix ``d·max(d, f)`` — or a MoE layer's stacked routed experts of one matrix,
    ``(E/ep)·d·f_e/etp``. An upper bound: ZeRO-3 reads only its rows of it."""
    m = model
    d = m.d_model
    largest = max(m.vocab_size * d, d * max(d, m.d_ff)) / tp
    if m.is_moe:
        largest = max(largest, (m.n_experts // ep) * d * m.expert_ff / etp(tp, sp))
    return float(largest)


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
