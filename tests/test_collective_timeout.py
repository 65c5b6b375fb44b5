"""A collective of shardwise.comm that only some ranks call: after the process group's timeout
it fails with one clear line (CollectiveTimeout, a ShardwiseConfigError) naming the collective
and its likely cause, chained to torch's own error; the rank that never called it is not left
hanging. Worker: tests/workers/collective_timeout_cases.py (2 ranks, 3 s group timeout)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import run_world  # noqa: E402
import collective_timeout_cases as W  # noqa: E402

# case → (op, tag, shape of the buffer the message names), as the worker issues them
EXPECTED = {"sync": ("all_reduce", "loss", "[4]"), "async": ("all_gather", "param", "[6]"),
            "ring": ("reduce_scatter", "grad", "[8]"), "tree": ("all_gather", "param", "[6]")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("collective_timeout")
    run_world(W.__file__, out, 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(EXPECTED))
def test_subset_collective_names_itself(ranks, case):
    (rec,) = [c for c in ranks[0]["cases"] if c["case"] == case]
    op, tag, shape = EXPECTED[case]
    assert rec["type"] == "CollectiveTimeout", rec
    assert rec["config_error"] and rec["collective_timeout"]
    msg = rec["message"]
    assert "\n" not in msg, msg  # one line
    for part in (op, "'dp'", f"'{tag}'", f"float32 {shape}", "group of 2 ranks",
                 f"{W.TIMEOUT_S:g} s", "subset of the ranks", "different orders"):
        assert part in msg, (part, msg)
    assert rec["cause"] and "RuntimeError" in rec["cause"], rec["cause"]  # chained to torch's
    # it fails at the group's timeout, not at the world's (30 s) or never
    assert W.TIMEOUT_S - 0.5 <= rec["seconds"] < W.TIMEOUT_S + 10, rec["seconds"]


@pytest.mark.timeout(120)
def test_rank_that_never_called_is_not_left_hanging(ranks):
    # rank 1 left its wait as soon as rank 0 was done: every timeout, well under its own limit
    assert ranks[1]["waited_s"] < len(W.COLLECTIVES) * W.TIMEOUT_S + 10 < W.WAIT_S
