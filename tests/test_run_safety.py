"""Run folders and checkpoints under the accidents of real runs (issue 13, items 4-8 and 12):
a divergence, a crash during the first save, a fresh restart, two runs in one folder, data that
changed under a resume, a full disk and an unwritable checkpoints folder.

Each is a tiny single-process CLI run (two ranks where ranks matter) that must end in one clear
line (``shardwise: error: ...``, exit 2, no traceback) or recover. Expected values come from the
files the run leaves (its own metrics log, the tensors read back here, the pid of the process
this test started), never from a recorded run.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli, run_world

Q = ["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "16", "--global-batch",
     "4", "--micro-batch", "2", "--eval-sequences", "4", "--eval-every", "100",
     "--sample-tokens", "4", "--log-every", "1", "--timeout", "60"]
ONE = [*Q, "--dp", "1"]
# rank 1 of a 2-rank world with no peer: had it reached the rendezvous it would block there, so
# a prompt exit proves the check ran before any collective (as in test_bad_inputs.py)
AS_RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29997"}


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def clear_error(r, *fragments):
    """Exit 2, the fragments in the output, and a one-line error as the last line."""
    assert r.returncode == 2, r.stdout[-3000:]
    for frag in fragments:
        assert frag in r.stdout, f"{frag!r} not in:\n{r.stdout[-3000:]}"
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    assert "shardwise: error:" in r.stdout.strip().splitlines()[-1], r.stdout[-3000:]


def state_of(step_folder):
    """Every tensor of a checkpoint (model and optimizer), read back here in one process."""
    from torch.distributed.checkpoint import FileSystemReader

    from shardwise.checkpoint.load import _dcp_load

    md = FileSystemReader(str(step_folder)).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    _dcp_load(state, step_folder)
    return state


# -- 4: a divergence never replaces the last good checkpoint -----------------------------------

@pytest.mark.timeout(240)
def test_divergence_keeps_the_last_finite_checkpoint_and_names_it(tmp_path, cache_dir):
    from shardwise.checkpoint import complete_checkpoints, find_resume_checkpoint

    out = tmp_path / "run"
    r = run_cli([*ONE, "--steps", "4", "--lr", "1e6", "--grad-clip", "0", "--warmup-steps", "0",
                 "--save-every", "1", "--keep", "1", "--out", out], cache_dir)
    # the step that diverged: the first logged step whose loss or gradient norm is not finite
    rows = [m for m in metrics(out) if "loss" in m]
    bad = next(m["step"] for m in rows if not (torch.tensor([m["loss"], m["grad_norm"]])
                                               .isfinite().all()))
    good = out / "checkpoints" / f"step_{bad - 1}"
    clear_error(r, f"training diverged at step {bad}", f"the last good checkpoint is {good}")
    # nothing of the diverged step was written; the last finite checkpoint survived --keep 1
    assert [p for _, p in complete_checkpoints(out / "checkpoints")] == [good]
    assert not (out / "checkpoints" / f"step_{bad}.tmp").exists()
    assert all(bool(t.isfinite().all()) for t in state_of(good).values())
    assert find_resume_checkpoint("auto", str(out)) == good  # what --resume auto loads


@pytest.mark.timeout(180)
def test_a_non_finite_state_on_one_rank_is_never_checkpointed(tmp_path):
    from shardwise.checkpoint import complete_checkpoints

    run_world(ROOT / "tests" / "workers" / "run_safety_cases.py", tmp_path, nproc=2)
    good = tmp_path / "checkpoints" / "step_1"
    for rank in (0, 1):  # rank 0's own state is finite: it refuses on the all-reduced flag
        res = json.loads((tmp_path / f"nonfinite_rank{rank}.json").read_text())
        assert res["error_type"] == "DivergedError", res
        assert "training diverged at step 2" in res["message"], res
        assert f"the last good checkpoint is {good}" in res["message"], res
    assert [p for _, p in complete_checkpoints(tmp_path / "checkpoints")] == [good]
    assert not (tmp_path / "checkpoints" / "step_2.tmp").exists()


def test_keep_rotation_never_deletes_the_newest_finite_checkpoint(tmp_path):
    from shardwise.checkpoint import MARKER, prune

    root = tmp_path / "checkpoints"
    for step, finite in ((1, True), (2, False)):  # step_2 as a non-finite one would be marked
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step,
                                                                     "finite": finite}))
        (root / f"step_{step}" / MARKER).write_text("{}")
    assert prune(root, keep=1) == []
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


# -- 5: a crash during the first save leaves only step_N.tmp: that is no checkpoint -------------

@pytest.mark.timeout(240)
def test_only_an_incomplete_checkpoint_means_start_fresh(tmp_path, cache_dir):
    out = tmp_path / "run"
    tmp = out / "checkpoints" / "step_5.tmp"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(os.urandom(1000))  # a save killed half-way
    steps = 2
    r = run_cli([*ONE, "--steps", steps, "--resume", "auto", "--out", out], cache_dir)
    assert r.returncode == 0, r.stdout[-3000:]
    said = [line for line in r.stdout.splitlines() if "step_5.tmp" in line]
    assert len(said) == 1 and "starting fresh" in said[0], r.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(steps + 1))
    assert (out / "checkpoints" / f"step_{steps}" / "COMPLETE").is_file()


# -- 6: a fresh restart (no checkpoint to resume) starts fresh logs ----------------------------

@pytest.mark.timeout(240)
def test_a_fresh_restart_does_not_log_steps_twice(tmp_path, cache_dir):
    out = tmp_path / "run"
    steps, killed_at = 3, 2
    args = [*ONE, "--steps", steps, "--resume", "auto", "--out", out]  # as torchrun restarts it
    r = run_cli(args, cache_dir, env={"SHARDWISE_TEST_KILL_AT_STEP": str(killed_at)})
    assert r.returncode != 0 and "SIGKILL rank 0" in r.stdout, r.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(killed_at + 1))  # the crashed attempt
    assert not (out / "checkpoints").exists()  # nothing to resume from: the restart is fresh
    r = run_cli(args, cache_dir)
    assert r.returncode == 0, r.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(steps + 1))  # each step once
    assert len(list((out / "tb").iterdir())) == 1  # one TensorBoard events file, not two


# -- 7: one run per folder ----------------------------------------------------------------------

def _snapshot(folder):
    """Every file under ``folder``: size and modification time."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(folder).rglob("*") if p.is_file()}


