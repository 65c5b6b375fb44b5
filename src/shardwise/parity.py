"""Parity with one process: the single-process reference, and the one comparison rule that every
parity test and ``shardwise verify`` apply to a parallel run.

**The reference** (:func:`reference_run`) is written in plain PyTorch and uses nothing from
``shardwise.train`` or ``shardwise.parallel``: the seeded plain model, the *whole* global batch in
one forward, ``F.cross_entropy`` averaged over counted tokens (or ``F.mse_loss`` for the
regression MLP), ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` (two groups: decay on
matrices, none on vectors and embeddings). A parallel run must reproduce it.

**The rule** (:func:`compare`), per step:

* *Loss, gradient norm, every gradient* (after clipping: what the optimizer used), elementwise
  ``|mine − ref| ≤ ATOL + RTOL·|ref|`` with ``RTOL = 1e-5`` and ``ATOL = 1e-6``, where at step
  t ≥ 1 the reference is evaluated **at the run's own parameters** after step t − 1
  (:func:`reference_at`, teacher forcing). Otherwise step t's gradients would also carry the
  parameter differences that AdamW amplified at the steps before (below: up to ~lr·1e-2 per
  element), times the loss's curvature, and no fixed tolerance would hold for them on every CPU;
  evaluated at the same parameters, the two gradients differ by the round-off of one step only
  (measured here: < 1e-7 on the 8-layer verify model). Why these are
  safe on any CPU: a parallel layout and the reference sum the same terms in different orders
  (ring all-reduce vs. one sequential sum, sharded vs. whole matmuls, SIMD widths). For n fp32
  terms two orders differ by at most 2·γ_n·Σ|x_i| with γ_n = n·u/(1 − n·u), u = 2⁻²⁴
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2); the worst case is
  pessimistic, and the expected error of random-sign round-off grows like √n·u·Σ|x_i| (Higham &
  Mary, SISC 2019, Thm. 3.1). The test models are tiny (d = 32, ≤ 8 layers, ≤ 128 tokens a step,
  losses ~4 and gradients ≤ ~0.3 in size), so √n·u·Σ|x| stays below ~1e-8: RTOL is 168 ulps and
  ATOL ~100× the expected error. Losses and gradients do not amplify round-off, so a gradient that
  is wrong by more than that is a bug, not arithmetic. ``make test-cpu-paths`` runs these checks
  under five CPU math paths (``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``)
  to show it.

* *Parameters after AdamW steps*, elementwise ``|Δp_t| ≤ ATOL + RTOL·|p_t| + Σ_{s≤t} lr_s·B_s``
  (:func:`adamw_param_bound`). AdamW moves each element by ``lr·u`` with ``u = m̂/(√v̂ + ε)``
  (Loshchilov & Hutter 2019, Alg. 2; torch's ``AdamW``), and ``u`` is very sensitive to its
  gradient where √v̂ is of order ε: at step 1 ``u = g/(|g| + ε)``, so a round-off of 1e-10 in a
  gradient of 1e-10 moves ``u`` by ~1e-2 and the weight by ~lr·1e-2, far above ATOL. No fixed
  tolerance can be right there, so the bound is *derived* from what was measured. With ``e_s =
  |g_s' − g_s|`` the measured gradient error of each element at step s (gradients after
  clipping), ``a_s = (1−β1)β1^{t−s}/(1−β1^t)`` and ``b_s = (1−β2)β2^{t−s}/(1−β2^t)`` the bias
  corrected EMA weights:

  - ``|δm̂_t| ≤ Σ_s a_s·e_s`` (m̂ is linear in g),
  - ``|δ√v̂_t| ≤ √(Σ_s b_s·e_s²)`` (√v̂ is a weighted ℓ2 norm of the g's: Minkowski),
  - so, exactly and not to first order, with ``s_t = √v̂_t`` and ``u_t`` of the reference,
    ``|δu_t| ≤ B_t = (|δm̂_t| + |u_t|·|δ√v̂_t|) / (max(s_t − |δ√v̂_t|, 0) + ε)``,
  - and ``p_t = (1 − lr_t·λ)·p_{t−1} − lr_t·u_t`` with ``0 ≤ 1 − lr_t·λ ≤ 1`` gives
    ``|δp_t| ≤ |δp_{t−1}| + lr_t·B_t``.

  The gradients of later steps are computed from the (slightly different) parameters, and that is
  inside the *measured* e_s (the run's gradients against the free-running reference's), so the
  bound holds over many steps. ATOL and RTOL then only have to
  cover AdamW's own fp32 arithmetic (a few ulps of p and of lr·u a step, ≤ 1e-8 here). Where
  gradients agree to round-off and √v̂ ≫ ε, B_t is ~1e-10 and the check is as strict as ATOL.

An optimizer that is wrong (a missed bias correction, a wrong shard of the state, a skipped
weight decay) moves parameters by O(lr) where B_t is tiny, and fails; a gradient that is wrong
fails the gradient check first.

**Drift** (:func:`drift_bound`): the pointwise bound is a worst case, so a small *systematic*
bias (a loss scaled by 1 + 1e-6, a token counted twice in a thousand) can pass every step. Round-off
has random sign; a bias does not. So the mean signed loss difference over a run's T steps must
also stay within the bound's *expected* round-off: RTOL = 2·n·u covers n = RTOL/(2u) ≈ 84 terms in
the worst case, whose expected error is √n·u (Higham & Mary 2019), i.e. τ/(2√n) of the pointwise
bound τ; the mean of T independent steps shrinks it by √T; λ = 3 standard deviations:
``|mean_t(Δloss_t)| ≤ λ·mean_t(τ_t)/(2·√(n·T))`` (docs/parity.md §2).

**Conversions** (:func:`kl_divergence`): a model folder imported and exported again with no step
in between must give the original's next-token distributions: KL(original ‖ round trip) of the
fp32 logits, as torchtitan checks its checkpoint conversions (docs/interop.md, export).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .models.moe import moe_aux_loss

RTOL, ATOL = 1e-5, 1e-6
UNIT_ROUNDOFF = 2.0 ** -24  # fp32's u
DRIFT_TERMS = RTOL / (2 * UNIT_ROUNDOFF)  # n whose worst case 2·n·u the pointwise RTOL is (≈ 84)
DRIFT_LAMBDA = 3.0  # standard deviations of the mean of random-sign round-off
IGNORE_INDEX = -100


# -- the single-process reference ----------------------------------------------------------------
def reference_run(model: nn.Module, global_batches: list[dict], *, lrs: list[float],
                  weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                  eps: float = 1e-8, max_norm: float = 0.0, keep_state: bool = False) -> dict:
    """Train ``model`` in this process, one AdamW step per batch of ``global_batches``.

    Each batch is the whole global batch of a step: ``{"input_ids": [B, S], "labels": [B, S]}``
    (cross-entropy averaged over labels ≠ -100) or ``{"inputs": [B, D], "targets": [B, D]}``
    (mean squared error). ``lrs[t]`` is step t's learning rate; ``max_norm > 0`` clips the global
    L2 norm (``clip_grad_norm_``). Returns ``{"loss": [T], "grad_norm": [T]`` (before clipping),
    ``"grads": [T × {name: grad after clipping}], "params": [T × {name: param after step t}],
    "lrs", "betas", "eps", "model", "batches", "max_norm"}`` and, with ``keep_state``,
    ``"state": [T × {name: {"exp_avg", "exp_avg_sq"}}]`` after each step. Names are the plain
    model's (a tied weight once).
    Raises ValueError if ``lrs`` and ``global_batches`` differ in length."""
    if len(lrs) != len(global_batches):
        raise ValueError(f"{len(global_batches)} batches but {len(lrs)} learning rates")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in named.values() if p.dim() < 2 or id(p) in embeddings]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lrs[0],
                            betas=betas, eps=eps)
    out = {"loss": [], "grad_norm": [], "grads": [], "params": [], "lrs": list(lrs),
           "betas": tuple(betas), "eps": eps, "model": model, "batches": list(global_batches),
           "max_norm": max_norm}
    for lr, batch in zip(lrs, global_batches):
        for g in opt.param_groups:
            g["lr"] = lr
        loss, norm, grads = _loss_and_grads(model, batch, max_norm)
        out["loss"].append(loss)
        out["grad_norm"].append(norm)
        out["grads"].append(grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["params"].append({n: p.detach().clone() for n, p in named.items()})
        if keep_state:
            out.setdefault("state", []).append(
                {n: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                 for n, p in named.items() if p in opt.state})
    return out


def _loss_and_grads(model, batch, max_norm) -> tuple[float, float, dict]:
    """Forward + backward of one whole batch, then the clip: (loss, norm before clipping,
    {name: gradient after clipping})."""
    named = dict(model.named_parameters())
    loss = reference_loss(model, batch)
    loss.backward()
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in named.values()
                                                     if p.grad is not None]))
    return (loss.item(), norm.item(),
            {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})


def reference_model_at(ref: dict, params: dict[str, torch.Tensor]) -> nn.Module:
    """The reference's plain model holding ``params`` (``{name: full-shape tensor}`` for every
    parameter, e.g. a parallel run's after some step): to evaluate the reference where the run
    is, so that comparisons see one step's round-off only (module docstring). Overwrites the
    parameters of ``ref["model"]``. Raises KeyError naming a parameter ``params`` lacks."""
    model = ref["model"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in params:
                raise KeyError(f"reference_model_at: no value for parameter {name}")
            p.copy_(params[name])
    model.zero_grad(set_to_none=True)
    return model


def reference_at(ref: dict, params: dict[str, torch.Tensor], step: int) -> dict:
    """The reference's computation of step ``step`` (its batch, its clip) evaluated at
    ``params`` (:func:`reference_model_at`, e.g. a parallel run's after step − 1): ``{"loss",
    "grad_norm", "grads"}``. Raises KeyError naming a parameter ``params`` lacks."""
    model = reference_model_at(ref, params)
    loss, norm, grads = _loss_and_grads(model, ref["batches"][step], ref["max_norm"])
    model.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": norm, "grads": grads}


def reference_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The reference's scalar loss of one whole batch (see :func:`reference_run`)."""
    if "ref_logps" in batch:  # preference pairs (rows 2i, 2i + 1): the DPO loss
        return reference_dpo_loss(model, batch)
    if "input_ids" in batch:
        logits = model(batch["input_ids"])  # [B, S, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               ignore_index=IGNORE_INDEX)
        # a mixture of experts: its aux loss sums (load balance, z-loss) over the counted tokens
        aux = moe_aux_loss(model)
        if aux is not None:
            loss = loss + aux / (batch["labels"] != IGNORE_INDEX).sum()
        return loss
    return F.mse_loss(model(batch["inputs"]), batch["targets"])


