"""The NCCL hazards that pass on gloo and hang or corrupt on NCCL (issue 38;
docs/troubleshooting.md "NCCL hazards"), each guarded structurally on CPU. Every test here has
``nccl`` in its name: ``pytest -k nccl`` runs them (with the expert-parallel one in
tests/test_expert_parallel.py).

1. groups eager, with ``device_id`` on CUDA; 2. created in one order, recorded identically on
every rank; 3. one point-to-point style per communicator; 4. collective tensors on the
topology's device (runtime check + a scan for device-less tensor factories); 5. the comm
thread's stream/event order. Expected values are hand-worked (the group lines of a 2×2 grid)."""

import ast
import datetime
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import load_pt, ROOT, run_world
from shardwise.comm import groups as G
from shardwise.comm.groups import NcclHazard, claim_p2p, compare_records, new_groups
from shardwise.comm.ops import check_device
from shardwise.comm.streams import StreamOrder

NPROC = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl")
    run_world(ROOT / "tests" / "workers" / "nccl_cases.py", out, NPROC)
    return [load_pt(out / f"rank{r}.pt") for r in range(NPROC)]


# -- hazards 1 and 2: eager groups, one recorded order ----------------------------------------
@pytest.mark.timeout(300)
def test_nccl_every_rank_records_the_same_group_order(ranks):
    first = ranks[0]["records"]
    for layout in range(2):
        compare_records([res["records"][layout] for res in ranks])
    # hand-worked: grid (pp, dp, cp, tp) = (2, 2, 1, 1) over ranks 0..3, r = pp·2 + dp
    assert first[0] == [("pp", (0, 2)), ("pp", (1, 3)), ("dp", (0, 1)), ("dp", (2, 3)),
                        ("tp", (0,)), ("tp", (1,)), ("tp", (2,)), ("tp", (3,)),
                        ("pp_batch", (0, 2)), ("pp_batch", (1, 3)), ("world", (0, 1, 2, 3))]
    # (1, 2, 1, 2) with ep = 2: the ep lines are the dp lines (ep = dp·cp: no edp group)
    assert first[1] == [("pp", (0,)), ("pp", (1,)), ("pp", (2,)), ("pp", (3,)),
                        ("dp", (0, 2)), ("dp", (1, 3)), ("tp", (0, 1)), ("tp", (2, 3)),
                        ("ep", (0, 2)), ("ep", (1, 3)), ("world", (0, 1, 2, 3))]


def test_nccl_new_groups_binds_device_id_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(G.dist, "new_group",
                        lambda ranks, **kw: calls.append((ranks, kw)) or object())
    t = datetime.timedelta(seconds=5)
    record = []
    mine = new_groups({"tp": [[0, 1], [2, 3]]}, 2, torch.device("cuda", 1), t, record)
    assert [kw.get("device_id") for _, kw in calls] == [torch.device("cuda", 1)] * 2
    assert record == [("tp", (0, 1)), ("tp", (2, 3))] and mine["tp"][1] == [2, 3]
    calls.clear()
    monkeypatch.setattr(G.dist, "get_backend", lambda group=None: "gloo")  # a gloo world
    new_groups({"tp": [[0, 1]]}, 0, torch.device("cpu"), t, [])
    assert "device_id" not in calls[0][1]  # gloo: nothing to bind
    assert calls[0][1]["backend"] == G.SHARED_GLOO  # on this process's one gloo device
    calls.clear()
    monkeypatch.setattr(G.dist, "get_backend", lambda group=None: "fake")  # the estimator's
    new_groups({"tp": [[0, 1]]}, 0, torch.device("cpu"), t, [])
    assert "backend" not in calls[0][1]  # the world's own backend (FakeStore has no gloo)


