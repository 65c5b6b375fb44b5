"""ZeRO-3 and FSDP2 on a model whose blocks run in a rank-dependent order: the first step fails
on every rank with one clear ShardwiseConfigError naming what each rank wanted, within seconds
(not after the process-group timeout, and not with silently wrong gradients); the same model
with a rank-independent order still trains like one process, and the order check (first step
only, ledger phase "order_check") stays out of a step's bytes.
Worker: tests/workers/unit_order_cases.py (2 ranks, dp=2, zero 3, explicit and torch)."""

import sys
from pathlib import Path

import pytest

from shardwise.data import DistributedSampler
from shardwise.parity import assert_parity, reference_run

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world  # noqa: E402
import unit_order_cases as W  # noqa: E402

N = 2  # dp ranks
SAME = [(e, o) for e in W.ENGINES for o in W.SAME_ORDERS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("unit_order")
    run_world(W.__file__, out, N)
    return out


def _load(results, case):
    return [load_pt(results / f"{case}_rank{r}.pt") for r in range(N)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", W.ENGINES)
def test_rank_dependent_order_is_a_clear_error_on_every_rank(results, engine):
    recs = _load(results, f"{engine}_rank_dependent")
    first = [f"layers.{rec['order'][0]}" for rec in recs]  # the block each rank runs first
    assert first[0] != first[1]
    for rank, rec in enumerate(recs):
        msg = rec["error"]
        assert rec.get("type") == "ShardwiseConfigError", msg
        assert "\n" not in msg, msg
        assert "rank-dependent order" in msg and "1st unit gathered in forward" in msg, msg
        for r in range(N):
            assert f"rank {r} wanted {first[r]}" in msg, msg
        assert "make the module order the same on every rank" in msg, msg
        # before any mismatched gather: long before the groups' timeout would have fired
        assert rec["seconds"] < W.TIMEOUT_S / 4, (rank, rec["seconds"])
    assert recs[0]["error"] == recs[1]["error"]  # every rank says the same


def _reference(order):
    """One process, plain PyTorch (shardwise.parity): the same seeded model, the whole global
    batch of each step."""
    work = W.workload()
    sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
    batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
               for _ in range(W.STEPS)]
    return reference_run(W.make_model(order), batches, lrs=[W.LR] * W.STEPS,
                         max_norm=W.MAX_NORM)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,order", SAME, ids=[f"{e}-{o}" for e, o in SAME])
def test_rank_independent_order_trains_like_one_process(results, engine, order):
    ref = _reference(W.SAME_ORDERS[order])
    for rank, rec in enumerate(_load(results, f"{engine}_same_{order}")):
        assert_parity(rec, ref, where=f"{engine} {order} rank {rank}")


def _hand_step_bytes(n=N):
    """ZeRO-3 bytes per step for the 3-block MLP (d 16, d_ff 32; each block 2·16·32 + 32 + 16
    = 1072 elements, even: no padding at n = 2; no root unit), fp32, reshard after forward:
    grad reduce_scatter (n−1)/n·4Ψ, param all_gather twice (forward and backward) 2·(n−1)/n·4Ψ,
    grad norm one fp64 all_reduce 2(n−1)/n·8, loss two fp64 all_reduces 2·2(n−1)/n·8."""
    psi = W.N_LAYERS * (2 * 16 * 32 + 32 + 16)
    f = (n - 1) / n
    out = {"grad": f * 4 * psi, "param": 2 * f * 4 * psi, "grad_norm": 2 * f * 8,
           "loss": 2 * 2 * f * 8}
    out[None] = sum(out.values())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,order", SAME, ids=[f"{e}-{o}" for e, o in SAME])
def test_order_check_is_first_step_only_and_not_in_step_bytes(results, engine, order):
    # explicit: forward and backward, each N_LAYERS units + the end of the pass; FSDP2: forward
    passes = 2 if engine == "explicit" else 1
    row_bytes = N * 3 * 8  # the gathered int64 [3] rows of all ranks
    for rec in _load(results, f"{engine}_same_{order}"):
        first, later = rec["order_checks"][0], rec["order_checks"][1:]
        assert len(first) == passes * (W.N_LAYERS + 1)
        for r in first:
            assert (r["op"], r["tag"], r["dtype"], tuple(r["shape"])) == \
                ("all_gather", "unit_order", "int64", (N * 3,))
            assert r["wire_bytes"] == pytest.approx((N - 1) / N * row_bytes)
        assert all(not checks for checks in later)
        assert rec["bytes"][0] == rec["bytes"][1]  # step 1 (checked) books what step 2 does
        if order == "module":
            assert rec["bytes"][0] == pytest.approx(_hand_step_bytes())


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory):
    out = tmp_path_factory.mktemp("unit_order_2d")
    run_world(W.__file__, out, 4)  # 4 ranks: the worker runs its dp=2 × tp=2 cases
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", W.ENGINES)
def test_2d_rank_dependent_order_fails_on_every_rank_of_the_layout(results_2d, engine):
    """dp=2 × tp=2 (rank = 2·dp index + tp index): only rank 1 reverses its layers. Rank 1 has
    a tp peer (0) and a dp peer (3) that do not, and rank 2 shares no line with it: every rank
    must still stop, with the same message."""
    recs = [load_pt(results_2d / f"2d_{engine}_rank_dependent_rank{r}.pt") for r in range(4)]
    first = {r: f"layers.{rec['order'][0]}" for r, rec in enumerate(recs)}
    assert first[1] != first[0] == first[2] == first[3]
    for rank, rec in enumerate(recs):
        msg = rec["error"]
        assert rec.get("type") == "ShardwiseConfigError", msg
        assert "\n" not in msg and "rank-dependent order" in msg, msg
        assert f"ranks 0, 2, 3 wanted {first[0]}" in msg and f"rank 1 wanted {first[1]}" in msg
        assert rec["seconds"] < W.TIMEOUT_S / 4, (rank, rec["seconds"])
    assert len({rec["error"] for rec in recs}) == 1
