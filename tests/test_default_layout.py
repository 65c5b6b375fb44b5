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
