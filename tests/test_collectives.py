"""shardwise.comm.algorithms (ring, halving-doubling, binomial tree, chain, pairwise) through
comm/ops.py, for n = 2 … 8 ranks in one world of 8 (worker: tests/workers/collectives_cases.py):

* gathers, broadcast and all-to-all bitwise equal to torch's own collective on the same group;
* sums within (n−1)·u·Σ|x| of the fp64 sum of every rank's input (u = 2⁻²⁴, fp32's unit
  round-off: n−1 additions, each off by at most u of its partial sum, Higham 2002 §4.2), and
  so within twice that of torch's; max bitwise torch's; one result, bitwise, on every rank;
* the bytes each rank handed to send equal to each algorithm's derived formula, written out
  here by hand from the module docstrings (and checked against ``cost.sent_bytes``).
"""

from pathlib import Path

import pytest
import torch

from shardwise.comm import algorithms
from shardwise.comm.algorithms import cost
from shardwise.errors import ShardwiseConfigError
from conftest import load_pt, run_world

WORKER = Path(__file__).parent / "workers" / "collectives_cases.py"
U = 2.0 ** -24  # fp32 unit round-off (eps / 2)
E = 4  # bytes per fp32 element


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    run_world(WORKER, out, 8)
    return [load_pt(out / f"rank{r}.pt") for r in range(8)]


def _all(cases):
    return [c for rank in cases for c in rank]


@pytest.mark.timeout(240)  # the world of 8 starts in this test's setup (~15 s on 2 cores)
def test_every_n_and_mode_ran(cases):
    seen = {(c["n"], c["mode"], c["op"]) for c in _all(cases)}
    for n in range(2, 9):
        for mode in ("ring", "tree"):
            for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                       "reduce", "all_reduce_strided", "async"):
                assert (n, mode, op) in seen


def test_copies_bitwise_equal_torch(cases):
    for c in _all(cases):
        if c["op"] in ("all_gather", "broadcast", "all_to_all"):
            assert torch.equal(c["ours"], c["native"]), (c["op"], c["mode"], c["n"])


def test_sums_within_the_stated_bound(cases):
    for c in _all(cases):
        if "exact" not in c or c.get("red", "sum") == "max":
            continue
        if c["op"] == "reduce" and c["index"] != c["root"]:
            continue
        n, ours = c["n"], c["ours"].double()
        if c.get("red") == "avg":  # SUM, then one rounded divide: ≤ u·Σ|x| (+ O(u²))
            bound = 1.001 * U * c["absum"]
            assert ((ours - c["exact"] / n).abs() <= bound).all(), (c["op"], c["mode"], n)
            continue
        bound = (n - 1) * U * c["absum"]
        assert ((ours - c["exact"]).abs() <= bound).all(), (c["op"], c["mode"], n)
        if c.get("native") is not None:
            assert ((ours - c["native"].double()).abs() <= 2 * bound).all()


def test_max_bitwise_equal_torch(cases):
    for c in _all(cases):
        if c.get("red") == "max":
            assert torch.equal(c["ours"], c["native"])


def test_all_reduce_identical_on_every_rank(cases):
    for n in range(2, 9):
        per_rank = [[c for c in cases[r] if c["n"] == n and c["op"].startswith("all_reduce")]
                    for r in range(n)]
        for row in zip(*per_rank):
            assert all(torch.equal(c["ours"], row[0]["ours"]) for c in row), row[0]["mode"]


def test_inputs_and_non_roots_unchanged(cases):
    for c in _all(cases):
        if c["op"] == "reduce_scatter":
            assert c["input_unchanged"]
        if c["op"] == "reduce":
            assert c["unchanged"]


def test_async_and_future_are_the_same_all_reduce(cases):
    for c in _all(cases):
        if c["op"] == "async":
            assert torch.equal(c["ours"], c["other"])


