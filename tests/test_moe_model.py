"""The mixture-of-experts model (models/moe.py) against values computed here independently, one
process, CPU, fp32: the balance loss and z-loss by explicit loops, routing ties, the dropless
output against a per-token dense loop, capacity drops against a hand-run queue, batch-split
invariance of loss and gradients, attach mode against plain mode, and the config's refusals.

**Tolerances.** A reference is computed in fp64 from the very fp32 inputs and weights, so its own
error is negligible (~1e-16 relative), and the fp32 module is bounded by a first-order forward
error analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.: an inner
product of n terms, in any order, has error ≤ γ_n·Σ|x_i·y_i|, γ_n = n·u/(1 − n·u), u = 2⁻²⁴,
§3.1; each elementary operation adds ≤ u relative, §2.2). The bound is evaluated elementwise
from the data (:func:`_dense_reference`, :func:`_aux_reference`) and doubled to cover the
second-order terms; every test also checks that the bound is small (≪ the quantity compared),
so a wrong weight, a missing renormalisation or a mis-routed token cannot hide inside it.
Comparisons of two fp32 computations of the same sums in different orders (batch splits,
attach vs plain mode) use the project's parity rule (:data:`shardwise.parity.RTOL`/``ATOL``,
whose docstring derives them for these tiny models).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import MoEConfig, MoELlama, build_model, moe_aux_loss
from shardwise.models.moe import (
    MoEFeedForward,
    capacity_keep,
    moe_layers,
    moe_stats,
    reset_moe_stats,
    route,
    set_aux_grad_scale,
)
from shardwise.parity import ATOL, RTOL

U = 2.0 ** -24  # fp32 unit round-off


def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u) (Higham §3.1)."""
    return n * U / (1 - n * U)


def _cfg(**kw) -> MoEConfig:
    base = dict(vocab_size=61, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                max_seq_len=32, n_experts=4, top_k=2, d_expert=8)
    return MoEConfig(**{**base, **kw})


