import os
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token/tokenizer cache for the whole session (tests share the embedded corpus), and
    under pytest-xdist one for all its workers (their base folders share a parent): the BPE
    tokenizer, the tokenized corpus and the CPU's peak-FLOP/s probe are built once, not once per
    worker. The cache's writers take a file lock per entry (shardwise.data._cache.file_lock),
    as a run's ranks sharing one cache do."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        d = tmp_path_factory.getbasetemp().parent / "shardwise-cache"
        d.mkdir(exist_ok=True)
        return d
    return tmp_path_factory.mktemp("shardwise-cache")


def run_cli(args, cache, timeout=240, env=None, cwd=None):
    """Run ``python -m shardwise *args``; returns CompletedProcess (stdout+stderr merged). The
    process is forked from a server that imported torch and shardwise once (tests/zygote.py;
    ``SHARDWISE_ZYGOTE=0``: a new interpreter each time)."""
    e = {**os.environ, "SHARDWISE_CACHE": str(cache), "OMP_NUM_THREADS": "1", **(env or {})}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or k not in env:
            e.pop(k, None)
    return zygote.run([str(a) for a in args], e, timeout, cwd)


def load_pt(path):
    """A results file this suite's own workers wrote (``tests/workers/*``, into pytest's tmp):
    ``torch.load`` with the C unpickler (``weights_only=False``). On a world's files (ledger
    records, gradient dicts) the weights-only unpickler, pure Python, took 3x the CPU (1.70 vs
    0.55 s for test_ep_zero's 32 files) and ~3 % of ``make test``'s. Safe: the suite wrote them.
    The product's own loads (checkpoints, HF folders) keep torch's default."""
    import torch

    return torch.load(path, weights_only=False)


def run_world(worker, out, nproc: int = 4) -> None:
    """Run the script ``worker`` with argument ``out`` as ``nproc`` gloo ranks (one world per
    test module: the cases all run inside it), and fail if any rank failed. The ranks are forked
    from one launcher (``python -m shardwise.launch``, itself forked from tests/zygote.py's
    server), which imported torch once for all of them; pytest's own worker runs threads, so it
    cannot fork them itself. When a rank fails, the launcher also prints where each rank it
    stopped was (``SHARDWISE_STACKS_ON_STOP``: the top of its Python stack)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_STACKS_ON_STOP": "1"}
    p = zygote.run(["--nproc", str(nproc), str(worker), str(out)], env, None,
                   module="shardwise.launch")
    print(p.stdout)  # the ranks' output, shown by pytest when the test fails
    assert p.returncode == 0, f"the worker world of {Path(worker).name} failed (output above)"


def split_worlds(worker, name: str, nproc: int = 4, fast: str = "results_fast",
                 prepare=None, slow: str = "results_slow"):
    """The two module-scoped fixtures of a file whose cases are split between ``make test`` and
    ``make test-slow`` (those marked slow): ``fast`` and ``slow``, each the folder of its
    own :func:`run_world` of ``worker``, ``prepare(out)`` called first where given. The worker
    picks its cases by the folder's name: ``name`` for the fast world (it must not contain
    "slow"), ``name + "_slow"`` for the slow one. Assign both at module level:
    ``results_fast, results_slow = split_worlds(W.__file__, "zero")``."""
    assert "slow" not in name, f"the fast world's folder name {name!r} must not contain 'slow'"

    def world(tmp_path_factory, folder):
        out = tmp_path_factory.mktemp(folder)
        if prepare is not None:
            prepare(out)
        run_world(worker, out, nproc=nproc)
        return out

    @pytest.fixture(scope="module", name=fast)
    def fast_world(tmp_path_factory):
        return world(tmp_path_factory, name)

    @pytest.fixture(scope="module", name=slow)
    def slow_world(tmp_path_factory):
        return world(tmp_path_factory, f"{name}_slow")

    return fast_world, slow_world


def world_of(request, slow: bool, fast: str = "results_fast", slow_name: str = "results_slow"):
    """The folder of the world that ran a case: :func:`split_worlds`' ``slow_name`` fixture if
    ``slow`` (the case is marked slow), else its ``fast`` fixture."""
    return request.getfixturevalue(slow_name if slow else fast)


def pytest_collection_modifyitems(items):
    """The pages' commands and the two verify worlds (the suite's longest files before their
    heavier cases moved to ``make test-slow``; in it, still the longest) go first, so that
    under ``-n 2 --dist loadfile`` both workers start with them and the other files fill in
    around them (otherwise they could start last and set the suite's wall time)."""
    first = ("test_doc_commands", "test_verify_n4", "test_verify_n8")
    items.sort(key=lambda item: next((i for i, f in enumerate(first) if f in item.nodeid),
                                     len(first)))  # stable


# Routing is a discrete choice: a layout whose router inputs differ from the reference's by
# round-off (~1e-7 relative: another summation order, the parity rule's premise) routes every
# token to the same experts unless its k-th and (k+1)-th router probabilities lie within that
# round-off. An MoE parity test checks that its data keeps them apart by far more (MIN_GAP, 100×
# the parity rule's rtol), so no CPU's summation order can flip a choice.
MIN_ROUTING_GAP = 1e-5


def min_routing_gap(model, batch: dict) -> float:
    """The smallest p_(k) − p_(k+1) over every token and MoE layer of ``model`` on ``batch``
    (router probabilities sorted descending; 1.0 where k = E). No gradient."""
    import torch

    from shardwise.models import moe_layers

    gaps = []

    def hook(mod, inputs, out, k):
        p = out.detach().float().softmax(-1).sort(-1, descending=True).values
        gaps.append(float((p[..., k - 1] - p[..., k]).min()) if k < p.shape[-1] else 1.0)

    hooks = [m.router.register_forward_hook(lambda mod, i, o, k=m.top_k: hook(mod, i, o, k))
             for m in moe_layers(model)]
    try:
        with torch.no_grad():
            model(batch["input_ids"])
    finally:
        for h in hooks:
            h.remove()
    return min(gaps)


# The wall time of each test file in its worker (setup, calls and teardown of its tests: a
# module-scoped world's start-up included), summed on the controller from the tests' reports and
# printed last, so that the next slow file is visible in every `make test` (issue 34: suite ≤ 12
# min). Under xdist the controller receives every worker's reports (``report.node`` names the
# worker), so the sums cost a dict update per report; each file's worker and each worker's total
# are shown too, which is what `--dist loadfile`'s balance is read from.
_FILE_SECONDS: dict[str, float] = {}
_FILE_WORKER: dict[str, str] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    node = getattr(report, "node", None)  # set by xdist on the controller
    _FILE_WORKER[path] = getattr(getattr(node, "gateway", None), "id", "") or "main"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """Outermost wrapper: the table comes after the durations and the short test summary, just
    before the final count line."""
    result = yield
    if _FILE_SECONDS:
        slow = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]
        terminalreporter.section("slowest files (seconds in their worker: setup + tests + "
                                 "teardown)")
        for path, seconds in slow:
            terminalreporter.write_line(f"{seconds:8.1f} s  {_FILE_WORKER[path]:>4}  {path}")
        workers: dict[str, float] = {}
        for path, seconds in _FILE_SECONDS.items():
            workers[_FILE_WORKER[path]] = workers.get(_FILE_WORKER[path], 0.0) + seconds
        terminalreporter.write_line("per worker: " + ", ".join(
            f"{w} {s:.0f} s" for w, s in sorted(workers.items())))
    return result
