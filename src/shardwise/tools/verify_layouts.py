"""The layouts ``shardwise verify`` runs when none are given: every factorization of the world
and its composed options, the V schedules, context, expert and hybrid-sharded data parallelism
(:func:`layouts_that_fit`). Which of them apply to a model, engine and optimizer is
:func:`shardwise.tools.verify.applies`."""

from __future__ import annotations

from ..config import CHOICES
from ..parallel.layout import Layout
from ..parallel.pp.schedules import V_SCHEDULES

# the loop-placed schedules run over every pp layout; the V schedules (zbv, dualpipev) in a few
# chosen ones (:func:`_v_layouts`), to keep verify's time
SCHEDULES = tuple(s for s in CHOICES["schedule"] if s not in V_SCHEDULES)


def layouts_that_fit(nproc: int, bounded: bool = False) -> list[Layout]:
    """The layouts ``verify`` runs on ``nproc`` ranks.

    Full (``bounded=False``): every single strategy on at most ``nproc`` ranks — DP dp =
    1…nproc; ZeRO 1/2/3 with dp = 2…nproc; TP tp ∈ {2, 4} with and without SP; PP pp =
    2…nproc with every schedule and m ∈ {pp, 2·pp} plus an odd m where the schedule allows
    it — then every factorization nproc = pp·dp·tp with at least two degrees > 1 (the
    compositions) × ZeRO stages (0…3 without pp, 0/1 with pp: ZeRO-2/3 + PP is refused) ×
    schedules (m = 2·pp) × SP on/off where tp > 1.

    Bounded (``bounded=True``, for large worlds such as 8): only the compositions of exactly
    ``nproc`` ranks, each factorization once with its most composed options (highest ZeRO
    stage, SP, zb-h1), and the 3D factorization also with interleaved 1F1B and ZeRO-1.

    Then the V schedules (:func:`_v_layouts`), context parallelism (:func:`_cp_layouts`), expert parallelism (:func:`_ep_layouts`:
    they run for a mixture-of-experts model only, ``--models moe-tiny``) and HSDP
    (:func:`_hsdp_layouts`), then ZeRO-2/3 and HSDP inside pipeline stages
    (:func:`_zero_pp_layouts`)."""
    return (_pp_dp_tp_layouts(nproc, bounded) + _v_layouts(nproc, bounded)
            + _cp_layouts(nproc, bounded)
            + _ep_layouts(nproc, bounded) + _hsdp_layouts(nproc, bounded)
            + _zero_pp_layouts(nproc, bounded))


def _v_layouts(nproc: int, bounded: bool) -> list[Layout]:
    """The V schedules (zbv, dualpipev; both engines): full, pp = 2 with m = 4 each, and on 4
    ranks pp = 4 (dualpipev, m = 8), dualpipev with dp = 2 and ZeRO-1, zbv with tp = 2 and SP;
    bounded (8 ranks), dualpipev over pp = 2 × dp = 2 × tp = 2 with SP and ZeRO-1. (More m,
    zbv at pp = 4 and the untied and MLP models: tests/test_pipeline_parity.py.)"""
    if bounded:
        return [Layout(pp=2, dp=2, tp=2, sp=True, zero=1, schedule="dualpipev",
                       microbatches=4)] if nproc == 8 else []
    out = [Layout(pp=2, schedule=s, microbatches=4) for s in V_SCHEDULES] if nproc >= 2 else []
    if nproc >= 4:
        out += [Layout(pp=4, schedule="dualpipev", microbatches=8),
                Layout(pp=2, dp=2, zero=1, schedule="dualpipev", microbatches=4),
                Layout(pp=2, tp=2, sp=True, schedule="zbv", microbatches=4)]
    return out


def _hsdp_layouts(nproc: int, bounded: bool) -> list[Layout]:
    """HSDP (dp = dp_replicate × dp_shard, both engines): full, dp_replicate = 2 × dp_shard = 2
    with ZeRO-1, 2 and 3; bounded (8 ranks), the same × tp = 2 with ZeRO-1 and 3."""
    if bounded:
        return [Layout(dp=4, tp=2, dp_replicate=2, zero=z) for z in (1, 3)] if nproc == 8 else []
    return [Layout(dp=4, dp_replicate=2, zero=z) for z in (1, 2, 3)] if nproc >= 4 else []


