"""Import → training in dp=2, ZeRO-3, tp=2 (with and without SP, with activation
checkpointing), pp=2 and cp=2 equals one process, on both engines (explicit; PyTorch: FSDP2,
DTensor TP, torch.distributed.pipelining), for every model family beyond Llama (GPT-2: learned positions, LayerNorm biases, GELU, biased
projections, fused-and-split q‖k‖v; Qwen2: qkv biases; Qwen3: per-head q/k RMSNorm, head_dim
≠ d/h; Mistral), in loss, gradient norm, every gradient and every parameter, by the project's
parity rule (:mod:`shardwise.parity`). The HF folders are built by transformers from tiny
configs (tests/test_hf_families.py) and written into the world's folder; one 2-rank world
(tests/workers/family_cases.py) runs every case."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.data import DistributedSampler  # noqa: E402
from shardwise.parity import assert_parity, reference_run, stages_together  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from conftest import load_pt, split_worlds, world_of  # noqa: E402
import family_cases as W  # noqa: E402
from test_hf_families import hf_folder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _hf_folders(out):
    for family in W.FAMILIES:
        hf_folder(out, family)  # out/<family>: config.json, model.safetensors, tokenizer


# the world of W.is_slow's cases: results_slow (``make test-slow``)
results_fast, results_slow = split_worlds(W.__file__, "families", nproc=2, prepare=_hf_folders)


@pytest.fixture
def results(request):
    """The folder of the world that ran this test's case."""
    p = request.node.callspec.params
    return world_of(request, W.is_slow(p["family"], p["layout"]))


_REFS: dict = {}


@pytest.fixture
def references(results):
    """shardwise.parity's one-process reference per family, from the same imported model (the
    HF folders of both worlds are the same bytes: built from the same configs and seeds)."""
    if not _REFS:
        work = W.workload()
        sampler = DistributedSampler(64, W.GLOBAL_BATCH, 1, 0, seed=0)
        batches = [work.batches(sampler.next_global_batch(), W.GLOBAL_BATCH)[0]
                   for _ in range(W.STEPS)]
        _REFS.update({f: reference_run(W.imported_model(str(results / f)), batches,
                                       lrs=[W.LR] * W.STEPS, max_norm=W.MAX_NORM)
                      for f in W.FAMILIES})
    return _REFS


def _params():
    """(family, layout) pairs, W.is_slow's marked slow."""
    return [pytest.param(f, lay, id=f"{f}-{lay}",
                         marks=pytest.mark.slow if W.is_slow(f, lay) else ())
            for f in W.FAMILIES for lay in W.LAYOUTS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,layout", _params())
def test_imported_family_trains_like_one_process(results, references, family, layout):
    ref = references[family]
    assert all(n > W.MAX_NORM for n in ref["grad_norm"])  # clipping binds
    recs = [load_pt(results / f"{family}_{layout}_rank{r}.pt")
            for r in range(2)]
    whole = stages_together([rec["params"] for rec in recs])
    assert all(set(p) == set(ref["params"][0]) for p in whole), \
        "the ranks together must hold every parameter"
    for rank, rec in enumerate(recs):
        assert rec["grads"][0], f"rank {rank} holds no gradients"
        assert_parity({**rec, "params_full": whole}, ref, where=f"{family} {layout} rank {rank}",
                      all_names="pp" not in layout)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,layout", _params())
def test_ledger_equals_formula(results, family, layout):
    """Every step's bytes per ledger tag equal the engine's formula (the families' biases,
    LayerNorm biases, positions and q/k norms included: tp_replicated_numel, f_summed_bytes)."""
    for rank in range(2):
        rec = load_pt(results / f"{family}_{layout}_rank{rank}.pt")
        for got, want in zip(rec["bytes"], rec["formula"]):
            tags = (set(got) | set(want)) - {"total"}
            for tag in sorted(tags):
                assert got.get(tag, 0.0) == pytest.approx(want.get(tag, 0.0), rel=1e-9), \
                    (family, layout, rank, tag, got, want)
