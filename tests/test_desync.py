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
import os
import subprocess
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


# -- the local launcher's diagnosis: (b) under step, (f), (d); then shardwise doctor ---------------

import re  # noqa: E402

import launcher_faults as LF  # noqa: E402
import zygote  # noqa: E402

from shardwise.tools import doctor  # noqa: E402


def launch_faulty(out: Path, mode: str):
    """Run tests/workers/launcher_faults.py in ``mode`` as 3 ranks under the local launcher;
    (its CompletedProcess, seconds it took)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = zygote.run(["--nproc", "3", LF.__file__, str(out), mode], env, 120,
                   module="shardwise.launch")
    return p, time.monotonic() - t0


def leftovers(out: Path) -> list[int]:
    """The ranks (pids written by the worker as ``out/pid{r}``) still alive: orphans. Waits up
    to 5 s for the kernel to finish them (the launcher has returned: it stopped them)."""
    pids = [int(f.read_text()) for f in sorted(out.glob("pid*"))]
    assert len(pids) == 3, pids  # every rank started

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def launcher_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("[launcher] diagnosis: ")]
    assert len(lines) == 1, out[-4000:]
    return lines[0][len("[launcher] diagnosis: "):]


@pytest.mark.timeout(150)
def test_b_a_shape_mismatch_under_step_is_one_launcher_line(tmp_path):
    # gloo aborts a rank that receives rank 1's 8 floats where it expects 4, before any
    # check could speak; the positions each rank left in the launcher's store name it
    p, elapsed = launch_faulty(tmp_path, "shape")
    assert p.returncode != 0, p.stdout[-3000:]
    line = launcher_line(p.stdout)
    want = (r"rank 1 called all_reduce\(dp, grad, float32\[8\]\) where ranks 0,2 called "
            r"all_reduce\(dp, grad, float32\[4\]\), at collective #1 on dp \(ranks 0,1,2\) in "
            r"step 1 \(rank [02] was killed by SIGABRT inside it\): " + re.escape(FIX))
    assert re.match(want, line), line
    assert "no fault took effect" not in p.stdout
    assert elapsed < W.TIMEOUT_S / 2, elapsed  # not the process-group timeout
    assert not leftovers(tmp_path)
    rep = json.loads((tmp_path / "flight" / "diagnosis.json").read_text())
    assert rep["diagnosis"] == line and rep["kind"] == "mismatch"
    assert set(rep["positions"]) == {"0", "1", "2"}


@pytest.mark.timeout(150)
def test_f_a_rank_killed_mid_step_is_named_by_the_launcher(tmp_path):
    p, elapsed = launch_faulty(tmp_path, "kill")
    assert p.returncode != 0, p.stdout[-3000:]
    line = launcher_line(p.stdout)
    # step k issues collectives #2k-1 (grad) and #2k (loss): rank 2 died between #5 and #6
    dead = ("rank 2 died (killed by SIGKILL) and has issued nothing since all_reduce(dp, grad, "
            "float32[4]) #5 in step 3; ")
    tail = ": the survivors were stopped; "
    assert line.startswith(dead) and tail in line, line
    # ranks 0 and 1 wait in #6, whether or not their wait had failed on the broken connection
    # before the launcher stopped them; on a loaded machine one may have been stopped between
    # #5 and #6, before it issued #6; and rank 2 returns from #5 once its own part is done, so
    # its last bytes to a peer can be lost with its sockets when it is killed: a survivor can
    # still be waiting in #5 (seen under load). Each is named once, in
    # one of these three places, and ranks in the same place are named together
    places = ("wait in all_reduce(dp, loss, float32[4]) #6",
              "last issued all_reduce(dp, grad, float32[4]) #5 in step 3",
              "wait in all_reduce(dp, grad, float32[4]) #5")
    named: dict[int, str] = {}
    for part in line[len(dead):line.index(tail)].split("; "):
        m = re.fullmatch(r"ranks? ([\d,]+) (.+)", part)
        assert m and m.group(2) in places and m.group(2) not in named.values(), line
        named.update((int(r), m.group(2)) for r in m.group(1).split(","))
    assert sorted(named) == [0, 1], line
    assert elapsed < W.TIMEOUT_S / 2, elapsed
    assert not leftovers(tmp_path)
    rep = json.loads((tmp_path / "flight" / "diagnosis.json").read_text())
    assert rep["failed"]["2"] == -9 and rep["kind"] == "died", rep["failed"]
    text, found = doctor.report(tmp_path)
    assert found and "likely cause: rank that died: " in text, text
    assert "rank 2: -9" in text and "rank 2: no flight record; its last position in the " \
        "store: last issued all_reduce(dp, grad, float32[4]) #5 in step 3" in text, text


@pytest.mark.timeout(120)
def test_f_under_torchrun_rank0_names_the_rank_that_stopped(tmp_path):
    """(f) under torchrun, which SIGTERMs the survivors as soon as rank 2 dies: rank 0's
    handler reads the positions from torchrun's store and names rank 2 and where it stopped;
    the job exits non-zero and no rank outlives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDWISE_DIAG",
                                                                     "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        LF.__file__, str(tmp_path), "kill"], env=env, capture_output=True,
                       text=True, timeout=110)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    lines = [ln for ln in out.splitlines()
             if "[shardwise] diagnosis (rank 0, stopped by torchrun): " in ln]
    assert len(lines) == 1, out[-4000:]
    assert "rank 2 has issued nothing since all_reduce(dp, grad, float32[4]) #5 in step 3; " \
        "ranks 0,1 " in lines[0], lines[0]
    assert time.monotonic() - t0 < LF.TIMEOUT_S / 2
    assert not leftovers(tmp_path)