@pytest.mark.timeout(300)
def test_a_second_run_in_a_busy_folder_is_refused_on_every_rank(tmp_path, cache_dir):
    out = tmp_path / "run"
    steps = 30
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    first = subprocess.Popen([sys.executable, "-m", "shardwise", *map(str, ONE), "--steps",
                              str(steps), "--out", str(out)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    stopped = False
    try:
        deadline = time.time() + 120
        while not (out / "config.toml").is_file():  # the first run has begun writing
            assert first.poll() is None, "the first run ended before it wrote config.toml"
            assert time.time() < deadline, "the first run never wrote config.toml"
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGSTOP)  # frozen mid-run: the folder is busy
        stopped = True
        before = _snapshot(out)
        # the second run: 2 ranks (local launcher), --resume auto (the restart a script would do)
        r = run_cli([*Q, "--dp", "2", "--steps", steps, "--resume", "auto", "--out", out],
                    cache_dir, timeout=150)
        clear_error(r, f"is in use by another run (pid {first.pid} on host "
                       f"{socket.gethostname()}")
        assert _snapshot(out) == before  # the second run wrote nothing there
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
    text, _ = first.communicate(timeout=150)
    assert first.returncode == 0, text[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(steps + 1))  # one run's steps, once


# -- 8: a resume on other data -------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_resume_on_changed_data_is_refused_unless_allowed(tmp_path, cache_dir):
    rng = random.Random(0)
    lines = ["".join(rng.choice("abcdefgh ") for _ in range(60)) for _ in range(60)]
    data = tmp_path / "data.txt"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    base = [*Q, "--data", data, "--out", out]
    r = run_cli([*base, "--dp", "1", "--steps", "2", "--save-every", "1"], cache_dir)
    assert r.returncode == 0, r.stdout[-3000:]
    before = data.read_bytes()
    after = before.translate(bytes.maketrans(b"ab", b"ba"))  # same bytes, newlines, token count
    assert len(after) == len(before) and after != before
    data.write_bytes(after)
    # every rank refuses before any collective (rank 1 of 2 alone would block in the rendezvous)
    t0 = time.time()
    r = run_cli([*base, "--dp", "2", "--steps", "4", "--resume", "auto"], cache_dir, timeout=80,
                env=AS_RANK_1_OF_2)
    clear_error(r, "was saved while training on other data", "--allow-data-change")
    assert time.time() - t0 < 75
    r = run_cli([*base, "--dp", "1", "--steps", "4", "--resume", "auto", "--allow-data-change"],
                cache_dir)
    assert r.returncode == 0 and "--allow-data-change given" in r.stdout, r.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(5))


