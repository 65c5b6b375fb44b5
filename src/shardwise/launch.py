"""Start the workers: under torchrun use its environment; alone, run them on localhost under
PyTorch's elastic agent (the one torchrun runs).

:func:`spawn` starts ``nproc`` copies of ``python -m shardwise <argv>`` through
:func:`torch.distributed.launcher.api.elastic_launch` with torchrun ``--standalone``'s
rendezvous (c10d on a port the agent binds itself, so no port race), ``OMP_NUM_THREADS=1`` each
(two threads per worker on two cores measured 3–6× slower), every line they print prefixed with
their rank. When any worker fails, the agent stops the others at once (SIGTERM, then SIGKILL) and
its exit code is returned: a failure never leaves the rest waiting in a collective until the
timeout; with ``max_restarts`` the agent restarts them all instead (``shardwise train
--max-restarts N --resume auto``). Workers never outlive the launcher: each one asks the kernel
for SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread that watches the
parent), so a launcher killed by any signal (SIGKILL included, or SIGHUP from a closed terminal)
takes its workers with it; on SIGTERM and SIGHUP the agent stops its workers first, as on Ctrl-C.

On CPU the workers are forked from the launcher (``fork=True``: the agent's ``start_method=
"fork"``) instead of started as new interpreters: each new interpreter spends about 3 s of CPU
importing torch and the parts of it a run needs (``torch._dynamo`` alone, which every torch
optimizer imports, about 1.4 s), and on a small machine that is most of a short run. The launcher
imports them once (:data:`PRELOAD`) and the forked workers share the pages. A fork is taken only
when it is safe: the launcher has run no multi-threaded torch op (intra-op threads = 1), has not
initialised CUDA, and has started no thread of its own. Otherwise, and on GPU, a new interpreter
is started (the agent's subprocess path). Measured for a 2-rank all-reduce from a shell, 2 cores:
the elastic agent forking 2.95 s, our own former fork launcher 2.88 s, the agent starting new
interpreters 13.35 s.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import io
import os
import signal
import sys
import threading
import time
import traceback


# what torch's env:// rendezvous reads; torchrun and spawn set every one of them
WORLD_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_worker() -> bool:
    """True inside a launched world (torchrun or :func:`spawn`): WORLD_SIZE is set. Raises
    :class:`~shardwise.errors.ShardwiseConfigError` for WORLD_SIZE without the rest of
    :data:`WORLD_VARS` (e.g. ``export WORLD_SIZE=2`` left in a shell): taken for a worker, the
    process would stop in torch's rendezvous with "RANK expected, but not set"."""
    if "WORLD_SIZE" not in os.environ:
        return False
    missing = [k for k in WORLD_VARS if k not in os.environ]
    if missing:
        from .errors import ShardwiseConfigError

        raise ShardwiseConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: a partial torchrun environment (a "
            "variable left in this shell?), so this process would wait as one rank of a world "
            "no launcher started: unset WORLD_SIZE (shardwise then starts the ranks itself), or "
            "run under torchrun")
    return True


# What a worker imports anyway, imported once by a forking launcher (see the module docstring).
PRELOAD = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "shardwise.parallel", "shardwise.train.loop",
           "shardwise.tools.verify")


_watching = False  # watch_launcher has run in this process


def watch_launcher() -> None:
    """In a worker of :func:`spawn` (``SHARDWISE_LAUNCHER_PID`` set): die with the launcher.
    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; elsewhere a daemon thread polls ``getppid()``
    each second. If the launcher is already gone when this runs, exit at once (status 1)."""
    global _watching
    launcher = os.environ.get("SHARDWISE_LAUNCHER_PID")
    if not launcher or "WORLD_SIZE" not in os.environ or _watching:
        return
    _watching = True
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):  # no libc prctl: fall back to the thread
            armed = False
    if os.getppid() != int(launcher):  # it died before the request took effect
        os._exit(1)
    if not armed:
        def watch():
            while os.getppid() == int(launcher):
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="shardwise-launcher-watch", daemon=True).start()


def can_fork() -> bool:
    """Whether forking workers from this process is safe (see the module docstring): a POSIX
    fork exists, torch runs one intra-op thread (no OpenMP pool to inherit half-alive), CUDA is
    not initialised, and this process runs no other Python thread. ``SHARDWISE_FORK=0`` in the
    environment turns forking off (new interpreters, as on GPU)."""
    import torch

    return (hasattr(os, "fork") and os.environ.get("SHARDWISE_FORK", "1") != "0"
            and torch.get_num_threads() == 1
            and not torch.cuda.is_initialized() and threading.active_count() == 1)


