"""A mixture-of-experts variant of our Llama, as plain model code with no parallelism inside.

Every ``moe_every``-th block (Megatron's ``moe_layer_freq``: block i is MoE when
``i % moe_every == 0``) replaces its SwiGLU feed-forward by :class:`MoEFeedForward`:

* **Router** (Shazeer et al. 2017; Mixtral, Jiang et al. 2024 §2.1; DeepSeek-V3 §2.1.2):
  ``p = softmax(x·W_rᵀ)`` over the E experts in fp32, the top-k experts per token, their
  weights ``p`` renormalised to sum to one (``norm_topk``; Mixtral's and Qwen3-MoE's rule).
  Ties are broken by expert index (a stable descending sort), so one process and every layout
  route identically, and a router that cannot tell experts apart (all logits equal) sends every
  token to experts 0..k-1.
* **Experts**: E SwiGLU MLPs of hidden size ``d_expert``, stored stacked (``w1``, ``w3``
  [E, f, d], ``w2`` [E, d, f]; Hugging Face's ``MixtralExperts`` layout), plus
  ``n_shared_experts`` always-on experts as one dense SwiGLU of hidden size n_shared · f
  (DeepSeekMoE, Dai et al. 2024 §3.2).
* **Dispatch**: the token copies sorted by expert (stable: token order within an expert) go to
  :attr:`MoEFeedForward.dispatcher` with the per-expert counts; the plain model's
  :class:`LocalDispatcher` runs each expert on its rows. Expert parallelism replaces the
  dispatcher by an all-to-all one (:mod:`shardwise.parallel.ep`); nothing else changes.
* **Dropless by default.** With ``capacity_factor`` c an expert takes at most
  ``C = ceil(c · k · s / E)`` token copies of each sequence (GShard, Lepikhin et al. 2021 §2.2,
  with the sequence as the group): first choices before second choices, earlier positions
  first; a dropped copy contributes nothing (the residual carries the token).

**Auxiliary losses**, per sequence, so their value does not depend on how a batch is split
over ranks or micro-batches:

* load balancing (Switch Transformer, Fedus et al. 2022 eq. 4–6; GShard; computed per sequence
  as DeepSeek-V3's complementary sequence-wise loss, §2.1.2 eq. 17–20):
  ``L_bal = E · Σ_i f_i · P_i`` with ``f_i`` the fraction of the sequence's k·s routed copies
  that chose expert i (before any drop; no gradient) and ``P_i`` the mean router probability of
  expert i over the sequence; 1 at perfect balance (f_i = 1/E, whatever the P_i), E/k at total
  collapse (a token picks an expert at most once, so f_i ≤ 1/k: E for top-1, as in Switch).
* router z-loss (ST-MoE, Zoph et al. 2022 eq. 5): ``L_z = mean_t (logsumexp_i logits_ti)²``.

Both enter the objective the way the token cross-entropy does, as sums divided by the step's
global token count N: a sequence of s tokens adds ``α · s · L_bal`` and ``β · Σ_t z_t²`` to
the loss sum, so the step's loss is ``CE_mean + α · mean_seq(L_bal) + β · L_z`` whenever every
token counts (pretraining). :func:`moe_aux_loss` gives the plain sum (with gradient) for a
caller that adds it itself; an engine sets :func:`set_aux_grad_scale` (1/N) instead and each
layer attaches its aux loss to its output (Megatron-Core's ``MoEAuxLossAutoScaler``), so the
gradient reaches the router from any backward through the model — also a pipeline stage's.

Shapes: ``b`` batch, ``s`` sequence, ``d`` d_model, ``E`` experts, ``k`` top_k, ``f`` d_expert,
``T = b·s`` tokens, ``N_r`` routed copies kept (≤ T·k).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .llama import FeedForward, Llama, LlamaConfig, TransformerBlock


@dataclasses.dataclass
class MoEConfig(LlamaConfig):
    """A :class:`LlamaConfig` whose every ``moe_every``-th block is a mixture of experts.

    ``n_experts`` E routed experts of hidden size ``d_expert`` (0: ``d_ff``), ``top_k`` per
    token, ``n_shared_experts`` always-on experts, ``capacity_factor`` (None: dropless),
    ``aux_loss_coef`` α and ``z_loss_coef`` β (module docstring), ``norm_topk``: renormalise
    the top-k weights. Raises ``ValueError`` for top_k > n_experts, a capacity factor ≤ 0, or
    moe_every < 1."""

    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    d_expert: int = 0
    moe_every: int = 1
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    norm_topk: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts={self.n_experts} must be ≥ 1")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts="
                             f"{self.n_experts}: a token cannot choose more experts than exist")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (or None: "
                             "dropless)")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be ≥ 1")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} must be ≥ 0")
        if not self.d_expert:
            self.d_expert = self.d_ff

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` is a mixture of experts (Megatron's ``moe_layer_freq``)."""
        return i % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def num_params(self) -> int:
        """Total parameter count Ψ (every expert; tied embeddings once)."""
        d, f = self.d_model, self.d_expert
        moe = self.n_experts * 3 * d * f + self.n_experts * d + self.n_shared_experts * 3 * d * f
        return super().num_params() + self.n_moe_layers * (moe - 3 * d * self.d_ff)

    def num_active_params(self) -> int:
        """Parameters one token uses: the dense ones, the router, and top_k + n_shared
        experts per MoE block (what the FLOPs of a token follow; Mixtral's "active")."""
        d, f = self.d_model, self.d_expert
        idle = (self.n_experts - self.top_k) * 3 * d * f
        return self.num_params() - self.n_moe_layers * idle