def _zero_pp_layouts(nproc: int, bounded: bool) -> list[Layout]:
    """ZeRO-2/3 and HSDP inside pipeline stages. Full, on ≥ 4 ranks: pp = 2 × dp = 2 with
    ZeRO-2 and ZeRO-3, each with 1F1B and interleaved 1F1B (m = 4), both engines (FSDP2 on the
    torch engine's stages); on ≥ 8 ranks, and bounded on 8: HSDP pp = 2 × dp = 4
    (dp_replicate 2) with ZeRO-3 (1F1B) and ZeRO-2 (interleaved 1F1B), both engines, and
    pp = 2 × dp = 2 × tp = 2 with SP and ZeRO-3 (explicit engine: the torch engine's pipeline
    refuses tp, :func:`~shardwise.tools.verify.applies`)."""
    out = []
    if nproc >= 4 and not bounded:
        out += [Layout(pp=2, dp=2, zero=z, schedule=s, microbatches=4)
                for z in (2, 3) for s in ("1f1b", "interleaved-1f1b")]
    if nproc >= 8 and (nproc == 8 or not bounded):
        out += [Layout(pp=2, dp=4, dp_replicate=2, zero=3, schedule="1f1b", microbatches=4),
                Layout(pp=2, dp=4, dp_replicate=2, zero=2, schedule="interleaved-1f1b",
                       microbatches=4),
                Layout(pp=2, dp=2, tp=2, sp=True, zero=3, schedule="1f1b", microbatches=4)]
    return out


def _ep_layouts(nproc: int, bounded: bool) -> list[Layout]:
    """The ep layouts of :func:`layouts_that_fit` (explicit engine, MoE models only:
    :func:`applies`). Full: ep = 2 and 4 over dp (ep = dp·cp and ep < dp), composed with ZeRO-1
    and ZeRO-3, with tp = 2 and with pp = 2 (1F1B, ZeRO 0 and 1; zbv). Bounded (8 ranks): ep = 8,
    ep = 4 × ZeRO-3,
    tp = 2 × ep = 4, pp = 2 × dp = 4 × ep = 2."""
    if bounded:
        if nproc != 8:
            return []
        return [Layout(dp=8, ep=8), Layout(dp=8, ep=4, zero=3), Layout(dp=4, tp=2, ep=4),
                Layout(pp=2, dp=4, ep=2, schedule="1f1b", microbatches=4)]
    out = [Layout(dp=d, ep=e) for d in (2, 4) if d <= nproc for e in (2, 4) if e <= d]
    if nproc >= 4:
        out += [Layout(dp=4, ep=2, zero=z) for z in (1, 3)]
        out += [Layout(dp=2, tp=2, ep=2),
                Layout(pp=2, dp=2, ep=2, schedule="1f1b", microbatches=4),
                Layout(pp=2, dp=2, ep=2, zero=1, schedule="1f1b", microbatches=4),
                Layout(pp=2, dp=2, ep=2, schedule="zbv", microbatches=4)]
    return out


def _cp_layouts(nproc: int, bounded: bool) -> list[Layout]:
    """The cp layouts of :func:`layouts_that_fit` (explicit engine, Llama only: :func:`applies`).

    Full: cp ∈ {2, 4} alone with both methods; on 4 ranks cp = 2 composed with dp = 2 (ZeRO 0,
    1, 3), tp = 2 (± SP) and pp = 2 (1F1B), each also with the all-gather method once.
    Bounded: on 8 ranks cp = 2 in three-axis compositions of all 8 — dp × cp × tp with ZeRO-3 and
    SP, pp × dp × cp with ZeRO-1, pp × cp × tp with SP and zb-h1 — and cp = 8, cp = 4 × tp = 2,
    the first also with the all-gather method."""
    if bounded:
        if nproc != 8:
            return []
        return [Layout(dp=2, cp=2, tp=2, zero=3, sp=True),
                Layout(dp=2, cp=2, tp=2, zero=3, sp=True, cp_method="allgather"),
                Layout(pp=2, dp=2, cp=2, zero=1, schedule="1f1b", microbatches=4),
                Layout(pp=2, cp=2, tp=2, sp=True, schedule="zb-h1", microbatches=4),
                Layout(cp=8), Layout(cp=4, tp=2)]
    out = [Layout(cp=c, cp_method=m) for c in (2, 4) if c <= nproc for m in ("ring", "allgather")]
    if nproc >= 4:
        for method in ("ring", "allgather"):
            zeros = (0, 1, 3) if method == "ring" else (0,)
            out += [Layout(dp=2, cp=2, zero=z, cp_method=method) for z in zeros]
            out += [Layout(cp=2, tp=2, sp=sp, cp_method=method)
                    for sp in ((False, True) if method == "ring" else (False,))]
            out.append(Layout(cp=2, pp=2, schedule="1f1b", microbatches=4, cp_method=method))
    return out


