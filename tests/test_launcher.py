"""The local launcher (``shardwise.launch.spawn``): its workers never outlive it, whatever stops it
(issue: after ``kill`` of the launcher both workers kept training). Each case starts a 2-rank run
that would take minutes, waits until it trains, signals the launcher, and then looks for any
process still running the run's command line."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _pids_of(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((ln for ln in (d / "status").read_text().splitlines()
                              if ln.startswith("State:")), "")
            except OSError:
                continue
            if marker in cmd and "zombie" not in state:
                out.append(int(d.name))
    return out


def _is_store_server(pid: int) -> bool:
    """The launcher's store server (a child of the launcher, not a worker)."""
    from shardwise.launch import STORE_PROCESS_NAME

    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip() == STORE_PROCESS_NAME
    except OSError:
        return False


def _signal_and_expect_no_worker(launcher, marker: str, sig) -> None:
    """Check 2 workers run (processes with ``marker`` in their command line, not the launcher
    nor its store server), send ``sig`` to the launcher, and fail if any of them
    (the server included) is still alive 10 s after it exited."""
    workers = [p for p in _pids_of(marker) if p != launcher.pid and not _is_store_server(p)]
    assert len(workers) == 2, f"expected 2 workers running, found {workers}"
    launcher.send_signal(sig)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _pids_of(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _pids_of(marker)
    assert not left, f"workers {left} still run 10 s after the launcher got {sig.name}"


def _kill_all(launcher, marker: str) -> None:
    for pid in [launcher.pid, *_pids_of(marker)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
@pytest.mark.timeout(180)
# make test: SIGTERM (the handler) with forked workers, SIGKILL with new interpreters; SIGHUP
# (SIGTERM's handler) and SIGKILL with forked workers (also test_forked_script_workers_die_with_
# their_launcher's) are make test-slow's
@pytest.mark.parametrize("sig,fork", [pytest.param(signal.SIGKILL, "1", marks=pytest.mark.slow),
                                      (signal.SIGTERM, "1"),
                                      pytest.param(signal.SIGHUP, "1", marks=pytest.mark.slow),
                                      (signal.SIGKILL, "0")])
def test_no_worker_outlives_its_launcher(sig, fork, tmp_path, cache_dir):
    """Workers forked from the launcher (SHARDWISE_FORK=1, CPU) and started as new interpreters
    (=0, as on GPU): after SIGKILL (no handler can run), SIGTERM and SIGHUP of the launcher."""
    out = tmp_path / f"run-{sig.name}"
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1",
           "SHARDWISE_FORK": fork}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "SHARDWISE_LAUNCHER_PID"):
        env.pop(k, None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardwise", "train", "--model", "tiny", "--tokenizer", "bytes",
         "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--dp", "2",
         "--steps", "100000", "--log-every", "1", "--eval-every", "100000", "--out", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None, f"the run ended early (exit {launcher.returncode})"
            assert time.monotonic() < deadline, "the run did not start training in 120 s"
            time.sleep(0.2)
        _signal_and_expect_no_worker(launcher, str(out), sig)
        if sig != signal.SIGKILL:  # stopped by the launcher itself, with the shell's code
            assert launcher.returncode == 128 + sig
    finally:
        _kill_all(launcher, str(out))


SCRIPT = '''
import pathlib, sys, time
import torch.distributed as dist
from shardwise.topology import init_distributed
init_distributed("cpu", timeout_s=30)
beat = pathlib.Path(sys.argv[1]) / f"beat{dist.get_rank()}"
while True:  # runs until something stops it
    beat.write_text(str(time.time()))
    time.sleep(0.2)
'''


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
@pytest.mark.timeout(120)
def test_forked_script_workers_die_with_their_launcher(tmp_path):
    """``python -m shardwise.launch --nproc 2 script.py`` (how the suite starts its worker
    worlds): the forked script workers die too when the launcher gets SIGKILL. (They were not
    watched: the watch was armed before the worker's own environment was set.)"""
    script = tmp_path / "forever.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in (
        "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
        "SHARDWISE_LAUNCHER_PID")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_FORK="1")
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise.launch", "--nproc", "2",
                                 str(script), str(tmp_path)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"beat{r}").exists() for r in range(2)):
            assert launcher.poll() is None, f"the world ended early (exit {launcher.returncode})"
            assert time.monotonic() < deadline, "the workers did not start in 60 s"
            time.sleep(0.2)
        _signal_and_expect_no_worker(launcher, str(script), signal.SIGKILL)
    finally:
        _kill_all(launcher, str(script))


