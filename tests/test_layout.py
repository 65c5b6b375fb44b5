"""``parallel/layout.py``: one Layout, one validator. No process group: every refusal must come
before any collective, so a topology without groups (only ``size`` and ``describe``) is enough.

* the name format round-trips through ``parse_layout`` and is the planner's prefix;
* ``Layout.check`` refuses each cross-strategy rule with the constraint and the fix;
* each shared rule's message is written once in ``src/shardwise`` (the reduce-dtype rule was
  written five times, the SP rule four)."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardwise.precision import Precision
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, preset_config
from shardwise.parallel.apply import Layout as ApplyLayout
from shardwise.parallel.layout import Layout, parse_layout
from shardwise.parallel.pp.schedules import check_schedule
from shardwise.plan.layout import PlanLayout

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"


def _topo(pp=1, dp=1, tp=1):
    sizes = {"pp": pp, "dp": dp, "cp": 1, "tp": tp, "ep": 1}
    return SimpleNamespace(size=sizes.__getitem__,
                           describe=lambda: f"pp={pp} × dp={dp} × tp={tp}")


@pytest.mark.parametrize("layout", [
    Layout(), Layout(dp=2, zero=3), Layout(tp=2, sp=True), Layout(pp=4, microbatches=8),
    Layout(pp=2, dp=2, tp=2, zero=1, sp=True, schedule="zb-h1", microbatches=4),
    Layout(pp=4, schedule="interleaved-1f1b", virtual_stages=4, microbatches=8),
])
def test_name_round_trips_through_parse_layout(layout):
    assert parse_layout(layout.name()) == layout


def test_one_layout_class_everywhere():
    assert ApplyLayout is Layout
    plan = PlanLayout(dp=64, tp=8, pp=16, zero=1, sp=True, schedule="interleaved-1f1b",
                      virtual_stages=8, ckpt="selective")
    assert isinstance(plan, Layout)
    shared = Layout(dp=64, tp=8, pp=16, zero=1, sp=True, schedule="interleaved-1f1b",
                    virtual_stages=8)
    assert plan.name() == shared.name() + ",b=1,ckpt=selective"
    assert plan.name() == "dp=64,tp=8,pp=16,zero=1,sp,interleaved-1f1b,v=8,b=1,ckpt=selective"


@pytest.mark.parametrize("schedule,v", [("1f1b", 0), ("gpipe", 1), ("interleaved-1f1b", 0),
                                        ("interleaved-1f1b", 3), ("zb-h1", 0)])
def test_chunks_is_what_the_schedule_resolves(schedule, v):
    lay = Layout(pp=4, schedule=schedule, virtual_stages=v)
    assert lay.chunks == check_schedule(schedule, 4, 12, v or None)
    assert Layout(schedule=schedule, virtual_stages=v).chunks == 1  # pp = 1: one chunk


def _llama():
    return preset_config("tiny", 67)


@pytest.mark.parametrize("layout,kw,needles", [
    (Layout(sp=True), {}, ["--sp (sequence parallelism) needs --tp > 1", "drop --sp"]),
    (Layout(sp=True), {"model_cfg": _llama()}, ["needs --tp > 1", "choose --tp from {2}"]),
    (Layout(zero=2), {}, ["--zero 2 shards the model state over the dp ranks, but dp=1",
                          "--dp 2 or more"]),
    (Layout(dp=2, zero=7), {}, ["--zero 7: choose 0"]),
    (Layout(dp=2, pp=2, zero=3, schedule="zb-h1"), {},
     ["ZeRO-3 with the split-backward schedule zb-h1", "--schedule 1f1b"]),
    (Layout(dp=2, pp=2, zero=2), {"engine": "torch"},
     ["--engine torch runs --zero 2 (FSDP2) without a pipeline", "--engine explicit"]),
    (Layout(tp=2, sp=True), {"model_cfg": _llama(), "seq_len": 15},
     ["--sp: --tp 2 does not divide --seq-len 15"]),
    (Layout(dp=2), {"topo": _topo(dp=4)}, ["does not match the topology pp=1 × dp=4 × tp=1",
                                           "Topology(pp=1, dp=2, tp=1)"]),
    (Layout(dp=2), {"precision": Precision.of(reduce="fp16")}, ["--reduce-dtype 'fp16': choose fp32 or bf16"]),
    (Layout(tp=2, pp=2), {"model_cfg": preset_config("mlp-tiny")},
     ["pipeline stages of the stacked MLP are not tensor-parallel", "use --pp 1 with --tp"]),
    (Layout(tp=3), {"model_cfg": preset_config("mlp-tiny")},
     ["--tp 3 does not divide the MLP's d_ff=32", "choose --tp from {1, 2, 4, 8, 16, 32}"]),
    (Layout(tp=3), {"model": build_model("tiny", vocab_size=67)},
     ["--tp 3 does not divide the model's n_heads=4", "choose --tp from {1, 2}"]),
    (Layout(pp=4), {"model_cfg": _llama(), "global_batch": 8, "micro_batch": 4},
     ["--pp 4 needs at least 4 microbatches", "--microbatches M"]),
    (Layout(pp=4, microbatches=4), {"model_cfg": _llama(), "global_batch": 8, "micro_batch": 1},
     ["too few for 4 pipeline stages"]),
])
def test_check_names_the_constraint_and_the_fix(layout, kw, needles):
    with pytest.raises(ShardwiseConfigError) as e:
        layout.check(**kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_check_passes_what_runs():
    llama = _llama()
    Layout().check()
    Layout(dp=2, tp=2, zero=3, sp=True).check(llama, _topo(dp=2, tp=2), seq_len=16,
                                              engine="torch")
    Layout(pp=2, dp=2, zero=1, microbatches=2).check(llama, global_batch=8, micro_batch=1,
                                                     precision=Precision.of(reduce="bf16"),
                                                     composition="pp")
    Layout(tp=2).check()  # no model given: the model's checks are skipped


@pytest.mark.parametrize("pattern", [r"needs --tp > 1", r"choose fp32 or bf16"])
def test_each_shared_rule_is_written_once(pattern):
    hits = [f"{f.relative_to(SRC)}:{i}" for f in sorted(SRC.rglob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if re.search(pattern, line)
            and not line.lstrip().startswith("#")]
    assert len(hits) == 1, hits
