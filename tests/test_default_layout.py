"""The default layout — one rule (``config.fields.DEFAULT_LAYOUT_RULE``): no degree chosen is
plain data parallelism over the whole world, under torchrun and alone, stated the same in
``--help``, the README and the code — and the rule that choosing any degree replaces it; the
start-of-run description of the rank groups."""

import re
import types
from pathlib import Path

import pytest
import torch

from shardwise.cli import _parser
from shardwise.config import from_args, validate
from shardwise.config.fields import DEFAULT_LAYOUT_RULE, LOCAL_WORLD

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _alone(monkeypatch):
    """Each case starts outside any world (a WORLD_SIZE left in the test's environment would
    count as torchrun's); the torchrun cases set it themselves."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _cfg(*argv):
    args, _ = _parser().parse_known_args(["train", *argv])
    return from_args(args)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("argv,want", [
    ((), (4, 1, 1, 0)),                         # no degree: dp over the 4 local ranks, plain DP
    (("--dp", "4", "--micro-batch", "4"), (4, 1, 1, 0)),  # a degree chosen: others 1, no ZeRO
    (("--tp", "2"), (1, 2, 1, 0)),
    (("--pp", "2"), (1, 1, 2, 0)),
    (("--dp", "2", "--zero", "3"), (2, 1, 1, 3)),
    (("--zero", "3"), (4, 1, 1, 3)),             # only the stage: ZeRO-3 over the whole world
    (("--dp", "2", "--tp", "2", "--zero", "1"), (2, 2, 1, 1)),  # make train (the Makefile's)
    (("--model", "mlp"), (4, 1, 1, 0)),
])
def test_default_layout_rule(argv, want):
    c = _cfg(*argv)
    assert (c.dp, c.tp, c.pp, c.zero) == want
    validate(c, c.world_size())


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8])
def test_under_torchrun_the_default_is_dp_over_its_world(monkeypatch, world):
    """torchrun's env (WORLD_SIZE, RANK) and no layout flag: dp = W, tp = pp = cp = 1, ZeRO 0
    (4 ranks: dp 4, not dp 2 × tp 2); --zero alone keeps dp = W; a chosen degree is kept."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    c = _cfg("--global-batch", "24")
    assert (c.dp, c.tp, c.pp, c.cp, c.zero) == (world, 1, 1, 1, 0)
    validate(c, world)
    if world > 1:
        z = _cfg("--global-batch", "24", "--zero", "3")
        assert (z.dp, z.tp, z.zero) == (world, 1, 3)
    chosen = _cfg("--dp", "2")
    assert (chosen.dp, chosen.tp, chosen.zero) == (2, 1, 0)  # not adapted to the world


def test_help_readme_and_code_state_one_rule(monkeypatch):
    """``train --help`` and ``trace --help`` print the rule, the README quotes it word for word,
    and what the help says (parsed from its text) is what from_args does, alone and under
    torchrun; the Makefile's make train names its layout, as the README says."""
    sub = next(a for a in _parser()._actions if hasattr(a, "choices") and a.choices
               and "train" in a.choices).choices
    rule = _flat(DEFAULT_LAYOUT_RULE)
    for name in ("train", "trace"):
        assert rule in _flat(sub[name].format_help()), name
    readme = _flat((ROOT / "README.md").read_text())
    assert rule in readme
    # the help's own words, parsed: dp = the world, the local world alone, ZeRO 0, tp = pp = cp = 1
    text = _flat(sub["train"].format_help())
    alone = int(re.search(r"run alone, (\d+) local ranks", text).group(1))
    zero = int(re.search(r"ZeRO (\d) unless --zero is given", text).group(1))
    assert "dp = the world size (torchrun's WORLD_SIZE;" in text
    assert "tp = pp = cp = 1" in text and alone == LOCAL_WORLD
    assert "(default: the world size: see the default layout above)" in text  # --dp's line
    c = _cfg()
    assert (c.dp, c.tp, c.pp, c.cp, c.zero) == (alone, 1, 1, 1, zero)
    monkeypatch.setenv("WORLD_SIZE", "8")
    c = _cfg()
    assert (c.dp, c.tp, c.pp, c.cp, c.zero) == (8, 1, 1, 1, zero)
    # make train: the Makefile passes the 2D layout the README describes
    make = (ROOT / "Makefile").read_text()
    line = re.search(r"^train:.*\n\t(.*)$", make, re.M).group(1)
    assert line.endswith("shardwise train --dp 2 --tp 2 --zero 1"), line
    assert "`make train` runs `shardwise train` with the layout flags `--dp 2 --tp 2 --zero 1`" \
        in readme