# -- the exit statuses the launcher records itself (the agent reports one failure only) --------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="records on Linux only")
@pytest.mark.timeout(60)
def test_exits_records_each_child_as_it_dies_and_leaves_it_to_be_reaped():
    """Two children: the first SIGKILLs itself, the second exits with status 1 once the first
    is recorded. ``_Exits`` records both, in that order, with the agent's convention (negative:
    the signal), and reaps neither: ``waitpid`` still gets each status (as the agent will)."""
    import threading

    from shardwise.launch import _Exits

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")

    def child(die):
        pid = os.fork()
        if pid == 0:
            die()
        return pid

    def recorded(n):
        deadline = time.monotonic() + 20
        while len(exits.died) < n:
            assert time.monotonic() < deadline, exits.died
            time.sleep(0.01)

    with _Exits() as exits:
        killed = child(lambda: os.kill(os.getpid(), signal.SIGKILL))
        recorded(1)
        failed = child(lambda: os._exit(1))
        recorded(2)
    assert [(pid, code) for pid, code, _ in exits.died] == [(killed, -9), (failed, 1)]
    assert exits.died[0][2] <= exits.died[1][2]
    assert os.waitstatus_to_exitcode(os.waitpid(killed, 0)[1]) == -9
    assert os.waitstatus_to_exitcode(os.waitpid(failed, 0)[1]) == 1


def test_failed_first_names_the_rank_that_died_before_the_one_the_agent_reported():
    """Rank 2 was killed (pid 102, at 1.0 s); ranks 0 and 1 exited with status 1 on its broken
    connection (1.2 s, 1.3 s), and the agent looked late: it reports rank 0, the
    lowest-numbered of the dead. The report gains rank 2, the first to fail, and not rank 1,
    which died after the reported rank (it may have been stopped by the agent)."""
    from shardwise.launch import _failed_first

    died = [(102, -9, 1.0), (100, 1, 1.2), (101, 1, 1.3), (555, 0, 0.5)]  # 555: no rank
    positions = {r: {"rank": r, "pid": 100 + r} for r in range(3)}
    assert _failed_first({0: 1}, 100, died, positions) == ({0: 1, 2: -9}, 2)
    # the agent saw rank 2 itself: nothing to add
    assert _failed_first({2: -9}, 102, died, positions) == ({2: -9}, 2)
    # no record of the reported rank (another platform, or a thread): its report stands
    assert _failed_first({0: 1}, 100, [], positions) == ({0: 1}, None)
    # a rank with no position (it died before its first collective) cannot be placed
    assert _failed_first({0: 1}, 100, died, {0: positions[0]}) == ({0: 1}, 0)


# -- forking safely, and where a stopped rank was ----------------------------------------------

AT_FORK = '''
import os, sys
from shardwise import launch
def before():  # the launcher's threads at each fork: (name, kernel wait channel)
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    print("FORK", len(tasks), ",".join(sorted(names)), file=sys.__stderr__, flush=True)
os.register_at_fork(before=before)
sys.exit(launch.main(sys.argv[1:]))
'''

STUCK = '''
import os, time
def stuck_here():
    time.sleep(600)
if os.environ["RANK"] == "1":
    stuck_here()
if os.environ["RANK"] == "0":
    time.sleep(3)  # rank 1 is in stuck_here by then
    raise SystemExit(3)
'''


def _launch(tmp_path, wrapper: str | None, script: str, arg: str, **extra):
    (tmp_path / "w.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in (
        "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
        "SHARDWISE_LAUNCHER_PID")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_FORK="1", **extra)
    head = [str(tmp_path / "at_fork.py")] if wrapper else ["-m", "shardwise.launch"]
    if wrapper:
        (tmp_path / "at_fork.py").write_text(wrapper)
    return subprocess.run([sys.executable, *head, "--nproc", "4", str(tmp_path / "w.py"), arg],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.timeout(150)
def test_workers_are_forked_while_no_store_thread_runs(tmp_path):
    """Each worker fork happens with at most one thread besides the forking one (the
    rendezvous keep-alive, asleep) and no TCPStore server thread (``pt_tcpstore_uv``): the
    stores are served by the launcher's store process. With the agent's own stores there were
    four threads, two of them store servers answering the ranks already forked; a fork then
    can leave a rank stuck for ever on a lock one of them held (the suite's rare world that
    hung, or timed out waiting for one rank's gloo address)."""
    r = _launch(tmp_path, AT_FORK, "import torch.distributed as dist\n"
                "from shardwise.topology import init_distributed\n"
                "init_distributed('cpu', timeout_s=60)\ndist.barrier()\n"
                "dist.destroy_process_group()\n", "ok")
    assert r.returncode == 0, r.stdout[-3000:]
    forks = [ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("FORK")]
    # the store server's fork (before the agent: one thread), then one fork per rank
    assert len(forks) == 5, r.stdout[-3000:]
    for n, names in forks:
        assert int(n) <= 2 and "pt_tcpstore_uv" not in names, forks


@pytest.mark.timeout(150)
def test_a_rank_the_launcher_stops_prints_where_it_was(tmp_path):
    """Rank 0 exits 3 while rank 1 sleeps in ``stuck_here``: the agent stops rank 1, and with
    SHARDWISE_STACKS_ON_STOP=1 (as the suite's worlds run) the launcher prints the top of its
    Python stack, which names ``stuck_here``."""
    r = _launch(tmp_path, None, STUCK, "-", SHARDWISE_STACKS_ON_STOP="1")
    assert r.returncode == 3, r.stdout[-3000:]
    assert "[launcher] rank 1 was stopped here:" in r.stdout, r.stdout[-3000:]
    stopped = r.stdout.split("[launcher] rank 1 was stopped here:")[1].split("[launcher]")[0]
    assert "in stuck_here" in stopped, r.stdout[-3000:]
