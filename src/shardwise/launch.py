"""Start the workers: under torchrun use its environment; alone, spawn them on localhost.

:func:`spawn` starts ``nproc`` copies of ``python -m shardwise <argv>`` with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port),
``OMP_NUM_THREADS=1`` each (two threads per worker on two cores measured 3–6× slower), and
prefixes every line they print with their rank. When any worker exits non-zero, the others are
stopped at once (SIGTERM, then SIGKILL) and its exit code is returned: a failure never leaves the
rest waiting in a collective until the timeout.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time

from .topology import free_port


def is_worker() -> bool:
    """True inside a launched world (torchrun or :func:`spawn`): WORLD_SIZE is set."""
    return "WORLD_SIZE" in os.environ


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
          program: list[str] | None = None, _attempt: int = 0) -> int:
    """Run ``program *argv`` (default ``python -m shardwise``) as ``nproc`` local ranks; return 0
    or the first failing rank's exit code (the other ranks are then stopped).

    The master port is free when picked but is bound only when rank 0 creates its store, seconds
    later; if another process took it meanwhile (EADDRINUSE while creating the store), the
    workers are started again on a new port, up to twice."""
    program = program or [sys.executable, "-m", "shardwise"]
    port = free_port()
    base = {**os.environ, **(env or {})}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
                PYTHONUNBUFFERED="1", SHARDWISE_LAUNCHER="1")
    if sys.stderr.isatty():
        base["SHARDWISE_TTY"] = "1"
    procs, threads, tails = [], [], []
    sink = sys.stdout.buffer
    for rank in range(nproc):
        e = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
        p = subprocess.Popen([*program, *argv], env=e,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        tails.append(collections.deque(maxlen=25))
        t = threading.Thread(target=_forward, args=(p.stdout, rank, sink, tails[-1]),
                             daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)
    code = 0
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
    for t in threads:
        t.join(timeout=2)
    if code not in (0, 130) and _attempt < 2 and any(
            b"EADDRINUSE" in line for line in tails[rank]) and any(
            b"TCPStore" in line or b"init_process_group" in line for line in tails[rank]):
        print(f"[launcher] port {port} was taken before rank {rank} could listen on it "
              "(EADDRINUSE): starting the workers again on another port", file=sys.stderr,
              flush=True)
        return spawn(argv, nproc, env, grace_s, program, _attempt=_attempt + 1)
    if code not in (0, 130):  # the first failure's own words, after the other ranks' echoes
        sink.write(f"[launcher] rank {rank} failed first (exit code {code}); its last "
                   f"lines:\n".encode() + b"\n".join(tails[rank]) + b"\n")
        sink.flush()
    return code


def _stop(procs, grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