def _layer(seed=0, **kw) -> MoEFeedForward:
    """A lone MoE feed-forward with random weights (std 0.5: logits and activations of order
    one, so routing margins are large and SiLU is not in its linear range)."""
    torch.manual_seed(seed)
    layer = MoEFeedForward(_cfg(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def _x(b=3, s=8, d=16, seed=1) -> torch.Tensor:
    return torch.randn(b, s, d, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ independent references

def _topk_by_loop(p: list[float], k: int) -> list[int]:
    """The k largest of ``p``, ties to the lower index (the documented rule), by Python sort."""
    return sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]


def _swiglu64(w1, w3, w2, x, dx_abs=None):
    """SwiGLU of one token in fp64, and the first-order bound on the fp32 module's error of it.

    w1, w3 [f, d], w2 [d, f], x [d] (fp64, exact copies of fp32 values). Returns (y [d], |y|
    bound term for a weight error, err [d])."""
    a1, a3 = w1 @ x, w3 @ x  # [f]
    da1 = gamma(x.numel()) * (w1.abs() @ x.abs())
    da3 = gamma(x.numel()) * (w3.abs() @ x.abs())
    s1 = F.silu(a1)
    h = s1 * a3
    # |silu'| ≤ 1.1 everywhere; silu itself (exp, add, div, mul) and the product: ≤ 5u relative
    dh = 1.1 * da1 * a3.abs() + s1.abs() * da3 + 5 * U * h.abs()
    y = w2 @ h
    dy = gamma(h.numel()) * (w2.abs() @ h.abs()) + w2.abs() @ dh
    return y, y.abs(), dy


def _dense_reference(layer: MoEFeedForward, x: torch.Tensor, keep: torch.Tensor | None = None):
    """For each token, Σ_j w_j · SwiGLU_{e_j}(x) (+ the shared SwiGLU), by loops in fp64, and the
    elementwise bound on the fp32 module's error. ``keep`` [b, s, k] bool: copies to count
    (capacity drops), default all. Returns (out [b, s, d] fp64, bound [b, s, d] fp64)."""
    b, s, d = x.shape
    E, k = layer.n_experts, layer.top_k
    x64 = x.double()
    wr = layer.router.weight.detach().double()
    w1, w3, w2 = (getattr(layer.experts, n).detach().double() for n in ("w1", "w3", "w2"))
    out = torch.zeros(b, s, d, dtype=torch.float64)
    bound = torch.zeros(b, s, d, dtype=torch.float64)
    for bi in range(b):
        for t in range(s):
            xt = x64[bi, t]
            z = wr @ xt  # [E]
            dz = float((gamma(d) * (wr.abs() @ xt.abs())).max())
            p = torch.softmax(z, 0)
            chosen = _topk_by_loop(p.tolist(), k)
            w = p[chosen]
            if layer.norm_topk:
                w = w / w.sum()
            # softmax: its inputs off by ≤ dz (→ 2·dz relative) and E + 2 roundings; the top-k
            # renormalisation divides two such numbers and adds k + 1 roundings
            rel_w = 4 * dz + (2 * E + k + 6) * U
            mag = torch.zeros(d, dtype=torch.float64)
            for j, e in enumerate(chosen):
                if keep is not None and not keep[bi, t, j]:
                    continue
                y, y_abs, dy = _swiglu64(w1[e], w3[e], w2[e], xt)
                out[bi, t] += w[j] * y
                bound[bi, t] += w[j] * dy + rel_w * w[j] * y_abs
                mag += w[j] * y_abs
            bound[bi, t] += gamma(k + 1) * mag  # the weighted products and their index_add
            if layer.shared is not None:
                sh = layer.shared
                y, y_abs, dy = _swiglu64(sh.w1.weight.detach().double(),
                                         sh.w3.weight.detach().double(),
                                         sh.w2.weight.detach().double(), xt)
                out[bi, t] += y
                bound[bi, t] += dy + U * (out[bi, t].abs() + y_abs)
    return out, 2 * bound  # ×2: the second-order terms


def _aux_reference(layer: MoEFeedForward, x: torch.Tensor):
    """The balance loss and z-loss sums by explicit loops per sequence (fp64), with bounds.

    Per sequence: f_i = (copies choosing i) / (k·s), P_i = mean_t p_ti, L_bal = E·Σ_i f_i·P_i,
    added as α·s·L_bal; z-loss: β·Σ_t (logsumexp_i z_ti)². Returns (balance, z, per-sequence
    L_bal list, bound on |balance error|, bound on |z error|)."""
    b, s, d = x.shape
    E, k = layer.n_experts, layer.top_k
    wr = layer.router.weight.detach().double()
    x64 = x.double()
    balance = zsum = 0.0
    per_seq, bal_err, z_err, z_mag = [], 0.0, 0.0, 0.0
    for bi in range(b):
        counts = [0] * E
        psum = [0.0] * E
        dz_max = 0.0
        for t in range(s):
            z = (wr @ x64[bi, t]).tolist()
            dz_max = max(dz_max, float((gamma(d) * (wr.abs() @ x64[bi, t].abs())).max()))
            m = max(z)
            ez = [math.exp(v - m) for v in z]
            p = [v / sum(ez) for v in ez]
            for e in _topk_by_loop(p, k):
                counts[e] += 1
            for e in range(E):
                psum[e] += p[e]
            lse = m + math.log(sum(ez))
            zsum += lse * lse
            # logsumexp: inputs off by ≤ dz, the log of a sum of E terms, the add: absolute
            # ≤ dz + (E + 2)·u·(1 + |lse|); squaring doubles the relative error, + u
            dl = dz_max + (E + 2) * U * (1 + abs(lse))
            z_err += 2 * abs(lse) * dl + U * lse * lse
            z_mag += lse * lse
        f = [c / (k * s) for c in counts]
        P = [v / s for v in psum]
        L = E * sum(fi * Pi for fi, Pi in zip(f, P))
        per_seq.append(L)
        balance += layer.aux_loss_coef * s * L
        # P_i: probabilities 2·dz + (E + 2)·u relative off, a mean of s; then E products and a
        # sum of E; the scalings by α, s, E and the sum over the b sequences
        bal_err += layer.aux_loss_coef * s * L * (2 * dz_max + (E + 2) * U + gamma(s) +
                                                  gamma(E) + gamma(b) + 4 * U)
    z_err += gamma(b * s) * z_mag
    z = layer.z_loss_coef * zsum
    return balance, z, per_seq, 2 * bal_err, 2 * layer.z_loss_coef * z_err + U * z


# ------------------------------------------------------------------------- auxiliary losses

@pytest.mark.parametrize("k", [1, 2])
def test_balance_and_z_loss_equal_the_formula_computed_by_loops(k):
    layer = _layer(top_k=k, aux_loss_coef=0.03, z_loss_coef=0.002)
    x = _x()
    with torch.no_grad():
        layer(x)
    balance, z, per_seq, bal_bound, z_bound = _aux_reference(layer, x)
    assert bal_bound < 1e-3 * balance and z_bound < 1e-3 * z  # the bound is not vacuous
    assert abs(float(layer.stats["balance"]) - balance) <= bal_bound
    assert abs(float(layer.stats["z"]) - z) <= z_bound
    assert abs(float(layer.aux) - (balance + z)) <= bal_bound + z_bound + U * (balance + z)
    # the random router is unbalanced: L_bal lies strictly between 1 and its maximum E/k
    assert all(1.0 < L < layer.n_experts / k for L in per_seq)


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_is_one_at_perfect_balance(k):
    """Token t prefers expert t mod E first and (t + 1) mod E second, so each expert takes
    exactly k·s/E copies of every sequence: f_i = 1/E and L_bal = E·Σ (1/E)·P_i = 1."""
    E, s, b = 4, 8, 2
    layer = _layer(top_k=k, n_experts=E, aux_loss_coef=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = 3.0 * torch.eye(E)
    x = torch.zeros(b, s, 16)
    for t in range(s):
        x[:, t, t % E] = 2.0
        x[:, t, (t + 1) % E] = 1.0
    with torch.no_grad():
        layer(x)
    assert layer.stats["tokens"].tolist() == [b * s * k // E] * E
    per_seq = float(layer.stats["balance"]) / (b * s)
    # fp32: probabilities of E terms, a mean of s, a sum of E: ≤ (2E + s + 8)·u relative
    assert abs(per_seq - 1.0) <= (2 * E + s + 8) * U


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_at_total_collapse_is_e_over_k(k):
    """Every token's probability all on expert 0 (logit 60 vs 0: e⁻⁶⁰ < u, so p₀ rounds to 1):
    top-1 gives f₀ = 1 and L_bal = E (Switch's maximum); with top-k a token picks an expert at
    most once, so f_i ≤ 1/k and the maximum is E/k (the second choices go to expert 1, the
    lowest index among the tied rest, with probability ~0)."""
    E = 4
    layer = _layer(top_k=k, n_experts=E, aux_loss_coef=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 60.0
    x = torch.zeros(2, 8, 16)
    x[..., 0] = 1.0
    with torch.no_grad():
        layer(x)
    T = 2 * 8
    assert layer.stats["tokens"].tolist() == [T] + [T if k == 2 else 0] + [0] * (E - 2)
    per_seq = float(layer.stats["balance"]) / T
    assert abs(per_seq - E / k) <= (2 * E + 16) * U * E


# -------------------------------------------------------------------------------- routing ties

def test_route_breaks_ties_by_expert_index():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25],
                          [0.1, 0.3, 0.3, 0.3],
                          [0.4, 0.1, 0.4, 0.1]])
    w, e = route(probs, 2)
    assert e.tolist() == [[0, 1], [1, 2], [0, 2]]
    torch.testing.assert_close(w, torch.full((3, 2), 0.5), atol=0, rtol=0)
    w, e = route(probs, 3, norm_topk=False)
    assert e.tolist() == [[0, 1, 2], [1, 2, 3], [0, 2, 1]]
    assert torch.equal(w, probs.gather(-1, e))


@pytest.mark.parametrize("k", [1, 2])
def test_a_zero_router_sends_every_token_to_experts_0_to_k_minus_1_in_every_split(k):
    """All logits equal: a model whose routers are zero routes every token of every layer to
    experts 0..k-1 with weight 1/k, for the whole batch and for each way of splitting it."""
    torch.manual_seed(0)
    model = MoELlama(_cfg(top_k=k))
    with torch.no_grad():
        for m in moe_layers(model):
            m.router.weight.zero_()
    tokens = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(2))
    for split in ([4], [2, 2], [3, 1], [1, 1, 1, 1]):
        for part in tokens.split(split):
            reset_moe_stats(model)
            with torch.no_grad():
                model(part)
            T = part.numel()
            want = [[T] * k + [0] * (4 - k)] * model.config.n_moe_layers
            assert moe_stats(model)["tokens"].tolist() == want, split
    probs = torch.softmax(torch.zeros(5, 4), -1)
    w, e = route(probs, k)
    assert (e == torch.arange(k)).all() and torch.equal(w, torch.full((5, k), 1.0 / k))


# ------------------------------------------------------------------------- dropless output

@pytest.mark.parametrize("k,shared,norm", [(1, 0, True), (2, 0, True), (2, 1, True),
                                           (2, 2, False), (3, 0, True)],
                         ids=["top1", "top2", "top2-shared1", "top2-shared2-unnormed", "top3"])
def test_dropless_output_equals_a_per_token_dense_reference(k, shared, norm):
    layer = _layer(top_k=k, n_shared_experts=shared, norm_topk=norm)
    x = _x()
    with torch.no_grad():
        got = layer(x)
    ref, bound = _dense_reference(layer, x)
    scale = ref.abs().max()
    assert bound.max() < 1e-3 * scale  # not vacuous
    err = (got.double() - ref).abs()
    worst = err.flatten().argmax()
    assert (err <= bound).all(), f"error {err.max():.3e} > bound {bound.flatten()[worst]:.3e}"
    assert int(layer.stats["dropped"]) == 0
    assert int(layer.stats["tokens"].sum()) == x.shape[0] * x.shape[1] * k


# --------------------------------------------------------------------------------- capacity

def test_capacity_keeps_first_choices_before_second_choices():
    """s = 3, k = 2, E = 2, capacity 2. Priority is slot-major: expert 0's queue is t0 (1st),
    t2 (1st), t1 (2nd), so t1's second choice is dropped; expert 1's queue is t1 (1st), t0 (2nd),
    t2 (2nd), so t2's second choice is dropped. (Token order would have dropped t2's *first*
    choice of expert 0 instead.)"""
    experts = torch.tensor([[[0, 1], [1, 0], [0, 1]]])
    keep = capacity_keep(experts, 2, 2)
    assert keep.tolist() == [[[True, True], [True, False], [True, False]]]
    assert capacity_keep(experts, 2, None).all()
    assert capacity_keep(experts, 2, 1).tolist() == [[[True, False], [True, False],
                                                      [False, False]]]


def _hand_keep(experts: torch.Tensor, E: int, C: int) -> torch.Tensor:
    """The capacity rule run by hand: per sequence, per expert a queue filled with every
    token's first choice in position order, then every second choice, …; a copy is kept while
    its expert has taken fewer than C copies of this sequence."""
    b, s, k = experts.shape
    keep = torch.zeros(b, s, k, dtype=torch.bool)
    for bi in range(b):
        taken = [0] * E
        for j in range(k):
            for t in range(s):
                e = int(experts[bi, t, j])
                if taken[e] < C:
                    taken[e] += 1
                    keep[bi, t, j] = True
    return keep


@pytest.mark.parametrize("c,k", [(1.0, 2), (0.5, 2), (1.5, 1), (0.25, 1)])
def test_capacity_drops_what_the_hand_run_queue_drops(c, k):
    E, b, s = 4, 3, 8
    layer = _layer(top_k=k, n_experts=E, capacity_factor=c)
    with torch.no_grad():  # skew the router toward expert 0 so that drops happen
        layer.router.weight[0] += 1.0
    x = _x(b, s) + 0.5
    with torch.no_grad():
        got = layer(x)
    C = math.ceil(c * k * s / E)
    assert layer.capacity(s) == C
    probs = torch.softmax(layer.router.weight.detach().double() @ x.double().transpose(1, 2),
                          1).transpose(1, 2)  # [b, s, E]
    experts = torch.tensor([[_topk_by_loop(probs[bi, t].tolist(), k) for t in range(s)]
                            for bi in range(b)])
    keep = _hand_keep(experts, E, C)
    dropped = int((~keep).sum())
    assert dropped > 0  # the case exercises the drop
    for bi in range(b):  # at most C copies per expert per sequence
        per_expert = torch.bincount(experts[bi][keep[bi]], minlength=E)
        assert int(per_expert.max()) <= C
    assert int(layer.stats["dropped"]) == dropped
    assert layer.stats["tokens"].tolist() == torch.bincount(experts[keep], minlength=E).tolist()
    ref, bound = _dense_reference(layer, x, keep)  # a dropped copy contributes nothing
    assert ((got.double() - ref).abs() <= bound).all()
    # the auxiliary losses see the routing before any drop: the dropless layer's values
    free = _layer(top_k=k, n_experts=E)
    free.load_state_dict(layer.state_dict())
    with torch.no_grad():
        free(x)
    assert torch.equal(free.stats["balance"], layer.stats["balance"])
    assert torch.equal(free.stats["z"], layer.stats["z"])


# ----------------------------------------------------------------- split invariance, attach

def _model(**kw) -> MoELlama:
    torch.manual_seed(0)
    model = MoELlama(_cfg(**kw))
    with torch.no_grad():  # wider routers than init: decisive routing, a visible aux loss
        for m in moe_layers(model):
            m.router.weight.normal_(0.0, 0.5)
    return model


_TOKENS = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(5))