def _forked_worker(argv: list[str], env: dict, script: str | None) -> int:
    """The entry point of a worker forked by the elastic agent (``start_method="fork"``), after
    the agent has set this rank's RANK, WORLD_SIZE, … and pointed stdout and stderr at its log
    files: its own session (as ``start_new_session``; a terminal's Ctrl-C goes to the launcher,
    which stops the workers), the caller's environment ``env`` on top, unbuffered output (as
    PYTHONUNBUFFERED), default signal handlers (the agent's and the launcher's are inherited;
    with ``SHARDWISE_STACKS_ON_STOP=1`` SIGTERM prints the Python stack first), the launcher's
    store as the world's (``SHARDWISE_WORLD_STORE``: MASTER_ADDR and MASTER_PORT point at it,
    with TORCHELASTIC_USE_AGENT_STORE=True, as the agent's own would), the launcher watch;
    then ``python -m shardwise *argv`` (its ``__main__``; or the Python file ``script`` as
    ``__main__`` with ``argv``, as ``python script *argv`` would). Returns 0; with any other
    status it calls ``os._exit`` (no handler of the launcher's runs here)."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding=sys.stderr.encoding, errors="backslashreplace")
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher's (_Exits) is not ours
        os.environ.update({k: v for k, v in env.items() if k not in _AGENT_VARS})
        if os.environ.get("SHARDWISE_STACKS_ON_STOP") == "1":  # print it when stopped
            import faulthandler

            faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        store = env.get("SHARDWISE_WORLD_STORE")
        if store:  # the launcher's store (_StoreServer), which outlives every attempt
            host, port = store.rsplit(":", 1)
            os.environ.update(MASTER_ADDR=host, MASTER_PORT=port,
                              TORCHELASTIC_USE_AGENT_STORE="True")
        watch_launcher()  # reads SHARDWISE_LAUNCHER_PID from the worker's own environment
        import runpy

        if script is None:  # as ``python -m shardwise *argv``: its __main__ exits with the code
            sys.argv = ["shardwise", *argv]
            runpy.run_module("shardwise", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # argparse and friends
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's last words, then exit
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code != 0:
            os._exit(code if isinstance(code, int) else 1)
    return 0  # the agent collects it (an os._exit(0) would leave it waiting for the value)


# What the elastic agent sets for each rank; the caller's environment never overrides them.
_AGENT_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


class _environ:
    """``with _environ(overrides):`` os.environ with ``overrides`` set, restored on exit."""

    def __init__(self, overrides: dict):
        self.overrides, self.saved = overrides, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.overrides}
        os.environ.update(self.overrides)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _last_lines(logs: str, rank: int, n: int = 25) -> list[str]:
    """The last ``n`` lines local rank ``rank`` wrote in its latest attempt: its stderr log,
    else its stdout log (the agent keeps them as ``<logs>/<run>/attempt_<k>/<rank>/*.log``)."""
    attempts = sorted(glob.glob(os.path.join(logs, "*", "attempt_*", str(rank))),
                      key=lambda d: int(d.split("attempt_")[-1].split(os.sep)[0]))
    for name in ("stderr.log", "stdout.log"):
        try:
            with open(os.path.join(attempts[-1], name), errors="replace") as f:
                lines = f.read().splitlines()
        except (OSError, IndexError):
            continue
        if lines:
            return lines[-n:]
    return []


STORE_PROCESS_NAME = "shardwise-store"  # the launcher's store server process (/proc/PID/comm)


class _StoreServer:
    """The launcher's TCPStore, served on a free localhost port by a child process forked
    before the agent starts, so that it outlives every rank: the ranks' collective checks
    publish their reports in it (``SHARDWISE_DIAG_STORE``; :mod:`shardwise.comm.fingerprint`)
    and name the folder of their position files (``SHARDWISE_DIAG_DIR``), read after a failure
    (:func:`_diagnose`; the launcher connects as a client only then); and, when the workers are
    forked, it is also the rendezvous store and the workers' store
    (``SHARDWISE_WORLD_STORE``), so that the agent serves no store itself.

    Why a process of its own: a TCPStore server runs a thread (``pt_tcpstore_uv``) that answers
    the ranks, and the agent would serve two (rendezvous, workers) in the launcher, which forks
    the workers while those threads answer the ranks forked before. A process forked while
    another thread runs inherits every lock that thread held at that instant, held for good: a
    worker can stop for ever at its first touch of one (a rank that never publishes its gloo
    address, its peers' ``DistStoreError: wait timeout``; or one that never exits). With the
    stores here, the launcher forks with no thread running but the rendezvous keep-alive's,
    asleep (its period is set past any run: one node has no peer to watch it)."""

    def __init__(self, port: int, pid: int, timeout_s: float):
        self.port, self.pid, self.timeout_s = port, pid, timeout_s

    @classmethod
    def start(cls, timeout_s: float) -> "_StoreServer | None":
        """The served store, or None if it cannot be started (then the ranks use the default
        store and only they diagnose, and the agent serves the rendezvous as torchrun does)."""
        import datetime

        try:
            r, w = os.pipe()
            parent, pid = os.getpid(), os.fork()
        except OSError:
            return None
        if pid == 0:  # the server: until the launcher is gone
            try:
                os.close(r)
                if sys.platform.startswith("linux"):  # named apart from the workers; dies
                    libc = ctypes.CDLL(None)  # with the launcher (and polls, below)
                    libc.prctl(15, STORE_PROCESS_NAME.encode(), 0, 0, 0)  # PR_SET_NAME
                    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
                import torch.distributed as dist

                store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
                os.write(w, str(store.port).encode())
                os.close(w)
                while os.getppid() == parent:
                    time.sleep(0.2)
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            text = f.read()
        if not text.isdigit():  # the child could not serve it
            os.waitpid(pid, 0)
            return None
        return cls(int(text), pid, timeout_s)

    def client(self):
        import datetime

        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             timeout=datetime.timedelta(seconds=max(self.timeout_s, 1.0)))

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except OSError:
            pass


class _Exits:
    """``with _Exits() as exits:`` the exit status of every child of this process, recorded the
    moment it dies, in the order they died (:attr:`died`): a SIGCHLD handler looks at each
    dead child with ``waitid(…, WNOWAIT)``, which leaves it for the agent to reap.

    Why: with forked workers the agent reports one failure only, the lowest-numbered rank of
    those already dead when it looks (every ``monitor_interval``, 0.1 s; later on a loaded
    machine), not the first to die. A rank killed by SIGKILL breaks its peers' gloo waits at
    once, and a peer that exits on that error (status 1) before the agent looks is reported
    in its place: the rank that died, and its signal, would be lost. The handler runs in the
    main thread, where the agent reaps its children, so a child is looked at before the agent
    can reap it (between the kernel's SIGCHLD and the handler the agent's thread would have to
    be inside the very ``waitpid`` of that child). Linux only (the children are read from
    ``/proc/self/task/*/children``), main thread only; elsewhere nothing is recorded and the
    agent's report stands."""

    def __init__(self):
        self.died: list[tuple[int, int, float]] = []  # (pid, exit code or -signal, monotonic s)
        self._seen: set[int] = set()  # dead children recorded and not yet reaped
        self._old = None

    def __enter__(self) -> "_Exits":
        if sys.platform.startswith("linux") and hasattr(os, "waitid") and \
                threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGCHLD, self._on_sigchld)
            signal.siginterrupt(signal.SIGCHLD, False)  # system calls it interrupts restart
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGCHLD, self._old)
            self._old = None

    def _on_sigchld(self, signum, frame) -> None:
        # it runs wherever the main thread was interrupted: no import, no lock, no output
        now, kids = time.monotonic(), set()
        for name in glob.glob("/proc/self/task/*/children"):
            try:
                with open(name) as f:
                    kids.update(int(pid) for pid in f.read().split())
            except (OSError, ValueError):
                pass
        self._seen &= kids  # reaped since: its pid may come back as a new child's
        for pid in sorted(kids - self._seen):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped meanwhile
                continue
            if info is None:  # alive
                continue
            self._seen.add(pid)
            self.died.append((pid, info.si_status if info.si_code == os.CLD_EXITED
                              else -info.si_status, now))