def sequence_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
                   ) -> torch.Tensor:
    """Each row's summed log-probability of its counted targets, fp64 [B]: ``log_softmax`` of
    the logits [B, S, V], the entries at the labels [B, S] gathered, positions with label −100
    dropped, summed per row (with grad)."""
    logp = torch.log_softmax(model(input_ids).float(), dim=-1)  # [B, S, V]
    counted = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, S]
    return torch.where(counted, picked, torch.zeros_like(picked)).double().sum(-1)


def reference_dpo_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The mean sigmoid DPO loss (Rafailov et al. 2023, eq. 7) of one whole batch of pairs:
    chosen at rows 2i, rejected at 2i + 1; ``batch["ref_logps"]`` [B] the frozen reference's
    :func:`sequence_logps`, ``batch["dpo_beta"]`` β. Written here from the formula, sharing no
    code with :mod:`shardwise.models.dpo`."""
    pi = sequence_logps(model, batch["input_ids"], batch["labels"])
    ref = torch.as_tensor(batch["ref_logps"], dtype=torch.float64)
    beta = float(batch["dpo_beta"])
    z = beta * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
    return torch.log1p(torch.exp(-z)).mean().float()  # −log σ(z) = log(1 + e^(−z))


# -- the AdamW parameter bound -------------------------------------------------------------------
def adamw_param_bound(ref_grads: list[torch.Tensor], grad_errors: list[torch.Tensor],
                      lrs: list[float], betas: tuple[float, float] = (0.9, 0.95),
                      eps: float = 1e-8) -> list[torch.Tensor]:
    """Per step t, the elementwise bound Σ_{s≤t} lr_s·B_s on |p_t' − p_t| that AdamW's
    normalisation can make of gradient errors (module docstring; Loshchilov & Hutter 2019,
    Alg. 2). ``ref_grads[s]`` is the reference's gradient of one parameter at step s (after
    clipping), ``grad_errors[s]`` the measured |g_s' − g_s|, both of the parameter's shape;
    ``lrs[s]`` step s's learning rate. Returns float64 tensors of that shape, one per step.
    Raises ValueError on mismatched lengths."""
    if not len(ref_grads) == len(grad_errors) <= len(lrs):
        raise ValueError(f"{len(ref_grads)} gradients, {len(grad_errors)} errors, {len(lrs)} lrs")
    b1, b2 = betas
    m = v = em = ev2 = cum = None
    out = []
    for t, (g, e) in enumerate(zip(ref_grads, grad_errors), start=1):
        g, e = g.detach().double(), e.detach().double().abs()
        if m is None:
            m, v, em, ev2, cum = (torch.zeros_like(g) for _ in range(5))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        em = b1 * em + (1 - b1) * e
        ev2 = b2 * ev2 + (1 - b2) * e * e
        c1, c2 = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
        m_hat, s, dm, ds = m / c1, v.sqrt() / c2, em / c1, ev2.sqrt() / c2
        u = m_hat.abs() / (s + eps)
        cum = cum + lrs[t - 1] * (dm + u * ds) / ((s - ds).clamp(min=0) + eps)
        out.append(cum.clone())
    return out


def adamw_state_bound(ref_grads: list[torch.Tensor], grad_errors: list[torch.Tensor],
                      betas: tuple[float, float] = (0.9, 0.95)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise tolerances on AdamW's moments after the last of the given steps (torch's
    ``exp_avg`` m = Σ_s (1−β1)β1^{t−s}·g_s and ``exp_avg_sq`` v = Σ_s (1−β2)β2^{t−s}·g_s², no
    bias correction; Kingma & Ba 2015, Alg. 1): with the measured errors e_s,
    |δm| ≤ Σ w_s·(e_s + RTOL·|g_s|) and |δv| ≤ Σ w'_s·(2|g_s|·e_s + e_s² + RTOL·g_s²), where the
    RTOL terms cover the EMAs' own fp32 rounding (measured against Σ|terms|, as m may cancel).
    Returns (tolerance of exp_avg, tolerance of exp_avg_sq), float64 of the gradient's shape."""
    b1, b2 = betas
    tm = tv = None
    for g, e in zip(ref_grads, grad_errors):
        g, e = g.detach().double().abs(), e.detach().double().abs()
        if tm is None:
            tm, tv = torch.zeros_like(g), torch.zeros_like(g)
        tm = b1 * tm + (1 - b1) * (e + RTOL * g)
        tv = b2 * tv + (1 - b2) * (2 * g * e + e * e + RTOL * g * g)
    return tm, tv


