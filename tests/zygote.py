"""A fork server for the suite's command-line runs: ``python -m shardwise ARGS`` without paying
for a new interpreter each time.

Each new interpreter spends about 3 s of CPU importing torch, ``torch._dynamo`` (every torch
optimizer imports it) and shardwise, and the suite starts a hundred of them on a 2-core machine.
:func:`run` asks one server per pytest worker, which imported all of that once and has run
nothing since, to fork a child for each command. The child is what ``python -m shardwise ARGS``
would be: its own session, the environment and working folder it was given, stdout and stderr
into one file, ``shardwise.cli.main(ARGS)`` and its exit status (``SystemExit`` included); it dies
with the server (``PR_SET_PDEATHSIG``). The server forks only while it runs no thread, so the
children may fork workers of their own (:func:`shardwise.launch.can_fork`).

Protocol: one JSON request per connection on a Unix socket ({"args", "env", "cwd", "out"}); the
server answers the child's pid, then its exit status (as ``subprocess`` reports it: negative =
killed by that signal), one line each. ``SHARDWISE_ZYGOTE=0`` makes :func:`run` start new
interpreters instead.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_server: tuple[subprocess.Popen, str] | None = None
# What a run imports after its start, once here instead of in every child (measured with the
# launcher's PRELOAD already imported: a 2-step `train` spent 2.2 s of its 4 s importing these):
# rank 0's loss plot (matplotlib.pyplot, 1.9 s, with the Agg backend the run selects itself),
# its TensorBoard writer, the checkpoint writer, and torch's launcher (every multi-rank run).
LATE = ("matplotlib.pyplot", "torch.utils.tensorboard", "torch.distributed.checkpoint",
        "torch.distributed.launcher.api", "safetensors.torch")


def _serve(path: str) -> None:
    """The server's loop (``python tests/zygote.py SOCKET``): import, listen, fork per request."""
    import ctypes
    import importlib

    import torch

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # die with pytest's worker
    torch.set_num_threads(1)
    import shardwise.cli  # noqa: F401
    from shardwise.launch import PRELOAD

    import matplotlib

    matplotlib.use("Agg")  # what shardwise's plots select before importing pyplot

    for name in PRELOAD + LATE:
        importlib.import_module(name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    print("ready", flush=True)
    parent = os.getppid()
    while True:
        conn, _ = sock.accept()
        with conn:
            req = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                conn.close()
                _child(req)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:  # the client is gone
                pass
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the client gave up (timeout) and closed
                pass
        if os.getppid() != parent:  # pytest is gone
            return


def _child(req: dict) -> None:
    """Become ``python -m shardwise *req["args"]`` and exit with its status."""
    import ctypes
    import io
    import traceback

    code = 1
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # die with the server
        os.setsid()
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding="utf-8")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding="utf-8", errors="backslashreplace")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [sys.executable, *req["args"]]
        if req.get("module") == "shardwise.launch":  # python -m shardwise.launch ARGS
            from shardwise.launch import main
        else:
            from shardwise.cli import main

        code = main(list(req["args"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception in python -m would
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _start() -> tuple[subprocess.Popen, str]:
    global _server
    if _server is None or _server[0].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="shardwise-zygote-"), "s")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), path], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready", "the CLI fork server did not start"
        _server = (proc, path)
        atexit.register(stop)
    return _server


def stop() -> None:
    """Stop this pytest worker's server (its children die with it)."""
    global _server
    if _server is not None:
        _server[0].kill()
        _server[0].wait()
        _server = None


def run(args: list[str], env: dict, timeout: float | None, cwd=None,
        module: str = "shardwise") -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, module, *args], env=env, cwd=cwd, stdout=PIPE,
    stderr=STDOUT, text=True, timeout=timeout)``, forked from the server (``module``:
    "shardwise" or "shardwise.launch"). Raises ``subprocess.TimeoutExpired`` (after killing the
    child's session) as ``subprocess.run`` would."""
    if os.environ.get("SHARDWISE_ZYGOTE") == "0" or not hasattr(os, "fork"):
        return subprocess.run([sys.executable, "-m", module, *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, cwd=cwd)
    _, path = _start()
    with tempfile.NamedTemporaryFile(prefix="shardwise-cli-", suffix=".out", delete=False) as f:
        out = f.name
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall((json.dumps({"args": list(args), "env": dict(env), "out": out,
                                   "cwd": str(cwd or os.getcwd()), "module": module})
                       + "\n").encode())
            answers = s.makefile("r")
            pid = int(answers.readline())
            s.settimeout(timeout)
            try:
                code = int(answers.readline())
            except (socket.timeout, TimeoutError):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                time.sleep(0.1)
                raise subprocess.TimeoutExpired([module, *args], timeout,
                                                output=Path(out).read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code,
                                           Path(out).read_text(errors="replace"))
    finally:
        os.unlink(out)


if __name__ == "__main__":
    _serve(sys.argv[1])