# -- 12: a full disk during a save; an unwritable checkpoints folder ----------------------------

FSIZE_WRAPPER = ("import resource, runpy, sys; "
                 "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
                 "sys.argv = ['shardwise', *sys.argv[2:]]; "
                 "runpy.run_module('shardwise', run_name='__main__')")


@pytest.mark.timeout(240)
# make test: the DCP data file's limit (the checkpoint's own writer); the RNG file's (torch.save
# alone) is make test-slow's: the error the save reports is built by the same code for both
@pytest.mark.parametrize("limit,causes", [
    pytest.param(8 << 10, ("inline_container.cc",), marks=pytest.mark.slow),  # torch.save (RNG)
    # DCP's data file: DCP writes each tensor with torch.save into the file's stream, so the
    # write that crosses the limit fails in torch.save's zip writer or in the stream's own write
    # ("File too large"), whichever makes it: seen both ways on this machine and a fresh clone
    (24 << 10, ("File too large", "inline_container.cc"))])
def test_a_full_disk_during_a_save_is_a_clear_error(tmp_path, cache_dir, monkeypatch, limit,
                                                    causes):
    """A file-size limit (RLIMIT_FSIZE, unprivileged, honoured by root too) makes the real
    writers fail as on a full disk, once a file outgrows ``limit``: the RNG file (14 KB) with
    torch.save's raw ``enforce fail at inline_container.cc``, or DCP's data file (the tiny
    model's are 11–53 KB, its first 34 KB: each rank's boxes go into files of at most its
    largest box, checkpoint/save.py)."""
    from shardwise.data import prepare_lm_data

    monkeypatch.setenv("SHARDWISE_CACHE", str(cache_dir))
    prepare_lm_data(None, "bytes", seq_len=16)  # the token cache exists before the limit
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", FSIZE_WRAPPER, str(limit), *map(str, ONE), "--steps", "2",
           "--save-every", "1", "--out", str(out)]
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=200)
    clear_error(r, f"checkpoint step 1: cannot write {out / 'checkpoints' / 'step_1.tmp'}",
                "MiB free on its file system", "choose another --out")
    assert any(c in r.stdout for c in causes), r.stdout[-3000:]  # the writer's own error, named
    assert list((out / "checkpoints").iterdir()) == []  # the partial save was removed


@pytest.mark.timeout(120)
def test_an_unwritable_checkpoints_folder_is_refused_before_the_run(tmp_path, cache_dir):
    out = tmp_path / "run"
    ck = out / "checkpoints"
    ck.mkdir(parents=True)
    ck.chmod(0o500)
    try:
        (ck / "probe").mkdir()  # root (or a file system that ignores modes) can still write
        (ck / "probe").rmdir()
        ck.chmod(0o700)
        ck.rmdir()
        ck.write_text("")  # then make it a regular file: step_N's parent is not a folder
        want = f"{ck} is a file, not a folder"
    except PermissionError:
        want = f"{ck} is not writable by this process"
    t0 = time.time()
    r = run_cli([*Q, "--dp", "2", "--steps", "2", "--out", out], cache_dir, timeout=80,
                env=AS_RANK_1_OF_2)
    if ck.is_dir():
        ck.chmod(0o700)
    clear_error(r, want, "choose another --out")
    assert time.time() - t0 < 75  # refused before the rendezvous, on a rank other than 0
