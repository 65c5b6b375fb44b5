"""The command line end to end: a short run of the embedded default, trace, each layout's run
against the dp=2 run (verify: tests/test_verify_n4.py and tests/test_verify_n8.py)."""

import json
import re
import tomllib

import pytest

from conftest import run_cli
from shardwise.models import build_model


@pytest.fixture(scope="module")
def short_run(cache_dir, tmp_path_factory):
    """`shardwise train` on the embedded default corpus (BPE tokenizer), tiny model, dp=2."""
    out = tmp_path_factory.mktemp("run") / "r"
    p = run_cli(["train", "--model", "tiny", "--dp", "2", "--steps", "40", "--seq-len", "64",
                 "--lr", "3e-3",
                 "--warmup-steps", "5", "--eval-every", "20", "--vocab-size", "1024",
                 "--out", out], cache_dir, timeout=400)
    assert p.returncode == 0, p.stdout
    return out, p.stdout


def test_short_run_of_the_embedded_default_lowers_validation_loss(short_run):
    out, stdout = short_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3  # steps 0, 20, 40
    assert val[-1] < val[0] - 0.5, val
    assert "embedded stdlib corpus" in stdout and "[rank 0]" in stdout


def test_run_folder_follows_the_contract(short_run):
    out, _ = short_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s",
                "comm_bytes"):
        assert key in steps[0], key
    assert steps[-1]["tokens"] == 40 * 16 * 64  # every label counted in packed text
    cfg = tomllib.loads((out / "config.toml").read_text())
    assert cfg["steps"] == 40 and cfg["dp"] == 2 and cfg["model"] == "tiny"
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["ratio"] == pytest.approx(1.0, abs=1e-12)
    assert (out / "loss.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    ckpt = out / "checkpoints" / "step_40"
    assert (ckpt / ".metadata").exists() and (ckpt / "meta.json").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_40"
    assert len((out / "sample.txt").read_text()) > 20


def test_memory_in_metrics_matches_fp32_adam_counts(short_run):
    """DP holds params 4Ψ, grads 4Ψ, Adam moments 8Ψ (+ one fp32 step counter per tensor)."""
    out, _ = short_run
    psi = json.loads((out / "summary.json").read_text())["params"]
    n_tensors = len(list(build_model("tiny", vocab_size=1024).parameters()))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in rows if "loss" in r):
        assert r["mem_params_bytes"] == 4 * psi and r["mem_grads_bytes"] == 4 * psi
        assert r["mem_optimizer_bytes"] == 8 * psi + 4 * n_tensors
        assert r["mem_bytes"] == 16 * psi + 4 * n_tensors


