"""Muon for the hidden matrices, AdamW for the rest, and the gathers Newton–Schulz needs.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al., "Muon is
Scalable for LLM Training", arXiv 2502.16982) replaces AdamW's per-element step for a matrix
W [A, B] by an orthogonalised momentum, as ``torch.optim.Muon`` (torch 2.13) defines it:

    B_t = μ·B_{t−1} + (1−μ)·g_t                 (``buf.lerp_(g, 1 − μ)``; μ = 0.95)
    U_t = (1−μ)·g_t + μ·B_t  (Nesterov)  or B_t (``g.lerp(B, μ)``)
    O_t = NS₅(U_t / max(‖U_t‖_F, ε))           quintic Newton–Schulz, (a, b, c) =
                                                (3.4445, −4.7750, 2.0315), 5 steps, ε = 1e-7
    W  ← (1 − lr·λ)·W − lr'·O_t                 lr' = 0.2·√max(A, B)·lr ("match_rms_adamw",
                                                Liu et al. §2.2: O's RMS ≈ AdamW's ≈ 0.2)

NS_k(X): k times X ← a·X + (b·G + c·G²)·X with G = X·Xᵀ (X the wide orientation, A ≤ B). It
pushes every singular value of X toward ~1 (into ≈ [0.7, 1.2]): a polynomial of the *whole*
matrix, so a rank holding a slice of U cannot compute its slice of O. The momentum, the Nesterov
mix and the weight decay are element-wise and stay sharded; only U travels (tag ``muon``):

* DP, CP, PP, EP: every rank holds whole matrices (experts whole on their ep rank) — nothing;
* ZeRO-1/2/3, HSDP: U of each unit that holds a Muon matrix, one all_gather of its flat slice
  over the unit's axis, (n−1)/n·4P_u bytes (Liu et al. §2, "Distributed Muon": all-gather, every
  rank orthogonalises redundantly and keeps its slice; docs/optimizers.md compares gathering to
  an owner);
* TP: each tp-sharded matrix's U all-gathered over tp along its tp dim, (t−1)/t·4·(A·B) bytes,
  one coalesced call for all of them; after the dp gather under ZeRO × TP.

Experts' stacked weights [E, A, B] are E matrices, each orthogonalised on its own. NS runs in
``ns_dtype`` (default fp32; torch.optim.Muon: bf16 — ``ns_dtype=torch.bfloat16`` reproduces it
bitwise, tests/test_muon.py); fp32 keeps the layouts within docs/parity.md's Muon bound.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..comm.ledger import ring_bytes
from .params import is_dtensor, placement, tp_sharded

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon DEFAULT_A/B/C (Jordan 2024)
NS_STEPS = 5
NS_EPS = 1e-7
MOMENTUM = 0.95
ADJUST_LR = ("original", "match_rms_adamw")
BLOCKS = ("layers.",)  # FQN prefix of the blocks: a matrix there is a hidden matrix


def is_hidden_matrix(fqn: str, p) -> bool:
    """Whether Muon updates parameter ``p`` named ``fqn`` (the plain model's name): a matrix
    (dim ≥ 2; experts' [E, A, B]) inside a block. Embeddings, the output head, norms and biases
    are AdamW's (Jordan 2024; Liu et al. 2025 §2: "AdamW for the rest")."""
    return p.dim() >= 2 and fqn.startswith(BLOCKS)


def newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS_steps(g/‖g‖_F) of ``g`` [A, B] (or [E, A, B]: each of the E matrices on its own), in
    ``dtype``; the result has g's shape and ``dtype``. For a 2-D ``g`` the same ops as
    ``torch.optim._muon._zeropower_via_newtonschulz`` (bitwise equal in bf16)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T  # [A, A]
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT  # [E, A, A]
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjust_lr(lr: float, fn: str, shape) -> float:
    """lr' of a matrix of ``shape`` [..., A, B]: "original" lr·√max(1, A/B) (Jordan 2024),
    "match_rms_adamw" 0.2·√max(A, B)·lr (Liu et al. 2025 §2.2); torch.optim.Muon's."""
    a, b = shape[-2:]
    return lr * (math.sqrt(max(1, a / b)) if fn == "original" else 0.2 * math.sqrt(max(a, b)))


def ns_flops(shape) -> float:
    """FLOPs of one NS_5 on a matrix of ``shape`` [..., A, B] (m = min, M = max): per step
    G = XXᵀ 2m²M, G·G 2m³, (·)X 2m²M, so 5·(4m²M + 2m³) per matrix (× E for experts)."""
    *lead, a, b = shape
    m, big = min(a, b), max(a, b)
    return math.prod(lead) * NS_STEPS * (4 * m * m * big + 2 * m ** 3)


class Muon(torch.optim.AdamW):
    """Muon on the param groups marked ``"muon": True``, AdamW (torch's, unchanged) on the rest.

    ``params``: groups as :class:`torch.optim.AdamW` takes them; a Muon group's tensors are what
    this rank holds of the matrices (whole, tp shards, or ZeRO's flat pieces). ``momentum``,
    ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``ns_eps``, ``adjust_lr_fn``: Muon's, as
    torch.optim.Muon names them (module docstring); ``ns_dtype``: NS's dtype. AdamW keywords
    (lr, betas, eps, weight_decay, foreach, fused) as AdamW's; ``lr`` and ``weight_decay`` of a
    group serve both. ``orthogonalize``: items ``[(param, update U, group)]`` → ``[(this rank's
    part of NS(whole U) shaped like param, the whole matrix's shape)]``; the default
    :class:`Orthogonalizer` without a topology needs whole matrices. State per Muon tensor:
    ``momentum_buffer`` (shape of the tensor) and ``step`` (fp32 count, for checkpoints).
    Raises ValueError for a Muon tensor of dim < 2 outside ZeRO's pieces, or a bad
    ``adjust_lr_fn``."""

    def __init__(self, params, *, momentum: float = MOMENTUM, nesterov: bool = True,
                 ns_coefficients=NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
                 ns_eps: float = NS_EPS, adjust_lr_fn: str = "match_rms_adamw",
                 ns_dtype: torch.dtype = torch.float32, orthogonalize=None, **adamw):
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: choose from {ADJUST_LR}")
        super().__init__(params, **adamw)
        for g in self.param_groups:
            if g.get("muon"):
                for k, v in (("momentum", momentum), ("nesterov", nesterov),
                             ("ns_coefficients", tuple(ns_coefficients)),
                             ("ns_steps", ns_steps), ("ns_eps", ns_eps),
                             ("adjust_lr_fn", adjust_lr_fn)):
                    g.setdefault(k, v)
        self.ns_dtype = ns_dtype
        self.orthogonalize = orthogonalize or Orthogonalizer()

    @staticmethod
    def state_keys(group: dict) -> tuple[str, ...]:
        """The state tensors a group's parameters keep (besides ``step``): Muon's momentum
        buffer, AdamW's two moments."""
        return ("momentum_buffer",) if group.get("muon") else ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = []  # (param, U, group): the element-wise part, on what this rank holds
        for g in self.param_groups:
            if not g.get("muon"):
                continue
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["momentum_buffer"] = torch.zeros_like(p.grad,
                                                             memory_format=torch.preserve_format)
                st["step"] += 1
                buf = st["momentum_buffer"]
                buf.lerp_(p.grad, 1 - g["momentum"])
                items.append((p, p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf, g))
        for (p, _, g), (o, shape) in zip(items, self.orthogonalize(items, self.ns_dtype)):
            p.mul_(1 - g["lr"] * g["weight_decay"])  # decoupled weight decay, then the step
            p.add_(o, alpha=-adjust_lr(g["lr"], g["adjust_lr_fn"], shape))
        others = [g for g in self.param_groups if not g.get("muon")]
        if others:  # torch's AdamW over the other groups, as they are
            groups, self.param_groups = self.param_groups, others
            try:
                super().step()
            finally:
                self.param_groups = groups
        return loss


def _ns(u: torch.Tensor, g: dict, dtype) -> torch.Tensor:
    return newton_schulz(u, g["ns_coefficients"], g["ns_steps"], g["ns_eps"], dtype)


class Orthogonalizer:
    """Each Muon item's part of NS(whole update), gathering what is split (module docstring).

    ``topo``: None (one process, or whole matrices); tp-sharded matrices (``placement(p).tp_dim``)
    are all-gathered over tp. ``flats`` (ZeRO): the units' :class:`.zero.flat.FlatShards`, the
    items are their pieces (``piece.zero_slot = (unit, j, a, b)``); ``muon_units``: indices of
    the units holding a Muon matrix (every rank gathers those, even with no piece of its own).
    Collectives: tag ``muon`` (see :meth:`bytes_formula`). Raises ValueError for a DTensor."""

    def __init__(self, topo=None, flats=None, muon_units=()):
        self.topo, self.flats, self.muon_units = topo, flats, sorted(muon_units)

    def __call__(self, items, dtype=torch.float32) -> list[tuple[torch.Tensor, tuple]]:
        if self.flats is not None:
            return self._zero(items, dtype)
        for p, _, _ in items:
            if is_dtensor(p):
                raise ValueError("Muon over DTensor parameters is not built (--engine torch "
                                 "with tp > 1 or FSDP2): use --engine explicit")
        wholes = self._tp_whole([(p, u) for p, u, _ in items])
        out = []
        for (p, u, g), w in zip(items, wholes):
            o = _ns(w, g, dtype)
            out.append((self._tp_part(o, p) if w is not u else o, tuple(w.shape)))
        return out

    # -- tp: gather along the tp dim, keep this rank's chunk -----------------------------------
    def _tp_whole(self, pairs) -> list[torch.Tensor]:
        """The whole matrix of each (param, local tensor shaped like it): the tensor itself
        unless the param is tp-sharded, else one all_gather over tp (tag ``muon``) of all of
        them concatenated, each then cut per rank and joined along its tp dim."""
        shard = [i for i, (p, _) in enumerate(pairs) if self.topo is not None and tp_sharded(p)
                 and self.topo.size("tp") > 1]
        out = [u for _, u in pairs]
        if not shard:
            return out
        t = self.topo.size("tp")
        flat = torch.cat([pairs[i][1].reshape(-1) for i in shard])
        rows = flat.new_empty(t * flat.numel())
        with self.topo.ledger.note("muon U over tp"):
            comm.all_gather(rows, flat, self.topo, "tp", tag="muon")
        rows, start = rows.view(t, -1), 0
        for i in shard:
            p, u = pairs[i]
            chunks = rows[:, start:start + u.numel()].reshape(t, *u.shape)
            out[i] = torch.cat(list(chunks), dim=placement(p).tp_dim)
            start += u.numel()
        return out

    def _tp_part(self, o: torch.Tensor, p) -> torch.Tensor:
        dim = placement(p).tp_dim
        k = p.shape[dim]
        return o.narrow(dim, self.topo.index("tp") * k, k)

    # -- ZeRO: gather each unit's flat slice of U, orthogonalise, keep this rank's pieces --------
    def _zero(self, items, dtype):
        by_slot = {piece.zero_slot: (u, g) for piece, u, g in items}
        done: dict[tuple[int, int], tuple[torch.Tensor, tuple]] = {}
        for fi in self.muon_units:
            f = self.flats[fi]
            mine = torch.zeros(f.shard_numel, dtype=f.dtype, device=f.device)  # [k]
            held = [(slot, ug) for slot, ug in by_slot.items() if slot[0] == fi]
            for (_, _, a, b), (u, _) in held:
                mine[a - f.lo: b - f.lo] = u
            full = torch.empty(f.padded, dtype=f.dtype, device=f.device)  # [P_u]
            with f.topo.ledger.note(f"{f.name} muon U"):
                comm.all_gather(full, mine, f.topo, f.axis, tag="muon")
            mats = [(j, full[f.offsets[j]: f.offsets[j] + f.numels[j]].view_as(f.params[j]), g)
                    for (_, j, _, _), (_, g) in held]  # tp-local shape
            wholes = self._tp_whole([(f.params[j], m) for j, m, _ in mats])
            for (j, m, g), w in zip(mats, wholes):
                o = _ns(w, g, dtype)
                done[fi, j] = ((self._tp_part(o, f.params[j]) if w is not m else o).reshape(-1),
                               tuple(w.shape))
        out = []
        for piece, _, _ in items:
            fi, j, a, b = piece.zero_slot
            o, shape = done[fi, j]
            off = self.flats[fi].offsets[j]
            out.append((o[a - off: b - off], shape))
        return out

    # -- the bill ------------------------------------------------------------------------------
    def bytes_formula(self, muon_params) -> float:
        """Bytes this rank sends in one step under tag ``muon``: Σ over the Muon units of
        (n−1)/n·4P_u (ZeRO), plus (t−1)/t·4·Σ numel of the tp-sharded Muon matrices this rank
        updates (whole, or a piece of) — the all_gather's ring cost (:func:`..comm.ledger.
        ring_bytes`; fp32 U). ``muon_params``: the Muon parameters of the module (ZeRO: those
        with a piece on this rank are found from the flats)."""
        total = 0.0
        if self.flats is not None:
            mine = set()
            for fi in self.muon_units:
                f = self.flats[fi]
                total += ring_bytes("all_gather", 4 * f.padded, f.n)
                ids = {id(p) for p in muon_params}
                mine |= {id(f.params[j]) for j, _, _ in f.pieces() if id(f.params[j]) in ids}
            held = [p for p in muon_params if id(p) in mine]
        else:
            held = list(muon_params)
        if self.topo is not None and self.topo.size("tp") > 1:
            t = self.topo.size("tp")
            total += ring_bytes("all_gather", 4 * t * sum(p.numel() for p in held
                                                          if tp_sharded(p)), t)
        return total
