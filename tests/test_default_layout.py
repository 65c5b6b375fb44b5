"""The default layout (dp=2 × tp=2, ZeRO-1) and the rule that choosing any degree replaces it;
the start-of-run description of the rank groups."""

import types

import pytest
import torch

from shardwise.cli import _parser
from shardwise.config import from_args, validate


def _cfg(*argv):
    args, _ = _parser().parse_known_args(["train", *argv])
    return from_args(args)


@pytest.mark.parametrize("argv,want", [
    ((), (2, 2, 1, 1)),                         # make train: dp=2 × tp=2, ZeRO-1, 4 ranks
    (("--dp", "4", "--micro-batch", "4"), (4, 1, 1, 0)),  # a degree chosen: others 1, no ZeRO
    (("--tp", "2"), (1, 2, 1, 0)),
    (("--pp", "2"), (1, 1, 2, 0)),
    (("--dp", "2", "--zero", "3"), (2, 1, 1, 3)),
    (("--zero", "3"), (2, 2, 1, 3)),             # only the stage: the default degrees stay
    (("--model", "mlp"), (2, 1, 1, 1)),          # TP splits heads: the MLP's default is dp only
])
def test_default_layout_rule(argv, want):
    c = _cfg(*argv)
    assert (c.dp, c.tp, c.pp, c.zero) == want
    validate(c, c.world_size())


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
    ((), (8, 0, "micro_batch")),                          # 16 / dp 2 = 8: the default fits
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
