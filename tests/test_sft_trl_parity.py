"""Issue 50: one SFT step on a tiny Llama 3.2-style folder (its tokenizer and real chat template:
tests/hf_chat_fixtures.py) logs the loss TRL's ``SFTTrainer`` computes with
``assistant_only_loss=True`` on the same conversations — one process, and under dp 2, ZeRO-3,
tp 2, pp 2 and ``--pack``.

TRL needs ``{% generation %}`` marks, so its tokenizer carries a copy of the template with the
marks added (it renders the same text: tests/test_chat_tokenization.py); our run reads the real,
unmarked folder (the segment rule). The data are the first 17 records of
examples/chat_sample.jsonl: 16 train conversations (the last is held out), and each run's global
batch is all of them — 16 rows, or the 8 packed rows ``--pack`` makes at ``--seq-len 256`` — so
step 1's loss is the mean over every assistant token of the 16 conversations, before any update,
which is what TRL's loss on one batch of the 16 is. TRL's side is its own dataset preparation,
collator and ``compute_loss`` on the trainer's first batch. Tolerance: the parity rule
(:mod:`shardwise.parity`). The one-process case runs in ``make test``; the layouts are
``@pytest.mark.slow`` (``make test-slow``).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("trl")

import hf_chat_fixtures as F  # noqa: E402
from conftest import run_cli  # noqa: E402
from shardwise.parity import ATOL, RTOL  # noqa: E402

pytestmark = pytest.mark.timeout(600)
SEQ, RECORDS, STEPS = 256, 17, 2
LAYOUTS = {"one": ["--dp", "1", "--global-batch", "16", "--micro-batch", "8"],
           "pack": ["--dp", "1", "--pack", "--global-batch", "8", "--micro-batch", "4"],
           "dp2": ["--dp", "2", "--pack", "--global-batch", "8", "--micro-batch", "2"],
           "dp2_zero3": ["--dp", "2", "--zero", "3", "--pack", "--global-batch", "8",
                         "--micro-batch", "2"],
           "tp2": ["--tp", "2", "--pack", "--global-batch", "8", "--micro-batch", "2"],
           "pp2": ["--pp", "2", "--pack", "--global-batch", "8", "--micro-batch", "2"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trlsft")
    folder = F.write_model_folder(root / "llama32", "llama3")
    data = root / "chat.jsonl"
    data.write_text("\n".join(F.CHAT.read_text().splitlines()[:RECORDS]) + "\n")
    return root, folder, data, {}


def run(setup, cache_dir, layout):
    root, folder, data, done = setup
    if layout not in done:
        out = root / layout
        p = run_cli(["train", "--task", "sft", "--init-from-hf", folder, "--data", data,
                     *LAYOUTS[layout], "--steps", STEPS, "--seq-len", SEQ, "--eval-sequences",
                     "1", "--sample-tokens", "4", "--out", out], cache_dir, timeout=300)
        assert p.returncode == 0, p.stdout
        assert "segment rule" in p.stdout, p.stdout
        if "--pack" in LAYOUTS[layout]:
            assert "packed into 8 rows" in p.stdout, p.stdout  # one step sees every example
        done[layout] = [json.loads(x).get("loss")
                        for x in (out / "metrics.jsonl").read_text().splitlines()]
    return done[layout]


@pytest.fixture(scope="module")
def trl_loss(setup):
    """TRL's SFTTrainer loss (assistant_only_loss) on one batch of the 16 conversations."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    root, folder, data, _ = setup
    convs = [json.loads(x)["messages"] for x in data.read_text().splitlines()][:RECORDS - 1]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = F.marked_template("llama3")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = SFTTrainer(model=model, processing_class=tok,
                         train_dataset=Dataset.from_list([{"messages": c} for c in convs]),
                         args=SFTConfig(output_dir=str(root / "trl"), report_to=[], use_cpu=True,
                                        per_device_train_batch_size=len(convs),
                                        assistant_only_loss=True, max_length=None))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == len(convs)
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, batch))


def _close(a, b):
    return abs(a - b) <= ATOL + RTOL * abs(b)


def first_loss(losses):
    return next(x for x in losses if x is not None)


def test_one_process_step_loss_equals_trls_sft_loss(setup, cache_dir, trl_loss):
    ours = first_loss(run(setup, cache_dir, "one"))
    print(f"step 1 loss: ours {ours!r}, TRL {trl_loss!r}, |Δ| {abs(ours - trl_loss):.2e}")
    assert _close(ours, trl_loss), (ours, trl_loss)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "one"])
def test_each_layout_step_loss_equals_trls_and_the_one_process_losses(setup, cache_dir,
                                                                      trl_loss, layout):
    got = run(setup, cache_dir, layout)
    assert _close(first_loss(got), trl_loss), (first_loss(got), trl_loss)
    ref = run(setup, cache_dir, "pack")
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None) and (a is None or _close(a, b)), (got, ref)
