"""DPO (issue 21), one process: strict preference data, pairs kept whole, the objective against
the formula by hand and against TRL's DPOTrainer, and a CLI run whose reward margin rises.
Parity of every layout with one process: tests/test_dpo_parity.py."""

import json
import math
import random

import pytest
import torch

from conftest import run_cli
from shardwise.config import TrainConfig, validate
from shardwise.data.dpo import IGNORE_INDEX, load_dpo_records, prepare_dpo_data
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model, loss_sum_and_count
from shardwise.models.dpo import DPO_BETA, DPO_LOGPS, REF_LOGPS

RECORDS = [
    {"prompt": "Q: hi\n", "chosen": "HELLO", "rejected": "no"},
    {"prompt": "Q: sky?\n", "chosen": "BLUE!", "rejected": "green grass"},
    {"prompt": "Q: 2+2?\n", "chosen": "FOUR", "rejected": "five, I think"},
    {"prompt": "Q: cat?\n", "chosen": "MEOW", "rejected": "woof"},
]


def _write(tmp_path, lines, name="pref.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return f


# -- data -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, words", [
    ({"prompt": "p", "chosen": "a"}, ["missing field 'rejected'"]),
    ({"prompt": "p", "rejected": "b"}, ["missing field 'chosen'"]),
    ({"chosen": "a", "rejected": "b"}, ["missing field 'prompt'"]),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, ["chosen response is empty"]),
    ({"prompt": "p", "chosen": "a", "rejected": "  \n"}, ["rejected response is empty"]),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, ["prompt is empty"]),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, ["'chosen' is int, not a string"]),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     ["are message lists and some are not", "conversational format"]),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, ["chosen[0] has role 'user'"]),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": [], "rejected": [
        {"role": "assistant", "content": "b"}]}, ["'chosen' is an empty message list"]),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, ["same text", "no preference"]),
    ("[1, 2]", ["expected a JSON object"]),
    ('{"prompt": "p", "chosen": ', ["not valid JSON"]),
])
def test_bad_records_name_file_and_line(tmp_path, bad, words):
    """Every malformed row is refused with its FILE:LINE (line 3 here: a good row, a blank
    line, then the bad one) and the constraint it breaks."""
    f = _write(tmp_path, [RECORDS[0], "", bad, RECORDS[1]])
    with pytest.raises(ShardwiseConfigError) as e:
        load_dpo_records(f)
    msg = str(e.value)
    assert f"{f}:3:" in msg, msg
    for w in words:
        assert w in msg, msg


def test_too_few_records_and_prompt_longer_than_seq_len(tmp_path):
    with pytest.raises(ShardwiseConfigError, match="1 record"):
        load_dpo_records(_write(tmp_path, [RECORDS[0]]))
    long = {"prompt": "x" * 40, "chosen": "a", "rejected": "b"}
    f = _write(tmp_path, [RECORDS[0], RECORDS[1], long])
    with pytest.raises(ShardwiseConfigError) as e:
        prepare_dpo_data(f, "bytes", seq_len=32)
    assert f"{f}:3:" in str(e.value) and "40 tokens, longer than --seq-len 32" in str(e.value)
    prepare_dpo_data(f, "bytes", seq_len=40)  # 40 prompt tokens leave one response target


def test_rows_pair_adjacent_and_count_exactly_the_response_and_eos(tmp_path):
    """By hand with the byte tokenizer: pair i is rows 2i (chosen) and 2i + 1 (rejected), both
    starting with the prompt's bytes; the counted targets of a row are its response's bytes and
    EOS (256), from position len(prompt) − 1 on; a response longer than the row is cut."""
    data = prepare_dpo_data(_write(tmp_path, RECORDS), "bytes", seq_len=24, val_every=4)
    assert data.train.shape == (6, 25) and data.val.shape == (2, 25)
    train = [r for i, r in enumerate(RECORDS) if i % 4 != 3]
    for i, rec in enumerate(train):
        n_p = len(rec["prompt"].encode())
        for j, key in enumerate(("chosen", "rejected")):
            row, lab = data.train[2 * i + j], data.train_labels[2 * i + j]
            assert row[:n_p].tolist() == list(rec["prompt"].encode())
            want = (list(rec[key].encode()) + [256])[: 24 - (n_p - 1)]
            counted = (lab != IGNORE_INDEX).nonzero().flatten().tolist()
            assert counted == list(range(n_p - 1, n_p - 1 + len(want)))
            assert lab[lab != IGNORE_INDEX].tolist() == want
    assert data.stats["truncated"] == 0
    cut = prepare_dpo_data(_write(tmp_path, RECORDS), "bytes", seq_len=12, val_every=4)
    assert cut.stats["truncated"] > 0  # "five, I think" does not fit in 12 − 8 positions


