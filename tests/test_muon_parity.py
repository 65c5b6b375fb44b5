"""``shardwise verify --optimizer muon`` (issue 41): every layout that builds Muon equals one
process (loss, norm and every gradient at every step; every parameter teacher-forced, as
docs/parity.md §Muon derives), and the ledger's bytes equal the formula with the ``muon`` term,
in one spawned world of 4 ranks. The gathers appear exactly where the matrices are split: over
tp (an all_gather), and under ZeRO/HSDP/EP×ZeRO as point-to-point sends of the matrices that
slice boundaries cut, to and from their owner. ``make test`` runs one layout of each kind of
gather (:data:`FAST`), ``make test-slow`` the others (a second verify world)."""

import json

import pytest

from conftest import run_cli

LAYOUTS = {  # layout → the axes Muon's update U is gathered over (none: whole matrices)
    "dp=2": (), "dp=2,cp=2": (), "pp=2,1f1b": (), "dp=2,pp=2,1f1b": (),
    "dp=2,zero=1": ("dp",), "dp=2,zero=2": ("dp",), "dp=4,zero=3": ("dp",),
    "dp=4,dp_replicate=2,zero=3": ("dp_shard",),
    "tp=2": ("tp",), "tp=2,sp": ("tp",), "dp=2,tp=2,zero=1": ("dp", "tp"),
    "dp=2,tp=2,zero=3": ("dp", "tp"), "tp=2,pp=2,1f1b": ("tp",),
}
TORCH = ("dp=2", "pp=2,1f1b", "dp=2,pp=2,1f1b")  # the torch engine: DDP and pipelining
# (its DTensor/FSDP2/ZeroRedundancyOptimizer layouts are refused: check_optimizer)
EP = {"dp=2,ep=2": (), "dp=4,ep=2,zero=1": ("edp", "dp"),  # moe-tiny: experts per ep rank
      "dp=2,tp=2,ep=2,zero=3": ("dp", "tp")}  # (edp has one rank here: gathers of 0 bytes)


# ``make test`` runs one layout of each kind of gather (none: dp=2 and PP × DP on both engines;
# dp ZeRO; HSDP's shard group; tp; dp × tp; EP × ZeRO over edp and dp; EP × TP × ZeRO-3), in one
# verify world; ``make test-slow`` the rest, each a kind a kept layout already gathers over
FAST = {"dp=2", "dp=2,pp=2,1f1b", "dp=4,zero=3", "dp=4,dp_replicate=2,zero=3", "tp=2,sp",
        "dp=2,tp=2,zero=3", "dp=4,ep=2,zero=1", "dp=2,tp=2,ep=2,zero=3"}


def _report(cache_dir, tmp_path_factory, slow: bool) -> dict:
    layouts = [lay for lay in [*LAYOUTS, *EP] if (lay in FAST) != slow]
    out = tmp_path_factory.mktemp("muon_slow" if slow else "muon") / "verify.json"
    p = run_cli(["verify", "--nproc", "4", "--optimizer", "muon", "--models", "tiny,moe-tiny",
                 "--layouts", *layouts, "--json", out], cache_dir, timeout=580)
    assert p.returncode == 0, p.stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(cache_dir, tmp_path_factory):
    return _report(cache_dir, tmp_path_factory, slow=False)


@pytest.fixture(scope="module")
def report_slow(cache_dir, tmp_path_factory):
    return _report(cache_dir, tmp_path_factory, slow=True)


def _report_of(request, layout: str) -> dict:
    return request.getfixturevalue("report" if layout in FAST else "report_slow")


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["fast", "slow"])
def test_every_layout_equals_one_process_and_the_ledger_its_formula(request, slow):
    report = request.getfixturevalue("report_slow" if slow else "report")
    cases = {(c["layout"], c["engine"], c["model"]): c for c in report["cases"]}
    mine = {lay for lay in [*LAYOUTS, *EP] if (lay in FAST) != slow}
    want = {(lay, "explicit", "tiny") for lay in LAYOUTS if lay in mine}
    want |= {(lay, "torch", "tiny") for lay in TORCH if lay in mine}
    want |= {(lay, "explicit", "moe-tiny") for lay in EP if lay in mine}
    assert want <= set(cases), sorted(want - set(cases))
    for key in want:
        c = cases[key]
        assert c["pass"], (key, c)
        assert c["ledger_vs_formula_max_deviation"] < 1e-9, key


@pytest.mark.parametrize("layout", [
    pytest.param(lay, marks=() if lay in FAST else pytest.mark.slow)
    for lay in sorted({**LAYOUTS, **EP})])
def test_muon_gathers_only_over_the_axes_that_split_a_matrix(request, layout):
    report = _report_of(request, layout)
    model = "moe-tiny" if layout in EP else "tiny"
    (case,) = [c for c in report["cases"] if (c["layout"], c["engine"], c["model"])
               == (layout, "explicit", model)]
    muon = {k: v for k, v in case["bytes_per_tag"].items() if k.startswith("muon ")}
    assert {k.split()[2] for k, v in muon.items() if v > 0} == set(
        (LAYOUTS | EP)[layout]), muon
    # tp shards: one all_gather over tp; ZeRO's cut matrices: sends to and from their owner
    assert all(k.split()[1] == ("all_gather" if k.split()[2] == "tp" else "send")
               for k, v in muon.items() if v > 0), muon