def test_toml_degrees_count_as_chosen(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("dp = 4\n")
    c = _cfg("--config", str(f))
    assert (c.dp, c.tp, c.pp, c.zero) == (4, 1, 1, 0)


def test_describe_groups_by_hand():
    """pp=2, dp=2, tp=2 over ranks 0..7 (docs/architecture.md's table): tp {0,1} {2,3} {4,5}
    {6,7}; dp {0,2} {1,3} {4,6} {5,7}; pp {0,4} {1,5} {2,6} {3,7}."""
    from shardwise.train.report import describe_groups

    grid = torch.arange(8).reshape(2, 2, 2)
    topo = types.SimpleNamespace(grid=grid, size=lambda a: 2)
    lines = describe_groups(topo)
    assert lines[0].strip() == "mesh (pp, dp, tp) = (2, 2, 2), rank r = (pp·2 + dp)·2 + tp"
    assert lines[1].strip() == "pp groups: {0,4} {1,5} {2,6} {3,7}"
    assert lines[2].strip() == "dp groups: {0,2} {1,3} {4,6} {5,7}"
    assert lines[3].strip() == "tp groups: {0,1} {2,3} {4,5} {6,7}"


def test_describe_groups_with_cp_by_hand():
    """dp=2, cp=2, tp=2 over ranks 0..7: r = (dp·2 + cp)·2 + tp, so tp {0,1} …, cp {0,2}
    {1,3} {4,6} {5,7}, dp {0,4} {1,5} {2,6} {3,7}, and the gradients' dp × cp lines, one per tp
    index: {0,2,4,6} {1,3,5,7}."""
    from shardwise.train.report import describe_groups

    grid = torch.arange(8).reshape(1, 2, 2, 2)
    sizes = {"pp": 1, "dp": 2, "cp": 2, "tp": 2}
    lines = describe_groups(types.SimpleNamespace(grid=grid, size=sizes.__getitem__))
    assert lines[0].strip() == ("mesh (pp, dp, cp, tp) = (1, 2, 2, 2), rank r = "
                                "((pp·2 + dp)·2 + cp)·2 + tp")
    assert [ln.strip() for ln in lines[1:]] == [
        "dp groups: {0,4} {1,5} {2,6} {3,7}", "cp groups: {0,2} {1,3} {4,6} {5,7}",
        "tp groups: {0,1} {2,3} {4,5} {6,7}", "dp_cp (gradients) groups: {0,2,4,6} {1,3,5,7}"]


# --- the micro-batch and pipeline microbatches, derived when not given (issue 23) -------------

@pytest.mark.parametrize("argv,want", [
    # (micro_batch, microbatches, derived): the largest b ≤ 8 dividing global batch / dp, and
    # with pp > 1 the smallest m ≥ pp dividing it (micro-batches of at most 8)
    ((), (4, 0, "micro_batch")),                          # 16 / dp 4 (the default) = 4
    (("--dp", "4"), (4, 0, "micro_batch")),               # 16 / 4 = 4
    (("--dp", "8", "--zero", "3"), (2, 0, "micro_batch")),
    (("--dp", "16"), (1, 0, "micro_batch")),
    (("--tp", "2"), (8, 0, "micro_batch")),               # 16 / dp 1: two micro-steps of 8
    (("--dp", "2", "--global-batch", "12"), (6, 0, "micro_batch")),  # 6 | 6
    (("--dp", "1", "--global-batch", "20"), (5, 0, "micro_batch")),  # 8, 7, 6 do not divide 20
    (("--pp", "4"), (4, 4, "micro_batch,microbatches")),  # 16 per pipeline, ≥ 4 microbatches
    (("--pp", "2"), (8, 2, "micro_batch,microbatches")),
    (("--dp", "2", "--pp", "2"), (4, 2, "micro_batch,microbatches")),
    (("--dp", "2", "--pp", "4"), (2, 4, "micro_batch,microbatches")),
    (("--pp", "2", "--global-batch", "64"), (8, 8, "micro_batch,microbatches")),  # b ≤ 8
    (("--pp", "3", "--global-batch", "12"), (4, 3, "micro_batch,microbatches")),
    (("--dp", "4", "--micro-batch", "2"), (2, 0, "")),     # explicit: kept as given
    (("--pp", "2", "--micro-batch", "2"), (2, 0, "")),     # explicit: m = 16 / 2 follows
    (("--pp", "2", "--microbatches", "4"), (8, 4, "")),    # explicit m: b = 16 / 4 follows
])
def test_micro_batch_is_derived_from_the_layout_when_not_given(argv, want):
    c = _cfg("--model", "tiny", "--n-layers", "4", *argv)  # 4 layers: enough for --pp 4
    assert (c.micro_batch, c.microbatches, c.derived) == want
    validate(c, c.world_size())


def test_derived_micro_batch_follows_the_trace_default_cap():
    """A preset default the user did not choose (trace's micro-batch 2) is the cap: kept where
    it fits, so trace's numbers do not move."""
    args, _ = _parser().parse_known_args(["trace", "--dp", "8"])
    c = from_args(args, model="tiny", global_batch=8, micro_batch=2, seq_len=16)
    assert (c.micro_batch, c.derived) == (1, "micro_batch")
    args, _ = _parser().parse_known_args(["trace", "--dp", "2"])
    c = from_args(args, model="tiny", global_batch=8, micro_batch=2, seq_len=16)
    assert (c.micro_batch, c.derived) == (2, "micro_batch")


@pytest.mark.parametrize("argv,match", [
    (("--dp", "32"), r"--global-batch 16 does not split over --dp 32 .* no micro-batch fits: "
                     r"choose --global-batch a multiple of 32 \(e.g. 32 or 64\) or --dp from "
                     r"\[1, 2, 4, 8, 16\]"),
    (("--dp", "3"), r"does not split over --dp 3 .* a multiple of 3 \(e.g. 15 or 18\)"),
    (("--dp", "4", "--pp", "8"), r"--pp 8 needs at least 8 microbatches per step, but global "
                                 r"batch / dp = 16 / 4 = 4 sequences per pipeline \(fewer than "
                                 r"8\): choose --global-batch a multiple of dp × pp = 32"),
    # dualpipev needs m ≥ 2·pp (issue 40): 16 / 2 = 8 sequences, fewer than 2·8
    (("--dp", "2", "--pp", "8", "--schedule", "dualpipev"),
     r"--pp 8 needs at least 16 microbatches per step with --schedule dualpipev, but global "
     r"batch / dp = 16 / 2 = 8 sequences per pipeline \(fewer than 16\): choose --global-batch "
     r"a multiple of dp × 2·pp = 32"),
])
def test_no_derived_value_fits_names_the_constraint_and_the_fix(argv, match):
    from shardwise.errors import ShardwiseConfigError

    with pytest.raises(ShardwiseConfigError, match=match):
        _cfg("--model", "tiny", *argv)


@pytest.mark.parametrize("argv,match", [
    (("--dp", "4", "--micro-batch", "8"), r"--global-batch 16 is not divisible by dp × "
     r"micro-batch = 4 × 8 = 32: choose a multiple of 32 \(e.g. 32 or 64\) or change "
     r"--micro-batch"),
    (("--pp", "4", "--micro-batch", "8"), r"--pp 4 needs at least 4 microbatches per step, but "
     r"global batch / \(dp × micro-batch\) = 16 / \(1 × 8\) = 2"),
])
def test_an_explicit_micro_batch_that_does_not_fit_keeps_the_old_error(argv, match, tmp_path):
    from shardwise.errors import ShardwiseConfigError

    with pytest.raises(ShardwiseConfigError, match=match):
        c = _cfg("--model", "tiny", *argv)
        validate(c, c.world_size())
    f = tmp_path / "c.toml"  # a value in the TOML file is the user's too
    f.write_text("micro_batch = 8\n")
    with pytest.raises(ShardwiseConfigError, match=match):
        c = _cfg("--model", "tiny", "--config", str(f), *argv[:2])
        validate(c, c.world_size())


def test_a_saved_config_derives_again_for_its_layout(tmp_path):
    """The run folder's config.toml records what was derived: read back (--config, as a resumed
    run does) it gives the same values for the same layout, and derives afresh for another
    layout instead of treating the saved micro-batch as chosen."""
    saved = _cfg("--model", "tiny", "--dp", "4")
    f = tmp_path / "config.toml"
    f.write_text(saved.to_toml())
    again = _cfg("--config", str(f))
    assert again == saved and again.derived == "micro_batch"
    other = _cfg("--config", str(f), "--dp", "2")  # 16 / 2 = 8: the default fits again
    assert (other.micro_batch, other.derived) == (8, "micro_batch")
    pipe = _cfg("--model", "tiny", "--pp", "4", "--n-layers", "4")
    f.write_text(pipe.to_toml())
    assert _cfg("--config", str(f)) == pipe
    two = _cfg("--config", str(f), "--pp", "2", "--n-layers", "4")
    assert (two.micro_batch, two.microbatches) == (8, 2)
