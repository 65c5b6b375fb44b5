"""Pipeline schedules as data, single process and pure: the simulator against closed forms and
hand-worked orders, deadlock-freedom of every schedule for all p ≤ 8, m ≤ 16 (exhaustive), the
simulator's own failure detection, activation memory, validation errors, the timeline outputs."""

import json

import pytest

from shardwise.errors import ShardwiseConfigError
from shardwise.parallel.pp import (SCHEDULES, Action, Costs, DeadlockError, Schedule,
                                         ScheduleError, bubble_formula, build_schedule,
                                         format_schedule, peak_activations, simulate,
                                         split_layers, validate_pp)
from shardwise.parallel.pp.schedules import rounds_of
from shardwise.viz.timeline import bubble_of, chrome_trace, draw_timeline

UNIT = Costs(t_f=1.0, t_b=1.0, t_w=1.0)


def valid_configs(p_max=8, m_max=16):
    """Every (schedule, p, m, v) the builder accepts with p ≤ p_max, m ≤ m_max, v ≤ 3."""
    for name in SCHEDULES:
        for p in range(1, p_max + 1):
            for m in range(p, m_max + 1):
                if name != "interleaved-1f1b":
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
    count = 0
    for name, p, m, v in valid_configs():
        s = build_schedule(name, p, m, v)
        for costs in (UNIT, Costs(1.0, 2.0, 0.5, t_comm=0.7)):
            r = simulate(s, costs)
            assert 0.0 <= r.bubble_fraction < 1.0
        n_compute = sum(a.is_compute for acts in s for a in acts)
        assert n_compute == p * v * m * (3 if name == "zb-h1" else 2)
        count += 1
    assert count == 424  # 4 schedules; interleaving with v ∈ {2, 3} where m splits into rounds


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
