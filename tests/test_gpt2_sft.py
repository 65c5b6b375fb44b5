"""The guide's path: ``shardwise train --task sft --init-from-hf ./gpt2-folder --data
alpaca.jsonl`` in the dp, ZeRO-3, tp and pp layouts, with prompt masking, then ``shardwise
export --to hf`` back to a GPT-2 folder that transformers loads.

The GPT-2 folder and the alpaca-style file come from examples/tiny_gpt2.py (a random
GPT2LMHeadModel built by transformers, a byte-level BPE trained locally by ``tokenizers``): no
downloads. Tolerances: losses by the project's parity rule (|Δ| ≤ ATOL + RTOL·|ref|,
:mod:`shardwise.parity`); the step-0 validation loss against transformers' masked loss on the
same rows, and the export's logits, by the same rule (one forward's round-off).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.parity import ATOL, RTOL  # noqa: E402

# make test: dp (the reference), tp (the export's source) and pp; ZeRO-3 is make test-slow's
# (GPT-2 under ZeRO-3 against one process, in process: tests/test_family_parity.py)
LAYOUTS = {"dp2": ["--dp", "2"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
SLOW_LAYOUTS = {"dp2_zero3": ["--dp", "2", "--zero", "3"]}
SEQ, STEPS = 96, 3


def _example():
    path = Path(__file__).parents[1] / "examples" / "tiny_gpt2.py"
    spec = importlib.util.spec_from_file_location("tiny_gpt2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("gpt2sft")
    _example().main([str(root), "--records", "120"])
    out = {name: _sft_run(root, name, flags, cache_dir) for name, flags in LAYOUTS.items()}
    return root, out


def _sft_run(root, name, flags, cache_dir):
    out = root / f"run_{name}"
    p = run_cli(["train", "--task", "sft", "--init-from-hf", root / "gpt2", "--data",
                 root / "alpaca.jsonl", *flags, "--steps", STEPS, "--seq-len", SEQ,
                 "--global-batch", "8", "--micro-batch", "2", "--eval-sequences", "4",
                 "--sample-tokens", "4", "--out", out], cache_dir, timeout=300)
    assert p.returncode == 0, p.stdout
    return out


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _close(a, b):
    return abs(a - b) <= ATOL + RTOL * abs(b)


@pytest.mark.timeout(600)
def test_sft_from_a_gpt2_folder_equals_across_layouts_and_starts_from_the_hf_model(runs):
    root, out = runs
    ref = _metrics(out["dp2"])
    train = [m for m in ref if "loss" in m]
    assert len(train) == STEPS
    for name in LAYOUTS:
        _check_same_losses(name, _metrics(out[name]), ref)
    # step 0's validation loss is transformers' loss on the same 4 rows, prompt tokens masked
    from shardwise.data.sft import prepare_sft_data

    data = prepare_sft_data(root / "alpaca.jsonl", str(root / "gpt2" / "tokenizer.json"),
                            seq_len=SEQ)
    rows, labels = data.val[:4], data.val_labels[:4]
    assert (labels == -100).sum() > (labels != -100).sum()  # the prompts are masked
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "gpt2",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    val0 = next(m["val_loss"] for m in ref if m["step"] == 0)
    assert _close(val0, float(want)), (val0, float(want))


def _check_same_losses(name, got, ref):
    for a, b in zip(got, ref):
        for key in ("loss", "val_loss"):
            if key in b:
                assert _close(a[key], b[key]), (name, key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_sft_from_a_gpt2_folder_in_more_layouts_equals_the_dp_run(runs, cache_dir, name):
    """make test-slow's layouts of the test above (ZeRO-3): the dp run's losses."""
    root, out = runs
    got = _metrics(_sft_run(root, name, SLOW_LAYOUTS[name], cache_dir))
    assert len([m for m in got if "loss" in m]) == STEPS
    _check_same_losses(name, got, _metrics(out["dp2"]))


@pytest.mark.timeout(300)
def test_export_of_the_sft_run_is_a_gpt2_folder_with_its_tokenizer(runs, cache_dir, tmp_path):
    root, out = runs
    hf_dir = tmp_path / "hf"
    p = run_cli(["export", "--checkpoint", out["tp2"], "--to", "hf", hf_dir], cache_dir,
                timeout=120)
    assert p.returncode == 0, p.stdout
    assert "GPT2LMHeadModel" in p.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    from shardwise.interop.hf import checkpoint_model_config, model_for, read_checkpoint

    state, meta, _ = read_checkpoint(out["tp2"])
    ours = model_for(checkpoint_model_config(state, meta)).eval()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert missing == ["output.weight"] and not unexpected  # tied: the embedding itself
    x = torch.randint(0, hf.config.vocab_size, (2, SEQ),
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    assert bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all()), float((a - b).abs().max())
    # the tokenizer is the folder's, as transformers reads it
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    src = transformers.AutoTokenizer.from_pretrained(root / "gpt2")
    text = "### Instruction:\nReverse the word.\n\n### Input:\nriver"
    assert tok(text)["input_ids"] == src(text)["input_ids"]
    assert tok.eos_token_id == src.eos_token_id == hf.config.eos_token_id
