"""Pipeline schedules as data, single process and pure: the simulator against closed forms and
hand-worked orders, deadlock-freedom of every schedule for all p ≤ 8, m ≤ 16 (exhaustive), the
simulator's own failure detection, activation memory, validation errors, the timeline outputs.
The V schedules (zbv, dualpipev): the placement, their orders against PyTorch's own
(``_calculate_single_rank_operations``), their bubble against the closed form at equal costs,
their peak activations and point-to-point counts, by hand."""

import json
from types import SimpleNamespace

import pytest

from shardwise.errors import ShardwiseConfigError
from shardwise.parallel.pp import (SCHEDULES, Action, Costs, DeadlockError, Schedule,
                                         ScheduleError, bubble_formula, build_schedule,
                                         format_schedule, peak_activations, simulate,
                                         split_layers, validate_pp)
from shardwise.parallel.pp.comms import p2p_bytes_formula
from shardwise.parallel.pp.schedules import chunk_of, rank_of, rounds_of, stage_of, stages_of
from shardwise.viz.timeline import bubble_of, chrome_trace, draw_timeline

UNIT = Costs(t_f=1.0, t_b=1.0, t_w=1.0)


def valid_configs(p_max=8, m_max=16):
    """Every (schedule, p, m, v) the builder accepts with p ≤ p_max, m ≤ m_max, v ≤ 3."""
    for name in SCHEDULES:
        for p in range(1, p_max + 1):
            for m in range(p, m_max + 1):
                if name in ("zbv", "dualpipev"):
                    if p >= 2 and (name == "zbv" or m >= 2 * p):
                        yield name, p, m, 2
                elif name != "interleaved-1f1b":
                    yield name, p, m, 1
                elif p >= 2 and rounds_of(p, m) is not None:
                    yield name, p, m, 2
                    yield name, p, m, 3


def compute(schedule, r):
    return [str(a) for a in schedule[r] if a.is_compute]


# -- hand-worked orders ---------------------------------------------------------------------------

def test_1f1b_p2_m3_order_by_hand():
    s = build_schedule("1f1b", 2, 3)
    assert compute(s, 0) == ["F0", "F1", "B0", "F2", "B1", "B2"]  # one warm-up forward
    assert compute(s, 1) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert [str(a) for a in s[0][:5]] == ["F0", "SEND_F0→1", "F1", "SEND_F1→1", "RECV_B0←1"]
    assert [str(a) for a in s[1][:4]] == ["RECV_F0←0", "F0", "B0", "SEND_B0→0"]


def test_gpipe_and_zb_h1_orders_by_hand():
    assert compute(build_schedule("gpipe", 2, 2), 1) == ["F0", "F1", "B0", "B1"]
    zb = build_schedule("zb-h1", 2, 2)
    assert compute(zb, 0) == ["F0", "F1", "I0", "W0", "I1", "W1"]
    assert compute(zb, 1) == ["F0", "I0", "F1", "I1", "W0", "W1"]  # last rank delays W by 1


def test_interleaved_p2_m2_v2_order_by_hand():
    s = build_schedule("interleaved-1f1b", 2, 2, 2)
    # stage s on rank s % 2, chunk s // 2; warm-up (v−1)·g + 2(p−1−r) = 2 + 2 on rank 0
    assert compute(s, 0) == ["F0", "F1", "F0.1", "F1.1", "B0.1", "B1.1", "B0", "B1"]
    assert compute(s, 1) == ["F0", "F1", "F0.1", "B0.1", "F1.1", "B1.1", "B0", "B1"]
    assert Action("SEND_F", 0, 1, 0) not in s[1]  # the last stage sends nothing forward
    assert Action("SEND_F", 0, 0, 0) in s[1]  # stage 1 → stage 2 wraps to rank 0


def test_format_schedule_is_printable():
    text = format_schedule(build_schedule("1f1b", 2, 2), compute_only=True)
    assert text.splitlines() == ["1f1b: p=2 ranks, m=2 microbatches, v=1 chunk(s) per rank",
                                 "rank 0: F0 F1 B0 B1", "rank 1: F0 B0 F1 B1"]
    assert "SEND_F0→1" in str(build_schedule("1f1b", 2, 2))


