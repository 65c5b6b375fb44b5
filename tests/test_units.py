"""Single-process pieces: models, optimizer groups, LR schedule, config, degree validation."""

import dataclasses
import math
import tomllib

import pytest
import torch

from shardwise.config import TrainConfig, apply_toml, validate
from shardwise.errors import ShardwiseConfigError
from shardwise.models import Llama, LlamaConfig, build_model
from shardwise.models.llama import apply_rope, rope_cache
from shardwise.topology import validate_degrees
from shardwise.train.optim import lr_multiplier, param_groups


def test_llama_parameter_count_formula():
    for tie in (True, False):
        cfg = LlamaConfig(vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                          tie_embeddings=tie)
        assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.num_params()


def test_tied_embedding_is_one_tensor_and_gqa_shapes():
    m = build_model("tiny", vocab_size=67)
    assert m.output.weight is m.tok_embeddings.weight
    attn = m.layers[0].attention
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (16, 32)  # 2 of 4 heads
    assert m(torch.randint(0, 67, (3, 10))).shape == (3, 10, 67)


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    m = build_model("tiny", vocab_size=67)
    a = torch.randint(0, 67, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 67
    torch.testing.assert_close(m(a)[0, :8], m(b)[0, :8], rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_cache(32, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i:i + 1], sin[i:i + 1])
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j:j + 1], sin[j:j + 1])
        return (qi * kj).sum()
    torch.testing.assert_close(score(5, 2), score(20, 17), rtol=1e-5, atol=1e-5)


def test_weight_decay_groups():
    m = build_model("tiny", vocab_size=67)
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(p.dim() == 2 and "tok_embeddings" not in names[id(p)] for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))


def test_lr_schedule_warmup_then_cosine():
    assert lr_multiplier(0, 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 10, 110, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(60, 10, 110, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(110, 10, 110, 0.1) == pytest.approx(0.1)


def test_config_toml_round_trip(tmp_path):
    cfg = dataclasses.replace(TrainConfig(), steps=7, lr=1e-4, data='a "quoted" path', overlap=False)
    f = tmp_path / "c.toml"
    f.write_text(cfg.to_toml())
    assert tomllib.loads(f.read_text())["data"] == 'a "quoted" path'
    assert apply_toml(TrainConfig(), str(f)) == cfg


def test_degree_validation_names_the_fix():
    validate_degrees(2, 2, 2, 8)
    with pytest.raises(ShardwiseConfigError, match=r"dp × tp × pp = 3 × 1 × 1 = 3 does not equal the world size 4.*\[1, 2, 4\]"):
        validate_degrees(1, 3, 1, 4)
    with pytest.raises(ShardwiseConfigError, match="world size 2"):
        validate(TrainConfig(dp=4), world_size=2)