def _loss_and_grads(model, rows):
    """(CE_sum + aux_sum, its gradients, routing counts) of one forward+backward of ``rows``."""
    model.zero_grad(set_to_none=True)
    reset_moe_stats(model)
    logits = model(rows[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    loss = ce + moe_aux_loss(model)
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
            moe_stats(model))


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_k=2, n_shared_experts=1),
                                dict(top_k=2, capacity_factor=1.0, moe_every=2)],
                         ids=["top1", "top2-shared", "top2-capacity-every2"])
def test_loss_and_gradients_of_a_batch_equal_the_sum_over_its_halves(kw):
    """Per-sequence definitions (balance, capacity) make the loss sum and its gradients
    additive over sequences: the batch of 4 equals half 1 + half 2 within the parity rule."""
    model = _model(**kw)
    whole, g, st = _loss_and_grads(model, _TOKENS)
    l1, g1, st1 = _loss_and_grads(model, _TOKENS[:2])
    l2, g2, st2 = _loss_and_grads(model, _TOKENS[2:])
    # the same routing (a tie or a near-tie would make the comparison meaningless)
    assert torch.equal(st["tokens"], st1["tokens"] + st2["tokens"])
    assert int(st["dropped"]) == int(st1["dropped"]) + int(st2["dropped"])
    if kw.get("capacity_factor"):
        assert int(st["dropped"]) > 0
    assert float(st["balance"]) > 0 and float(st["z"]) > 0
    torch.testing.assert_close(whole, l1 + l2, rtol=RTOL, atol=ATOL)
    for n in g:
        torch.testing.assert_close(g[n], g1[n] + g2[n], rtol=RTOL, atol=ATOL, msg=n)
    router = [n for n in g if n.endswith("router.weight")]
    assert router and all(g[n].abs().max() > 1e-3 for n in router)


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_k=1, n_shared_experts=1,
                                                    capacity_factor=1.0)])
