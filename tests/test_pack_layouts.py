"""``--pack`` in the layouts: the packed rows' loss (token mean over the same counted tokens)
and every gradient equal the unpacked rows' in dp, ZeRO-3, tp (with and without SP) and pp, and
both equal the one-process reference (the plain model, the whole unpacked batch, mean token
loss). One 2-rank world runs every case (tests/workers/pack_cases.py). Tolerance: the parity
rule (:mod:`shardwise.parity`)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_world  # noqa: E402
import pack_cases as W  # noqa: E402
from shardwise.models import lm_loss  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("pack")
    run_world(W.__file__, out, nproc=2)
    return out


@pytest.fixture(scope="module")
def reference():
    b = W.batches()["unpacked"]
    m = W.model()
    loss, count = lm_loss(m(b["input_ids"]), b["labels"])
    (loss / count).backward()
    return float(loss / count), {n: p.grad for n, p in m.named_parameters()}


def close(a, b, what):
    d = (a - b).abs()
    assert bool((d <= ATOL + RTOL * b.abs()).all()), f"{what}: max |Δ| {float(d.max()):.3g}"


@pytest.mark.parametrize("layout", list(W.LAYOUTS))
def test_packed_equals_unpacked_and_one_process(world, reference, layout):
    ref_loss, ref_grads = reference
    assert W.batches()["packed"]["input_ids"].shape[0] < len(W.batches()["unpacked"]["labels"])
    for rank in range(2):
        u = load_pt(world / f"{layout}_unpacked_rank{rank}.pt")
        p = load_pt(world / f"{layout}_packed_rank{rank}.pt")
        close(torch.tensor(p["loss"]), torch.tensor(u["loss"]), f"{layout} loss")
        close(torch.tensor(u["loss"]), torch.tensor(ref_loss), f"{layout} loss vs one process")
        assert set(p["grads"]) == set(u["grads"]) and p["grads"]
        for n, g in p["grads"].items():
            close(g, u["grads"][n], f"{layout} rank {rank} {n}")
            close(g, ref_grads[n], f"{layout} rank {rank} {n} vs one process")
