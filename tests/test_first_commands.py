"""The first commands a newcomer types just work (issue 23): each layout with no batch flag runs,
and the start-up line says which micro-batch (and pipeline microbatches) was derived from the
layout. The five runs go one after another (up to 8 gloo workers each, ~10–30 s on 2 cores); the
derivation rule itself is unit-tested, without a world, in tests/test_default_layout.py."""

import json
import tomllib

import pytest
import torch

from conftest import run_cli

# only what keeps a run small and offline (as tests/test_cli.py): no batch flag
SMALL = ["train", "--steps", "2", "--tokenizer", "bytes", "--seq-len", "32"]


def _slow(layout, note):  # make test-slow's: dp 8 and tp 4 (make test derives over dp 4, pp 4, 3D)
    return pytest.param(layout, note, marks=pytest.mark.slow, id=" ".join(layout))


@pytest.mark.parametrize("layout,note", [
    (["--dp", "4"], "micro-batch 4 (derived: global batch 16 / dp 4; pass --micro-batch to choose)"),
    _slow(["--dp", "8", "--zero", "3"], "micro-batch 2 (derived: global batch 16 / dp 8;"),
    # the tiny model's 2 kv heads do not split over 4: small's do (2 layers keep it quick)
    _slow(["--tp", "4", "--model", "small", "--n-layers", "2"],
          "micro-batch 8 (derived: global batch 16 / dp 1;"),
    # the tiny model's 2 layers are too few for 4 stages
    (["--pp", "4", "--n-layers", "4"], "micro-batch 4, 4 microbatches (derived: global batch 16 "
                                       "/ dp 1 = 16 sequences per pipeline, at least pp 4"),
    (["--dp", "2", "--tp", "2", "--pp", "2"], "micro-batch 4, 2 microbatches (derived: global "
                                              "batch 16 / dp 2 = 8 sequences per pipeline"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_layout_with_no_batch_flag_runs_and_says_what_was_derived(cache_dir, tmp_path,
                                                                    layout, note):
    out = tmp_path / "r"
    argv = [*SMALL, "--model", "tiny", *layout, "--out", out]  # a later --model wins
    p = run_cli(argv, cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    head = p.stdout.split("step 0:")[0]  # the start-up lines, before the first evaluation
    assert note in head, p.stdout
    assert "[rank 0] done in" in p.stdout, p.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["derived"] in ("micro_batch", "micro_batch,microbatches")
    # issue 51: --device auto (the default) says what it picked and config.toml keeps "auto";
    # the layout is named in the field's words (tests/test_device_auto.py: the words)
    assert saved["device"] == "auto"
    if not torch.cuda.is_available():
        assert "[rank 0]   device cpu (auto: no CUDA), backend gloo\n" in head, head
    if "--zero" in layout:
        assert "[rank 0]   ZeRO-3 / FSDP: parameters, gradients and AdamW state sharded over " \
               "dp = 8 — our ZeRO-3" in head, head
    if layout[0] == "--dp" and layout[1] == "4":  # resumed from its own config.toml: the same
        p = run_cli(["train", "--config", out / "config.toml", "--steps", "3", "--resume",
                     "auto"], cache_dir, timeout=240)
        assert p.returncode == 0, p.stdout
        assert "micro-batch 4 (derived: global batch 16 / dp 4;" in p.stdout, p.stdout
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


# make test: dp 1 and tp 2 (dp 2 and pp 2 are make test-slow's: the cases above run dp 4 and
# pp 4 with no batch flag, the layout line of every degree is the same code)
@pytest.mark.parametrize("layout,world", [(["--dp", "1"], 1),
                                          pytest.param(["--dp", "2"], 2, marks=pytest.mark.slow),
                                          (["--tp", "2"], 2),
                                          pytest.param(["--pp", "2"], 2, marks=pytest.mark.slow)],
                         ids=lambda a: " ".join(a) if isinstance(a, list) else str(a))
def test_each_small_degree_runs_with_the_defaults(cache_dir, tmp_path, layout, world):
    """Degrees 1 and 2 of dp, tp and pp, one flag each (4 and 8 are the cases above): the run
    says its layout and world, trains its 2 steps and derives the micro-batch it was not given."""
    out = tmp_path / "r"
    p = run_cli([*SMALL, "--model", "tiny", *layout, "--out", out], cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    degrees = {"dp": 1, "tp": 1, "pp": 1, layout[0][2:]: int(layout[1])}
    assert f"layout pp={degrees['pp']} × dp={degrees['dp']} × tp={degrees['tp']} ({world} " \
           f"rank" in p.stdout, p.stdout
    assert f"(derived: global batch 16 / dp {degrees['dp']}" in p.stdout, p.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


@pytest.mark.parametrize("layout,needles", [
    (["--tp", "8"], ["--tp 8 does not divide the model's n_kv_heads=4", "choose --tp from "
                                                                       "{1, 2, 4}"]),
    (["--pp", "8"], ["the model has 4 layers, too few for 8 pipeline stages", "--n-layers 8"]),
], ids=["tp 8", "pp 8"])
def test_a_degree_the_default_model_cannot_take_is_refused_with_the_fix(cache_dir, tmp_path,
                                                                        layout, needles):
    """Degree 8 of tp and pp on the default model (small: 4 kv heads, 4 layers): refused before
    any rank starts, naming the constraint and the fix."""
    p = run_cli(["train", "--steps", "2", *layout, "--out", tmp_path / "r"], cache_dir,
                timeout=120)
    assert p.returncode != 0
    for needle in needles:
        assert needle in p.stdout, p.stdout
    assert "[rank" not in p.stdout, p.stdout  # nothing was spawned
