"""Issue 36's acceptance path on a tiny Llama 3.2-style folder (llama3 RoPE scaling, tied
embeddings, a ChatML chat template) and a Mistral folder (sliding window 256):
``shardwise train --task sft --pack --init-from-hf DIR --data examples/chat_sample.jsonl`` in
the dp, ZeRO-3, tp and pp layouts logs the one-process losses, then ``shardwise export`` gives a
folder transformers loads with equal logits.

The folders are built by transformers from tiny random configs (no downloads), with the byte
tokenizer's files. Tolerance: the parity rule (:mod:`shardwise.parity`). The layouts are
``@pytest.mark.slow`` (``make test-slow``; tests/test_sft_trl_parity.py checks the same layouts
against TRL there too); ``make test`` keeps the one-process runs and the export.
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.data import ByteTokenizer  # noqa: E402
from shardwise.interop.hf import write_tokenizer_files  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

pytestmark = pytest.mark.timeout(1200)  # the module's fixture runs six CLI trainings
CHAT = Path(__file__).parents[1] / "examples" / "chat_sample.jsonl"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYOUTS = {"one": ["--dp", "1"], "dp2": ["--dp", "2"], "dp2_zero3": ["--dp", "2", "--zero", "3"],
           "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
SEQ, STEPS = 256, 3


def folder(root, family):
    common = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=256,
                  eos_token_id=256)
    if family == "llama32":
        cfg = transformers.LlamaConfig(**common, max_position_embeddings=512,
                                       tie_word_embeddings=True, rope_parameters={
                                           "rope_type": "llama3", "rope_theta": 10000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    else:
        cfg = transformers.MistralConfig(**common, max_position_embeddings=512,
                                         sliding_window=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / family)
    write_tokenizer_files(ByteTokenizer(), root / family, 512)
    tc = json.loads((root / family / "tokenizer_config.json").read_text())
    (root / family / "tokenizer_config.json").write_text(json.dumps({**tc,
                                                                     "chat_template": CHATML}))
    return root / family


class Runs:
    """The module's CLI runs, each made when a test first asks for it (so ``make test``, which
    leaves the slow layout tests out, trains only the two one-process runs)."""

    def __init__(self, root, cache_dir):
        self.root, self.cache_dir, self.out, self.src = root, cache_dir, {}, {}

    def __getitem__(self, key):
        family, name = key
        if family not in self.src:
            self.src[family] = folder(self.root, family)
        if key not in self.out:
            run = self.root / f"{family}_{name}"
            p = run_cli(["train", "--task", "sft", "--pack", "--init-from-hf", self.src[family],
                         "--data", CHAT, *LAYOUTS[name], "--steps", STEPS, "--seq-len", SEQ,
                         "--global-batch", "8", "--micro-batch", "2", "--eval-sequences", "4",
                         "--sample-tokens", "4", "--out", run], self.cache_dir, timeout=300)
            assert p.returncode == 0, p.stdout
            assert "chat template" in p.stdout and "packed into" in p.stdout, p.stdout
            self.out[key] = run
        return self.out[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    # Mistral in every layout: tests/test_family_parity.py; here its window through SFT
    root = tmp_path_factory.mktemp("llama3sft")
    return root, Runs(root, cache_dir)


def losses(run):
    return [json.loads(x).get("loss") for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the same layouts, against TRL too: tests/test_sft_trl_parity.py (slow)
@pytest.mark.parametrize("family,layout", [("llama32", k) for k in LAYOUTS if k != "one"])
def test_layouts_log_the_one_process_losses(runs, family, layout):
    _, out = runs
    ref, got = losses(out[family, "one"]), losses(out[family, layout])
    assert len(got) == len(ref) and any(x is not None for x in got)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= ATOL + RTOL * abs(b)), \
            (got, ref)


@pytest.mark.parametrize("family", ["llama32", "mistral"])
def test_export_reloads_in_transformers_with_equal_logits(runs, cache_dir, family):
    root, out = runs
    hf_dir = root / f"{family}_hf"
    p = run_cli(["export", "--checkpoint", out[family, "one"], "--to", "hf", hf_dir], cache_dir,
                timeout=120)
    assert p.returncode == 0, p.stdout
    meta = json.loads((hf_dir / "config.json").read_text())
    if family == "llama32":
        assert meta["rope_parameters"]["rope_type"] == "llama3" and meta["tie_word_embeddings"]
    else:
        assert meta["sliding_window"] == SEQ
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    from shardwise.interop.hf import hf_model_overrides, load_hf_weights
    from shardwise.models import Llama, LlamaConfig

    ours = Llama(LlamaConfig(**hf_model_overrides(hf_dir))).eval()
    load_hf_weights(ours, hf_dir)
    x = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(x).logits
        d = (ours(x) - ref).abs()
    assert bool((d <= ATOL + RTOL * ref.abs()).all()), float(d.max())
