"""Context parallelism: the load-balanced split worked by hand, and in one 4-rank world (workers/
cp_cases.py) ring and all-gather attention against one process's causal attention, their
bytes against the formula worked here, activation checkpointing, evaluation and sampling.

The model-level parity of every cp layout (cp = 2, 4 alone and composed with dp/ZeRO, tp ± SP,
pp; both methods) is ``shardwise verify`` (tests/test_verify_n4.py, test_verify_n8.py).

Tolerances: the parity rule's (shardwise.parity: rtol 1e-5, atol 1e-6, derived there from the
round-off of summing the same fp32 terms in another order; ring attention sums a row's softmax
blockwise and merges by log-sum-exp, which reorders the same sums).
"""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import load_pt, ROOT, run_world
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, loss_sum_and_count
from shardwise.parallel.cp import chunk_ids, shard_sequence, validate_cp, zigzag_positions
from shardwise.parity import ATOL, RTOL
from shardwise.train.workload import SyntheticLMWorkload

sys.path.insert(0, str(ROOT / "tests" / "workers"))
import cp_cases as W  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "cp_cases.py"


def test_zigzag_split_by_hand():
    """s = 16 over cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_ids(4, 1) == (1, 6)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_covers_every_position_once_and_balances_causal_work(cp):
    """Causal work of a query at position p: p + 1 keys. Every rank gets the same total (the
    point of the head-tail split), and the ranks' positions partition 0..s-1."""
    s = 16 * cp
    parts = [zigzag_positions(s, cp, i) for i in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(s))
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1
    contiguous = {int((torch.arange(i * s // cp, (i + 1) * s // cp) + 1).sum())
                  for i in range(cp)}
    assert len(contiguous) == cp  # a contiguous split is not balanced


def test_shard_sequence_selects_the_chunks_and_adds_positions():
    ids = torch.arange(32).reshape(2, 16)
    topo = SimpleNamespace(size=lambda a: 2, index=lambda a: 1)
    out = shard_sequence({"input_ids": ids, "labels": ids + 100}, topo)
    want = [4, 5, 6, 7, 8, 9, 10, 11]
    assert out["input_ids"][1].tolist() == [16 + p for p in want]
    assert out["labels"][0].tolist() == [100 + p for p in want]
    assert out["position_ids"].tolist() == [want, want]


def test_positions_follow_the_chunks_in_the_plain_model():
    """``positions`` reach RoPE: a prefix at positions 0..3 gives the whole sequence's logits
    there (causal); RoPE is relative, so the same tokens at 8..11 give the same logits, and at
    the uneven 0, 1, 2, 10 different ones."""
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67)
    ids = torch.randint(0, 67, (1, 16))
    first = model(ids[:, :4], positions=torch.arange(4)[None])
    torch.testing.assert_close(first, model(ids)[:, :4], rtol=RTOL, atol=ATOL)
    shifted = model(ids[:, :4], positions=torch.arange(8, 12)[None])
    torch.testing.assert_close(shifted, first, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(model(ids[:, :4], positions=torch.tensor([[0, 1, 2, 10]])), first,
                              rtol=RTOL, atol=ATOL)
    # a chunk of a sequence longer than the model's positions (tiny: 256) is named, not an
    # IndexError from the RoPE table
    with pytest.raises(ValueError, match="position 300 ≥ max_seq_len 256"):
        model(ids[:, :4], positions=torch.tensor([[0, 1, 2, 300]]))


@pytest.mark.parametrize("kw,fragment", [
    (dict(cp=2, method="zigzag"), "--cp-method 'zigzag': choose ring"),
    (dict(cp=2, engine="torch", device="cpu"), "context_parallel does not run on CPU"),
    (dict(cp=4, seq_len=20, model_config=build_model("tiny").config),
     "--seq-len 20 is not divisible by 8"),
])
def test_validate_cp_names_the_constraint(kw, fragment):
    model_config = kw.pop("model_config", None)
    with pytest.raises(ShardwiseConfigError, match=fragment):
        validate_cp(model_config, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    run_world(WORKER, out, nproc=4)
    return [load_pt(out / f"rank{r}.pt") for r in range(4)]


def _reference():
    """One process's causal GQA attention on the whole seeded tensors (as the worker draws)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(W.B, n, W.S, W.HD, generator=g).requires_grad_()
               for n in (W.H, W.KV, W.KV))
    dout = torch.randn(W.B, W.H, W.S, W.HD, generator=g)
    rep = W.H // W.KV
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                         v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_core_attention_matches_one_process(world, cp, method):
    out, dq, dk, dv = _reference()
    for rec in world[:cp]:
        case = rec[f"core_cp{cp}_{method}"]
        pos = case["pos"]
        for mine, ref in ((case["out"], out), (case["dq"], dq), (case["dk"], dk),
                          (case["dv"], dv)):
            torch.testing.assert_close(mine, ref.index_select(2, pos), rtol=RTOL, atol=ATOL)
        # bytes, worked by hand: this rank's K and V, 2·b·(s/cp)·k·hd fp32
        kv = 2 * W.B * (W.S // cp) * W.KV * W.HD * 4
        sends = lambda recs, tag: [b for op, t, b in recs if op == "send" and t == tag]  # noqa
        if method == "ring":  # forward: n−1 K/V sends; backward: n−1 K/V + n dK/dV
            assert sends(case["fwd"], "cp_kv") == [kv] * (cp - 1)
            assert sends(case["bwd"], "cp_kv") == [kv] * (cp - 1)
            assert sends(case["bwd"], "cp_dkv") == [kv] * cp
        else:  # one all-gather of the n·KV tensor, one reduce-scatter: (n−1)/n of it each
            assert [(op, b) for op, t, b in case["fwd"]] == [("all_gather", (cp - 1) * kv)]
            assert [(op, b) for op, t, b in case["bwd"]] == [("reduce_scatter", (cp - 1) * kv)]


@pytest.mark.timeout(300)
def test_allgather_attention_over_our_ring_collectives_matches_one_process(world):
    """The all-gather and reduce-scatter of the all-gather method run by
    shardwise.comm.algorithms (``--collectives ring``) instead of gloo's: the same outputs and
    gradients (they write into autograd-free buffers from the comm thread)."""
    out, dq, dk, dv = _reference()
    for rec in world:
        case = rec["core_cp4_allgather_ours"]
        for mine, ref in ((case["out"], out), (case["dq"], dq), (case["dk"], dk),
                          (case["dv"], dv)):
            torch.testing.assert_close(mine, ref.index_select(2, case["pos"]), rtol=RTOL,
                                       atol=ATOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_ring_and_keeps_the_gradients(world, ac):
    """dp = 2 × cp = 2: with --ac the gradients equal the run without (the recompute re-runs the
    same ring: rtol/atol of the parity rule), the step's bytes are unchanged, and the forward
    ring runs again in phase "recompute" (full: every block's forward K/V; selective: PyTorch's
    policy may cache the ring's outputs — then nothing is re-sent)."""
    for rec in world:
        base, run = rec["model_ac_none"], rec[f"model_ac_{ac}"]
        assert run["loss"] == pytest.approx(base["loss"], rel=RTOL, abs=ATOL)
        for name, g in base["grads"].items():
            torch.testing.assert_close(run["grads"][name], g, rtol=RTOL, atol=ATOL)
        assert run["step_bytes"] == base["step_bytes"]
        assert base["recompute_bytes"] == 0
        if ac == "full":  # cp = 2: one K/V message per block's forward, 2 blocks
            assert run["recompute_bytes"] > 0


@pytest.mark.timeout(300)
def test_evaluation_and_sampling_under_cp_equal_one_process(world):
    """cp = 4: the chunks' loss sums and counts add up to one process's loss of the batch; the
    plain-attention model under ``plain_attention`` gives one process's logits."""
    work = SyntheticLMWorkload(vocab_size=67, seq_len=32, num_train=64, num_val=8, seed=0)
    batch = work.batches(torch.arange(4), 4, split="val")[0]
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=67, **W.MODEL)
    with torch.no_grad():
        s, c = loss_sum_and_count(model, batch)
        logits = model(batch["input_ids"])
    for rec in world:
        assert float(rec["eval_sums"][1]) == float(c)
        assert float(rec["eval_sums"][0]) == pytest.approx(float(s), rel=RTOL, abs=ATOL)
        torch.testing.assert_close(rec["logits"], logits, rtol=RTOL, atol=ATOL)


def _train_losses(out):
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.timeout(400)
def test_train_cp2_dp2_follows_the_dp4_loss_curve(tmp_path, cache_dir):
    """``shardwise train --cp 2 --dp 2`` on the embedded corpus takes the same 20 steps as
    ``--dp 4`` at the same global batch: each step's loss within the parity rule's
    1e-6 + 1e-5·|loss| (the issue's bar is 1e-5; the losses are ~3-6). The two runs differ only
    in the order fp32 sums are taken (a dp row's sequences split over cp instead of whole rows
    over dp), and free-running AdamW amplifies that round-off only where √v̂ ~ ε (the parity
    rule's note), which 20 steps from the same start do not reach at this tolerance."""
    from conftest import run_cli

    args = ["train", "--model", "tiny", "--steps", "20", "--seq-len", "64", "--global-batch",
            "8", "--tokenizer", "bytes", "--eval-every", "100", "--eval-sequences", "8",
            "--sample-tokens", "0", "--log-every", "1", "--timeout", "60"]
    runs = {}
    for name, layout, shown in (("cp", ["--cp", "2", "--dp", "2"], "dp=2 × cp=2 × tp=1"),
                                ("dp", ["--dp", "4"], "dp=4 × tp=1")):
        p = run_cli([*args, *layout, "--out", tmp_path / name], cache_dir, timeout=380)
        assert p.returncode == 0, p.stdout[-3000:]
        assert shown in p.stdout, p.stdout[-3000:]
        runs[name] = _train_losses(tmp_path / name)
    got, want = runs["cp"], runs["dp"]
    assert len(got) == len(want) == 20
    assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(got, want)), (got, want)
    assert got[-1] < got[0]  # and it learns


@pytest.mark.timeout(300)
def test_torch_context_parallel_splits_as_we_do_and_has_no_cpu_kernel(world):
    """torch 2.13's ``context_parallel`` shards a position buffer with its head-tail load
    balancer exactly as :func:`shard_sequence` does (checked on each rank inside
    ``torch_context_parallel``, which raises otherwise), and its attention on CPU raises the
    error ``validate_cp`` quotes when it refuses ``--engine torch --cp`` on CPU."""
    for rec in world[:2]:
        assert rec["torch_cp"]["split_checked"]
        assert "does not have a sharding strategy registered" in rec["torch_cp"]["sdpa_error"]