@pytest.mark.timeout(300)
def test_nccl_cpu_sub_groups_share_one_gloo_event_loop(ranks):
    """Each CPU sub-group used to start its own gloo device, whose TCP event loop wakes every
    10 ms: hundreds per verify rank, up to half of two cores in kernel time. Now every rank has
    two such threads (the default group's device, the shared one) whatever it joined."""
    for res in ranks:
        assert res["backend"] == G.SHARED_GLOO
        assert res["groups_joined"] == 10  # hand count: 11 + 11 groups, each rank on 5 + 5 lines
        if res["loop_threads"] is not None:  # Linux: /proc names the threads
            assert res["loop_threads"] <= 2, res["loop_threads"]


def test_nccl_planted_group_order_difference_is_caught():
    """A rank that creates dp's groups before pp's: the comparison names it and the place."""
    same = [("pp", (0, 2)), ("dp", (0, 1))]
    compare_records([same, list(same)])
    with pytest.raises(NcclHazard, match=r"rank 1 created group #0 \('dp', \(0, 1\)\)"):
        compare_records([same, same[::-1]])
    with pytest.raises(NcclHazard, match="rank 1 created 1 groups, rank 0 2"):
        compare_records([same, same[:1]])


# -- hazard 3: one point-to-point style per communicator --------------------------------------
@pytest.mark.timeout(300)
def test_nccl_p2p_styles_never_mix_on_one_communicator(ranks):
    for r, res in enumerate(ranks):
        assert torch.equal(res["recv"], torch.full((3,), float(r % 2)))  # stage 0's value
        assert res["pp_style"] == "single" and res["batch_style"] == "batch"
        assert res["batch_is_own_group"]
        assert "NCCL can hang" in res["mix"], res["mix"]


def test_nccl_claim_p2p_raises_on_a_planted_mix():
    g = SimpleNamespace(group_name="planted_nccl_group")
    claim_p2p(g, "single")
    claim_p2p(g, "single")  # the same style again is fine
    with pytest.raises(NcclHazard, match="batch_isend_irecv and single send/recv"):
        claim_p2p(g, "batch")
    with pytest.raises(ValueError, match="choose from"):
        claim_p2p(SimpleNamespace(group_name="other"), "blocking")


# -- hazard 4: tensors on the topology's device -----------------------------------------------
@pytest.mark.timeout(300)
def test_nccl_cpu_tensor_refused_on_accelerator_topology(ranks):
    for res in ranks:
        assert "tensor on cpu, the topology's device is cuda:0" in res["device_check"]
        assert torch.equal(res["after"], torch.full((2,), 2.0))


def test_nccl_check_device_planted():
    topo = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(NcclHazard, match=r"all_reduce on axis dp \(loss\): tensor on cpu"):
        check_device(topo, "all_reduce", "dp", torch.zeros(1), "loss")
    check_device(SimpleNamespace(device=torch.device("cpu")), "all_reduce", "dp", torch.zeros(1))
    check_device(topo, "all_reduce", "dp", torch.zeros(1, device="meta"))  # shapes only


FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange"}
# host-side tensors that never reach a collective (or are moved to the device before one), each
# keyed by its source text (whitespace squeezed), so the entry follows the code if it moves
ALLOWED = {
    "torch.arange(starts[j, l], starts[j, l] + recv[j][l])":
        "ep dispatch: a host index list, concatenated and moved .to(rows.device)",
    "torch.tensor(count_items(mb))":
        "pp eval: a token count returned to train.loop.evaluate, added into a device tensor",
    "torch.tensor(float(v), dtype=torch.float32)":
        "ZeRO checkpoint: the optimizer's step counter (AdamW keeps it on CPU)",
    "torch.tensor(float(steps[j]) - 1.0)":
        "ZeRO checkpoint: the step counter in a saved state dict (host)",
    "torch.empty(0, dtype=self._rdtype)": "ZeRO byte formula: element_size() only",
    "torch.tensor(0.0)": "Muon's step count: a host scalar, as torch's AdamW keeps its 'step'; "
    "no collective takes it",
    "torch.empty(len(pickle.dumps(box[0])), dtype=torch.uint8)":
        "broadcast_object: a stand-in for the ledger's shape/bytes, never communicated",
    "torch.empty(tuple(v.size), dtype=v.properties.dtype)":
        "checkpoint: a DCP load template on CPU (DCP reads into it from disk)",
    "torch.zeros(1, dtype=torch.long)": "a host index (validation row 0) for the data pipeline",
    "torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)": "DPO data: host labels",
    "torch.arange(r * n // dp, (r + 1) * n // dp)": "eval split: host sequence indices",
    "torch.zeros(1, n)": "MoE stats of a stage without MoE layers, .to(topo.device) below",
    "torch.tensor([float(st[\"balance\"]), float(st[\"z\"]), float(st[\"dropped\"])], "
    "dtype=torch.float64)": "MoE stats vector, moved .to(topo.device) before its all-reduce",
    "torch.arange(out[0][\"labels\"].shape[1])": "SFT label mask: host positions",
}