def _failed_first(failed: dict, reported_pid: int | None, died: list,
                  positions: dict) -> tuple[dict, int | None]:
    """``failed`` (global rank → exit code, as the agent reported it) completed with every rank
    whose death :class:`_Exits` recorded (``died``) no later than that of the rank the agent
    reported (``reported_pid``): those failed by themselves, since the agent stops the others
    only after it saw a failure; and the first of them to fail (None: not known). A rank is
    known by the pid of its position (``positions``: global rank → its position in the
    store); the ranks that published none keep the agent's report."""
    last = {pid: (code, t) for pid, code, t in died}  # a pid's latest death
    if reported_pid not in last:
        return failed, None
    rank_of = {p["pid"]: r for r, p in positions.items() if p.get("pid") in last}
    out, when = dict(failed), {}
    for pid, r in rank_of.items():
        code, t = last[pid]
        if code != 0 and t <= last[reported_pid][1]:
            out.setdefault(r, code)
            when[r] = t
    reported = rank_of.get(reported_pid)
    first = min(when, key=lambda r: (when[r], r != reported, r)) if when else None
    return out, first


def _diagnose(store, failed: dict, exits: _Exits | None = None,
              reported_pid: int | None = None) -> tuple[str | None, dict, int | None]:
    """One line from every rank's position in ``store`` (the :class:`_StoreServer`) after the
    ranks ``failed`` (global rank → exit code, as the agent reported them: the pid of that
    rank ``reported_pid``) failed, with ``failed`` completed from the deaths ``exits``
    recorded (:func:`_failed_first`); also written, with the positions, to
    ``FLIGHT/diagnosis.json`` when the ranks have a flight folder (``RUN/flight``: ``shardwise
    doctor RUN`` reads it). Returns (the line, or None when the ranks published nothing (no
    collective checks); the failures as completed; the first rank to fail, None: the agent's)."""
    import json

    if store is None:
        return None, failed, None
    try:  # a lazy import: the launcher needs the checks' reading only after a failure
        from .comm.diagnosis import diagnose_store, store_positions

        client = store.client()
        first = None
        if exits is not None:
            failed, first = _failed_first(failed, reported_pid, exits.died,
                                          store_positions(client))
        line, record = diagnose_store(client, failed, first)
    except Exception as e:  # noqa: BLE001 - never hide the failure itself behind ours
        return f"(no diagnosis: reading the ranks' positions failed: {e})", failed, None
    dirs = {p.get("flight_dir") for p in record.get("positions", {}).values()} - {None}
    for d in dirs:
        try:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "diagnosis.json"), "w") as f:
                json.dump(record, f, indent=1)
        except OSError:
            pass
    return line, failed, first


