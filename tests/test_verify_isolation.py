"""``shardwise verify``: a case that hangs fails on its own, and the next case still runs and
passes (issue: a hung layout made the next one fail with DistStoreError)."""

import json

import pytest

from conftest import run_cli


@pytest.mark.timeout(120)
def test_a_hung_case_fails_alone_and_the_next_case_passes(cache_dir, tmp_path):
    """Rank 0 of the first case sleeps past the 3 s process-group timeout (the test hook
    SHARDWISE_TEST_HANG_CASE), so rank 1 times out in its first collective: that case is
    reported failed with its own message, and dp=2,zero=1 after it runs in a fresh world and
    passes by the parity rule."""
    p = run_cli(["verify", "--nproc", "2", "--layouts", "dp=2", "dp=2,zero=1", "--models", "tiny",
                 "--engine", "explicit", "--timeout", "3", "--json", tmp_path / "v.json"],
                cache_dir, timeout=100, env={"SHARDWISE_TEST_HANG_CASE": "dp=2 explicit tiny"})
    assert p.returncode == 1, p.stdout  # one case failed
    cases = json.loads((tmp_path / "v.json").read_text())["cases"]
    assert [(c["layout"], c["pass"]) for c in cases] == [("dp=2", False), ("dp=2,zero=1", True)]
    assert "rank 0 hung in dp=2 explicit tiny" in cases[0]["error"]
    assert "verify: dp=2 explicit tiny: FAILED: rank 0:" in p.stdout
    assert cases[1]["diff_over_tolerance"] <= 1 and cases[1]["param_diff_over_bound"] <= 1
    assert "1/2 passed" in p.stdout