def test_attach_mode_gives_the_gradients_of_plain_mode(kw):
    """set_aux_grad_scale(model, 1/N) and backward of CE_sum/N alone = backward of
    (CE_sum + moe_aux_loss)/N; the aux value is still reported (detached)."""
    model = _model(**kw)
    rows = _TOKENS
    N = rows[:, 1:].numel()

    def run(attach: bool):
        model.zero_grad(set_to_none=True)
        set_aux_grad_scale(model, 1.0 / N if attach else None)
        logits = model(rows[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        aux = moe_aux_loss(model)
        ((ce if attach else ce + aux) / N).backward()
        return aux, {n: p.grad.clone() for n, p in model.named_parameters()}

    aux_plain, plain = run(False)
    aux_att, att = run(True)
    assert aux_plain.requires_grad and not aux_att.requires_grad
    assert torch.equal(aux_att, aux_plain.detach())
    for n in plain:
        torch.testing.assert_close(att[n], plain[n], rtol=RTOL, atol=ATOL, msg=n)
    # and without the aux term the router gradients differ: the test can tell
    model.zero_grad(set_to_none=True)
    set_aux_grad_scale(model, None)
    logits = model(rows[:, :-1])
    (F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / N).backward()
    r = next(n for n in plain if n.endswith("router.weight"))
    assert (dict(model.named_parameters())[r].grad - plain[r]).abs().max() > 1e-4


def test_a_recompute_does_not_count_the_routing_twice():
    """--ac full reruns each block's forward inside backward: the stats count it once."""
    model = build_model("moe-tiny", vocab_size=61, ac="full")
    rows = _TOKENS
    reset_moe_stats(model)
    logits = model(rows[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
    st = moe_stats(model)
    cfg = model.config
    assert st["tokens"].sum(1).tolist() == [rows[:, :-1].numel() * cfg.top_k] * cfg.n_moe_layers


def test_parameter_counts_match_the_model():
    cfg = _cfg(n_shared_experts=1, moe_every=2, n_layers=3, d_expert=12)
    model = MoELlama(cfg)
    assert cfg.n_moe_layers == 2  # blocks 0 and 2
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    d, f, E, k = cfg.d_model, cfg.d_expert, cfg.n_experts, cfg.top_k
    assert cfg.num_params() - cfg.num_active_params() == 2 * (E - k) * 3 * d * f


# ----------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kw,match", [
    (dict(n_experts=4, top_k=5), r"top_k=5 must be between 1 and n_experts=4"),
    (dict(top_k=0), r"top_k=0 must be between 1 and n_experts"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be > 0"),
    (dict(capacity_factor=-1.5), r"capacity_factor=-1.5 must be > 0"),
    (dict(moe_every=0), r"moe_every=0 must be ≥ 1"),
    (dict(n_experts=0, top_k=0), r"n_experts=0 must be ≥ 1"),
    (dict(n_shared_experts=-1), r"n_shared_experts=-1 must be ≥ 0"),
])
def test_a_bad_config_is_refused_naming_the_constraint(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)
    with pytest.raises(ValueError, match=match):
        build_model("moe-tiny", **kw)