def test_simulated_makespan_by_hand():
    # 1F1B p=2 m=2, T_F=1, B=2: rank 1 runs F0 1–2, B0 2–4, F1 4–5, B1 5–7; rank 0 waits for
    # B0's gradient until 4 (B0 4–6) and for B1's until 7 (B1 7–9): makespan 9, busy 6 each
    r = simulate(build_schedule("1f1b", 2, 2), UNIT)
    assert r.makespan == 9.0 and r.busy == [6.0, 6.0]
    assert r.bubble_fraction == pytest.approx(1 - 12 / 18)


# -- closed forms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ("gpipe", "1f1b"))
@pytest.mark.parametrize("costs", (UNIT, Costs(1.0, 2.0, 0.0), Costs(2.0, 1.0, 1.0)))
def test_gpipe_and_1f1b_bubble_equals_closed_form(name, costs):
    for p in range(1, 9):
        for m in (p, p + 1, 2 * p, 16):
            r = simulate(build_schedule(name, p, m), costs)
            assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaved_bubble_equals_closed_form():
    for p in range(2, 9):
        for m in sorted({p, 2 * p, 3 * p, p + 1}):
            if rounds_of(p, m) is None:
                continue
            for v in (2, 3, 4):
                r = simulate(build_schedule("interleaved-1f1b", p, m, v), UNIT)
                assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
                assert r.bubble_fraction < bubble_formula("1f1b", p, m)


def test_zb_h1_bubble_at_most_half_of_1f1b_and_equals_its_closed_form():
    for p in range(2, 9):
        for m in range(p, 17):
            zb = simulate(build_schedule("zb-h1", p, m), UNIT).bubble_fraction
            one = simulate(build_schedule("1f1b", p, m), UNIT).bubble_fraction
            assert zb <= one / 2
            # Qi et al. 2023 §3.1: idle (p−1)(T_F+T_B−T_W) vs 1F1B's (p−1)(T_F+T_B+T_W)
            assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            assert zb == pytest.approx(bubble_formula("zb-h1", p, m, costs=UNIT), abs=1e-12)


# -- deadlock-freedom: exhaustive property test -----------------------------------------------------