def _pp_dp_tp_layouts(nproc: int, bounded: bool) -> list[Layout]:
    comps = _compositions(nproc)
    if bounded:
        out = []
        for pp, dp, tp in _factorizations(nproc):
            opts = [lay for lay in comps if (lay.pp, lay.dp, lay.tp) == (pp, dp, tp)]
            out.append(opts[-1])  # the most composed: highest ZeRO stage, SP, zb-h1
            if min(pp, dp, tp) > 1:  # 3D: also interleaved 1F1B without SP, ZeRO-1
                out += [lay for lay in opts if lay.schedule == "interleaved-1f1b"
                        and not lay.sp and lay.zero == 1]
        return list(dict.fromkeys(out))
    out = [Layout(dp=d) for d in range(1, nproc + 1)]
    out += [Layout(dp=d, zero=z) for z in (1, 2, 3) for d in range(2, nproc + 1)]
    out += [Layout(tp=t, sp=sp) for t in (2, 4) if t <= nproc for sp in (False, True)]
    for p in range(2, nproc + 1):
        for sched in SCHEDULES:
            ms = [p, 2 * p] + ([p + 1] if sched != "interleaved-1f1b" and (p + 1) % 2 else [])
            out += [Layout(pp=p, schedule=sched, microbatches=m) for m in ms]
    return out + comps


def _factorizations(n: int) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) with pp·dp·tp = n and at least two degrees > 1; tp ≤ 4 (the verify Llama
    has 4 kv heads)."""
    out = []
    for pp in range(1, n + 1):
        for dp in range(1, n + 1):
            if n % (pp * dp) == 0:
                tp = n // (pp * dp)
                if tp <= 4 and sum(d > 1 for d in (pp, dp, tp)) >= 2:
                    out.append((pp, dp, tp))
    return out


def _compositions(n: int) -> list[Layout]:
    out = []
    for pp, dp, tp in _factorizations(n):
        zeros = ([0] + ([1] if dp > 1 else [])) if pp > 1 else ([0, 1, 2, 3] if dp > 1 else [0])
        scheds = SCHEDULES if pp > 1 else ("1f1b",)
        sps = (False, True) if tp > 1 else (False,)
        for z in zeros:
            for sched in scheds:
                for sp in sps:
                    out.append(Layout(pp=pp, dp=dp, tp=tp, zero=z, sp=sp, schedule=sched,
                                      microbatches=2 * pp if pp > 1 else 0))
    return out


# ``verify --param-dtype bf16`` / ``--offload optimizer`` (:mod:`.verify_storage`): each kind of
# layout once — DP, ZeRO-1/2/3 (dp 2: §7's bitwise case), dp 4 ZeRO-3, HSDP, TP, PP, ZeRO-2/3
# inside pipeline stages (1F1B, interleaved) and HSDP × PP
STORAGE_LAYOUTS = ("dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3", "dp=4,zero=3",
                   "dp=4,dp_replicate=2,zero=3", "tp=2", "dp=2,tp=2,zero=3", "pp=2,1f1b,m=4",
                   "dp=2,pp=2,zero=2,1f1b,m=4", "dp=2,pp=2,zero=3,1f1b,m=4",
                   "dp=2,pp=2,zero=3,interleaved-1f1b,m=4",
                   "dp=4,dp_replicate=2,pp=2,zero=3,1f1b,m=4")


def storage_layouts(nproc: int) -> list[Layout]:
    """The layouts of :data:`STORAGE_LAYOUTS` on at most ``nproc`` ranks."""
    from ..parallel.layout import parse_layout

    return [lay for lay in map(parse_layout, STORAGE_LAYOUTS) if lay.world <= nproc]


def step_traffic(ledger) -> dict[str, float]:
    """This rank's wire bytes of the ledger's current step, keyed ``"<tag> <op> <axis>"`` (one
    key per kind of traffic; what a refactor must leave equal, or rename)."""
    out: dict[str, float] = {}
    for r in ledger.step_records():
        key = f"{r.tag} {r.op} {r.axis}"
        out[key] = out.get(key, 0.0) + r.wire_bytes
    return out
