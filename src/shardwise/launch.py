"""Start the workers: under torchrun use its environment; alone, spawn them on localhost.

:func:`spawn` starts ``nproc`` copies of ``python -m shardwise <argv>`` with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port),
``OMP_NUM_THREADS=1`` each (two threads per worker on two cores measured 3–6× slower), and
prefixes every line they print with their rank. When any worker exits non-zero, the others are
stopped at once (SIGTERM, then SIGKILL) and its exit code is returned: a failure never leaves the
rest waiting in a collective until the timeout. Workers never outlive the launcher: each one asks
the kernel for SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread that
watches the parent), so a launcher killed by any signal (SIGKILL included, or SIGHUP from a closed
terminal) takes its workers with it; on SIGTERM and SIGHUP the launcher stops its workers first,
as on Ctrl-C.

On CPU the workers are forked from the launcher (``fork=True``) instead of started as new
interpreters: each new interpreter spends about 3 s of CPU importing torch and the parts of it a
run needs (``torch._dynamo`` alone, which every torch optimizer imports, about 1.4 s), and on a
small machine that is most of a short run. The launcher imports them once (:data:`PRELOAD`) and the
forked workers share the pages. A fork is taken only when it is safe: the launcher has run no
multi-threaded torch op (intra-op threads = 1), has not initialised CUDA, and has started no
thread of its own (the output threads start after the last fork). Otherwise, and on GPU, a new
interpreter is started as before.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from .topology import free_port


def is_worker() -> bool:
    """True inside a launched world (torchrun or :func:`spawn`): WORLD_SIZE is set."""
    return "WORLD_SIZE" in os.environ


# What a worker imports anyway, imported once by a forking launcher (see the module docstring).
PRELOAD = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "shardwise.parallel", "shardwise.train.loop",
           "shardwise.verify")


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


class _Stopped(Exception):
    """Raised in the launcher by a SIGTERM or SIGHUP handler while it waits for its workers."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


def can_fork() -> bool:
    """Whether forking workers from this process is safe (see the module docstring): a POSIX
    fork exists, torch runs one intra-op thread (no OpenMP pool to inherit half-alive), CUDA is
    not initialised, and this process runs no other Python thread. ``SHARDWISE_FORK=0`` in the
    environment turns forking off (new interpreters, as on GPU)."""
    import torch

    return (hasattr(os, "fork") and os.environ.get("SHARDWISE_FORK", "1") != "0"
            and torch.get_num_threads() == 1
            and not torch.cuda.is_initialized() and threading.active_count() == 1)


class _Forked:
    """A forked worker with the part of ``subprocess.Popen``'s interface :func:`spawn` uses:
    ``pid``, ``stdout`` (the read end of its output pipe), ``poll()`` and ``wait(timeout)``
    (return codes as Popen gives them: negative = killed by that signal)."""

    def __init__(self, argv: list[str], env: dict, script: str | None = None):
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the launcher's code
            os.close(read)
            _worker_main(argv, env, write, script)
        os.close(write)
        self.pid, self.returncode = pid, None
        self.stdout = os.fdopen(read, "rb", buffering=0)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def _worker_main(argv: list[str], env: dict, out_fd: int, script: str | None = None) -> None:
    """Body of a forked worker: its own session (as ``start_new_session``), the environment
    ``env``, stdout and stderr into ``out_fd`` unbuffered (as PYTHONUNBUFFERED), default signal
    handlers; then ``shardwise.cli.main(argv)`` (or the Python file ``script`` as ``__main__``
    with ``argv``, as ``python script *argv`` would) and ``os._exit`` with its code (no atexit
    handler of the launcher runs here)."""
    code = 1
    try:
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding=sys.stderr.encoding, errors="backslashreplace")
        os.environ.clear()
        os.environ.update(env)
        watch_launcher()  # reads SHARDWISE_LAUNCHER_PID from the worker's own environment
        if script is None:
            from .cli import main

            code = main(argv)
        else:
            import runpy

            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as e:  # argparse and friends
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's last words, then exit
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _forward(stream, rank: int, sink, tail: collections.deque) -> None:
    """Copy a worker's output to ``sink``, starting every line with ``[rank r] ``; keep the last
    lines in ``tail``."""
    prefix = f"[rank {rank}] ".encode()
    at_line_start = True
    while True:
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        out = bytearray()
        for byte in chunk:
            if at_line_start and byte not in (10, 13):
                out += prefix
                at_line_start = False
            out.append(byte)
            if byte in (10, 13):  # \n, and \r for progress-bar redraws
                at_line_start = True
        sink.write(bytes(out))
        sink.flush()
        tail.extend(bytes(out).splitlines())


