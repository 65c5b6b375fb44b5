"""SFT: alpaca records → masked labels; prompt tokens contribute nothing; rows never see each
other; a few steps under dp=2 give the one-process losses."""

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli
from shardwise.data import ByteTokenizer
from shardwise.data.sft import (
    IGNORE_INDEX,
    PROMPT_NO_INPUT,
    encode_example,
    format_prompt,
    prepare_sft_data,
)
from shardwise.models import build_model, lm_loss

SAMPLE = ROOT / "examples" / "sft_sample.jsonl"
RECORDS = [
    {"instruction": "Add.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "output": "Hello there, friend!"},
    {"instruction": "Reverse it.", "input": "abc", "output": "cba"},
    {"instruction": "Plural of cat?", "input": "", "output": "cats"},
]


def _write(tmp_path, records) -> Path:
    f = tmp_path / "sft.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return f


def test_labels_count_exactly_the_response_and_eos():
    """Hand-worked with the byte tokenizer: the prompt's bytes are known, so the first counted
    target is at position len(prompt) − 1 and the counted targets are output bytes + EOS."""
    tok, rec = ByteTokenizer(), RECORDS[1]
    prompt = PROMPT_NO_INPUT.format(instruction="Say hi.")
    assert format_prompt(rec) == prompt and prompt.endswith("### Response:\n")
    tokens, labels, kept = encode_example(tok, rec, seq_len=256)
    n_p = len(prompt.encode())
    counted = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    assert counted == list(range(n_p - 1, n_p - 1 + len("Hello there, friend!") + 1))
    assert labels[labels != IGNORE_INDEX].tolist() == list(b"Hello there, friend!") + [256]
    assert tokens[:n_p].tolist() == list(prompt.encode()) and kept == 21
    # right truncation keeps the prompt and cuts the response; a prompt filling the row is dropped
    _, lab_cut, kept_cut = encode_example(tok, rec, seq_len=n_p + 4)
    assert kept_cut == 5 and lab_cut[lab_cut != IGNORE_INDEX].tolist() == list(b"Hello")
    assert encode_example(tok, rec, seq_len=n_p - 1) is None


def test_prompt_and_padding_contribute_zero_gradient_and_loss_is_the_response_mean(tmp_path):
    data = prepare_sft_data(_write(tmp_path, RECORDS * 2), "bytes", seq_len=256, val_every=4)
    x, y = data.train[:4, :-1], data.train_labels[:4]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=257)
    logits = model(x)
    logits.retain_grad()
    loss_sum, count = lm_loss(logits, y)
    (loss_sum / count).backward()
    masked = y == IGNORE_INDEX
    assert masked.any() and (~masked).any()
    assert torch.all(logits.grad[masked] == 0)  # exactly zero, not just small
    assert torch.all(logits.grad[~masked].abs().sum(-1) > 0)

    # the loss by hand: positions and targets from the record strings, not from the labels
    recs = [r for i, r in enumerate(RECORDS * 2) if i % 4 != 3][:4]
    logp = torch.log_softmax(logits.detach().double(), -1)
    terms = []
    for b, r in enumerate(recs):
        n_p = len(format_prompt(r).encode())
        target = list(r["output"].encode()) + [256]
        terms += [-logp[b, n_p - 1 + j, t] for j, t in enumerate(target)]
    assert int(count) == len(terms)
    by_hand = float(torch.stack(terms).mean())
    assert float(loss_sum.detach() / count) == pytest.approx(by_hand, rel=1e-6)

    # perturb every masked input token after each example (the padding): nothing changes, so
    # an example never attends to what follows it in its row (one example per row, causal)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    x2 = x.clone()
    for b, r in enumerate(recs):
        end = len(format_prompt(r).encode()) + len(r["output"].encode()) + 1  # tokens used
        x2[b, end:] = torch.randint(0, 257, (x.shape[1] - end,))
    assert not torch.equal(x, x2)
    loss2_sum, _ = lm_loss(model(x2), y)
    (loss2_sum / count).backward()
    assert float(loss2_sum.detach()) == float(loss_sum.detach())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_sample_file_parses_and_fits():
    data = prepare_sft_data(SAMPLE, "bytes", seq_len=256)
    assert data.stats["records"] >= 40 and data.stats["train_dropped"] == 0
    assert len(data.val) >= 2 and 0 < data.stats["padding_fraction"] < 1


SFT = ["train", "--task", "sft", "--data", SAMPLE, "--model", "tiny", "--tokenizer", "bpe",
       "--vocab-size", "400", "--seq-len", "96", "--global-batch", "8", "--micro-batch", "2",
       "--steps", "6", "--lr", "3e-3", "--warmup-steps", "1", "--eval-every", "3",
       "--eval-sequences", "2", "--sample-tokens", "8"]


@pytest.mark.timeout(300)
def test_sft_under_dp2_logs_the_one_process_losses(cache_dir, tmp_path):
    """Same seed and global batches: dp=2 (2 ranks, different token counts per rank) must give
    the dp=1 run's token-weighted losses; the counted tokens are response tokens only."""
    runs = {}
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}"
        p = run_cli([*SFT, "--dp", str(dp), "--out", out], cache_dir, timeout=280)
        assert p.returncode == 0, p.stdout
        runs[dp] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    one, two = ([r for r in runs[d] if "loss" in r] for d in (1, 2))
    assert [r["step"] for r in two] == list(range(1, 7))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-6)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert two[-1]["loss"] < two[0]["loss"]
    # counted tokens per step = response tokens of the sampled examples: far fewer than 8 × 96
    per_step = [b["tokens"] - a["tokens"] for a, b in zip(two, two[1:])]
    assert all(0 < n < 8 * 96 / 2 for n in per_step), per_step
    assert "SFT" in p.stdout and "padding" in p.stdout
