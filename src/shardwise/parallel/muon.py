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
* ZeRO-1/2/3, HSDP: a matrix inside one rank's slice is orthogonalised there; one that slice
  boundaries cut goes to its owner (the rank holding most of it): the other holders send their
  pieces of U, the owner runs NS once and sends each its piece of O back, point-to-point over the
  unit's axis (Liu et al. §2 "Distributed Muon" all-gathers every unit instead: docs/
  optimizers.md §5 measured 9–35× more bytes that way);
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
from .views import full_shape

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
    items are their pieces (``piece.zero_slot = (unit, j, a, b)``): a matrix cut by a slice
    boundary is orthogonalised by its owner (:meth:`owner_pieces`; docs/optimizers.md §5).
    Collectives: tag ``muon`` (see :meth:`bytes_formula`). Raises ValueError for a DTensor."""

    def __init__(self, topo=None, flats=None):
        self.topo, self.flats = topo, flats

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

    # -- ZeRO: each matrix to its owner, orthogonalised once, its pieces sent back -------------
    @staticmethod
    def owner_pieces(f, j: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(owner index on ``f.axis``, [(rank index, a, b)]) of matrix ``j`` of flat group
        ``f``: every rank whose slice [r·k, (r+1)·k) holds elements [a, b) of it, and the one
        holding most of them (the lowest index on a tie), which orthogonalises it. Read from
        the layout alone, the same on every rank; no collective."""
        k, off, n = f.shard_numel, f.offsets[j], f.numels[j]
        pieces = [(r, max(off, r * k), min(off + n, (r + 1) * k)) for r in range(f.n)]
        pieces = [(r, a, b) for r, a, b in pieces if a < b]
        owner = max(pieces, key=lambda x: (x[2] - x[1], -x[0]))[0]
        return owner, pieces

    def _zero(self, items, dtype):
        """Matrices in (unit, index) order, the same on every rank: one held whole by this rank
        is orthogonalised here; one cut by slice boundaries goes to its owner (:meth:`owner_pieces`):
        each other holder sends its piece of U (tag ``muon``), the owner joins them (and, inside
        dp × tp, gathers the tp shards with its tp peers, who own the same matrix), runs NS and
        sends each holder its piece of O back."""
        done = {}
        for piece, u, g in sorted(items, key=lambda it: it[0].zero_slot[:2]):
            fi, j, a, b = piece.zero_slot
            f, p = self.flats[fi], self.flats[fi].params[j]
            off, me = f.offsets[j], f.rank
            owner, pieces = self.owner_pieces(f, j)
            if me != owner:  # send my piece of U, get my piece of O
                out = torch.empty(b - a, dtype=f.dtype, device=f.device)
                with f.topo.ledger.note(f"{f.name} muon U to owner"):
                    comm.send(u.contiguous(), f.topo, f.axis, owner, tag="muon")
                    comm.recv(out, f.topo, f.axis, owner, tag="muon")
                done[fi, j] = (out, a, full_shape(p))
                continue
            whole = torch.empty(f.numels[j], dtype=f.dtype, device=f.device)  # tp-local, flat
            whole[a - off: b - off] = u
            with f.topo.ledger.note(f"{f.name} muon U from holders"):
                for r, ra, rb in pieces:
                    if r != me:
                        comm.recv(whole[ra - off: rb - off], f.topo, f.axis, r, tag="muon")
            m = whole.view_as(p)
            (w,) = self._tp_whole([(p, m)])
            o = _ns(w, g, dtype)
            o = (self._tp_part(o, p) if w is not m else o).reshape(-1)
            with f.topo.ledger.note(f"{f.name} muon O to holders"):
                for r, ra, rb in pieces:
                    if r != me:
                        comm.send(o[ra - off: rb - off].contiguous(), f.topo, f.axis, r,
                                  tag="muon")
            done[fi, j] = (o[a - off: b - off], a, tuple(w.shape))
        return [(done[piece.zero_slot[:2]][0], tuple(done[piece.zero_slot[:2]][2]))
                for piece, _, _ in items]

    # -- the bill ------------------------------------------------------------------------------
    def bytes_formula(self, muon_params) -> float:
        """Bytes this rank sends in one step under tag ``muon`` (fp32 U and O): under ZeRO, for
        each Muon matrix cut by a slice boundary, 4 bytes per element of its piece when another
        rank owns it, and 4 per element of the other holders' pieces when this rank does (O sent
        back) — point-to-point, so exactly what is handed to send; then (t−1)/t·4·(A·B) for
        each tp-sharded Muon matrix this rank orthogonalises (without ZeRO: every one it holds;
        under ZeRO: those it owns), the tp all_gather's ring cost (:func:`..comm.ledger.
        ring_bytes`). ``muon_params``: the Muon parameters of the module."""
        total, ids, held = 0.0, {id(p) for p in muon_params}, list(muon_params)
        if self.flats is not None:
            held = []
            for f in self.flats:
                for j, a, b in f.pieces():
                    if id(f.params[j]) not in ids:
                        continue
                    owner, pieces = self.owner_pieces(f, j)
                    if owner != f.rank:
                        total += 4 * (b - a)
                    else:
                        total += 4 * sum(rb - ra for r, ra, rb in pieces if r != owner)
                        held.append(f.params[j])
        if self.topo is not None and self.topo.size("tp") > 1:
            t = self.topo.size("tp")
            total += ring_bytes("all_gather", 4 * t * sum(p.numel() for p in held
                                                          if tp_sharded(p)), t)
        return total