# -- the objective --------------------------------------------------------------------------
def _dpo_batch(data, ref_logps=None, beta=0.1):
    b = {"input_ids": data.train[:, :-1], "labels": data.train_labels,
         DPO_BETA: torch.tensor(beta, dtype=torch.float64),
         DPO_LOGPS: torch.zeros(len(data.train), dtype=torch.float64)}
    if ref_logps is not None:
        b[REF_LOGPS] = ref_logps
    return b


def test_objective_is_eq7_by_hand_and_masked_positions_get_zero_gradient(tmp_path):
    """shardwise's objective (the path every layout takes: per-token cross-entropy →
    models/dpo.py) against eq. 7 written out here from log_softmax, for a policy and a different
    reference: the loss sum, the per-row log-probs it writes, and ∂loss/∂logits exactly 0 at
    every prompt and padding position (and nonzero at the response targets)."""
    data = prepare_dpo_data(_write(tmp_path, RECORDS), "bytes", seq_len=24, val_every=4)
    torch.manual_seed(0)
    policy = build_model("tiny", vocab_size=257)
    torch.manual_seed(1)
    reference = build_model("tiny", vocab_size=257)
    x, y, beta = data.train[:, :-1], data.train_labels, 0.3

    def logps_by_hand(model):
        logp = torch.log_softmax(model(x).double(), -1)
        out = []
        for row in range(len(x)):
            t = (y[row] != IGNORE_INDEX).nonzero().flatten()
            out.append(logp[row, t, y[row, t]].sum())
        return torch.stack(out)

    with torch.no_grad():
        ref = logps_by_hand(reference)
        pre = _dpo_batch(data, beta=beta)
        loss_sum_and_count(reference, pre)  # the reference pass writes its log-probs
    torch.testing.assert_close(pre[DPO_LOGPS], ref, rtol=1e-6, atol=1e-5)

    pi = logps_by_hand(policy).detach()
    z = beta * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
    want = float(sum(math.log1p(math.exp(-float(v))) for v in z))
    batch = _dpo_batch(data, ref_logps=pre[DPO_LOGPS].clone(), beta=beta)
    logits_box = {}

    def keep(module, inputs, out):  # returns None: the output is unchanged
        out.retain_grad()
        logits_box["out"] = out

    hook = policy.output.register_forward_hook(keep)
    s, n = loss_sum_and_count(policy, batch)
    hook.remove()
    assert int(n) == 3  # pairs
    assert float(s.detach()) == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(batch[DPO_LOGPS], pi, rtol=1e-6, atol=1e-5)
    (s / n).backward()
    g = logits_box["out"].grad  # [6, 24, 257]
    masked = y == IGNORE_INDEX
    assert masked.any() and torch.all(g[masked] == 0)
    assert torch.all(g[~masked].abs().sum(-1) > 0)


@pytest.mark.parametrize("flags, words", [
    (dict(global_batch=6, dp=2, micro_batch=3), ["3 rows per rank", "split a pair"]),
    (dict(global_batch=8, dp=2, micro_batch=1), ["micro-batch of 1 rows", "split a pair"]),
    (dict(global_batch=8, dp=1, pp=2, microbatches=8, micro_batch=1), ["micro-batch of 1"]),
    (dict(global_batch=7, dp=1, micro_batch=7), ["split a pair"]),
    (dict(cp=2, dp=1), ["--cp > 1"]),
    (dict(engine="torch", tp=2, dp=1), ["--engine torch"]),
    (dict(dpo_beta=0.0), ["--dpo-beta 0.0 must be > 0"]),
    (dict(model="moe-tiny"), ["dense language model"]),
])
def test_a_batch_or_layout_dpo_cannot_run_is_refused_before_any_collective(tmp_path, flags,
                                                                             words):
    """validate() — run by the launcher and by every rank before the first collective —
    refuses a batch that would split a (chosen, rejected) pair over ranks or micro-batches,
    and the layouts DPO does not run in, naming the fix."""
    base = dict(model="tiny", task="dpo", data=str(_write(tmp_path, RECORDS)), dp=2, tp=1,
                zero=0, seq_len=32, global_batch=8, micro_batch=2)
    cfg = TrainConfig(**{**base, **flags})
    with pytest.raises(ShardwiseConfigError) as e:
        validate(cfg, cfg.world_size())
    for w in words:
        assert w in str(e.value), str(e.value)
    validate(TrainConfig(**base), 2)  # the base itself is fine


