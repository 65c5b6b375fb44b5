"""``shardwise verify --nproc 4``: parity of every layout with one process by
shardwise.parity's rule, and the ledger against the formula. A file of its own, so that
the suite's two workers (pytest-xdist, one file each) run the two verify worlds side by side.

``make test`` runs one layout of each kind (:data:`ONE_OF_EACH`, ~1/8 of the matrix); the whole
matrix (307 cases, ~4.5 min alone) is ``@pytest.mark.slow`` (``make test-slow``; and
``make test-cpu-paths``, which selects by file, runs it under every CPU math path). Each kind
also has its own parity tests in ``make test`` (tests/test_zero.py, test_pipeline_parity.py, …)."""

import json

import pytest

from conftest import run_cli


# one layout of each kind the whole matrix covers: DP (dp = 2 and 4: the traffic's 2(d−1)·G),
# ZeRO-3, FSDP × TP with SP (TP with SP alone is slow: composed here and in PP × TP, and
# tests/test_tensor_parallel.py runs it on both engines), PP × DP ZeRO-1 under interleaved 1F1B
# and a V schedule, PP × TP with SP, cp (ring) alone and with dp ZeRO-3, HSDP and ZeRO-3 inside
# pipeline stages
ONE_OF_EACH = ["dp=2", "dp=4", "dp=4,zero=3", "dp=2,tp=2,zero=3,sp",
               "dp=2,pp=2,zero=1,interleaved-1f1b,m=4", "pp=2,zbv,m=4", "tp=2,pp=2,sp,zb-h1,m=4",
               "cp=2", "dp=2,cp=2,zero=3", "dp=4,dp_replicate=2,zero=3",
               "dp=2,pp=2,zero=3,1f1b,m=4"]


