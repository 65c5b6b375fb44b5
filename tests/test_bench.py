"""``shardwise bench --layout``: the report files, both engines, ledger = formula, A B A B order.

One spawned 2-rank world (through the real command line) runs the tiny model on dp=2,
dp=2,zero=3 and cp=2 for 2 rounds × 1 timed step per engine; a layout ``check_supported``
refuses (ZeRO-3 with pp) must become a row of the table, not a crash, and an engine a layout
refuses (torch with cp on CPU) a cell saying so, with the reason. The expected bytes and memory of
plain DP are worked out here by hand from the parameter count.
"""

import json

import pytest

from conftest import run_cli
from shardwise.tools.bench.harness import alternate
from shardwise.tools.bench.layouts import check_layouts
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model

VOCAB = 4096  # the layout bench's default vocabulary


@pytest.fixture(scope="module")
def report(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    p = run_cli(["bench", "--layout", "dp=2", "--layouts", "dp=2,zero=3", "pp=2,dp=2,zero=3,zb-h1",
                 "cp=2", "--model", "tiny", "--steps", "1", "--rounds", "2", "--seq-len", "16",
                 "--micro-batch", "2", "--out", out], cache_dir, timeout=120)
    assert p.returncode == 0, p.stdout
    return out, p.stdout, json.loads((out / "bench.json").read_text())


@pytest.mark.timeout(150)
def test_report_files_and_both_engines(report):
    out, stdout, data = report
    for name in ("bench.md", "bench.json", "bench.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["layout"]: r for r in data["rows"]}
    assert set(rows) == {"dp=2", "dp=2,zero=3", "pp=2,dp=2,zero=3,zb-h1", "cp=2"}
    for name in ("dp=2", "dp=2,zero=3"):
        for eng in ("explicit", "torch"):
            r = rows[name][eng]
            assert "error" not in r, r
            assert r["median_step_s"] > 0 and r["steps_timed"] == 2
        ratio = rows[name]["explicit"]["median_step_s"] / rows[name]["torch"]["median_step_s"]
        assert rows[name]["explicit_over_torch"] == pytest.approx(ratio)
        e, t = (rows[name][k]["step_times_s_rank0"] for k in ("explicit", "torch"))
        assert len(e) == len(t) == 2  # 2 rounds × 1 step: the paired ratio is the median
        assert rows[name]["explicit_over_torch_paired"] == pytest.approx(  # of e[i] / t[i]
            (e[0] / t[0] + e[1] / t[1]) / 2)
        assert rows[name]["explicit_over_torch_min"] == pytest.approx(min(e) / min(t))
    assert "| dp=2,zero=3 | 2 | explicit |" in stdout
    # refused before any collective, reported as a row with the reason
    assert "ZeRO-3 with the split-backward schedule" in rows["pp=2,dp=2,zero=3,zb-h1"]["error"]


@pytest.mark.timeout(150)
def test_explicit_ledger_equals_formula(report):
    _, _, data = report
    rows = {r["layout"]: r for r in data["rows"]}
    for name in ("dp=2", "dp=2,zero=3"):
        r = rows[name]["explicit"]
        assert r["ledger_over_formula"] == 1.0, (name, r["ledger_by_tag_rank0"])
        assert r["worst_rank_deviation"] == 0.0
    # plain DP by hand: a ring all-reduce of S bytes over n = 2 sends 2(n−1)/n · S = S, so the
    # gradients cost 4Ψ and the two fp64 scalars (token count, loss) 8 bytes each
    psi = sum(p.numel() for p in build_model("tiny", vocab_size=VOCAB).parameters())
    dp = rows["dp=2"]["explicit"]
    assert dp["ledger_bytes_rank0"] == 4 * psi + 16
    # model state: fp32 params + grads + AdamW (exp_avg, exp_avg_sq) = 16Ψ, plus AdamW's fp32
    # step counter per parameter tensor
    n_tensors = len(list(build_model("tiny", vocab_size=VOCAB).parameters()))
    assert dp["model_state_rank0"]["total"] == 16 * psi + 4 * n_tensors
    assert dp["memory_formula_bytes"] == 16 * psi


@pytest.mark.timeout(150)
def test_alternation_order_is_a_b_a_b(report):
    _, _, data = report
    for row in data["rows"]:
        if "error" not in row:  # an engine the layout refuses is not timed (cp=2: torch)
            timed = [e for e in ("explicit", "torch") if not row[e].get("refused")]
            assert row["order"] == timed * 2, row["layout"]


def test_alternate_skips_a_failed_variant_and_keeps_the_order():
    calls = []
    runs = {"A": {"times": []}, "B": {"times": [], "error": "boom"}, "C": {"times": []}}
    order = []

    def step(r):
        calls.append(next(k for k, v in runs.items() if v is r))
        return 1.0

    alternate(runs, rounds=3, steps=2, step_fn=step, order=order)
    assert order == ["A", "C"] * 3
    assert calls == ["A", "A", "C", "C"] * 3
    assert runs["A"]["times"] == [1.0] * 6 and runs["B"]["times"] == []


def test_paired_ratio_cancels_drift_between_rounds():
    from shardwise.tools.bench.layouts import paired_ratio

    # round 1 on a quiet machine, round 2 three times slower: A is 0.8 × B in both rounds,
    # while the pooled medians would mix the two regimes
    a = [0.8, 0.8, 2.4, 2.4]
    b = [1.0, 1.0, 3.0, 3.0]
    assert paired_ratio(a, b, rounds=2) == pytest.approx(0.8)
    assert paired_ratio(a, b[:3], rounds=2) is None


def test_layout_syntax_errors_are_refused_before_spawning():
    with pytest.raises(ShardwiseConfigError, match="comma-separated"):
        check_layouts(["dp=2", "dp=two"])
    assert check_layouts(["dp=2", "pp=2,dp=2,tp=2", "pp=2,dp=2,zero=3"]) == 8


def test_a_rank_that_failed_turns_the_engine_into_an_error_row():
    """Rank 0's numbers are fine, rank 1's torch run failed: the torch cell must say so, the
    explicit cell aggregates both ranks (slowest median, summed bytes, worst deviation)."""
    import torch

    from shardwise.tools.bench.layouts import _row, _vector, format_table
    from shardwise.parallel.apply import Layout

    def ok(median, ledger, formula):
        return {"median_s": median, "steps_timed": 2, "times_s": [median] * 2,
                "ledger_bytes": ledger,
                "formula_bytes": formula, "ledger_by_tag": {}, "formula_by_tag": {},
                "seconds_by_tag": {}, "mem": {"total": 100}, "mem_formula": 100.0,
                "booking_off_after_warmup": False}

    meta = {"global_batch": 4, "n_micro": 1, "tokens_per_step": 64}
    rank0 = {"explicit": ok(0.5, 10.0, 10.0), "torch": ok(1.0, 20.0, 20.0), "_meta": meta}
    rank1 = {"explicit": ok(0.7, 12.0, 10.0), "torch": {"error": "RuntimeError: boom"},
             "_meta": meta}
    g = torch.stack([_vector(rank0), _vector(rank1), _vector(None)])  # rank 2: not a member
    row = _row("dp=2", Layout(dp=2), rank0, g, ["explicit", "torch"])
    assert row["torch"] == {"error": "failed on rank(s) [1] (see their stderr)"}
    e = row["explicit"]
    assert e["median_step_s"] == 0.7 and e["tokens_per_s"] == 64 / 0.7
    assert e["ledger_over_formula"] == 22.0 / 20.0
    assert e["worst_rank_deviation"] == pytest.approx(0.2)
    assert row["explicit_over_torch"] is None and row["explicit_over_torch_paired"] is None
    assert "error: failed on rank(s) [1]" in format_table([row])


@pytest.mark.timeout(150)
def test_cp_row_refuses_torch_and_shows_the_ring_overlap(report):
    """cp=2 on tiny (2 layers), micro-batch 2, seq 16: the torch engine is refused on CPU with
    the reason; the explicit engine is timed, its ledger equals the formula, and its extra step
    with ContextParallelAttention.timings gives per rank, counted here by hand, per layer
    (n − 1) K/V exchanges forward, (n − 1) K/V + n dK/dV backward: 2 · (1 + 1 + 2) = 8."""
    _, stdout, data = report
    row = {r["layout"]: r for r in data["rows"]}["cp=2"]
    assert row["torch"]["refused"] is True
    assert "PyTorch's context_parallel does not run on CPU" in row["torch"]["error"]
    assert "use --engine explicit" in row["torch"]["error"]  # the whole reason, with the fix
    assert "| cp=2 | 2 | torch | refused: --engine torch --cp 2: PyTorch's" in stdout
    e = row["explicit"]
    assert e["median_step_s"] > 0 and e["steps_timed"] == 2
    assert e["ledger_over_formula"] == 1.0 and e["worst_rank_deviation"] == 0.0
    ring = e["ring_overlap"]
    assert ring["exchanges_per_rank"] == 2 * ((2 - 1) + (2 - 1) + 2) == 8
    assert ring["window_s"] > 0 and 0.0 <= ring["blocked_s"] <= ring["window_s"]
    assert ring["overlap"] == pytest.approx(1 - ring["blocked_s"] / ring["window_s"])
    assert len(ring["overlap_per_rank"]) == 2 and 0 <= ring["unblocked"] <= 16
    assert f"| {ring['overlap']:.3f} |" in stdout and "ring overlap, cp=2" in stdout
    assert "ring_overlap" not in {r["layout"]: r for r in data["rows"]}["dp=2"]["explicit"]
