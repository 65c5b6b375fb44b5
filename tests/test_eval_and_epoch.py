"""Distributed evaluation counts each validation sequence exactly once at every dp, and the
dropped epoch tail is reported (issue 13, items 2 and 3).

* One 4-rank world (tests/workers/eval_cases.py) evaluates the initial tiny model under plain DP
  (dp 1, 2, 3), ZeRO-3, FSDP, dp × tp and pp × dp, over ``n`` validation rows with ``n`` not a
  multiple of dp or below dp; each loss must equal a plain-PyTorch token-weighted mean over
  exactly the first ``n`` rows, computed here, and every rank of a layout must run the same
  number of forwards.
* One CLI run (dp=2, ZeRO-3, 10 training sequences, global batch 4, 3 validation sequences over
  micro-batches of 1): ``summary.json`` holds the epoch counts by hand (2 steps, 2 dropped), the
  start-up log says so, and the step-0 validation loss equals a reference computed from the
  data file's bytes.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import TrainConfig
from shardwise.data import DistributedSampler
from shardwise.models import IGNORE_INDEX, build_model
from shardwise.parity import ATOL, RTOL
from shardwise.train.loop import eval_shard

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, run_cli, run_world  # noqa: E402
import eval_cases as W  # noqa: E402


def _mean_loss(model, input_ids, labels):
    """Token-weighted mean cross-entropy of a plain model over all rows at once (fp64 loss)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids).double()  # [n, seq, V]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return float(total / (labels != IGNORE_INDEX).sum())


# -- the split itself ---------------------------------------------------------------------------
def test_eval_shard_covers_each_row_once_with_equal_forwards():
    """Over every rank, the shares are 0..n-1 exactly once, and the forwards each rank runs
    cover its own share and equal the most loaded rank's micro-batch count (hand formula)."""
    for n in range(1, 26):
        for dp in range(1, 6):
            for micro in (1, 2, 3, 8):
                shares = [eval_shard(n, dp, r, micro) for r in range(dp)]
                rows = torch.cat([idx for idx, _ in shares]).tolist()
                assert sorted(rows) == list(range(n)), (n, dp, micro)
                most = max(len(idx) for idx, _ in shares)
                assert {f for _, f in shares} == {(most + micro - 1) // micro}, (n, dp, micro)


# -- evaluation under every kind of layout, one world -------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    run_world(W.__file__, out, nproc=4)
    return out


def _reference(n):
    work = W.workload()
    (mb,) = work.batches(torch.arange(n), n, split="val")  # the first n rows, masked labels
    return _mean_loss(W.make_model(), mb["input_ids"], mb["labels"])


@pytest.mark.timeout(300)
def test_eval_loss_is_the_same_at_every_layout(world):
    """Every layout's loss = the plain-model loss over exactly the first n validation rows (and
    so = dp=1's); every rank ran ceil(ceil(n / dp) / micro) forwards."""
    refs = {n: _reference(n) for n in {c[3] for c in W.CASES}}
    assert abs(refs[22] - _reference(21)) > 10 * RTOL * refs[22]  # a row more or less shows
    for name, kw, _, n, micro in W.CASES:
        dp = kw.get("dp", 1)
        ranks = range(kw.get("pp", 1) * dp * kw.get("tp", 1))
        got = [load_pt(world / f"{name}_rank{r}.pt") for r in ranks]
        for r, g in zip(ranks, got):
            assert g["loss"] == pytest.approx(refs[n], rel=RTOL, abs=ATOL), (name, r)
            assert g["calls"] == -(-(-(-n // dp)) // micro), (name, r)
    dp1 = load_pt(world / "dp1_n22_rank0.pt")["loss"]
    for name in ("dp2_n22", "dp3_n22", "dp3_n22_mb1"):
        assert load_pt(world / f"{name}_rank0.pt")["loss"] == pytest.approx(dp1, rel=RTOL)


# -- the CLI: epoch counts in summary.json, and evaluation through the whole run ----------------
def _write_data(folder: Path) -> str:
    """20 documents: 0..18 train (8 characters + EOS each: 171 bytes-tokenizer tokens → 10
    rows of 17), 19 validation (373 + EOS = 374 tokens → 22 rows). Returns document 19."""
    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz .,;()=\n"
    for i in range(20):
        size = 373 if i == 19 else 8
        picks = torch.randint(0, len(alphabet), (size,), generator=g).tolist()
        (folder / f"d{i:02d}.txt").write_text("".join(alphabet[p] for p in picks))
    return (folder / "d19.txt").read_text()


@pytest.mark.timeout(300)
def test_cli_reports_the_epoch_tail_and_counts_each_val_row_once(tmp_path, cache_dir):
    val_doc = _write_data(tmp_path / "data")
    out = tmp_path / "run"
    p = run_cli(["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "16",
                 "--data", tmp_path / "data", "--dp", "2", "--zero", "3", "--global-batch", "4",
                 "--micro-batch", "1", "--eval-sequences", "3", "--steps", "1", "--out", out],
                cache_dir)
    assert p.returncode == 0, p.stdout
    summary = json.loads((out / "summary.json").read_text())
    # hand count: 10 training sequences, global batch 4 → 2 steps, 10 − 2·4 = 2 dropped
    assert (summary["sequences_per_epoch"], summary["steps_per_epoch"],
            summary["dropped_per_epoch"]) == (10, 2, 2)
    assert "epoch: 10 training sequences = 2 steps × 4 + 2 dropped" in p.stdout
    # step-0 validation loss: the first 3 rows of document 19's bytes + EOS, on the same init
    tokens = torch.tensor(list(val_doc.encode()) + [256])
    rows = tokens[: 3 * 17].reshape(3, 17)  # [3, seq_len + 1]
    cfg = TrainConfig()
    torch.manual_seed(cfg.seed)
    model = build_model("tiny", vocab_size=257, tie_embeddings=cfg.tie_embeddings,
                        dropout=cfg.dropout)
    ref = _mean_loss(model, rows[:, :-1], rows[:, 1:])
    assert summary["val_loss_start"] == pytest.approx(ref, rel=RTOL, abs=ATOL)


def test_sampler_epoch_counts_by_hand():
    """sequences = steps × global batch + dropped, for a few hand-checked splits."""
    for n, batch, dp, want in ((10, 4, 1, (10, 2, 2)), (20, 8, 2, (20, 2, 4)),
                               (12, 4, 2, (12, 3, 0)), (7, 7, 1, (7, 1, 0))):
        counts = DistributedSampler(n, batch, dp, 0).epoch_counts()
        assert (counts["sequences_per_epoch"], counts["steps_per_epoch"],
                counts["dropped_per_epoch"]) == want
