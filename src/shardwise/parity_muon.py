"""Parity for ``--optimizer muon``: the one-process reference with Muon, and its parameter check.

**The reference** (:func:`reference_run_muon`) is :func:`shardwise.parity.reference_run`'s plain
PyTorch loop with the optimizer swapped: Muon on the hidden matrices (dim ≥ 2 inside
``layers.``), ``torch.optim.AdamW`` on the rest (decay on the output head, none on embeddings,
norms and biases). Its Muon is written here again, independently of
:mod:`shardwise.parallel.muon`, from ``torch.optim.Muon``'s definition (torch 2.13,
``torch/optim/_muon.py``): ``B ← μB + (1−μ)g``, ``U = (1−μ)g + μB``, ``O = NS₅(U/‖U‖_F)`` with
(a, b, c) = (3.4445, −4.7750, 2.0315), ``W ← (1 − lr·λ)W − 0.2·√max(A, B)·lr·O``; NS in fp32
(``torch.optim.Muon`` runs it in bf16: :func:`newton_schulz` with ``dtype=torch.bfloat16`` is
bitwise its ``_zeropower_via_newtonschulz``, tests/test_muon.py).

**The parameter rule.** AdamW's bound (:func:`shardwise.parity.adamw_param_bound`) propagates the
measured gradient errors through the optimizer. For Muon that bound is useless: NS_k is a
polynomial matrix function, and its Fréchet derivative is bounded by the divided differences of
p(σ) = aσ + bσ³ + cσ⁵ on the singular-value interval [0, 1.2023] that the iteration maps into
itself (Higham, *Functions of Matrices*, 2008, §3.1; generalised to rectangular X by Noferini
2017): L₁ = max(sup|p′|, sup p(σ)/σ) = |p′(1.2023)| ≈ 3.96 per step, so ‖δO‖_F ≤ L₁⁵·2‖δU‖_F/‖U‖_F
≈ 1.9·10³·‖δU‖_F/‖U‖_F (:data:`NS_LIPSCHITZ` = L₁⁵). The input term is small, but a stated bound
must add NS's own fp32 round-off in each run — ≈ √m·u·‖X‖_F·(|a| + 3|b|σ² + 5|c|σ⁴) per iteration
(Higham & Mary 2019), amplified by Σ_k L₁^k ≈ 330 — about 0.1 in ‖δO‖_F for a 64 × 32 matrix: as
large as a typical element of O (≈ 0.1), so a normwise bound per element would pass a wrong piece
of the update (docs/parity.md §6). So the parameters are checked by **teacher forcing**, as the
gradients already are (:func:`shardwise.parity.reference_at`): step t's reference update is
computed from the run's own parameters after step t − 1 and the run's own gradients of steps 0…t
(the momentum built from them): the run and the reference then orthogonalise the same U, element
for element, and differ only by the fp32 round-off of the same operations on a gathered copy (≤
lr'·γ_m·‖O‖ per element, ~1e-10 here), so ATOL + RTOL·|p| holds with room and any wrong piece of
the update (O(lr'·|O_ij|) ≈ 1e-5 at lr 3e-4) fails.
The gradients themselves are checked against the reference's at the run's parameters, as for AdamW;
together the two checks pin every step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .parity import ATOL, RTOL, _check_flat, _flat, _loss_and_grads

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS, NS_EPS, MOMENTUM = 5, 1e-7, 0.95
RULE = (f"loss, grad norm, gradients: as for AdamW (|Δ| ≤ {ATOL:g} + {RTOL:g}·|ref| at the run's "
        f"own parameters, every step); parameters: |Δp_t| ≤ {ATOL:g} + {RTOL:g}·|p_t| against "
        "the reference's Muon/AdamW step from the run's parameters and gradients (teacher-forced: "
        "docs/parity.md §6, shardwise.parity_muon)")


def _lipschitz(coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS) -> float:
    """L₁^steps (module docstring): the largest |p′| and p(σ)/σ on [0, σ_max], σ_max = the
    largest value p takes on [0, 1] (the interval the iteration keeps), on a fine grid."""
    a, b, c = coefficients
    s = torch.linspace(0, 1, 200001, dtype=torch.float64)
    top = float((a * s + b * s ** 3 + c * s ** 5).max())
    s = torch.linspace(1e-9, max(1.0, top), 200001, dtype=torch.float64)
    slope = (a + 3 * b * s ** 2 + 5 * c * s ** 4).abs().max()
    ratio = (a + b * s ** 2 + c * s ** 4).abs().max()
    return float(max(slope, ratio)) ** steps


NS_LIPSCHITZ = _lipschitz()


def newton_schulz(g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` for one matrix [A, B], in ``dtype``;
    [E, A, B]: each of the E matrices in turn."""
    if g.dim() == 3:
        return torch.stack([newton_schulz(m, dtype) for m in g])
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def groups_of(model: nn.Module) -> dict[str, str]:
    """{name: "muon" | "decay" | "no_decay"} for every parameter of the plain model."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {n: ("muon" if p.dim() >= 2 and n.startswith("layers.") else
                "no_decay" if p.dim() < 2 or id(p) in emb else "decay")
            for n, p in model.named_parameters()}


class MuonReference:
    """The reference optimizer over named copies: Muon on the ``"muon"`` names of ``kinds``
    (:func:`groups_of`), ``torch.optim.AdamW`` on the others. :meth:`step` takes the
    parameters before the step and the gradients (some names only: a pipeline stage's) and
    returns the parameters after it."""

    def __init__(self, shapes: dict[str, torch.Size], kinds: dict[str, str], *,
                 weight_decay: float, betas, eps: float):
        self.kinds, self.wd = kinds, weight_decay
        self.shadow = {n: torch.zeros(s) for n, s in shapes.items()}
        self.buf: dict[str, torch.Tensor] = {}
        groups = [{"params": [self.shadow[n] for n in shapes if kinds[n] == k], "weight_decay": w}
                  for k, w in (("decay", weight_decay), ("no_decay", 0.0))]
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=0.0, betas=betas,
                                       eps=eps)

    @torch.no_grad()
    def step(self, params: dict, grads: dict, lr: float) -> dict[str, torch.Tensor]:
        names = [n for n in grads if n in params]
        for n, t in self.shadow.items():
            t.grad = None
            if n in names:
                t.copy_(params[n])
                t.grad = grads[n].detach().clone()
        for n in names:
            if self.kinds[n] != "muon":
                continue
            p, g = self.shadow[n], self.shadow[n].grad
            buf = self.buf.setdefault(n, torch.zeros_like(g))
            buf.lerp_(g, 1 - MOMENTUM)
            o = newton_schulz(g.lerp(buf, MOMENTUM))
            p.mul_(1 - lr * self.wd)
            p.add_(o, alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        return {n: self.shadow[n].clone() for n in names}


def reference_run_muon(model: nn.Module, global_batches: list[dict], *, lrs: list[float],
                       weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                       max_norm: float = 0.0) -> dict:
    """:func:`shardwise.parity.reference_run` with :class:`MuonReference` as the optimizer; the
    result also holds ``"optimizer": "muon"``, ``"init"`` (the parameters before step 0),
    ``"kinds"`` and ``"weight_decay"``. Raises ValueError if ``lrs`` and ``global_batches``
    differ in length."""
    if len(lrs) != len(global_batches):
        raise ValueError(f"{len(global_batches)} batches but {len(lrs)} learning rates")
    named = dict(model.named_parameters())
    kinds = groups_of(model)
    opt = MuonReference({n: p.shape for n, p in named.items()}, kinds,
                        weight_decay=weight_decay, betas=betas, eps=eps)
    out = {"loss": [], "grad_norm": [], "grads": [], "params": [], "lrs": list(lrs),
           "betas": tuple(betas), "eps": eps, "model": model, "batches": list(global_batches),
           "max_norm": max_norm, "optimizer": "muon", "kinds": kinds,
           "weight_decay": weight_decay,
           "init": {n: p.detach().clone() for n, p in named.items()},
           "check_params": check_params}  # compare() applies this rule to the parameters
    for lr, batch in zip(lrs, global_batches):
        loss, norm, grads = _loss_and_grads(model, batch, max_norm)
        out["loss"].append(loss)
        out["grad_norm"].append(norm)
        out["grads"].append(grads)
        new = opt.step({n: p.detach() for n, p in named.items()}, grads, lr)
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(new[n])
        model.zero_grad(set_to_none=True)
        out["params"].append({n: p.detach().clone() for n, p in named.items()})
    return out


def check_params(rep, pre: str, mine: dict, ref: dict) -> None:
    """The teacher-forced parameter check of a Muon run (module docstring): for each step t and
    each name the run reports parameters and gradients of at every step up to t, the
    reference's update from the run's parameters after step t − 1 (``ref["init"]`` at t = 0)
    and the run's gradients, against the run's parameters after step t: ATOL + RTOL·|ref|.
    Books failures and the worst differences into ``rep`` (a ParityReport)."""
    params = mine["params"] if isinstance(mine["params"], (list, tuple)) else None
    if params is None:
        rep.failures.append(f"{pre}a Muon run's check needs its parameters after every step")
        return
    names = [n for n in params[0] if n in ref["init"]]
    opt = MuonReference({n: ref["init"][n].shape for n in names}, ref["kinds"],
                        weight_decay=ref["weight_decay"], betas=ref["betas"], eps=ref["eps"])
    for t, named in enumerate(params):
        before = ref["init"] if t == 0 else params[t - 1]
        grads = {n: mine["grads"][t][n] for n in names if n in mine["grads"][t]}
        if set(grads) != set(names):
            rep.failures.append(f"{pre}step {t}: no gradient for {sorted(set(names) - set(grads))}"
                                " to force the Muon check with")
            return
        forced = opt.step(before, grads, ref["lrs"][t])
        want = _flat([forced[n] for n in names])
        d, ratio = _check_flat(rep, f"{pre}step {t} param", names,
                               [forced[n].shape for n in names],
                               _flat([named[n] for n in names]), want,
                               ATOL + RTOL * want.abs(),
                               "ATOL + RTOL·|ref| (Muon, teacher-forced)")
        rep.max_param_diff = max(rep.max_param_diff, d)
        rep.param_bound_ratio = max(rep.param_bound_ratio, ratio)