# -- TRL ------------------------------------------------------------------------------------
def test_loss_and_gradients_equal_trl_dpo_trainer(tmp_path):
    """TRL's own DPOTrainer (``compute_loss``, loss_type "sigmoid") on two tiny random
    transformers Llamas (policy and a different reference, saved locally: nothing downloaded)
    and TRL's own tokenization and collation of the same records, against shardwise's data
    pipeline and objective on the same weights loaded through --init-from-hf's loader: the same
    token ids and masks, the same loss, reward margin, accuracy and log-probs, and the same
    gradient for every weight. Tolerance: two fp32 implementations of the same math (HF's
    attention/MLP vs ours, TRL's fused log-softmax vs F.cross_entropy): rtol 1e-5 on the loss,
    a row's log-prob (a sum of ≤ 24 terms ≤ ~6 in size) to 1e-4 absolute, gradients 1e-5·max|g|
    + 1e-6."""
    import trl  # in the dev extra: `make test` checks against TRL itself
    import transformers
    from datasets import Dataset

    from shardwise.interop.hf import (byte_tokenizer_json, hf_model_overrides, load_hf_weights,
                                      to_hf_state_dict)
    from shardwise.models import Llama, LlamaConfig

    def hf_cfg():
        return transformers.LlamaConfig(
            vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
            pad_token_id=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    hf, ours = {}, {}
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        hf[name] = transformers.LlamaForCausalLM(hf_cfg())
        hf[name].save_pretrained(tmp_path / name)
        over = hf_model_overrides(tmp_path / name)
        ours[name] = Llama(LlamaConfig(**over))
        load_hf_weights(ours[name], tmp_path / name)
    beta = 0.3
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer_json(),
                                               eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    recs = RECORDS[:3]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=["sigmoid"],
                         report_to="none", use_cpu=True, per_device_train_batch_size=3,
                         bf16=False, fp16=False)  # fp32 (accelerate would autocast the ref)
    trainer = trl.DPOTrainer(model=hf["policy"], ref_model=hf["reference"], args=args,
                             train_dataset=Dataset.from_list(recs), processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(recs))]
    inputs = trainer.data_collator(rows)  # [chosen × 3; rejected × 3] rows, completion_mask
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # ours: the same records through data/dpo.py (all three for training: val_every large)
    f = _write(tmp_path, recs + [RECORDS[3]])
    data = prepare_dpo_data(f, "bytes", seq_len=24, val_every=100)
    for i, r in enumerate(rows):  # TRL tokenized prompt and response apart, as we do
        for j, key in enumerate(("chosen_ids", "rejected_ids")):
            lab = data.train_labels[2 * i + j]
            assert lab[lab != IGNORE_INDEX].tolist() == r[key]
            assert data.train[2 * i + j, :len(r["prompt_ids"])].tolist() == r["prompt_ids"]
    data.train, data.train_labels = data.train[:6], data.train_labels[:6]
    with torch.no_grad():
        pre = _dpo_batch(data, beta=beta)
        loss_sum_and_count(ours["reference"], pre)
    batch = _dpo_batch(data, ref_logps=pre[DPO_LOGPS].clone(), beta=beta)
    s, n = loss_sum_and_count(ours["policy"], batch)
    loss = s / n
    loss.backward()
    print(f"DPO loss: shardwise {float(loss.detach()):.9f}, TRL {float(trl_loss.detach()):.9f}")
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5)
    pi, ref = batch[DPO_LOGPS], batch[REF_LOGPS]
    margin = beta * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
    assert float(margin.mean()) == pytest.approx(m["rewards/margins"], abs=1e-4)
    assert float((margin > 0).double().mean()) == pytest.approx(m["rewards/accuracies"])
    assert float(pi[0::2].mean()) == pytest.approx(m["logps/chosen"], abs=1e-4)
    assert float(pi[1::2].mean()) == pytest.approx(m["logps/rejected"], abs=1e-4)
    grads = to_hf_state_dict({k: p.grad for k, p in ours["policy"].named_parameters()},
                             ours["policy"].config.tie_embeddings)
    hf_grads = {k: p.grad for k, p in hf["policy"].named_parameters()}
    assert set(grads) == set(hf_grads)
    worst = max(float((g - hf_grads[k]).abs().max()) for k, g in grads.items())
    print(f"max |grad shardwise − grad TRL| over every weight: {worst:.2e}")
    for k, g in grads.items():
        torch.testing.assert_close(g, hf_grads[k], rtol=0,
                                   atol=1e-5 * float(hf_grads[k].abs().max()) + 1e-6, msg=k)