def spawn(argv: list[str], nproc: int, env: dict | None = None, grace_s: float = 5.0,
          program: list[str] | None = None, fork: bool = False, max_restarts: int = 0) -> int:
    """Run ``program *argv`` (default ``python -m shardwise``) as ``nproc`` local ranks under
    PyTorch's elastic agent (:func:`torch.distributed.launcher.api.elastic_launch`, the agent
    torchrun runs; ``--standalone``'s rendezvous: c10d on a port the agent binds itself); return
    0, or the exit code of the first rank that failed (128 + N for signal N; the first to die
    as :class:`_Exits` recorded it, where the agent reported a later one), after the agent has
    stopped the others (SIGTERM, then SIGKILL after ``grace_s`` seconds).

    ``fork``: run ``python -m shardwise *argv`` (or, for ``program = [python, script.py]``, the
    script) in workers forked from this process (:func:`_forked_worker`), only where
    :func:`can_fork`; else new interpreters. Use it for CPU runs; a GPU run starts new
    interpreters. ``max_restarts``: the agent restarts all ranks up to that many times after a
    failure (``TORCHELASTIC_RESTART_COUNT`` tells a worker which attempt it is).

    Every line a rank prints is echoed with ``[rank r] `` in front (stdout to stdout, stderr to
    stderr). With ``SHARDWISE_STACKS_ON_STOP=1`` (in ``env`` or this environment) and forked
    workers, after a failure the top of the Python stack of each rank the agent stopped is
    printed too (``[launcher] rank r was stopped here:``). SIGTERM, SIGHUP and Ctrl-C of the
    launcher stop the workers (exit 128 + signal), and a launcher killed outright (SIGKILL)
    takes them with it (:func:`watch_launcher`)."""
    import logging
    import shutil
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    program = program or [sys.executable, "-m", "shardwise"]
    overlay = {**(env or {})}
    overlay.update(OMP_NUM_THREADS=overlay.get("OMP_NUM_THREADS",
                                               os.environ.get("OMP_NUM_THREADS", "1")),
                   PYTHONUNBUFFERED="1", SHARDWISE_LAUNCHER="1",
                   SHARDWISE_LAUNCHER_PID=str(os.getpid()))
    if sys.stderr.isatty():
        overlay["SHARDWISE_TTY"] = "1"
    for k in _AGENT_VARS:
        overlay.pop(k, None)
    script = program[1] if (len(program) == 2 and program[0] == sys.executable
                            and program[1].endswith(".py")) else None
    forked = fork and (script or program == [sys.executable, "-m", "shardwise"]) and can_fork()
    stacks = forked and (overlay.get("SHARDWISE_STACKS_ON_STOP")
                         or os.environ.get("SHARDWISE_STACKS_ON_STOP")) == "1"
    if forked:
        for name in PRELOAD:  # once here instead of once per worker
            importlib.import_module(name)
        # HF tokenizers (the launcher may have trained one) warns in every fork after its
        # thread pool ran, and a pool does not survive a fork: workers encode single-threaded
        overlay.setdefault("TOKENIZERS_PARALLELISM",
                           os.environ.setdefault("TOKENIZERS_PARALLELISM", "false"))
        entrypoint, args = _forked_worker, (list(argv), overlay, script)
    else:
        entrypoint, args = program[0], (*program[1:], *argv)
    # the ranks' collective checks publish their reports in a store of ours, which outlives
    # every rank: after a failure we read it and print one line (:func:`_diagnose`)
    diag = _StoreServer.start(grace_s)
    rdzv, launcher_env = dict(endpoint="127.0.0.1:0", configs={}), {}
    if diag is not None:
        overlay["SHARDWISE_DIAG_STORE"] = f"127.0.0.1:{diag.port}"
        if forked:  # the agent serves no store (no thread of it in the forks): ours serves both
            overlay["SHARDWISE_WORLD_STORE"] = f"127.0.0.1:{diag.port}"
            rdzv = dict(endpoint=f"127.0.0.1:{diag.port}",
                        configs={"is_host": False, "keep_alive_interval": 24 * 3600})
            launcher_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    logs = tempfile.mkdtemp(prefix="shardwise-launch-")
    if diag is not None:  # and write their positions, twice per gloo collective, into files
        # of ours: a copy in memory each instead of a store set (comm/positions.py)
        overlay["SHARDWISE_DIAG_DIR"] = os.path.join(logs, "positions")
        os.makedirs(overlay["SHARDWISE_DIAG_DIR"])
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=rdzv["endpoint"], rdzv_configs=rdzv["configs"],
        max_restarts=max_restarts,
        monitor_interval=0.1, start_method="fork" if forked else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs, tee=Std.ALL),
        log_line_prefix_template="[rank ${rank}] ", shutdown_timeout=max(1, round(grace_s)))
    # the agent's own log lines (its failure reports come with a Python traceback of the agent)
    # give way to one line of ours; what the ranks print is echoed in full
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing",
                                            "torch.distributed.launcher")]
    levels = [lg.level for lg in quiet]
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                           signal.SIGHUP, signal.SIGQUIT)}
    code = 0
    exits = _Exits()  # every rank's exit as it happens: the agent reports only one
    try:
        for lg in quiet:
            lg.setLevel(logging.CRITICAL)
        with _environ(launcher_env if forked else overlay), exits:  # a fork sets its own
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        seen, failure = e.get_first_failure()
        line, failed, first = _diagnose(diag, {r: f.exitcode for r, f in e.failures.items()},
                                        exits, failure.pid)
        rank, why = seen, "the first failure the agent saw"
        if first is not None and first != seen:  # it died before the rank the agent reported
            rank, why = first, (f"the first to fail; the agent reported rank {seen}, which "
                                f"failed later")
        exitcode = failed[rank]
        code = exitcode if exitcode >= 0 else 128 - exitcode
        sys.stdout.flush()
        local = failure.local_rank + rank - seen  # one node: local and global ranks are equal
        last = "".join(f"[rank {rank}] {ln}\n" for ln in _last_lines(logs, local))
        sys.stderr.write(f"[launcher] rank {rank} failed (exit code {code}; {why}); any rank "
                         f"still running was stopped. Its last lines:\n{last}")
        if line:
            sys.stderr.write(f"[launcher] diagnosis: {line}\n")
        if stacks:  # the Python stacks the stopped ranks printed (faulthandler, on SIGTERM)
            for r in range(nproc):
                tail = _last_lines(logs, r, 60)
                start = next((i for i, ln in enumerate(tail) if ln.startswith(
                    ("Thread 0x", "Current thread 0x"))), None)
                if r != local and start is not None:
                    sys.stderr.write(f"[launcher] rank {r} was stopped here:\n" + "".join(
                        f"[rank {r}] {ln}\n" for ln in tail[start:start + 13]))
        sys.stderr.flush()
    except SignalException as stop:
        code = 128 + int(stop.sigval)
        print(f"[launcher] {signal.Signals(stop.sigval).name}: stopped the {nproc} rank(s)",
              file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = 130
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(logs, ignore_errors=True)  # and the position files
        if diag is not None:
            diag.stop()
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.launch --nproc N SCRIPT [ARGS...]``: run a Python file as N local
    gloo ranks (forked from this launcher: :func:`spawn` with ``fork=True``). The test suite's
    worker worlds start this way; exit code as :func:`spawn`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m shardwise.launch")
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    return spawn(a.args, a.nproc, program=[sys.executable, a.script], fork=True)


if __name__ == "__main__":
    sys.exit(main())