def test_every_schedule_is_deadlock_free_for_all_p_up_to_8_m_up_to_16():
    """All (schedule, p ≤ 8, p ≤ m ≤ 16, v) the builder accepts: the simulator runs to the end
    (no deadlock, every RECV matched with the message it names, every (microbatch, stage) run
    forward and backward exactly once) with free and with costly communication."""
    count = {}
    for name, p, m, v in valid_configs():
        s = build_schedule(name, p, m, v)
        for costs in (UNIT, Costs(1.0, 2.0, 0.5, t_comm=0.7)):
            r = simulate(s, costs)
            assert 0.0 <= r.bubble_fraction < 1.0
        kinds = [a.kind for acts in s for a in acts if a.is_compute]
        assert kinds.count("F") == p * v * m
        assert kinds.count("B") + kinds.count("I") == p * v * m
        assert kinds.count("W") == kinds.count("I")
        if name in ("zb-h1", "zbv"):
            assert kinds.count("B") == 0
        count[name] = count.get(name, 0) + 1
    # the four loop schedules (interleaving with v ∈ {2, 3} where m splits into rounds);
    # zbv: p ≥ 2, m ≥ p; dualpipev: m ≥ 2p
    assert sum(count[n] for n in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")) == 424
    assert count["zbv"] == sum(17 - p for p in range(2, 9)) == 84
    assert count["dualpipev"] == sum(17 - 2 * p for p in range(2, 9)) == 49


def test_simulator_detects_deadlock():
    # both ranks receive first
    s = Schedule("hand", 2, 1, 1, (
        (Action("RECV_B", 0, 0, 1), Action("F", 0), Action("SEND_F", 0, 0, 1), Action("B", 0)),
        (Action("RECV_F", 0, 0, 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0, 0, 0))))
    with pytest.raises(DeadlockError, match="rank 0 at RECV_B0←1, rank 1 at RECV_F0←0"):
        simulate(s)


def test_simulator_detects_receives_in_the_wrong_order():
    good = build_schedule("gpipe", 2, 2)
    r1 = list(good[1])
    i, j = r1.index(Action("RECV_F", 0, 0, 0)), r1.index(Action("RECV_F", 1, 0, 0))
    r1[i], r1[j] = r1[j], r1[i]  # rank 1 now expects microbatch 1 first
    bad = Schedule("swapped", 2, 2, 1, (good[0], tuple(r1)))
    with pytest.raises(ScheduleError, match="expected"):
        simulate(bad)


def test_simulator_detects_missing_dependencies():
    w_first = Schedule("w", 1, 1, 1, ((Action("F", 0), Action("W", 0), Action("I", 0)),))
    with pytest.raises(ScheduleError, match="before I0"):
        simulate(w_first)
    unfinished = Schedule("u", 1, 1, 1, ((Action("F", 0), Action("I", 0)),))
    with pytest.raises(ScheduleError, match="never completes"):
        simulate(unfinished)


def test_rendezvous_semantics_is_stricter():
    """With sends that block until received (no buffering), GPipe still runs but 1F1B deadlocks
    (rank r sends F while rank r+1 sends B): the runtime relies on asynchronous sends."""
    simulate(build_schedule("gpipe", 4, 8), mode="rendezvous")
    with pytest.raises(DeadlockError):
        simulate(build_schedule("1f1b", 4, 8), mode="rendezvous")


# -- activation memory ------------------------------------------------------------------------------

def test_activation_memory_1f1b_at_most_p_gpipe_m():
    for p in range(1, 9):
        for m in range(p, 17):
            assert peak_activations(build_schedule("1f1b", p, m)) == [p - r for r in range(p)]
            assert peak_activations(build_schedule("gpipe", p, m)) == [m] * p
            assert max(peak_activations(build_schedule("zb-h1", p, m))) <= p


# -- validation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    (dict(n=8, pp=4, schedule="1f1b", m=2), "less than --pp 4"),
    (dict(n=8, pp=2, schedule="1f1b", m=4, batch=6), "does not divide the 6 sequences"),
    (dict(n=8, pp=2, schedule="interleaved-1f1b", m=7), "3 rounds of equal size"),
    (dict(n=8, pp=1, schedule="interleaved-1f1b", m=2), "needs --pp ≥ 2"),
    (dict(n=8, pp=2, schedule="interleaved-1f1b", m=2, v=1), "≥ 2 virtual stages"),
    (dict(n=8, pp=2, schedule="1f1b", m=2, v=2), "one model chunk per rank"),
    (dict(n=2, pp=4, schedule="1f1b", m=4), "too few for 4 pipeline stages"),
    (dict(n=8, pp=4, schedule="interleaved-1f1b", m=4, v=3), "too few for 12"),
    (dict(n=8, pp=2, schedule="1f1b", m=2, lps=[5, 2]), "summing to the model's 8"),
    (dict(n=8, pp=2, schedule="1f1b", m=2, lps=[8]), "has 1 entries"),
    (dict(n=8, pp=3, schedule="1f1b", m=3, lps=[4, 0, 4]), r"stages \[1\] have no layer"),
    (dict(n=8, pp=2, schedule="pipedream", m=2), "unknown"),
    (dict(n=8, pp=1, schedule="zbv", m=2), "needs --pp ≥ 2"),
    (dict(n=8, pp=2, schedule="zbv", m=2, v=3), "exactly 2 model chunks"),
    (dict(n=8, pp=4, schedule="dualpipev", m=7), r"--microbatches ≥ 2·pp = 8"),
    (dict(n=6, pp=4, schedule="zbv", m=4), "too few for 8 pipeline stages"),
])
def test_validate_pp_rejects_bad_input(args, match):
    with pytest.raises(ShardwiseConfigError, match=match):
        validate_pp(args["n"], args["pp"], args["schedule"], args["m"], args.get("batch"),
                    args.get("v"), args.get("lps"))