# -- the CLI --------------------------------------------------------------------------------
def preference_file(path, n=96, seed=0):
    """A small preference set with a clear pattern: the prompt names a word; the chosen
    response shouts it (upper case, "!"), the rejected one gives another word quietly."""
    rng = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "green", "tiger", "music", "paper", "light",
             "bread", "house", "chair", "ocean", "plant", "smile", "train"]
    lines = []
    for _ in range(n):
        w = rng.choice(words)
        other = rng.choice([x for x in words if x != w])
        lines.append({"prompt": f"Shout the word: {w}\n", "chosen": f"{w.upper()}!",
                      "rejected": f"{other}."})
    return _write(path, lines, name="shout.jsonl")


@pytest.mark.timeout(300)
def test_cli_dpo_raises_the_reward_margin_over_30_steps(cache_dir, tmp_path):
    """``shardwise train --task dpo`` under dp=2 × tp=2 (4 ranks), 30 steps: the reward margin
    (mean of β·[(log π − log π_ref)_chosen − (…)_rejected] over each step's 8 pairs) starts at
    exactly 0 (policy = reference) and ends well above it, with the accuracy near 1 and the
    validation loss below log 2; every step's record carries the DPO metrics."""
    data = preference_file(tmp_path)
    out = tmp_path / "run"
    p = run_cli(["train", "--task", "dpo", "--data", data, "--model", "tiny", "--tokenizer",
                 "bytes", "--seq-len", "40", "--global-batch", "16", "--micro-batch", "4",
                 "--dp", "2", "--tp", "2", "--steps", "30", "--lr", "3e-3", "--warmup-steps",
                 "3", "--dpo-beta", "0.1", "--eval-every", "15", "--eval-sequences", "16",
                 "--log-every", "5", "--sample-tokens", "0", "--out", out], cache_dir,
                timeout=280)
    assert p.returncode == 0, p.stdout
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    margins = [r["dpo_reward_margin"] for r in steps]
    assert margins[0] == 0.0 and steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert sum(margins[-5:]) / 5 > 0.5, margins
    assert sum(r["dpo_reward_accuracy"] for r in steps[-5:]) / 5 > 0.9
    assert steps[-1]["val_loss"] < math.log(2) - 0.1
    for k in ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_logps_chosen",
              "dpo_logps_rejected", "mem_reference_bytes"):
        assert k in steps[-1]
    assert "reward margin" in p.stdout and "DPO" in p.stdout
    print("reward margin by step:", [round(x, 4) for x in margins])
    print("accuracy by step:", [r["dpo_reward_accuracy"] for r in steps])


def test_cli_bad_row_fails_before_any_collective(cache_dir, tmp_path):
    """A row without "rejected" stops a 2-rank run with the file and line, before the process
    group starts (no mesh line is printed)."""
    f = _write(tmp_path, [RECORDS[0], {"prompt": "p", "chosen": "a"}, RECORDS[1]])
    p = run_cli(["train", "--task", "dpo", "--data", f, "--model", "tiny", "--tokenizer",
                 "bytes", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2",
                 "--dp", "2", "--steps", "1", "--out", tmp_path / "run"], cache_dir,
                timeout=120)
    assert p.returncode != 0
    assert f"{f}:2: missing field 'rejected'" in p.stdout, p.stdout
    assert "mesh (pp, dp, tp)" not in p.stdout