PP_HANG_AFTER_S = 2.0


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, cache_dir):
    # (d) a 2-stage pipeline (2 microbatches per step) whose stage 0 skips its third pp_fwd
    # send (step 2, microbatch 0)
    run = tmp_path_factory.mktemp("pp") / "run"
    args = ["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "16",
            "--global-batch", "4", "--micro-batch", "2", "--eval-sequences", "4",
            "--eval-every", "100", "--sample-tokens", "0", "--steps", "3", "--pp", "2",
            "--hang-after", str(PP_HANG_AFTER_S), "--timeout", "60", "--out", run]
    t0 = time.monotonic()
    r = run_cli(args, cache_dir, timeout=170, env={"SHARDWISE_TEST_SKIP_SEND": "0:pp_fwd:3"})
    return r, time.monotonic() - t0, run


@pytest.mark.timeout(200)
def test_d_a_pipeline_stage_that_skips_a_send_is_named(pp_run):
    r, elapsed, run = pp_run
    out = r.stdout
    assert r.returncode == 2, out[-3000:]
    assert "skips send pp_fwd #3" in out  # the fault took effect
    # rank 1 received messages #1, #2 (step 1) and #3 (the one after the skipped one) and
    # waits for #4; rank 0 sent 3 and waits for the gradient that answers #4
    want = ("rank 1 waits in recv(pp, pp_fwd, float32[2,16,32], from=0) for message #4 of "
            "0>1:pp_fwd (step 2), which rank 0 never sent (it sent 3); rank 0 waits in "
            "recv(pp, pp_bwd, float32[2,16,32], from=1) for message #4, the answer to it: "
            "rank 0 skipped a pp_fwd send to rank 1; every send must meet its receive")
    line = launcher_line(out)
    assert line.startswith(want), line
    # the rank that reaches --hang-after first prints the diagnosis (both wait; under load either
    # can be first); the launcher's line above is the one the user reads
    assert [ln for ln in out.splitlines()
            if re.match(r"\[rank [01]\] shardwise: error: ", ln) and want in ln], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    waited = []
    for rank in (0, 1):
        flight = json.loads((run / "flight" / f"rank{rank}.json").read_text())
        assert flight["wait_p2p"]["op"] == "recv" and flight["wait_p2p"]["n"] == 4, flight
        waited.append(flight["waited_s"])
    # the first to give up waited --hang-after, and the diagnosis came well within + 15 s
    assert PP_HANG_AFTER_S <= max(waited) < PP_HANG_AFTER_S + 15, waited
    assert elapsed < 90, elapsed  # start-up, 2 steps, the diagnosis: not the 60 s timeout


@pytest.mark.timeout(60)
def test_doctor_names_a_missing_pipeline_send(pp_run, cache_dir):
    r, _, run = pp_run
    d = run_cli(["doctor", run], cache_dir, timeout=50)
    assert d.returncode == 0, d.stdout
    text = d.stdout
    assert "likely cause: missing pipeline send: " in text, text
    assert "rank 0 skipped a pp_fwd send to rank 1" in text
    # the timelines end with each rank's waiting receive, #4 of its channel
    assert re.search(r"rank 0: in recv\(pp, pp_bwd, float32\[2,16,32\], from=1\) \(message #4 "
                     r"of 1>0:pp_bwd\) for \d+\.\d s \(step 2\)", text), text
    assert re.search(r"step +2 +#4 +recv\(pp, pp_fwd, float32\[2,16,32\], from=0\) +0>1:pp_fwd",
                     text), text


DOCTOR_CAUSES = {"extra": "rank-conditional collective", "save": "rank-conditional collective",
                 "shape": "shape mismatch", "compute": "rank stuck in compute"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DOCTOR_CAUSES))
def test_doctor_names_the_cause_from_the_flight_records(world_out, ranks, case):
    folder = world_out / ("flight" if case == "compute" else f"flight_{case}")
    text, found = doctor.report(folder)
    assert found, text
    assert f"diagnosis: {ranks[0][case]['message']}" in text, text  # the line the ranks raised
    assert f"likely cause: {DOCTOR_CAUSES[case]}: " in text, text
    for r in range(NPROC):  # every rank that raised wrote its record: one timeline each
        assert f"\n  rank {r}: " in text, text


def test_doctor_without_records_says_so(tmp_path):
    text, found = doctor.report(tmp_path)
    assert not found and "no flight records in" in text