def factories_without_device(root: Path) -> list[tuple[str, int, str]]:
    """(file, line, source) of every ``torch.<factory>(...)`` without ``device=`` in parallel/,
    comm/ and train/ (``*_like`` factories inherit their device and are not listed)."""
    found = []
    for d in ("parallel", "comm", "train"):
        for f in sorted((root / d).rglob("*.py")):
            text = f.read_text()
            for n in ast.walk(ast.parse(text)):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr in FACTORIES and isinstance(n.func.value, ast.Name)
                        and n.func.value.id == "torch"
                        and not any(k.arg == "device" for k in n.keywords)):
                    src = re.sub(r"\s+", " ", ast.get_source_segment(text, n))
                    found.append((str(f.relative_to(root)), n.lineno, src.replace("( ", "(")))
    return found


def test_nccl_tensor_factories_name_their_device():
    bad = [f"{f}:{line}: {src}" for f, line, src in
           factories_without_device(ROOT / "src" / "shardwise") if src not in ALLOWED]
    assert not bad, ("tensor factories without device= (NCCL takes device tensors only: pass "
                     "device=topo.device, or add to ALLOWED with why):\n" + "\n".join(bad))


def test_nccl_factory_scan_catches_a_planted_factory(tmp_path):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "planted.py").write_text(
        "import torch\nn = torch.tensor([1.0])\nok = torch.zeros(2, device=d)\n")
    assert factories_without_device(tmp_path) == [("comm/planted.py", 2, "torch.tensor([1.0])")]


# -- hazard 5: the comm thread's stream and events --------------------------------------------
def _fakes(log):
    class Event:
        def __init__(self):
            self.name = f"e{sum(c[0] == 'event' for c in log)}"
            log.append(("event", self.name))

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, e):
            log.append(("wait", self.name, e.name))

        def __enter__(self):
            log.append(("enter", self.name))

        def __exit__(self, *a):
            log.append(("exit", self.name))

    return Stream, Event


def test_nccl_comm_stream_waits_for_compute_and_compute_waits_for_comm():
    log = []
    Stream, Event = _fakes(log)
    compute, comm_s = Stream("compute"), Stream("comm")
    order = StreamOrder("cpu", comm_s, current=lambda: compute, event=Event)
    ready = order.before()
    out, done = order.run(lambda: log.append(("body",)) or 7, ready)
    order.after(done)
    assert out == 7
    assert log == [("event", "e0"), ("record", "e0", "compute"),   # 1. inputs written
                   ("wait", "comm", "e0"), ("enter", "comm"), ("body",), ("exit", "comm"),
                   ("event", "e1"), ("record", "e1", "comm"),        # 2. on the comm stream
                   ("wait", "compute", "e1")]                       # 3. before it is read


def test_nccl_cpu_runs_the_same_calls_without_a_stream():
    order = StreamOrder.for_device("cpu")
    assert order.stream is None
    ready = order.before()
    out, done = order.run(lambda: 3, ready)
    order.after(done)
    assert (ready, out, done) == (None, 3, None)