def spawn(argv: list[str], nproc: int, env: dict | None = None, grace_s: float = 5.0,
          program: list[str] | None = None, fork: bool = False, _attempt: int = 0) -> int:
    """Run ``program *argv`` (default ``python -m shardwise``) as ``nproc`` local ranks; return 0
    or the first failing rank's exit code (the other ranks are then stopped).

    ``fork``: run ``shardwise.cli.main(argv)`` (or, for ``program = [python, script.py]``, the
    script) in workers forked from this process, only where :func:`can_fork`; else new
    interpreters. Use it for CPU runs; a GPU run starts new interpreters.

    The master port is free when picked but is bound only when rank 0 creates its store, seconds
    later; if another process took it meanwhile (EADDRINUSE while creating the store), the
    workers are started again on a new port, up to twice."""
    program = program or [sys.executable, "-m", "shardwise"]
    port = free_port()
    base = {**os.environ, **(env or {})}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
                PYTHONUNBUFFERED="1", SHARDWISE_LAUNCHER="1",
                SHARDWISE_LAUNCHER_PID=str(os.getpid()))
    if sys.stderr.isatty():
        base["SHARDWISE_TTY"] = "1"
    script = program[1] if (len(program) == 2 and program[0] == sys.executable
                            and program[1].endswith(".py")) else None
    forked = fork and (script or program == [sys.executable, "-m", "shardwise"]) and can_fork()
    if forked:
        for name in PRELOAD:  # once here instead of once per worker
            importlib.import_module(name)
        # HF tokenizers (the launcher may have trained one) warns in every fork after its
        # thread pool ran, and a pool does not survive a fork: workers encode single-threaded
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        base.setdefault("TOKENIZERS_PARALLELISM", os.environ["TOKENIZERS_PARALLELISM"])
    procs, threads, tails = [], [], []
    sink = sys.stdout.buffer
    for rank in range(nproc):  # every fork before the first thread starts
        e = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
        procs.append(_Forked(list(argv), e, script) if forked else subprocess.Popen(
            [*program, *argv], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True))
    for rank, p in enumerate(procs):
        tails.append(collections.deque(maxlen=25))
        t = threading.Thread(target=_forward, args=(p.stdout, rank, sink, tails[-1]),
                             daemon=True)
        t.start()
        threads.append(t)
    code, failed, previous = 0, [], {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the workers, as on Ctrl-C
            previous[sig] = signal.signal(sig, _raise_stopped)
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                alive = sum(c is None for c in codes)
                if alive:
                    print(f"[launcher] rank {rank} exited with code {code}; stopping the "
                          f"{alive} other rank(s)", file=sys.stderr, flush=True)
                _stop(procs, grace_s)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        code = 130
    except _Stopped as stop:
        print(f"[launcher] {stop}: stopping the {nproc} rank(s)", file=sys.stderr, flush=True)
        _stop(procs, grace_s)
        code = 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in threads:
        t.join(timeout=2)
    stopped = code in (130, 128 + signal.SIGTERM, 128 + signal.SIGHUP) and not failed
    if not stopped and code != 0 and _attempt < 2 and any(
            b"EADDRINUSE" in line for line in tails[rank]) and any(
            b"TCPStore" in line or b"init_process_group" in line for line in tails[rank]):
        print(f"[launcher] port {port} was taken before rank {rank} could listen on it "
              "(EADDRINUSE): starting the workers again on another port", file=sys.stderr,
              flush=True)
        return spawn(argv, nproc, env, grace_s, program, fork, _attempt=_attempt + 1)
    if not stopped and code != 0:  # the first failure's own words, after the other ranks' echoes
        sink.write(f"[launcher] rank {rank} failed first (exit code {code}); its last "
                   f"lines:\n".encode() + b"\n".join(tails[rank]) + b"\n")
        sink.flush()
    return code


def _kill(pid: int, sig: int) -> None:
    """``sig`` to the worker's process group (its session), or to the worker alone if it has
    not made its own group yet (a fork that has just started)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(procs, grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            _kill(p.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            _kill(p.pid, signal.SIGKILL)
            p.wait()


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
