"""shardwise.comm: every collective gives the right values on its axis, and the ledger books the
ring-formula bytes for it (hand-worked here)."""

from pathlib import Path

import pytest
import torch

from shardwise.comm import Ledger, ring_bytes
from conftest import load_pt, run_world

WORKER = Path(__file__).parent / "workers" / "comm_cases.py"


def test_ring_formulas_hand_worked():
    S = 1200.0
    assert ring_bytes("all_reduce", S, 4) == 2 * 3 / 4 * S == 1800
    assert ring_bytes("all_gather", S, 4) == 900 == ring_bytes("reduce_scatter", S, 4)
    assert ring_bytes("all_to_all", S, 3) == 800
    assert ring_bytes("broadcast", S, 2) == 600
    assert ring_bytes("send", S, 2) == S and ring_bytes("recv", S, 2) == 0
    assert ring_bytes("all_reduce", S, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes("gossip", S, 2)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    run_world(WORKER, out, 4)
    return [load_pt(out / f"rank{r}.pt") for r in range(4)]


def test_rank_layout_puts_tp_innermost(ranks):
    # r = ((pp·dp + dp_index)·cp + cp_index)·tp + tp_index with dp = tp = 2, cp = 1
    assert [res["coords"] for res in ranks] == [
        {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, {"pp": 0, "dp": 0, "cp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "cp": 0, "tp": 0}, {"pp": 0, "dp": 1, "cp": 0, "tp": 1}]


def test_collective_values(ranks):
    base = torch.arange(6, dtype=torch.float32)
    for r, res in enumerate(ranks):
        tp_peers = [r - r % 2, r - r % 2 + 1]  # same dp index
        dp_peers = [r % 2, r % 2 + 2]  # same tp index
        assert torch.equal(res["all_reduce_tp"], sum(base + 10 * p for p in tp_peers))
        assert torch.equal(res["all_reduce_dp_avg"], torch.full((3,), sum(p + 1.0 for p in dp_peers) / 2))
        assert res["all_reduce_world_max"].item() == 3.0
        assert torch.equal(res["all_gather_tp"], torch.tensor([[tp_peers[0]] * 3, [tp_peers[1]] * 3], dtype=torch.float32))
        summed = sum(torch.arange(8, dtype=torch.float64) * (p + 1) for p in dp_peers)
        i = dp_peers.index(r)
        assert torch.equal(res["reduce_scatter_dp"], summed[4 * i: 4 * i + 4])
        assert torch.equal(res["reduce_scatter_dp_async"], summed[4 * i: 4 * i + 4])
        assert torch.equal(res["broadcast_dp_src1"], torch.full((5,), float(dp_peers[1])))
        j = tp_peers.index(r)
        assert torch.equal(res["all_to_all_tp"], torch.tensor([10.0 * p + j for p in tp_peers]))
        assert torch.equal(res["p2p_tp"], torch.full((7,), float(tp_peers[0])))


def test_async_handle_does_not_keep_the_input(ranks):
    """An in-flight async reduce_scatter's Handle holds no reference to its input: a caller
    that drops its own (ZeRO's flat gradient [P_u], issue 53) frees it at once (the backend's
    work keeps what it still reads: gloo reduces a copy), and the result is still the sum."""
    assert [res["async_input_alive"] for res in ranks] == [False] * 4


def test_ledger_books_ring_bytes(ranks):
    for r, res in enumerate(ranks):
        recs = {rec["op"] + ":" + rec["axis"]: rec for rec in res["records"]}
        assert recs["all_reduce:tp"]["wire_bytes"] == 2 * 1 / 2 * 24  # 6 fp32
        assert recs["all_reduce:world"]["wire_bytes"] == 2 * 3 / 4 * 4
        assert recs["all_gather:tp"]["wire_bytes"] == 1 / 2 * 24  # full output 2×3 fp32
        assert recs["reduce_scatter:dp"]["wire_bytes"] == 1 / 2 * 64  # full input 8 fp64
        assert recs["broadcast:dp"]["wire_bytes"] == 1 / 2 * 20
        assert recs["all_to_all:tp"]["wire_bytes"] == 1 / 2 * 8
        p2p = recs.get("send:tp") or recs.get("recv:tp")
        assert p2p["wire_bytes"] == (28 if r % 2 == 0 else 0)
        assert all(rec["seconds"] >= 0 and rec["phase"] == "step" for rec in res["records"])
        assert res["records"][0]["dtype"] == "float32" and res["records"][0]["shape"] == (6,)


def test_ledger_step_window_and_phases():
    from shardwise.comm.ledger import CommRecord

    led = Ledger()

    def rec(tag, phase="step"):
        return CommRecord("all_reduce", "dp", 2, "float32", (4,), 16, 16.0, 0.0, phase, tag, "x")
    led.add(rec("grad"))
    led.begin_step()
    led.add(rec("grad"))
    led.add(rec("loss"))
    led.add(rec("eval", phase="eval"))
    assert led.step_bytes() == 32 and led.step_bytes("grad") == 16
    assert len(Ledger.summarize(led.step_records())) == 2
