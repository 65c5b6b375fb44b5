"""A desync is one line on every rank, not a hang (issue 18, tests (a), (b), (c), (e)):
collective fingerprints compared across ranks (comm/fingerprint.py) turn an extra collective on
one rank, the same collective with another shape, and a gathering collective called from rank
0 alone into one ``CollectiveMismatch`` message on every rank, naming the rank, the op and the
sequence number, within a few check slices and far below the process-group timeout; a rank
stuck in compute is named after ``--hang-after`` (``CollectiveHang``), with flight records.

One 3-rank world runs the cases (tests/workers/desync_cases.py); one CLI run checks the
whole path: ``shardwise train`` with rank 0 alone all-gathering after step 1 exits non-zero
with the one line and no traceback, well before the process-group timeout.
"""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import run_cli, run_world  # noqa: E402
import desync_cases as W  # noqa: E402

from shardwise.comm.fingerprint import SLICE_S  # noqa: E402

NPROC = 3
OTHERS = ",".join(str(r) for r in range(NPROC) if r != W.ODD)  # "0,2"
# the bound: a stuck rank reports after one slice, a rank at the check after one slice, the
# prover waits one slice more for every report, a stuck rank sees the verdict within one slice:
# 4 slices (2 s), plus 8 s for two cores shared by three ranks and other jobs. Far below the
# process-group timeout (60 s), so the check, not the timeout, spoke.
BOUND_S = 4 * SLICE_S + 8.0
assert BOUND_S < W.TIMEOUT_S / 2

# case → the start of the one message every rank must raise (then the fix) (as the worker injects each fault)
FIX = "every rank of a group must issue the same collectives"
EXPECTED = {
    # (a) rank 1's third collective on dp (after the broadcast and the grad all-reduce)
    "extra": f"rank {W.ODD} called all_reduce(dp, extra, float32[4]) where ranks {OTHERS} "
             f"issued no collective (reached the check before step 2), at collective #3 on dp "
             f"(ranks 0,1,2) in step 1: {FIX}",
    # (b) the second collective: [8] on rank 1 where the others all-reduce [4]
    "shape": f"rank {W.ODD} called all_reduce(dp, grad, float32[8]) where ranks {OTHERS} "
             f"called all_reduce(dp, grad, float32[4]), at collective #2 on dp (ranks 0,1,2) "
             f"in step 1: {FIX}",
    # (e) rank 0's all-gather of 3 shards of [3] after step 1, in its "save"
    "save": "rank 0 called all_gather(dp, checkpoint, float32[9]) where ranks 1,2 issued no "
            "collective (reached the check before step 2), at collective #3 on dp (ranks "
            f"0,1,2) in phase 'checkpoint' after step 1: {FIX}",
}


@pytest.fixture(scope="module")
def world_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("desync")
    run_world(W.__file__, out, NPROC)
    return out


@pytest.fixture(scope="module")
def ranks(world_out):
    return [json.loads((world_out / f"rank{r}.json").read_text())["cases"]
            for r in range(NPROC)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_desync_raises_one_message_on_every_rank(ranks, case):
    for r in range(NPROC):
        rec = ranks[r][case]
        assert rec["type"] == "CollectiveMismatch" and rec["mismatch"], (r, rec)
        assert rec["message"].startswith(EXPECTED[case]), (r, rec["message"])
        assert "\n" not in rec["message"]  # one line, the same on every rank
        assert rec["message"] == ranks[0][case]["message"]
        assert rec["seconds"] < BOUND_S, (r, rec["seconds"])


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_compute_is_named_after_hang_after(ranks, world_out):
    # its last position in the store: the grad all-reduce, the second collective of step 1
    want = (f"rank {W.ODD} reported nothing since it issued all_reduce(dp, grad, float32[4]) #2 "
            f"in step 1 (stuck in compute, in code outside shardwise.comm, or dead); ranks "
            f"{OTHERS} wait at the check before step 2: rank ")
    msgs = {ranks[r]["compute"]["message"] for r in range(NPROC)}
    waited = []
    assert len(msgs) == 1 and next(iter(msgs)).startswith(want), msgs
    for r in range(NPROC):
        rec = ranks[r]["compute"]
        assert rec["type"] == "CollectiveHang" and rec["timeout"], (r, rec)
        if r == W.ODD:  # it raises when it reaches the check, after its "compute"
            assert rec["seconds"] < W.HANG_AFTER_S + 3.0 + BOUND_S, rec
            # its record: it reached the check late and waited there for nothing; the
            # diagnosis it raised is the one the waiting ranks published
            flight = json.loads((world_out / "flight" / f"rank{r}.json").read_text())
            assert flight["waiting"] == "at the check before step 2", flight
            assert flight["waited_s"] < BOUND_S and flight["diagnosis"] == rec["message"]
            continue
        assert rec["seconds"] < W.HANG_AFTER_S + BOUND_S, (r, rec)  # not much after it
        flight = json.loads((world_out / "flight" / f"rank{r}.json").read_text())
        assert flight["waiting"] == "at the check before step 2", flight
        assert flight["waited_s"] < W.HANG_AFTER_S + BOUND_S, flight
        waited.append(flight["waited_s"])
        assert [(x["fingerprint"], x["seq"]) for x in flight["last"]] == [
            ("broadcast(dp, param, float32[2], src=0)", 1),
            ("all_reduce(dp, grad, float32[4])", 2)], flight["last"]
        assert any("step_one" in frame for frame in flight["stack"]), flight["stack"]
    # not before --hang-after: the rank that gave up first waited all of it (the other may
    # have seen its verdict a little sooner in its own wait)
    assert max(waited) >= W.HANG_AFTER_S, waited


@pytest.mark.timeout(150)
def test_matching_collectives_pass_the_check(ranks):
    assert all(ranks[r]["clean"]["type"] is None for r in range(NPROC)), ranks


@pytest.mark.timeout(200)
def test_train_with_a_rank0_only_gather_exits_with_the_one_line(tmp_path, cache_dir):
    args = ["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "16",
            "--global-batch", "4", "--micro-batch", "2", "--eval-sequences", "4",
            "--eval-every", "100", "--sample-tokens", "0", "--steps", "3", "--dp", "2",
            "--timeout", "120", "--out", tmp_path / "run"]
    t0 = time.monotonic()
    r = run_cli(args, cache_dir, timeout=170, env={"SHARDWISE_TEST_RANK0_GATHER": "1"})
    elapsed = time.monotonic() - t0
    out = r.stdout
    assert r.returncode == 2, out[-3000:]
    want = ("shardwise: error: rank 0 called all_gather(dp, checkpoint, float32[6]) where "
            "rank 1 issued no collective (reached the check before step 2), at collective #")
    lines = [ln for ln in out.splitlines() if want in ln]
    assert lines and all(FIX in ln for ln in lines), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # step 1 was logged, step 2 never ran: the check came before it
    logged = [json.loads(ln)["step"] for ln in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert logged == [0, 1], logged
    # the check spoke, not the process-group timeout (120 s: rank 0's gather would wait
    # that long): start-up, 2 steps and the diagnosis took well under it
    assert elapsed < 90, elapsed