def drift_bound(ref_losses: list[float]) -> float:
    """The largest |mean_t(mine_t − ref_t)| that round-off explains over the T = len(ref_losses)
    steps of a run: λ·mean_t(ATOL + RTOL·|ref_t|)/(2·√(n·T)), n = RTOL/(2u) (module docstring,
    docs/parity.md §2). Units: those of the loss. Raises ValueError on an empty list."""
    if not ref_losses:
        raise ValueError("drift_bound: no steps")
    tau = sum(ATOL + RTOL * abs(float(x)) for x in ref_losses) / len(ref_losses)
    return DRIFT_LAMBDA * tau / (2 * math.sqrt(DRIFT_TERMS * len(ref_losses)))


# -- the comparison ------------------------------------------------------------------------------
@dataclasses.dataclass
class ParityReport:
    """Worst differences of a run against the reference, and what failed.

    ``max_*_diff``: largest |mine − ref| (loss, grad norm, any gradient element, any parameter
    element); ``tol_ratio``: the largest |mine − ref| / (ATOL + RTOL·|ref|) over losses, norms
    and gradients (≤ 1 when they pass: the margin left); ``param_bound_ratio``: the largest
    |Δp| / (ATOL + RTOL·|p| + AdamW bound), and of AdamW's moments against theirs, ≤ 1 when they
    pass; ``max_param_bound``: the largest AdamW term Σ lr·B used, and ``worst_param``: where it
    was (name, index, its gradient errors and reference gradients, for verify's footnote);
    ``drift_ratio``: |mean signed loss difference| / :func:`drift_bound` (≤ 1 when it passes);
    ``failures``: one line per failed check (empty when the run matches)."""
    max_loss_diff: float = 0.0
    max_norm_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    tol_ratio: float = 0.0
    param_bound_ratio: float = 0.0
    max_param_bound: float = 0.0
    worst_param: str = ""
    drift_ratio: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _check(report, what, mine, ref, tol=None, kind="") -> tuple[float, float]:
    """Elementwise |mine − ref| ≤ tol (default ATOL + RTOL·|ref|; ``kind`` names another in
    the failure line); books failures. Returns (the largest |mine − ref|, the largest
    |mine − ref| / tol)."""
    a, b = torch.as_tensor(mine).detach().double(), torch.as_tensor(ref).detach().double()
    if a.shape != b.shape:
        report.failures.append(f"{what}: shape {tuple(a.shape)} != reference {tuple(b.shape)}")
        return math.inf, math.inf
    diff = (a - b).abs()
    tol = ATOL + RTOL * b.abs() if tol is None else torch.as_tensor(tol, dtype=torch.float64)
    if not diff.numel():
        return 0.0, 0.0
    ratio = diff / tol
    bad = ~(ratio <= 1)  # NaN fails too
    if bad.any():
        i = int(torch.nan_to_num(ratio, nan=math.inf).argmax())
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape)) \
            if diff.dim() else ()
        flat = lambda t: float(t.reshape(-1)[i]) if t.numel() > 1 else float(t)  # noqa: E731
        report.failures.append(
            f"{what}: {int(bad.sum())} of {diff.numel()} elements outside the tolerance; worst at "
            f"{idx}: {flat(a):.9g} vs reference {flat(b):.9g}, |Δ| {flat(diff):.3g} > "
            f"{flat(tol.expand_as(diff)):.3g} ({kind or f'ATOL {ATOL:g} + RTOL {RTOL:g}·|ref|'})")
    return (float(torch.nan_to_num(diff, nan=math.inf).max()),
            float(torch.nan_to_num(ratio, nan=math.inf).max()))