@pytest.mark.timeout(300)
def test_resume_in_another_layout_rebuilds_the_reference_from_the_initial_policy(cache_dir,
                                                                                 tmp_path):
    """The reference is not in the checkpoint: a run resumed from step 2 (saved under dp=2,
    resumed under tp=2) rebuilds it from the initial weights, so steps 3 and 4 log the
    uninterrupted run's loss and reward margin (a reference taken from the resumed policy
    would give margin 0 and loss log 2 at step 3). Tolerance: the parity rule's rtol 1e-5 and
    atol 1e-6 (another layout sums in another order)."""
    flags = ["train", "--task", "dpo", "--data", preference_file(tmp_path), "--model", "tiny",
             "--tokenizer", "bytes", "--seq-len", "40", "--global-batch", "8", "--micro-batch",
             "2", "--steps", "4", "--warmup-steps", "1", "--sample-tokens", "0", "--eval-every",
             "2", "--eval-sequences", "4"]
    a = run_cli([*flags, "--dp", "2", "--save-every", "2", "--out", tmp_path / "a"], cache_dir,
                timeout=280)
    assert a.returncode == 0, a.stdout
    b = run_cli([*flags, "--tp", "2", "--resume", tmp_path / "a" / "checkpoints" / "step_2",
                 "--out", tmp_path / "b"], cache_dir, timeout=280)
    assert b.returncode == 0, b.stdout
    assert "resumed from" in b.stdout

    def steps(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    full, resumed = steps("a"), steps("b")
    assert sorted(resumed) == [3, 4]
    assert full[3]["dpo_reward_margin"] != 0.0
    for s in (3, 4):
        for k in ("loss", "dpo_reward_margin", "dpo_logps_chosen", "dpo_logps_rejected"):
            assert resumed[s][k] == pytest.approx(full[s][k], rel=1e-5, abs=1e-6), (s, k)


def test_bf16_reference_pass_runs_under_the_policys_autocast(cache_dir, tmp_path):
    """--dtype bf16: the reference forward runs under the same autocast as the policy's, so at
    step 1 (policy = reference) every margin is exactly 0 and the loss exactly log 2 in bf16
    too (a reference forward in fp32 against the bf16 policy gave a step-1 margin of −9.4e-5:
    the difference of bf16 and fp32 log-probs, times β)."""
    p = run_cli(["train", "--task", "dpo", "--data", preference_file(tmp_path), "--model",
                 "tiny", "--tokenizer", "bytes", "--seq-len", "40", "--global-batch", "4",
                 "--micro-batch", "2", "--dp", "1", "--steps", "2", "--dtype", "bf16",
                 "--sample-tokens", "0", "--eval-sequences", "4", "--out", tmp_path / "run"],
                cache_dir, timeout=200)
    assert p.returncode == 0, p.stdout
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if r.get("step") == 1)
    assert first["dpo_reward_margin"] == 0.0 and first["dpo_reward_chosen"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [  # pp's meta build: make test-slow (and tests/test_meta_init.py)
    ["--dp", "2", "--zero", "3"],
    pytest.param(["--pp", "2", "--dp", "2"], marks=pytest.mark.slow)], ids=["dp2_zero3", "pp2_dp2"])
def test_the_meta_build_gives_the_whole_builds_run_bitwise(cache_dir, tmp_path, layout):
    """DPO built on the meta device (the policy and its frozen reference each filled with the
    initial weights: the init replayed from the same RNG state for the reference; that the RNG
    is put back: tests/test_meta_init.py) logs, step by step, exactly what the whole build logs (``SHARDWISE_WHOLE_BUILD=1``:
    the model built whole, the reference a deep copy): loss, reward margin and log-probs,
    gradient norm. pp = 2 checks the RNG order (the last stage's tied copy draws after the
    init); ZeRO-3 the reference's flat shards filled from the replay."""
    flags = ["train", "--task", "dpo", "--data", preference_file(tmp_path), "--model", "tiny",
             "--tokenizer", "bytes", "--seq-len", "40", "--global-batch", "8", "--micro-batch",
             "2", "--steps", "2", "--warmup-steps", "1", "--sample-tokens", "0", "--eval-every",
             "100", "--eval-sequences", "4", *layout]
    runs = {}
    for name, env in (("meta", {}), ("whole", {"SHARDWISE_WHOLE_BUILD": "1"})):
        p = run_cli([*flags, "--out", tmp_path / name], cache_dir, timeout=300, env=env)
        assert p.returncode == 0, p.stdout
        assert ("on the meta device" if name == "meta" else "whole on every rank") in p.stdout
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [r for r in map(json.loads, lines) if "loss" in r]
    keys = ("loss", "grad_norm", "dpo_reward_margin", "dpo_logps_chosen", "dpo_logps_rejected")
    assert len(runs["meta"]) == len(runs["whole"]) == 2
    for a, b in zip(runs["meta"], runs["whole"]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