@pytest.mark.timeout(300)
def test_verify_passes_one_layout_of_each_kind(cache_dir, tmp_path):
    """``make test``'s share of the matrix below: each layout of :data:`ONE_OF_EACH` on every
    engine and test model it applies to passes the parity rule, with ledger bytes = formula."""
    p = run_cli(["verify", "--nproc", "4", "--layouts", *ONE_OF_EACH,
                 "--json", tmp_path / "verify.json"], cache_dir, timeout=280)
    assert p.returncode == 0, p.stdout
    report = json.loads((tmp_path / "verify.json").read_text())
    cases = {(c["layout"], c["engine"], c["model"]) for c in report["cases"]}
    assert {c[0] for c in cases} == set(ONE_OF_EACH)
    for engine in ("explicit", "torch"):
        for model in ("tiny", "mlp-tiny"):
            for layout in ("dp=2", "dp=4", "dp=4,zero=3", "dp=4,dp_replicate=2,zero=3",
                           "dp=2,pp=2,zero=1,interleaved-1f1b,m=4", "dp=2,pp=2,zero=3,1f1b,m=4"):
                assert (layout, engine, model) in cases
        assert ("tp=2,pp=2,sp,zb-h1,m=4", engine, "tiny") in cases
    assert ("cp=2", "explicit", "tiny") in cases and ("dp=2,cp=2,zero=3", "explicit", "tiny") \
        in cases
    assert report["pass"] and all(c["pass"] for c in report["cases"])
    assert all(c["ledger_vs_formula_max_deviation"] < 1e-9 for c in report["cases"])
    assert all(c["diff_over_tolerance"] <= 1 and c["param_diff_over_bound"] <= 1
               for c in report["cases"])
    assert f"{len(report['cases'])}/{len(report['cases'])} passed" in p.stdout
    by = {(c["layout"], c["engine"], c["model"]): c["bytes_per_tag"] for c in report["cases"]}
    for engine in ("explicit", "torch"):
        for model in ("tiny", "mlp-tiny"):
            grad = {d: by[f"dp={d}", engine, model]["grad all_reduce dp"] for d in (2, 4)}
            assert grad[2] > 0 and grad[4] == 3 * grad[2], grad  # 2(d−1)·G


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_passes_every_layout_that_fits_both_engines(cache_dir, tmp_path):
    """N = 4: every single strategy and every factorization of 4 over (pp, dp, tp) × ZeRO
    stages × schedules × SP, both engines, both test models (the MLP's TP without SP or pp), the
    cp layouts and ZeRO-2/3 inside pipeline stages; ledger bytes = formula for each."""
    p = run_cli(["verify", "--nproc", "4", "--json", tmp_path / "verify.json"], cache_dir,
                timeout=580)
    assert p.returncode == 0, p.stdout
    report = json.loads((tmp_path / "verify.json").read_text())
    cases = {(c["layout"], c["engine"], c["model"]) for c in report["cases"]}
    for engine in ("explicit", "torch"):
        for model in ("tiny", "mlp-tiny"):
            for dp in (1, 2, 3, 4):
                assert (f"dp={dp}", engine, model) in cases
            for zero in (1, 2, 3):
                assert (f"dp=4,zero={zero}", engine, model) in cases
            for sched in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
                assert (f"dp=2,pp=2,zero=1,{sched},m=4", engine, model) in cases
        for tp in ("tp=2", "tp=2,sp", "tp=4", "tp=4,sp"):
            assert (tp, engine, "tiny") in cases
        for zero in ("", ",zero=1", ",zero=2", ",zero=3"):  # FSDP+TP and DP×TP
            for sp in ("", ",sp"):
                assert (f"dp=2,tp=2{zero}{sp}", engine, "tiny") in cases
        for sched in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):  # PP×TP
            assert (f"tp=2,pp=2,sp,{sched},m=4", engine, "tiny") in cases
        # the stacked MLP under TP (W_in column-, W_out row-parallel) and FSDP/DP × TP; no SP
        # (no sequence dimension) and no TP inside pipeline stages of the MLP
        for layout in ("tp=2", "tp=4", "dp=2,tp=2", "dp=2,tp=2,zero=1", "dp=2,tp=2,zero=3"):
            assert (layout, engine, "mlp-tiny") in cases
        for layout in ("tp=2,sp", "dp=2,tp=2,sp", "tp=2,pp=2,sp,1f1b,m=4"):
            assert (layout, engine, "mlp-tiny") not in cases
    # context parallelism (explicit engine; the torch one has no CPU kernel): cp = 2 and 4 with
    # both methods, and cp = 2 with dp = 2 (ZeRO 0/1/3), tp = 2 (± SP) and pp = 2
    for layout in ("cp=2", "cp=2,allgather", "cp=4", "cp=4,allgather", "dp=2,cp=2",
                   "dp=2,cp=2,zero=1", "dp=2,cp=2,zero=3", "dp=2,cp=2,allgather", "cp=2,tp=2",
                   "cp=2,tp=2,sp", "cp=2,tp=2,allgather", "cp=2,pp=2,1f1b,m=4",
                   "cp=2,pp=2,allgather,1f1b,m=4"):
        assert (layout, "explicit", "tiny") in cases
        assert (layout, "torch", "tiny") not in cases and (layout, "explicit", "mlp-tiny") \
            not in cases
    # HSDP: dp_replicate = 2 × dp_shard = 2 with ZeRO-1/2/3, both engines, both models
    for zero in (1, 2, 3):
        for engine in ("explicit", "torch"):
            for model in ("tiny", "mlp-tiny"):
                assert (f"dp=4,dp_replicate=2,zero={zero}", engine, model) in cases
    # ZeRO-2/3 inside pipeline stages (both engines: FSDP2 on the torch engine's stages)
    for zero in (2, 3):
        for sched in ("1f1b", "interleaved-1f1b"):
            for model in ("tiny", "mlp-tiny"):
                for engine in ("explicit", "torch"):
                    assert (f"dp=2,pp=2,zero={zero},{sched},m=4", engine, model) in cases
    assert report["pass"] and all(c["pass"] for c in report["cases"])
    assert all(c["ledger_vs_formula_max_deviation"] < 1e-9 for c in report["cases"])
    assert all(c["diff_over_tolerance"] <= 1 and c["param_diff_over_bound"] <= 1
               for c in report["cases"])
    assert report["rule"].startswith("loss, grad norm, gradients") and "rule: " in p.stdout
    assert f"{len(report['cases'])}/{len(report['cases'])} passed" in p.stdout
    # the report's per-case losses and traffic (what benchmarks/verify_diff.py compares): a loss
    # per step, and the ranks' summed ring all-reduce bytes d·2(d−1)/d·G = 2(d−1)·G for dp = d
    assert all(len(c["losses"]) == report["steps"] for c in report["cases"])
    by = {(c["layout"], c["engine"], c["model"]): c["bytes_per_tag"] for c in report["cases"]}
    for engine in ("explicit", "torch"):
        for model in ("tiny", "mlp-tiny"):
            grad = {d: by[f"dp={d}", engine, model]["grad all_reduce dp"] for d in (2, 3, 4)}
            assert grad[2] > 0 and grad[3] == 2 * grad[2] and grad[4] == 3 * grad[2], grad