def compare(mine: dict, ref: dict, *, where: str = "", all_names: bool = True) -> ParityReport:
    """Check a run ``mine`` against ``ref`` (from :func:`reference_run`) with the rule of the
    module docstring.

    ``mine`` holds ``"loss": [T]``, optionally ``"grad_norm": [T]``, ``"grads": [T × {name:
    full-shape gradient after clipping}]``, ``"params"``: ``[T × {name: tensor}]`` after each
    step (or ``{name: tensor}`` after the last, for T = 1), and, when ``"params"`` holds only
    some parameters (a pipeline stage's), ``"params_full": [T × {name: tensor}]`` with all of
    them, to evaluate the reference at (:func:`reference_at`). ``T`` may be less than the
    reference's steps. Names of grads and params may be a subset of the reference's unless
    ``all_names``. With ``"state": {name: {"exp_avg", "exp_avg_sq", …}}`` (the run's full
    AdamW state after its last step) and a reference run with ``keep_state``, the moments are
    checked against :func:`adamw_state_bound`. ``where`` prefixes every failure line (e.g.
    ``"rank 1"``). Returns a :class:`ParityReport`. Raises ValueError when T > 1 and no
    per-step parameters are given."""
    rep = ParityReport()
    pre = f"{where} " if where else ""
    steps = len(mine["loss"])
    params = mine.get("params")
    per_step = isinstance(params, (list, tuple))
    forcing = mine.get("params_full", params if per_step else None)
    if steps > 1 and forcing is None:
        raise ValueError("compare: a run of several steps needs its parameters after each step "
                         "(mine['params'] as a list, or mine['params_full'])")
    signed, ref_losses = [], []
    for t in range(steps):
        # step 0 starts from the shared initialisation; later steps from the run's own params
        at = ({k: ref[k][t] for k in ("loss", "grad_norm", "grads")} if t == 0
              else reference_at(ref, forcing[t - 1], t))
        signed.append(float(mine["loss"][t]) - float(at["loss"]))
        ref_losses.append(float(at["loss"]))
        d, r = _check(rep, f"{pre}step {t} loss", mine["loss"][t], at["loss"])
        rep.max_loss_diff, rep.tol_ratio = max(rep.max_loss_diff, d), max(rep.tol_ratio, r)
        if mine.get("grad_norm") is not None:
            d, r = _check(rep, f"{pre}step {t} grad norm", mine["grad_norm"][t], at["grad_norm"])
            rep.max_norm_diff, rep.tol_ratio = max(rep.max_norm_diff, d), max(rep.tol_ratio, r)
        grads = mine["grads"][t]
        if all_names and set(grads) != set(at["grads"]):
            rep.failures.append(f"{pre}step {t}: gradient names differ from the reference's: "
                                f"{sorted(set(grads) ^ set(at['grads']))}")
        names = []
        for name, g in grads.items():
            if name not in at["grads"]:
                rep.failures.append(f"{pre}step {t}: no reference gradient for {name}")
            elif g.shape != at["grads"][name].shape:
                _check(rep, f"{pre}step {t} grad {name}", g, at["grads"][name])
            else:
                names.append(name)
        want = _flat([at["grads"][n] for n in names])
        d, r = _check_flat(rep, f"{pre}step {t} grad", names, [grads[n].shape for n in names],
                           _flat([grads[n] for n in names]), want, ATOL + RTOL * want.abs(),
                           f"ATOL {ATOL:g} + RTOL {RTOL:g}·|ref|")
        rep.max_grad_diff, rep.tol_ratio = max(rep.max_grad_diff, d), max(rep.tol_ratio, r)
    if steps:
        _check_drift(rep, pre, signed, ref_losses)
    if params is None:
        return rep
    if ref.get("check_params") is not None:  # a reference with its own parameter rule (Muon:
        ref["check_params"](rep, pre, mine, ref)  # shardwise.parity_muon, teacher-forced)
        return rep
    checks = list(enumerate(params)) if per_step else [(steps - 1, params)]
    for t, named in checks:
        if all_names and set(named) != set(ref["params"][t]):
            rep.failures.append(f"{pre}step {t}: parameter names differ from the reference's")
        for name in named:
            if name not in ref["params"][t]:
                rep.failures.append(f"{pre}no reference parameter {name}")
    # every element of every parameter at once: the gradient history, flattened and
    # concatenated over the names, gives the bound elementwise (one pass, not one per tensor)
    names = [n for n in checks[-1][1] if n in ref["params"][0]
             and _grad_errors(rep, pre, mine, ref, n, steps)[1] is not None]
    shapes = [ref["params"][0][n].shape for n in names]
    sizes = [math.prod(sh) for sh in shapes]
    g_ref = [_flat([ref["grads"][s][n] for n in names]) for s in range(steps)]
    err = [(_flat([mine["grads"][s][n] for n in names]) - g).abs() for s, g in enumerate(g_ref)]
    bounds = adamw_param_bound(g_ref, err, ref["lrs"], ref["betas"], ref["eps"])
    for t, named in checks:
        label = "final" if not per_step else f"step {t}"
        ref_p = _flat([ref["params"][t][n] for n in names])
        d, ratio = _check_flat(rep, f"{pre}{label} param", names, shapes,
                               _flat([named[n] for n in names]), ref_p,
                               ATOL + RTOL * ref_p.abs() + bounds[t],
                               "ATOL + RTOL·|ref| + AdamW bound")
        rep.param_bound_ratio = max(rep.param_bound_ratio, ratio)
        rep.max_param_diff = max(rep.max_param_diff, d)
    if names and bounds[checks[-1][0]].numel():
        t = checks[-1][0]
        i = int(bounds[t].argmax())
        name, j = _locate(names, sizes, i)
        idx = [int(x) for x in torch.unravel_index(torch.tensor(j), ref["params"][0][name].shape)]
        rep.max_param_bound = float(bounds[t][i])
        rep.worst_param = (f"{name}{idx} at step {t}: gradient errors "
                           f"{[f'{float(e[i]):.1e}' for e in err[:t + 1]]}, reference gradients "
                           f"{[f'{float(g[i]):.1e}' for g in g_ref[:t + 1]]}")
    if mine.get("state") is not None:  # AdamW's moments after the run's last step
        ref_state = ref["state"][steps - 1]
        if all_names and set(mine["state"]) != set(ref_state):
            rep.failures.append(f"{pre}optimizer state names differ from the reference's")
        held = [n for n in names if n in mine["state"]]
        missing = sorted(set(mine["state"]) - set(names))
        if missing:
            rep.failures.append(f"{pre}optimizer state without a checked parameter: {missing}")
        keep = torch.cat([torch.full((k,), n in mine["state"]) for n, k in zip(names, sizes)]) \
            if names else torch.zeros(0, dtype=torch.bool)
        tols = adamw_state_bound([g[keep] for g in g_ref], [e[keep] for e in err], ref["betas"])
        for key, tol in zip(("exp_avg", "exp_avg_sq"), tols):
            _, ratio = _check_flat(rep, f"{pre}{key}", held,
                                   [ref["params"][0][n].shape for n in held],
                                   _flat([mine["state"][n][key] for n in held]),
                                   _flat([ref_state[n][key] for n in held]), tol,
                                   "RTOL·Σw|g| + bound from the gradient errors")
            rep.param_bound_ratio = max(rep.param_bound_ratio, ratio)
    return rep