def test_validate_pp_accepts_and_returns_v():
    assert validate_pp(8, 4, "interleaved-1f1b", 5, batch=10) == 2  # one round of 5
    assert validate_pp(8, 2, "interleaved-1f1b", 3, virtual_stages=4) == 4
    assert validate_pp(8, 4, "zb-h1", 4, batch=8) == 1
    assert validate_pp(8, 2, "1f1b", 2, layers_per_stage=[0, 8]) == 1  # embedding-only stage
    assert validate_pp(8, 4, "zbv", 4) == 2  # the V: two chunks per rank
    assert validate_pp(8, 2, "dualpipev", 4, virtual_stages=2) == 2


def test_balanced_split():
    assert [len(r) for r in split_layers(8, 3)] == [3, 3, 2]
    assert [list(r) for r in split_layers(4, 4)] == [[0], [1], [2], [3]]
    assert [list(r) for r in split_layers(5, 2, [3, 2])] == [[0, 1, 2], [3, 4]]


# -- timeline outputs ---------------------------------------------------------------------------------

def test_timeline_png_and_chrome_trace_from_simulation(tmp_path):
    r = simulate(build_schedule("zb-h1", 4, 8), UNIT)
    png = draw_timeline(r.events, tmp_path / "zb.png", title="zb-h1 p=4 m=8", unit="T_F")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert bubble_of(r.events, 4) == pytest.approx(r.bubble_fraction)
    trace = chrome_trace(r.events, time_scale=1000.0)
    json.dumps(trace)  # serialisable
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(r.events)
    f0 = next(e for e in spans if e["tid"] == 1 and e["name"] == "F0")
    assert f0["ts"] == 1000.0 and f0["dur"] == 1000.0  # rank 1 starts F0 after rank 0's F0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {f"pp rank {r}" for r in range(4)}


# -- the V schedules: zbv, dualpipev ----------------------------------------------------------------