def test_comm_bytes_per_step_match_the_dp_formula(short_run):
    """comm_bytes = 2(n−1)/n·4Ψ (gradients) + two fp64 scalars, n = 2, Ψ counted here."""
    out, _ = short_run
    vocab = json.loads((out / "summary.json").read_text())
    psi = vocab["params"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = 2 * (2 - 1) / 2 * 4 * psi + 2 * (2 * (2 - 1) / 2 * 8)
    assert all(r["comm_bytes"] == pytest.approx(expected, rel=1e-12) for r in rows if "loss" in r)


def test_trace_prints_every_collective_and_matches_formula(cache_dir):
    p = run_cli(["trace", "--dp", "2", "--bucket-mb", "0.05"], cache_dir, timeout=120)
    assert p.returncode == 0, p.stdout
    psi = sum(t.numel() for t in build_model("tiny", vocab_size=4096).parameters())
    grad = 2 * (2 - 1) / 2 * 4 * psi  # 2(n−1)/n × 4Ψ, n = 2
    m = re.search(r"grad\s+([\d,.]+)\s+([\d,.]+)\s+([\d.]+)", p.stdout)
    assert m, p.stdout
    assert float(m.group(1).replace(",", "")) == pytest.approx(grad)
    assert float(m.group(2).replace(",", "")) == pytest.approx(grad)
    m = re.search(r"total \(rank 0\)\s+([\d,.]+)\s+([\d,.]+)", p.stdout)
    assert float(m.group(1).replace(",", "")) == pytest.approx(grad + 16)  # + 2 fp64 scalars
    assert len(re.findall(r"all_reduce\s+dp\s+2 grad", p.stdout)) > 1  # several buckets


def test_trace_with_our_ring_expands_each_collective_into_its_sends(cache_dir):
    """ZeRO-3 over dp=2 with --collectives ring: each reduce-scatter and all-gather sends one
    shard, (n−1)/n · S, to the other rank in one step; measured = booked for the whole step
    (a row may end with its unit and pass: the ``for`` column)."""
    p = run_cli(["trace", "--collectives", "ring", "--dp", "2", "--zero", "3"], cache_dir,
                timeout=120)
    assert p.returncode == 0, p.stdout
    rows = re.findall(r"(reduce_scatter|all_gather)\s+dp\s+2 (?:grad|param)\s+float32\s+\[(\d+)\]"
                      r"\s+([\d,]+)\s+([\d,.]+)\s+([\d,.]+) ring\s+[\d.]+[^\n]*\n.*step 0: → rank 1\s+"
                      r"([\d,]+) B", p.stdout)
    assert len(rows) >= 4, p.stdout
    for op, numel, S, booked, sent, step0 in rows:
        S = int(S.replace(",", ""))
        assert S == 4 * int(numel)
        assert float(booked.replace(",", "")) == float(sent.replace(",", "")) == S / 2
        assert int(step0.replace(",", "")) == S // 2
    m = re.search(r"total \(rank 0\)\s+([\d,.]+)\s+([\d,.]+)\s+([\d.]+)\s+([\d,.]+)\s+([\d.]+)",
                  p.stdout)
    assert m and m.group(3) == "1.0000" and m.group(5) == "1.0000", p.stdout


def test_trace_of_a_pipeline_draws_the_real_timeline(cache_dir, tmp_path):
    p = run_cli(["trace", "--pp", "4", "--schedule", "1f1b", "--microbatches", "8", "--out",
                 tmp_path], cache_dir, timeout=180)
    assert p.returncode == 0, p.stdout
    assert (tmp_path / "trace_1f1b.png").stat().st_size > 5000
    trace = json.loads((tmp_path / "trace_1f1b.trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sum(e.get("name", "").startswith("F") for e in events) >= 4 * 8  # m F's per stage
    assert "ledger / formula within 0.00e+00 of 1" in p.stdout


def _table_rows(stdout: str) -> dict[int, tuple[str, str, int]]:
    """The trace table's rows: {#: (op, tag, S bytes)}."""
    return {int(i): (op, tag, int(S.replace(",", ""))) for i, op, tag, S in re.findall(
        r"^\[rank 0\]\s+(\d+) (\w+)\s+cp\s+2 (cp_\w+)\s+\w+\s+\[[\d, ]+\]\s+([\d,]+) ",
        stdout, re.M)}


@pytest.mark.timeout(120)
def test_trace_cp_prints_the_ring_block_by_block(cache_dir):
    """``trace --cp 2`` on tiny (2 layers, 2 kv heads, head_dim 32 / 4 = 8) with trace's
    defaults (global batch 8, micro-batch 2: m = 4 micro-batches of b = 2 sequences), worked out
    here by hand: a K/V message is 2·b·(s/cp)·k·hd·4 = 2·2·32·2·8·4 = 8,192 B; per layer and
    micro-batch forward sends n − 1 = 1 K/V, backward 1 K/V and n = 2 dK/dV."""
    p = run_cli(["trace", "--cp", "2", "--model", "tiny", "--seq-len", "64"], cache_dir,
                timeout=100)
    assert p.returncode == 0, p.stdout
    out = p.stdout
    n, layers, m, kv = 2, 2, 4, 2 * 2 * (64 // 2) * 2 * 8 * 4
    table = _table_rows(out)
    sends = [v for v in table.values() if v[0] == "send"]
    assert sum(tag == "cp_kv" for _, tag, _ in sends) == 2 * (n - 1) * layers * m == 16
    assert sum(tag == "cp_dkv" for _, tag, _ in sends) == n * layers * m == 16
    assert {S for _, _, S in table.values()} == {kv}
    assert f"one K/V message   = 2·b·(s/cp)·k·hd·4 = 2·2·(64/2)·2·8·4 = {kv:,} B" in out
    ring = out[out.index("ring attention, cp rank 0 of 2"):]
    # micro-batch 0 in detail: per layer 1 K/V forward, 1 K/V + 2 dK/dV backward
    rows = re.findall(r"#(\d+)/#(\d+)\s+(K/V|dK/dV) +of cp (\d) → cp (\d).*?([\d,]+) B  "
                      r"([\d.]+)", ring)
    assert len(rows) == layers * ((n - 1) + (n - 1) + n) == 8, ring
    for a, b, what, frm, to, nbytes, ratio in rows:
        tag = "cp_kv" if what == "K/V" else "cp_dkv"  # each row points at a send and its recv
        assert table[int(a)] == ("send", tag, kv) and table[int(b)] == ("recv", tag, kv)
        assert to == "1" and int(nbytes.replace(",", "")) == kv and ratio == "1.0000"
    # t = 0 holds its own block, t = 1 cp 1's; rank 0 holds chunks 0 and 3, cp 1 chunks 1, 2
    assert "t=0  holds cp 0's (chunks 0, 3) K/V: K0·Q0 causal, K0·Q3 full, K3·Q3 causal; " \
           "K3·Q0 skipped" in ring
    assert "t=1  holds cp 1's (chunks 1, 2) K/V: K1·Q3 full, K2·Q3 full; K1·Q0, K2·Q0 " \
           "skipped" in ring
    assert [r[3] for r in rows if r[2] == "dK/dV"] == ["0", "1"] * layers  # block at t
    for kind, count in (("forward   K/V    (cp_kv )", 8), ("backward  K/V    (cp_kv )", 8),
                        ("backward  dK/dV  (cp_dkv)", 16)):
        assert re.search(rf"{re.escape(kind)}\s+{count} sends, expected .* = {count}\n", ring)
    assert "MISMATCH" not in ring and "within 0.00e+00 of 1" in ring


@pytest.mark.timeout(120)
def test_trace_cp_allgather_lists_each_layers_collectives(cache_dir):
    """``--cp-method allgather``: one all_gather of K/V per layer and micro-batch forward and
    one reduce_scatter backward, S = n·KV = 2·8,192 B, booked (n − 1)/n · S = 8,192 B."""
    p = run_cli(["trace", "--cp", "2", "--cp-method", "allgather", "--model", "tiny",
                 "--seq-len", "64"], cache_dir, timeout=100)
    assert p.returncode == 0, p.stdout
    kv = 2 * 2 * 32 * 2 * 8 * 4
    rows = re.findall(r"(forward|backward) +micro-batch 0: #\d+ +(all_gather|reduce_scatter) +"
                      r"cp_\w+ +S +([\d,]+) B +booked +([\d,.]+) B +1\.0000", p.stdout)
    assert [r[:2] for r in rows] == [("forward", "all_gather")] * 2 + \
        [("backward", "reduce_scatter")] * 2, p.stdout
    assert {(int(S.replace(",", "")), float(b.replace(",", ""))) for *_, S, b in rows} == \
        {(2 * kv, kv)}
    assert "forward   all_gather        8, expected L·m = 2·4 = 8" in p.stdout


# make test-slow: make test trains under torch.distributed.run (torchrun's module) in
# tests/test_multinode.py (two nodes of one rank, losses against one process), and starts train
# under torchrun in tests/test_torchrun_errors.py and test_desync.py
@pytest.mark.slow
def test_train_under_torchrun_uses_its_world(cache_dir, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "shardwise", "train",
                        "--model", "tiny", "--dp", "2", "--steps", "3", "--tokenizer", "bytes",
                        "--seq-len", "32", "--out", str(tmp_path / "r")], env=env,
                       stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=240)
    assert p.returncode == 0, p.stdout
    assert "[rank 0] shardwise train: tiny" in p.stdout and "dp=2" in p.stdout
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


COMMON = ["train", "--model", "tiny", "--steps", "8", "--eval-every", "4", "--tokenizer", "bytes",
          "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2"]


def _val_losses(cache_dir, out, layout):
    p = run_cli([*COMMON, *layout, "--out", out], cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    assert (out / "checkpoints" / "step_8" / ".metadata").exists()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def dp2_val_losses(cache_dir, tmp_path_factory):
    return _val_losses(cache_dir, tmp_path_factory.mktemp("dp2") / "r", ["--dp", "2"])


def _slow(*layout):  # a layout whose end-to-end run is make test-slow's
    return pytest.param(list(layout), marks=pytest.mark.slow, id=" ".join(layout))


@pytest.mark.parametrize("layout", [
    _slow("--pp", "2", "--schedule", "zb-h1", "--microbatches", "4"),
    _slow("--tp", "2", "--sp"),
    _slow("--dp", "2", "--zero", "3", "--engine", "torch"),
    # FSDP2's `replicate` (zero 0) over DTensor TP swaps in its unsharded parameters: the final
    # checkpoint must read the ones the optimizer holds (make test's case: two engines' paths,
    # the checkpoint's and DTensor TP's, in one run; the layouts' parity in process:
    # tests/test_verify_n4.py, test_compose_torch.py)
    ["--dp", "2", "--tp", "2", "--engine", "torch"]], ids=lambda a: " ".join(a))
def test_train_end_to_end_in_each_layout_gives_the_dp_run_validation_losses(
        cache_dir, tmp_path, dp2_val_losses, layout):
    """Same seed, same global batches: each layout's run must log the validation losses of the
    dp=2 run (which test_dp_parity ties to one process), and write its run folder."""
    mine = _val_losses(cache_dir, tmp_path / "r", layout)
    assert len(mine) == 3 and mine[-1] < mine[0]
    assert mine == pytest.approx(dp2_val_losses, rel=1e-5, abs=1e-6)


# -- a newcomer's first runs (issue 23): 2 steps, one process, byte tokenizer -----------------
FIRST = ["train", "--model", "tiny", "--dp", "1", "--steps", "2", "--tokenizer", "bytes",
         "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--eval-sequences", "4"]


@pytest.fixture(scope="module")
def no_sample_run(cache_dir, tmp_path_factory):
    """`--sample-tokens 0`, 2 steps: a run folder with its final checkpoint (step_2)."""
    out = tmp_path_factory.mktemp("first") / "r"
    p = run_cli([*FIRST, "--sample-tokens", "0", "--out", out], cache_dir, timeout=120)
    assert p.returncode == 0, p.stdout
    return out, p.stdout


def test_sample_tokens_0_prints_and_writes_no_sample(no_sample_run):
    out, stdout = no_sample_run
    assert "sample from the trained model" not in stdout
    assert not (out / "sample.txt").exists()


def test_resume_at_the_final_step_says_no_step_ran_and_prints_no_nan(no_sample_run, cache_dir):
    out, _ = no_sample_run
    p = run_cli([*FIRST, "--sample-tokens", "0", "--out", out, "--resume", "auto"], cache_dir,
                timeout=120)
    assert p.returncode == 0, p.stdout
    assert "no steps ran in this invocation" in p.stdout, p.stdout
    assert "nan" not in p.stdout.lower()
    summary = json.loads((out / "summary.json").read_text())  # strict JSON: NaN would not parse
    assert summary["steps_run"] == 0 and summary["median_step_s"] is None


def test_model_mismatch_of_a_bytes_run_names_the_changed_flag_not_vocab_size(no_sample_run,
                                                                            cache_dir, tmp_path):
    """--vocab-size does nothing with --tokenizer bytes: the hint must not suggest it."""
    out, _ = no_sample_run
    p = run_cli([*FIRST, "--n-layers", "3", "--out", tmp_path / "b", "--resume",
                 out / "checkpoints" / "step_2"], cache_dir, timeout=120)
    assert p.returncode == 2, p.stdout
    assert "saved from another model configuration" in p.stdout
    assert "--vocab-size" not in p.stdout, p.stdout
    assert "--model tiny --tokenizer bytes" in p.stdout
    assert "--n-layers (3 here, not given in the checkpoint's run)" in p.stdout, p.stdout