MOE_PRESETS = {
    "moe-tiny": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256,
                     n_experts=4, top_k=2, d_expert=32),
    "moe-small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688,
                      max_seq_len=1024, n_experts=8, top_k=2, d_expert=344),
}


def route(probs: torch.Tensor, k: int, norm_topk: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` experts of router probabilities ``probs`` [..., E] fp32 → (weights [..., k]
    fp32, with gradient, renormalised to sum to 1 when ``norm_topk``; experts [..., k] int64).
    Ties go to the lower expert index: a stable descending sort keeps equal values in index
    order (``torch.topk`` promises no order among ties)."""
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
    experts = order[..., :k]
    weights = probs.gather(-1, experts)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """Which routed copies an expert takes: ``experts`` [b, s, k] → keep [b, s, k] bool. Dropless
    (``capacity`` None): all. Else each expert takes at most ``capacity`` copies per sequence,
    first choices before second choices, earlier positions first (GShard §2.2)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    b, s, k = experts.shape
    order = experts.transpose(1, 2).reshape(b, k * s)  # slot-major priority
    hot = F.one_hot(order, n_experts)  # [b, k·s, E]
    rank = (hot.cumsum(1) * hot).sum(-1) - 1  # position of each copy in its expert's queue
    return (rank < capacity).view(b, k, s).transpose(1, 2)


class Experts(nn.Module):
    """``n`` SwiGLU experts stacked: ``w1``, ``w3`` [n, f, d], ``w2`` [n, d, f]. Expert parallelism
    keeps a contiguous slice of them (n = E/ep on each rank, split on dim 0)."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, f, d))
        self.w3 = nn.Parameter(torch.empty(n, f, d))
        self.w2 = nn.Parameter(torch.empty(n, d, f))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [N, d], rows grouped by expert (``counts[e]`` rows for local expert e, Σ = N) →
        [N, d]. One matmul pair per expert (on CPU a loop is as fast as a grouped GEMM)."""
        out = []
        for e, rows in enumerate(torch.split(x, counts)):
            h = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())  # [n_e, f]
            out.append(h @ self.w2[e].t())  # [n_e, d]
        return torch.cat(out) if out else x[:0]


class LocalDispatcher(nn.Module):
    """The plain model's dispatch: every expert lives here; no communication."""

    def forward(self, rows: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
        """``rows`` [N, d] sorted by expert, ``counts`` [E] python ints → expert outputs [N, d]."""
        return experts(rows, counts)


class _AttachAux(torch.autograd.Function):
    """y → y; in backward the scalar ``aux`` receives the gradient ``scale`` (Megatron-Core's
    ``MoEAuxLossAutoScaler``): the aux loss joins the objective as ``scale · aux`` without
    appearing in the value a caller back-propagates."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (an activation-checkpoint recompute): its
    forward must not count the step's routing statistics twice."""
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """x [b, s, d] → [b, s, d]: route, dispatch, weighted combine, plus the shared experts.

    Submodules: ``router`` (d → E, no bias), ``experts`` (:class:`Experts`), ``shared`` (a
    SwiGLU of hidden n_shared·f, or None), ``dispatcher`` (:class:`LocalDispatcher`; the EP
    transform swaps it). After each forward (not a recompute) ``stats`` accumulates the step's
    fp64 sums: ``balance`` (α·Σ s·L_bal) and ``z`` (β·Σ z²), ``tokens`` [E] routed copies each
    expert took, ``dropped`` copies dropped. ``aux`` is the last forward's aux loss sum (fp32
    scalar; with gradient in plain mode, detached when a grad scale attaches it)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.norm_topk
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert)
        self.shared = None
        if cfg.n_shared_experts:
            shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.d_expert)
            self.shared = FeedForward(shared)
        self.dispatcher = LocalDispatcher()
        self.aux_grad_scale: float | None = None
        self.aux = None
        self.reset_stats()

    def reset_stats(self) -> None:
        z = torch.zeros((), dtype=torch.float64)
        self.stats = {"balance": z, "z": z.clone(), "tokens": torch.zeros(self.n_experts,
                                                                          dtype=torch.long),
                      "dropped": torch.zeros((), dtype=torch.long)}

    def capacity(self, s: int) -> int | None:
        """Copies per expert per sequence of ``s`` tokens: ceil(c·k·s/E), or None (dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * s / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        E, k = self.n_experts, self.top_k
        logits = self.router(x).float()  # [b, s, E]
        probs = logits.softmax(-1)
        weights, experts = route(probs, k, self.norm_topk)  # [b, s, k] each
        keep = capacity_keep(experts, E, self.capacity(s))  # [b, s, k]
        # auxiliary losses as token sums (module docstring)
        routed = F.one_hot(experts, E).sum(2)  # [b, s, E]: copies of each token per expert
        f = routed.sum(1).float() / (k * s)  # [b, E], no gradient
        balance = self.aux_loss_coef * s * (E * (f * probs.mean(1)).sum(-1)).sum()
        z = self.z_loss_coef * torch.logsumexp(logits, -1).pow(2).sum()
        # dispatch: the kept copies sorted by expert (stable: token order within an expert)
        flat_e = experts.reshape(-1)  # [T·k], token-major
        kept = keep.reshape(-1).nonzero().squeeze(1)
        kept = kept[torch.sort(flat_e[kept], stable=True).indices]
        token = kept // k  # [N_r] token index of each copy
        counts = torch.bincount(flat_e[kept], minlength=E)  # [E]
        xs = x.reshape(b * s, d)
        ys = self.dispatcher(xs[token], counts.tolist(), self.experts)  # [N_r, d]
        w = weights.reshape(-1)[kept].unsqueeze(1)  # [N_r, 1] fp32
        out = torch.zeros(b * s, d, dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, ys.float() * w).to(x.dtype).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        aux = balance + z  # fp32 scalar
        self.aux = aux if self.aux_grad_scale is None else aux.detach()
        if not _in_backward():
            st = self.stats
            st["balance"] = st["balance"] + balance.detach().double().cpu()
            st["z"] = st["z"] + z.detach().double().cpu()
            st["tokens"] = st["tokens"] + counts.cpu()
            st["dropped"] = st["dropped"] + int(b * s * k - kept.numel())
        if self.aux_grad_scale is not None:
            return _AttachAux.apply(out, aux, self.aux_grad_scale)
        return out


class MoEBlock(TransformerBlock):
    """A :class:`TransformerBlock` whose ``feed_forward`` is a :class:`MoEFeedForward`."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        self.feed_forward = MoEFeedForward(cfg)


class MoELlama(Llama):
    """:class:`Llama` with MoE blocks where ``config.is_moe_layer(i)``: tokens [b, s] int64 →
    logits [b, s, V]. Module names: ``layers.{i}.feed_forward.router``, ``.experts.w1`` …"""

    def make_block(self, cfg: MoEConfig, i: int) -> nn.Module:
        return MoEBlock(cfg) if cfg.is_moe_layer(i) else TransformerBlock(cfg)

    @torch.no_grad()
    def reset_parameters(self):
        """As :meth:`Llama.reset_parameters`, experts' ``w2`` scaled like the dense ``w2``."""
        super().reset_parameters()
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("experts.w2"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layers))
            elif name.endswith(("experts.w1", "experts.w3")):
                nn.init.normal_(p, 0.0, std)


def moe_layers(module: nn.Module) -> list[MoEFeedForward]:
    """The :class:`MoEFeedForward` layers of ``module`` (a model, a pipeline stage, an engine)."""
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def set_aux_grad_scale(module: nn.Module, scale: float | None) -> None:
    """Every MoE layer of ``module`` attaches its aux loss to its output with gradient
    ``scale`` (an engine: 1/N, as it divides the token-loss sum); None: plain mode, the caller
    adds :func:`moe_aux_loss`."""
    for m in moe_layers(module):
        m.aux_grad_scale = scale


def moe_aux_loss(module: nn.Module) -> torch.Tensor | None:
    """Σ over the MoE layers of the last forward's aux loss sums (fp32 scalar; with gradient in
    plain mode), or None for a model without MoE layers."""
    layers = moe_layers(module)
    if not layers:
        return None
    return sum(m.aux for m in layers)


def reset_moe_stats(module: nn.Module) -> None:
    """Zero the routing statistics of ``module``'s MoE layers (and an all-to-all dispatcher's
    records): called at the start of each step."""
    for m in moe_layers(module):
        m.reset_stats()
        if hasattr(m.dispatcher, "reset"):
            m.dispatcher.reset()


def moe_stats(module: nn.Module) -> dict | None:
    """The routing statistics accumulated since :func:`reset_moe_stats` over this module's MoE
    layers: {"balance", "z": fp64 scalars (aux loss sums), "tokens": [n_layers, E] int64,
    "dropped": int64 scalar}, or None without MoE layers."""
    layers = moe_layers(module)
    if not layers:
        return None
    return {"balance": sum(m.stats["balance"] for m in layers),
            "z": sum(m.stats["z"] for m in layers),
            "tokens": torch.stack([m.stats["tokens"] for m in layers]),
            "dropped": sum(m.stats["dropped"] for m in layers)}