def test_placements_by_hand():
    # loop: stage s on rank s % p, chunk s // p; v: rank r holds stages r and 2p−1−r
    assert [stages_of(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [chunk_of(s, 4, "v") for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for placement in ("loop", "v"):
        for p in range(1, 6):
            for s in range(2 * p):
                assert stage_of(rank_of(s, p, placement), chunk_of(s, p, placement), p,
                                placement) == s
    with pytest.raises(ValueError, match="unknown placement"):
        stage_of(0, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="two chunks"):
        stage_of(0, 2, 2, "v")
    s = build_schedule("zbv", 4, 8)
    assert (s.placement, s.v, s.stage_of(3, 1), s.rank_of(7)) == ("v", 2, 4, 0)
    assert build_schedule("interleaved-1f1b", 4, 8).placement == "loop"


def _torch_order(cls, p, m, r):
    """PyTorch's compute order of rank r (torch.distributed.pipelining's own builder, fed the
    attributes it reads), as our action strings: stage index → our chunk under the V placement,
    an overlapped pair (OVERLAP_F_B) as its two sub-actions in order."""
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []
    for a in cls._calculate_single_rank_operations(fake, r):
        if a is None:
            continue
        for sub in (a.sub_actions or (a,)):
            c = chunk_of(sub.stage_index, p, "v")
            assert stage_of(r, c, p, "v") == sub.stage_index
            out.append(str(Action(str(sub.computation_type.value), sub.microbatch_index, c)))
    return out


@pytest.mark.parametrize("name", ("zbv", "dualpipev"))
def test_v_orders_equal_pytorchs(name):
    """Ours are written independently; the torch engine runs PyTorch's classes, so the two
    engines run the same order (docs/pipeline-parallel.md §5)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    cls = ScheduleZBVZeroBubble if name == "zbv" else ScheduleDualPipeV
    for p in range(2, 7):
        for m in range(p if name == "zbv" else 2 * p, 3 * p + 2):
            s = build_schedule(name, p, m)
            for r in range(p):
                assert compute(s, r) == _torch_order(cls, p, m, r), (name, p, m, r)


def test_zbv_and_dualpipev_p2_m4_by_hand():
    zbv = build_schedule("zbv", 2, 4)
    # rank 0 (stages 0 and 3): 2(p−r)−1 = 3 forwards of stage 0, then the last stage's F/I/W
    assert compute(zbv, 0)[:9] == ["F0", "F1", "F2", "F0.1", "I0.1", "W0.1", "F1.1", "I1.1",
                                   "W1.1"]
    # rank 1 (stages 1 and 2): F of stage 1 then of stage 2 (local hand-over), I/W split
    assert compute(zbv, 1)[:6] == ["F0", "F0.1", "F1", "F1.1", "I0.1", "W0.1"]
    dual = build_schedule("dualpipev", 2, 4)
    assert compute(dual, 1) == ["F0", "F0.1", "F1", "F1.1", "F2", "B0.1", "F2.1", "B0", "F3",
                                "B1.1", "F3.1", "B1", "B2.1", "B2", "I3.1", "I3", "W3.1", "W3"]
    # rank 1 holds stages 1 and 2: no message between them, only to and from rank 0
    assert all(a.peer == 0 for a in dual[1] if not a.is_compute)
    assert Action("SEND_F", 0, 0, 1) in dual[0] and Action("RECV_F", 0, 1, 1) in dual[0]
    assert not any(a.kind == "SEND_F" and a.chunk == 1 for a in dual[0])  # the last stage


@pytest.mark.parametrize("name", ("zbv", "dualpipev"))
def test_v_bubble_equals_closed_form_at_equal_costs(name):
    """T_F = T_B = T_W: idle (p−1)·T/2 per rank, bubble (p−1)/(6m+p−1) (Qi et al. 2023 §6 for
    ZB-V; DeepSeek-V3 §3.2.1 Table 2, (PP/2−1)(F&B+B−3W), for DualPipeV), a sixth of 1F1B's
    idle, and below ZB-H1's; for zbv from m = 2p−1 (below, part of the order is dropped);
    p ≤ 8, m ≤ 16, at two cost scales."""
    for p in range(2, 9):
        for m in range(2 * p - 1 if name == "zbv" else 2 * p, 17):
            s = build_schedule(name, p, m)
            for t in (1.0, 2.5):
                costs = Costs(t, t, t)
                r = simulate(s, costs)
                assert r.makespan == pytest.approx(m * 3 * t + (p - 1) * t / 2, abs=1e-9)
                assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
                assert r.bubble_fraction == pytest.approx(
                    bubble_formula(name, p, m, 2, costs), abs=1e-12)
            assert r.bubble_fraction < bubble_formula("zb-h1", p, m, costs=costs)
    with pytest.raises(ValueError, match="T_F = T_B = T_W"):
        bubble_formula(name, 4, 8, 2, Costs(1.0, 2.0, 1.0))


def test_dualpipev_matches_deepseeks_formula_when_forward_dominates():
    """DeepSeek-V3 Table 2: idle (p−1)(F&B + B − 3W) per rank with per-chunk costs and F&B =
    F + B + W when the pair is not overlapped; T_F = 2, T_B = T_W = 1 (chunks: 1, ½, ½) gives
    (p−1)(2 + ½ − 3/2) = p−1."""
    for p in range(2, 7):
        for m in (2 * p, 3 * p + 1):
            r = simulate(build_schedule("dualpipev", p, m), Costs(2.0, 1.0, 1.0))
            assert r.makespan == pytest.approx(4 * m + (p - 1), abs=1e-9)


def test_v_activation_memory():
    """Peak chunks alive (F until its B, or W): zbv 2p on every rank (p stages' worth, 1F1B's
    peak on rank 0: Qi et al. 2023 §6), dualpipev 2p+1 (DeepSeek-V3 Table 2, "PP+1" with
    PP = 2p stages), once m ≥ 2p."""
    for p in range(2, 9):
        for m in range(2 * p, 17):
            assert peak_activations(build_schedule("zbv", p, m)) == [2 * p] * p
            assert peak_activations(build_schedule("dualpipev", p, m)) == [2 * p + 1] * p


@pytest.mark.parametrize("name", ("zbv", "dualpipev"))
def test_v_point_to_point_counts_equal_formula(name):
    """Rank r sends chunk 0's output on (none from rank p−1: stage p is its own) and chunk 1's
    (none from rank 0: the last stage), so m·(2 − [r=0] − [r=p−1]) activations and as many
    gradients; p2p_bytes_formula gives that count times A."""
    for p in range(2, 6):
        m = 2 * p
        s = build_schedule(name, p, m)
        for r in range(p):
            want = m * (2 - (r == 0) - (r == p - 1))
            kinds = [a.kind for a in s[r]]
            assert kinds.count("SEND_F") == kinds.count("SEND_B") == want
            assert p2p_bytes_formula(r, p, 2, m, 10, placement="v") == {
                "pp_fwd": 10 * want, "pp_bwd": 10 * want}
    assert p2p_bytes_formula(1, 2, 2, 4, 10, placement="v") == {"pp_fwd": 40, "pp_bwd": 40}


def test_placement_is_described_for_the_user():
    from shardwise.parallel.pp.split import describe_placement

    assert describe_placement(8, 4, "zbv") == [
        "pp rank 0: stage 0 = block 0 (+ embedding), stage 7 = block 7 (+ head)",
        "pp rank 1: stage 1 = block 1, stage 6 = block 6",
        "pp rank 2: stage 2 = block 2, stage 5 = block 5",
        "pp rank 3: stage 3 = block 3, stage 4 = block 4"]
    assert describe_placement(10, 2, "dualpipev")[0] == \
        "pp rank 0: stage 0 = blocks 0–2 (+ embedding), stage 3 = blocks 8–9 (+ head)"
    assert describe_placement(8, 2, "1f1b") == ["pp rank 0: stage 0 = blocks 0–3 (+ embedding)",
                                                "pp rank 1: stage 1 = blocks 4–7 (+ head)"]
    with pytest.raises(ShardwiseConfigError, match="too few for 8"):
        describe_placement(6, 4, "zbv")


def test_six_schedules_side_by_side(tmp_path):
    """python -m shardwise.viz.schedules: every schedule at the same (p, m), simulated bubble =
    closed form at equal costs, the V ones lowest; the picture is a PNG."""
    from shardwise.tools.trace import bubble_line
    from shardwise.viz.schedules import compare, draw_schedules

    rows = compare(2, 4)
    assert [r["schedule"] for r in rows] == list(SCHEDULES)
    for r in rows:
        assert r["bubble"] == pytest.approx(r["formula"], abs=1e-12), r["schedule"]
    by = {r["schedule"]: r for r in rows}
    assert by["zbv"]["bubble"] == pytest.approx(1 / 25)
    assert by["1f1b"]["bubble"] == pytest.approx(0.2)
    assert (by["zbv"]["placement"], by["zbv"]["v"], by["dualpipev"]["peak"]) == ("v", 2, [5, 5])
    png = draw_schedules(rows, tmp_path / "six.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # trace's line: zbv below m = 2p−1 has no closed form, the simulator's number is shown
    line = bubble_line(0.5, "zbv", 2, 2, 2, 4)
    assert "simulator's" in line and f"{1 / 7:.3f}" in line
    assert "(p−1)/(6m+p−1)" in bubble_line(0.5, "dualpipev", 2, 4, 2, 4)


def test_planner_refuses_the_v_schedules_it_does_not_price():
    from shardwise.plan.hardware import get_cluster
    from shardwise.plan.layout import PlanLayout, check_layout
    from shardwise.plan.models import get_model

    with pytest.raises(ShardwiseConfigError, match="does not price the V schedules"):
        check_layout(get_model("llama3-8b"), get_cluster("h100-sxm"),
                     PlanLayout(pp=2, schedule="zbv"), 64)


def test_simulator_detects_local_hand_over_out_of_order():
    """On rank p−1 the V's stage p takes stage p−1's output without a message: running F of
    chunk 1 before F of chunk 0 is caught."""
    good = build_schedule("zbv", 2, 2)
    r1 = list(good[1])
    i, j = r1.index(Action("F", 0, 0)), r1.index(Action("F", 0, 1))
    r1[i], r1[j] = r1[j], r1[i]
    bad = Schedule("swapped", 2, 2, 2, (good[0], tuple(r1)), placement="v")
    with pytest.raises(ScheduleError, match="previous stage on this rank"):
        simulate(bad)