def _check_drift(rep, pre, signed: list[float], ref_losses: list[float]) -> None:
    """Books a failure when the mean signed loss difference over the steps exceeds
    :func:`drift_bound` (NaN fails); sets ``rep.drift_ratio``."""
    mean, bound = sum(signed) / len(signed), drift_bound(ref_losses)
    ratio = abs(mean) / bound
    rep.drift_ratio = max(rep.drift_ratio, ratio if not math.isnan(ratio) else math.inf)
    if not ratio <= 1:
        rep.failures.append(
            f"{pre}loss drift: mean signed difference over {len(signed)} step(s) {mean:.3g} "
            f"exceeds the expected round-off {bound:.3g} (a systematic bias: every step within "
            "the pointwise bound, all on one side)")


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated, in float64 (an empty list: an empty tensor)."""
    return (torch.cat([t.detach().reshape(-1).double() for t in tensors]) if tensors
            else torch.zeros(0, dtype=torch.float64))


def _locate(names: list[str], sizes: list[int], i: int) -> tuple[str, int]:
    """(name, flat index within it) of element ``i`` of a concatenation of ``sizes``."""
    for name, k in zip(names, sizes):
        if i < k:
            return name, i
        i -= k
    raise IndexError(i)


def _check_flat(rep, what, names, shapes, mine, ref, tol, kind) -> tuple[float, float]:
    """:func:`_check` of tensors flattened and concatenated (``names`` of ``shapes``), in one
    pass; on a failure, one line per failing tensor with the element's index in it. Returns
    (max |Δ|, max |Δ| / tol)."""
    probe = ParityReport()
    d, ratio = _check(probe, what, mine, ref, tol, kind)
    if probe.failures:
        start = 0
        for name, shape in zip(names, shapes):
            k = math.prod(shape)
            cut = lambda t: t[start:start + k].view(shape)  # noqa: E731
            _check(rep, f"{what} {name}", cut(mine), cut(ref), cut(tol), kind)
            start += k
    return d, ratio


def _grad_errors(rep, pre, mine, ref, name, steps):
    """(the reference's gradients of ``name`` at steps 0 … steps−1, the run's |errors| against
    them), or (None, None) with a failure booked when the run lacks one."""
    missing = [s for s in range(steps) if name not in mine["grads"][s]]
    if missing:
        rep.failures.append(f"{pre}{name}: no gradient at step(s) {missing} to bound its "
                            "parameter and optimizer state with")
        return None, None
    g_ref = [ref["grads"][s][name] for s in range(steps)]
    if any(mine["grads"][s][name].shape != g_ref[s].shape for s in range(steps)):
        return None, None  # the gradient check has failed already
    return g_ref, [(mine["grads"][s][name].detach().double() - g_ref[s].double()).abs()
                   for s in range(steps)]


def stages_together(per_rank: list[list[dict]]) -> list[dict]:
    """Per step, the union of several ranks' ``{name: tensor}`` (pipeline stages, each with its
    own parameters): the ``"params_full"`` that :func:`compare` evaluates the reference at."""
    return [{n: t for rank in step for n, t in rank.items()} for step in zip(*per_rank)]


def assert_parity(mine: dict, ref: dict, *, where: str = "", all_names: bool = True,
                  shown: int = 8) -> ParityReport:
    """:func:`compare`, raising AssertionError with the first ``shown`` failure lines."""
    rep = compare(mine, ref, where=where, all_names=all_names)
    if rep.failures:
        more = len(rep.failures) - shown
        raise AssertionError("\n".join(rep.failures[:shown]
                                       + ([f"... and {more} more"] if more > 0 else [])))
    return rep


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> float:
    """KL(p ‖ q) of the next-token distributions, averaged over positions: with p = softmax of
    ``logits_p`` and q = softmax of ``logits_q`` over the last axis (the vocabulary),

        KL = mean over positions of Σ_v p_v·(log p_v − log q_v)

    (Kullback & Leibler 1951; ``F.kl_div(log q, log p, log_target=True, reduction="batchmean")``
    over the flattened positions). Both are ``log_softmax`` in fp64 of the fp32 logits (the cast
    is exact), so the sum's own round-off (~1e-16) is far below the bounds it is compared with.

    torchtitan checks a checkpoint conversion this way (scripts/checkpoint_conversion/README.md,
    "Comprehensive Check (KL Divergence)"; numerical_tests_example.py compares the original and
    converted models' logits with ``F.kl_div(log_softmax(a), softmax(b), reduction="mean")``,
    which also divides by the vocabulary size: the per-position sum here does not, so the same
    bound is V times stricter). Why it separates round-off from a wrong conversion: for logits
    that differ by δ, KL = log E_p[e^δ] − E_p[δ] ≈ ½·Var_p(δ) ≤ ½·max|δ|², second order in δ, so
    round-off of 1e-6 in the logits gives ~1e-12, while a misplaced tensor moves whole
    distributions (KL of order 1e-2 and up). Raises ValueError for tensors of other shapes."""
    if logits_p.shape != logits_q.shape or logits_p.dim() == 0:
        raise ValueError(f"kl_divergence: logits of shapes {tuple(logits_p.shape)} and "
                         f"{tuple(logits_q.shape)}: give two [..., vocab] tensors of one shape")
    v = logits_p.shape[-1]
    log_p = torch.log_softmax(logits_p.detach().double().reshape(-1, v), dim=-1)
    log_q = torch.log_softmax(logits_q.detach().double().reshape(-1, v), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


RULE = (f"loss, grad norm, gradients: |Δ| ≤ {ATOL:g} + {RTOL:g}·|ref| at every step; "
        f"loss drift: |mean_t Δloss_t| ≤ {DRIFT_LAMBDA:g}·mean_t(ATOL + RTOL·|ref_t|)/(2√(nT)), "
        f"n = RTOL/2u; "
        f"parameters: |Δp_t| ≤ {ATOL:g} + {RTOL:g}·|p_t| + Σ_s≤t lr_s·(|δm̂_s| + |û_s|·|δ√v̂_s|)"
        "/(max(√v̂_s − |δ√v̂_s|, 0) + ε), from the measured gradient errors (shardwise.parity)")
