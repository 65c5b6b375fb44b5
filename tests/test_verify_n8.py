"""``shardwise verify --nproc 8 --bounded``: parity of every layout with one process by
shardwise.parity's rule, and the ledger against the formula. A file of its own, so that
the suite's two workers (pytest-xdist, one file each) run the two verify worlds side by side.

``make test`` runs one of the bounded set's three-axis compositions (:data:`ONE_OF_THEM`); the
whole bounded set (24 layouts, ~2.5 min alone) is ``@pytest.mark.slow`` (``make test-slow``;
``make test-cpu-paths`` runs it too). (3D dp × tp × pp with SP over 8 ranks is also in
``make test`` in process: tests/test_pipeline_compose.py, both engines; zb-h1 × tp × sp:
tests/test_verify_n4.py.)"""

import json

import pytest

from conftest import run_cli


# HSDP inside pipeline stages (both engines): 8 ranks is its smallest world
ONE_OF_THEM = ["dp=4,pp=2,dp_replicate=2,zero=3,1f1b,m=4"]


@pytest.mark.timeout(300)
def test_verify_an_8_rank_composition(cache_dir, tmp_path):
    """``make test``'s share of the bounded set below: :data:`ONE_OF_THEM` over 8 ranks, both
    engines, pass the parity rule with ledger bytes = formula."""
    p = run_cli(["verify", "--nproc", "8", "--models", "tiny", "--layouts", *ONE_OF_THEM,
                 "--json", tmp_path / "verify.json"], cache_dir, timeout=280)
    assert p.returncode == 0, p.stdout
    report = json.loads((tmp_path / "verify.json").read_text())
    assert {(c["layout"], c["engine"]) for c in report["cases"]} == \
        {(lay, eng) for lay in ONE_OF_THEM for eng in ("explicit", "torch")}
    assert report["pass"] and all(c["pass"] for c in report["cases"])
    assert all(c["ledger_vs_formula_max_deviation"] < 1e-9 for c in report["cases"])
    assert all(c["diff_over_tolerance"] <= 1 and c["param_diff_over_bound"] <= 1
               for c in report["cases"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_verify_bounded_8_rank_compositions(cache_dir, tmp_path):
    """N = 8, bounded: each factorization of 8 with at least two degrees > 1 (FSDP+TP with
    tp = 4 and with dp = 4, PP×TP, PP×DP, 3D with zb-h1 + SP and with interleaved 1F1B), and
    cp in three-axis compositions and alone (cp = 8), HSDP × tp, and HSDP and ZeRO-3 × tp inside
    pipeline stages."""
    p = run_cli(["verify", "--nproc", "8", "--bounded", "--json", tmp_path / "verify.json"],
                cache_dir, timeout=380)
    assert p.returncode == 0, p.stdout
    report = json.loads((tmp_path / "verify.json").read_text())
    layouts = {c["layout"] for c in report["cases"]}
    assert {"dp=2,tp=4,zero=3,sp", "dp=2,tp=2,pp=2,zero=1,sp,zb-h1,m=4",
            "dp=2,tp=2,pp=2,zero=1,interleaved-1f1b,m=4"} <= layouts
    # context parallelism composed over all 8 ranks (explicit engine), and cp = 8
    assert {"dp=2,cp=2,tp=2,zero=3,sp", "dp=2,cp=2,tp=2,allgather,zero=3,sp",
            "dp=2,cp=2,pp=2,zero=1,1f1b,m=4", "cp=2,tp=2,pp=2,sp,zb-h1,m=4", "cp=8",
            "cp=4,tp=2"} <= layouts
    # HSDP × tp: dp_replicate = 2 × dp_shard = 2 × tp = 2, ZeRO-1 and 3, both engines
    cases = {(c["layout"], c["engine"]) for c in report["cases"]}
    for zero in (1, 3):
        for engine in ("explicit", "torch"):
            assert (f"dp=4,tp=2,dp_replicate=2,zero={zero}", engine) in cases
    # HSDP (both engines) and ZeRO-3 × tp (explicit: the torch engine's pipeline runs FSDP2
    # with tp 1 only) inside pipeline stages
    for layout in ("dp=4,pp=2,dp_replicate=2,zero=3,1f1b,m=4",
                   "dp=4,pp=2,dp_replicate=2,zero=2,interleaved-1f1b,m=4"):
        assert (layout, "explicit") in cases and (layout, "torch") in cases
    layout = "dp=2,tp=2,pp=2,zero=3,sp,1f1b,m=4"
    assert (layout, "explicit") in cases and (layout, "torch") not in cases
    assert {c["engine"] for c in report["cases"]} == {"explicit", "torch"}
    assert report["pass"] and all(c["pass"] for c in report["cases"])
    assert all(c["ledger_vs_formula_max_deviation"] < 1e-9 for c in report["cases"])
    assert all(c["diff_over_tolerance"] <= 1 and c["param_diff_over_bound"] <= 1
               for c in report["cases"])
    assert report["rule"].startswith("loss, grad norm, gradients") and "rule: " in p.stdout