# -- bytes handed to send vs the derived formulas -------------------------------------------------
def _blocks(N, parts):  # split_bounds' rule, written again: the first N % parts get one more
    return [N // parts + (1 if j < N % parts else 0) for j in range(parts)]


def _fold(n):
    p = 1
    while 2 * p <= n:
        p *= 2
    return p, n - p


def _doubling_bytes(seg, w):  # recursive doubling: Σ over m = 1, 2, … p/2 of the range held
    total, m = 0, 1
    while m < len(seg):
        lo = (w // m) * m
        total += sum(seg[lo:lo + m])
        m *= 2
    return total


def expected_sent(c):
    """Bytes index i hands to send, by hand from each algorithm's derivation."""
    n, i, op, mode = c["n"], c["index"], c["op"], c["mode"]
    p, r = _fold(n)
    extra, partner = i < 2 * r and i % 2 == 0, i < 2 * r and i % 2 == 1
    w = i // 2 if partner else i - r  # virtual index (not for an extra)
    if op == "all_reduce":
        N = c["numel"]
        if mode == "ring":  # reduce-scatter sends all blocks but i, all-gather all but i+1
            b = _blocks(N, n)
            return E * (2 * N - b[i] - b[(i + 1) % n])
        if extra:
            return E * N  # folds in, receives the result
        seg = _blocks(N, p)
        return E * ((N - seg[w]) + _doubling_bytes(seg, w) + (N if partner else 0))
    if op in ("reduce_scatter", "all_gather"):
        k = c["k"]
        if mode == "ring":
            return E * (n - 1) * k
        seg = [2 * k if u < r else k for u in range(p)]  # virtual segments
        if op == "reduce_scatter":
            return E * (n * k if extra else (n - 1) * k)
        if extra:
            return E * k
        return E * (_doubling_bytes(seg, w) + ((n - 1) * k if partner else 0))
    if op == "all_to_all":
        return E * (n - 1) * c["k"]
    S = E * c["numel"]
    v = (i - c["root"]) % n
    if op == "reduce":
        return 0 if v == 0 else S
    if mode == "ring":  # chain: every rank but the last forwards S
        return 0 if v == n - 1 else S
    low = v & -v if v else 1 << n.bit_length()  # children v + m for m < lowbit(v) (root: < n)
    return S * sum(1 for j in range(n.bit_length()) if (1 << j) < low and v + (1 << j) < n)


def test_sent_bytes_equal_the_derived_formula(cases):
    checked = 0
    for c in _all(cases):
        if "sent_bytes" not in c:
            continue
        assert c["sent_bytes"] == expected_sent(c), (c["op"], c["mode"], c["n"], c["index"])
        assert sum(b for _, _, b in c["sends"]) == c["sent_bytes"]
        checked += 1
    assert checked > 1000


def test_ring_sends_what_the_ledger_books(cases):
    """Ring on even blocks: measured = the booked (n−1)/n·S formula, per rank."""
    for c in _all(cases):
        even = c.get("k") or (c.get("numel", 1) % c["n"] == 0)
        if c["op"] in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all") \
                and c["mode"] == "ring" and even and "sent_bytes" in c:
            assert c["sent_bytes"] == c["wire_bytes"]


def test_broadcast_and_reduce_total_is_the_booked_total(cases):
    """A tree or a chain sends S to each of n−1 ranks: Σ over ranks = n × (n−1)/n·S booked."""
    groups = {}
    for c in _all(cases):
        if c["op"] in ("broadcast", "reduce"):
            key = (c["n"], c["op"], c["mode"], c["numel"], c["root"])
            groups.setdefault(key, []).append(c)
    for key, cs in groups.items():
        assert len(cs) == key[0]
        assert sum(c["sent_bytes"] for c in cs) == pytest.approx(sum(c["wire_bytes"] for c in cs))


def test_ring_all_reduce_talks_only_to_the_right_neighbour(cases):
    for c in _all(cases):
        if c["op"] == "all_reduce" and c["mode"] == "ring" and c["numel"] >= c["n"]:
            n = c["n"]
            assert {to for _, to, _ in c["sends"]} == {(c["index"] + 1) % n}
            assert {s for s, _, _ in c["sends"]} == set(range(2 * (n - 1)))


def test_cost_module_bytes_agree_with_the_hand_formulas():
    for n in range(2, 9):
        for i in range(n):
            for op, alg, mode in (("all_reduce", "ring", "ring"),
                                  ("all_reduce", "halving_doubling", "tree"),
                                  ("reduce_scatter", "halving_doubling", "tree"),
                                  ("all_gather", "halving_doubling", "tree"),
                                  ("broadcast", "binomial", "tree"), ("broadcast", "chain", "ring"),
                                  ("reduce", "binomial", "tree")):
                p, _ = _fold(n)
                c = {"n": n, "index": i, "op": op, "mode": mode, "k": 2 * p,
                     "numel": 2 * p * n, "root": 0}
                S = E * (c["numel"] if op in ("all_reduce", "broadcast", "reduce") else n * c["k"])
                assert cost.sent_bytes(op, alg, S, n, i) == expected_sent(c), (op, alg, n, i)


# -- selection and the α-β model (no world) ----------------------------------------------------
def test_alpha_beta_hand_worked():
    a, b = 1e-5, 1e-9
    assert cost.time_s("all_reduce", "ring", 1e6, 4, a, b) == pytest.approx(6 * a + 1.5e6 * b)
    assert cost.time_s("all_reduce", "halving_doubling", 1e6, 4, a, b) == \
        pytest.approx(4 * a + 1.5e6 * b)
    # n = 6: p = 4, the fold adds 2(α + S·β)
    assert cost.time_s("all_reduce", "halving_doubling", 1e6, 6, a, b) == \
        pytest.approx(4 * a + 1.5e6 * b + 2 * (a + 1e6 * b))
    assert cost.time_s("broadcast", "binomial", 1e3, 5, a, b) == pytest.approx(3 * (a + 1e3 * b))
    assert cost.time_s("broadcast", "chain", 1e3, 5, a, b) == pytest.approx(4 * (a + 1e3 * b))


def test_auto_picks_trees_for_small_and_rings_for_large():
    assert algorithms.choose("broadcast", "auto", 1024, 8) == "binomial"
    assert algorithms.choose("broadcast", "auto", 64 << 20, 8) == "chain"
    assert algorithms.choose("all_reduce", "auto", 1024, 6) == "halving_doubling"
    assert algorithms.choose("all_reduce", "auto", 64 << 20, 6) == "ring"
    assert algorithms.choose("all_reduce", "native", 64 << 20, 6) is None
    assert algorithms.choose("all_reduce", "ring", 8, 1) is None  # a group of one: nothing moves
    assert algorithms.choose("all_to_all", "tree", 8, 3) == "pairwise"


def test_unknown_collectives_is_a_config_error_before_any_group():
    from shardwise.topology import Topology

    with pytest.raises(ShardwiseConfigError, match=r"--collectives 'rings'.*choose native.*"
                       r"ring, tree.*auto"):
        algorithms.check_collectives("rings")
    with pytest.raises(ShardwiseConfigError, match="choose native"):
        Topology(dp=1, collectives="bogus")  # raises before touching torch.distributed


def test_bench_fit_recovers_alpha_and_beta_and_busbw_is_nccl_tests():
    from shardwise.tools.bench.collectives import BUSBW_FACTOR, fit

    sizes = [1024 * 4 ** j for j in range(8)]
    for op, impl in (("all_reduce", "ring"), ("broadcast", "tree"), ("reduce_scatter", "tree")):
        times = [cost.time_s(op, algorithms.choose(op, impl, S, 4), S, 4, 3e-5, 2e-10)
                 for S in sizes]
        f = fit(op, impl, 4, sizes, times)
        assert f["alpha_s"] == pytest.approx(3e-5, rel=1e-6)
        assert f["beta_s_per_byte"] == pytest.approx(2e-10, rel=1e-6)
    # nccl-tests doc/PERFORMANCE.md: busbw = algbw × 2(n−1)/n, (n−1)/n, 1
    assert BUSBW_FACTOR["all_reduce"](4) == 1.5 and BUSBW_FACTOR["all_gather"](4) == 0.75
    assert BUSBW_FACTOR["broadcast"](8) == 1.0
