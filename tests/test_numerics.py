"""The numerics slot of ``parallelize`` (issue 52): a transform given as ``numerics=`` runs on
the plain model before tensor parallelism, so it reaches every ``nn.Linear`` in every layout
(a mixture of experts' stacked expert matmuls are none) —
our TP layers (which call their op themselves), DTensor TP, ZeRO-3, FSDP2, pipeline stages,
context and expert parallelism — and the layout still equals one process running the same
transform. The transform: a weight fake-quantizer (tests/workers/numerics_cases.py)."""

from pathlib import Path

import pytest

from conftest import load_pt, run_world
from shardwise.parity import ATOL, RTOL

W = Path(__file__).parent / "workers" / "numerics_cases.py"
# the layouts an engine refuses, by design: torch's context parallelism is CUDA's; PyTorch has
# no expert-parallel module (docs/expert-parallel.md)
REFUSED = {("cp", "torch"), ("ep", "torch")}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)  # docs/parity.md: the loss at a step


@pytest.mark.timeout(600)
def test_a_numerics_transform_reaches_every_linear_in_every_layout(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("numerics_cases", W)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    run_world(W, tmp_path, nproc=2)
    ran = 0
    for name in cases.CASES:
        ref = load_pt(tmp_path / f"{name}_ref.pt")
        q, plain = ref["quantized"][0], ref["plain"][0]
        assert ref["linears"], name
        assert not _close(q, plain), (name, q, plain)  # the transform changes the loss
        for engine in cases.ENGINES:
            recs = [load_pt(tmp_path / f"{name}_{engine}_rank{r}.pt") for r in range(2)]
            if (name, engine) in REFUSED:
                assert all("refused" in r for r in recs), (name, engine, recs)
                continue
            assert not any("refused" in r for r in recs), (name, engine, recs)
            seen = set().union(*(r["seen"] for r in recs))
            assert seen == set(ref["linears"]), (name, engine, sorted(set(ref["linears"]) - seen))
            for r in recs:
                assert _close(r["losses"][0], q), (name, engine, r["losses"][0], q)
            ran += 1
    assert ran == len(cases.CASES) * len(cases.ENGINES) - len(REFUSED)
