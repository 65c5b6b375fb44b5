"""Packed SFT under context parallelism (issue 55): the document mask and per-document positions
across the chunk boundaries of the load-balanced split.

By hand, in this process: where documents start, what ``shard_sequence`` makes of a packed row,
which chunk pairs ring attention computes or skips. In one 4-rank world (workers/
cp_pack_cases.py): one step on packed chat rows (several documents a row, most longer than a
chunk, assistant-only labels) at cp = 2 and 4 (ring and all-gather), cp = 2 × dp = 2, cp = 2 ×
tp = 2, pp = 2 × cp = 2, a row whose tail chunks hold no counted token, and learned positions:
loss, token count and every gradient equal the packed rows at cp = 1 and the documents run one by one (this
process, the plain model), by the parity rule (:func:`shardwise.parity.compare`: rtol 1e-5,
atol 1e-6); the ledger's cp bytes equal the formula. Planted breaks (positions that continue
across documents, positions that restart at each chunk, the mask dropped at a chunk boundary)
must fail the same comparison.
"""

import functools
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import load_pt, ROOT, run_world
from shardwise.models import lm_loss, positions_kw
from shardwise.parallel.cp import shard_sequence
from shardwise.parallel.cp.attention import _pairs
from shardwise.parallel.cp.split import document_starts
from shardwise.parity import compare

sys.path.insert(0, str(ROOT / "tests" / "workers"))
import cp_pack_cases as W  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
GOOD = [c for c in W.CASES if c not in W.BREAKS]


def test_document_starts_by_hand():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert document_starts(docs).tolist() == [[0, 0, 0, 3, 3, 5, 6, 6], [0] * 8]


def test_shard_sequence_of_a_packed_row_by_hand():
    """s = 16, cp = 2 (docs/context-parallel.md's worked example): documents A (0–6), B (7–12),
    padding (13–15). Rank 1 holds positions 4–11: A's tail and B's head; its positions are the
    documents' own, its document ids where each token's document starts."""
    docs = torch.tensor([[0] * 7 + [1] * 6 + [-1] * 3])
    pos = torch.tensor([list(range(7)) + list(range(6)) + list(range(3))])
    ids = torch.arange(16)[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos, "document_ids": docs}
    topo = SimpleNamespace(size=lambda a: 2, index=lambda a: 1)
    out = shard_sequence(batch, topo)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert out["position_ids"].tolist() == [[4, 5, 6, 0, 1, 2, 3, 4]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 7, 7, 7, 7, 7]]
    r0 = shard_sequence(batch, SimpleNamespace(size=lambda a: 2, index=lambda a: 0))
    assert r0["position_ids"].tolist() == [[0, 1, 2, 3, 5, 0, 1, 2]]
    assert r0["document_ids"].tolist() == [[0, 0, 0, 0, 7, 13, 13, 13]]


def test_ring_skips_the_blocks_no_document_reaches():
    """cp = 4 (chunks 0–7), rank 0 holds chunks 0 and 7. Plain causal: from rank 1 (chunks 1,
    6) it computes chunk 7 against both. If every document of chunk 7 starts in chunk 6 or
    later (reach [0, 6]), chunk 1 is skipped: it cannot attend there."""
    assert list(_pairs(4, 0, 1)) == [(1, 0, False), (1, 1, False)]
    assert list(_pairs(4, 0, 1, [0, 6])) == [(1, 1, False)]
    assert list(_pairs(4, 0, 0, [0, 7])) == [(0, 0, True), (1, 1, True)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_pack")
    run_world(W.__file__, out, nproc=4)
    return out


def _ranks(world, case):
    return [load_pt(f) for f in sorted(world.glob(f"{case}_rank*.pt"))]


@functools.lru_cache(maxsize=None)
def references(which: str, pos: str) -> dict:
    """{"packed": the packed rows at cp = 1, "alone": each document alone in its own forward,
    the token losses summed and divided by the total count} as parity references (one step)."""
    b = W.batches(which)
    m = W.model(pos)
    loss, count = lm_loss(m(b["input_ids"], **positions_kw(b)), b["labels"])
    (loss / count).backward()
    packed = {"loss": [float(loss / count)], "grad_norm": [0.0], "count": int(count),
              "grads": [{n: p.grad.clone() for n, p in m.named_parameters()}]}
    m = W.model(pos)
    total, loss_sum = 0, 0.0
    for x, y in zip(*W.examples(which)):
        lo, c = lm_loss(m(x[None]), y[None])
        lo.backward()
        total, loss_sum = total + int(c), loss_sum + float(lo)
    alone = {"loss": [loss_sum / total], "grad_norm": [0.0], "count": total,
             "grads": [{n: p.grad / total for n, p in m.named_parameters()}]}
    return {"packed": packed, "alone": alone}


def _reports(world, case):
    layout, _, _, which, pos, _ = W.CASES[case]
    refs = references(which, pos)
    for r in _ranks(world, case):
        mine = {"loss": [r["loss"]], "grads": [r["grads"]]}
        # a pipeline stage holds its own layers' gradients only
        yield r, refs, {k: compare(mine, ref, all_names=layout.pp == 1)
                        for k, ref in refs.items()}


@pytest.mark.parametrize("case", GOOD)
def test_packed_cp_equals_cp1_and_the_documents_alone(world, case):
    n = 0
    for r, refs, reps in _reports(world, case):
        n += 1
        assert refs["packed"]["count"] == refs["alone"]["count"] == r["tokens"]
        for what, rep in reps.items():
            assert rep.ok, f"{case} vs {what}:\n" + "\n".join(rep.failures[:6])
    layout, _, ranks, *_ = W.CASES[case]
    assert n == layout.dp * layout.cp * layout.tp * layout.pp
    local = [r["local_tokens"] for r in _ranks(world, case)]  # tp, pp ranks: the same tokens
    assert sum(local) == layout.tp * layout.pp * refs["alone"]["count"]
    if layout.pp > 1:  # the stages together hold every gradient
        names = set().union(*(r["grads"] for r in _ranks(world, case)))
        assert names == set(refs["packed"]["grads"][0])


def test_a_chunk_with_no_counted_token_counts_in_the_global_count(world):
    local = [r["local_tokens"] for r in _ranks(world, "cp4_one_document")]
    assert 0 in local and sum(local) > 0  # and the case passed above


@pytest.mark.parametrize("case", list(W.CASES))
def test_ledger_equals_formula_for_the_cp_tags(world, case):
    for r in _ranks(world, case):
        assert r["ledger"]["cp_kv"] > 0 and r["ledger"] == r["formula"], (case, r["ledger"])


@pytest.mark.parametrize("case", W.BREAKS)
def test_planted_breaks_fail_the_comparison(world, case):
    """Each break is far outside the tolerance (the good cases stay below 0.03 of it)."""
    for _, _, reps in _reports(world, case):
        for what, rep in reps.items():
            assert not rep.ok and rep.tol_ratio > 10, (case, what, rep.tol_ratio)
