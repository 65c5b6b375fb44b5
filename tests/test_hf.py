"""Hugging Face interop: export a checkpoint to a LlamaForCausalLM folder that transformers loads
with equal logits; load a transformers-made Llama into our model (any layout); round trips.

Every HF model here is built by transformers itself (random init, save_pretrained into tmp): no
downloads. The reference for "equal" is always transformers' own forward pass.
"""

import json
import os

import pytest
import torch

from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from shardwise.data import ByteTokenizer  # noqa: E402
from shardwise.interop.hf import (  # noqa: E402
    export_hf,
    from_hf_state_dict,
    hf_model_overrides,
    load_hf_weights,
    to_hf_state_dict,
    write_tokenizer_files,
)
from shardwise.models import Llama, LlamaConfig, build_model  # noqa: E402

ATOL = 1e-5


def _hf_config(vocab=300, tie=False, theta=500000.0, eps=1e-6, max_pos=64):
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
              rms_norm_eps=eps, tie_word_embeddings=tie, bos_token_id=256, eos_token_id=256)
    try:  # transformers 5.x
        return transformers.LlamaConfig(**kw, rope_parameters={"rope_type": "default",
                                                               "rope_theta": theta})
    except TypeError:  # 4.x
        return transformers.LlamaConfig(**kw, rope_theta=theta)


def _hf_model(tmp_path, **kw):
    """A random tiny LlamaForCausalLM saved by transformers into ``tmp_path/hf``."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(_hf_config(**kw)).eval()
    with torch.no_grad():  # norms are ones at init: randomise them so a mix-up shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    write_tokenizer_files(ByteTokenizer(), folder, 64)
    return model, folder


def test_rope_is_the_rotate_half_convention_of_hf_llama():
    """Our apply_rope against transformers' apply_rotary_pos_emb with its own cos/sin tables."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from shardwise.models.llama import apply_rope, rope_cache

    cfg = _hf_config(theta=1000.0)
    rot = LlamaRotaryEmbedding(cfg)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    pos = torch.arange(10)[None].expand(2, -1)
    cos_hf, sin_hf = rot(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rope_cache(10, 8, 1000.0)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_hf, atol=1e-6, rtol=1e-6)
    # an interleaved-pair rotation would differ: the test can tell the conventions apart
    inter = torch.stack([-q[..., 1::2], q[..., ::2]], -1).flatten(-2)
    assert (q * cos + inter * sin - q_hf).abs().max() > 1e-2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_llama_loads_into_ours_with_equal_logits_and_round_trips(tmp_path, tie):
    """HF → ours: same logits (GQA, RMSNorm eps, RoPE theta, tied or not); ours → HF names:
    the very tensors transformers saved."""
    hf, folder = _hf_model(tmp_path, tie=tie)
    over = hf_model_overrides(folder)
    assert over["rope_theta"] == 500000.0 and over["norm_eps"] == 1e-6
    ours = Llama(LlamaConfig(**over)).eval()
    load_hf_weights(ours, folder)
    x = torch.randint(0, 300, (3, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=ATOL, rtol=0)
    back = to_hf_state_dict(dict(ours.named_parameters()), tie_embeddings=tie)
    ref = {k: v for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    again = from_hf_state_dict(back, tie_embeddings=tie)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_a_gpt2_variant_we_cannot_express_is_refused_with_the_reason(tmp_path):
    """GPT-2 folders load (tests/test_hf_families.py); a variant that scales attention by the
    layer index computes other logits, so validate refuses it from config.json alone."""
    from shardwise.config import TrainConfig, validate
    from shardwise.errors import ShardwiseConfigError

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=64,
                                  scale_attn_by_inverse_layer_idx=True)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ShardwiseConfigError, match="scale_attn_by_inverse_layer_idx = True: "
                       "shardwise's GPT-2 needs"):
        validate(TrainConfig(model="tiny", dp=1, tp=1, zero=0, seq_len=32,
                             init_from_hf=str(tmp_path / "gpt2")))


@pytest.fixture(scope="module")
def trained_run(cache_dir, tmp_path_factory):
    """A real 2-step run (one process) on a small text file with a BPE tokenizer, untied."""
    root = tmp_path_factory.mktemp("hfrun")
    text = root / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    out = root / "run"
    p = run_cli(["train", "--model", "tiny", "--dp", "1", "--steps", "2", "--data", text,
                 "--tokenizer", "bpe", "--vocab-size", "300", "--seq-len", "32",
                 "--global-batch", "4", "--micro-batch", "2", "--no-tie-embeddings",
                 "--eval-sequences", "4", "--sample-tokens", "4", "--out", out],
                cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    return out, text


@pytest.fixture(scope="module")
def exported(trained_run, cache_dir):
    """`shardwise export` of the trained run."""
    out, _ = trained_run
    hf_dir = out.parent / "hf"
    p = run_cli(["export", "--checkpoint", out, "--to", "hf", hf_dir], cache_dir, timeout=120)
    assert p.returncode == 0, p.stdout
    assert "LlamaForCausalLM" in p.stdout
    return hf_dir


@pytest.mark.timeout(240)
def test_export_of_a_trained_run_loads_in_transformers_with_equal_logits(trained_run, exported,
                                                                         cache_dir):
    out, text = trained_run
    hf_dir = exported
    assert {f.name for f in hf_dir.iterdir()} >= {"config.json", "model.safetensors",
                                                   "tokenizer.json", "tokenizer_config.json"}
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings is False

    # ours: the same checkpoint read back through DCP into a fresh model
    from shardwise.interop.hf import checkpoint_model_config, read_checkpoint

    state, meta, _ = read_checkpoint(out)
    ours = Llama(checkpoint_model_config(state, meta)).eval()
    ours.load_state_dict(state)
    x = torch.randint(0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=ATOL, rtol=0)
    assert not torch.equal(state["output.weight"], state["tok_embeddings.weight"])

    # the tokenizer the run trained with, as transformers sees it
    from shardwise.data import prepare_lm_data

    os.environ["SHARDWISE_CACHE"] = str(cache_dir)
    try:
        tok = prepare_lm_data(str(text), "bpe", 300, 32).tokenizer
    finally:
        os.environ.pop("SHARDWISE_CACHE")
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    sample = "def f12(x):\n    return x * 12 + 5\n"
    assert hf_tok(sample)["input_ids"] == tok.encode(sample)
    assert hf_tok.eos_token_id == tok.eos_id == json.loads(
        (hf_dir / "config.json").read_text())["eos_token_id"]


@pytest.mark.timeout(240)
def test_ours_to_hf_to_ours_continues_where_the_run_ended(trained_run, exported, cache_dir,
                                                         tmp_path):
    """Train from the exported folder with --init-from-hf (its tokenizer.json and config.json
    decide the vocabulary and shape): the step-0 validation loss of the new run equals the final
    validation loss of the old one, so the weights made the round trip unchanged."""
    out, text = trained_run
    again = tmp_path / "again"
    p = run_cli(["train", "--init-from-hf", exported, "--dp", "1", "--steps", "1",
                 "--data", text, "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2",
                 "--eval-sequences", "4", "--sample-tokens", "4", "--out", again],
                cache_dir, timeout=200)
    assert p.returncode == 0, p.stdout
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert second[0]["step"] == 0
    assert second[0]["val_loss"] == pytest.approx(first[-1]["val_loss"], rel=1e-6, abs=1e-6)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_of_a_tied_bytes_checkpoint_ships_a_byte_tokenizer(tmp_path):
    """Checkpoint written the way train/checkpoint.py writes it (DCP, "model" dict, meta.json)."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from shardwise.config import TrainConfig

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=257).eval()
    step = tmp_path / "run" / "checkpoints" / "step_3"
    dcp.save({"model": {k: v.detach() for k, v in model.named_parameters()}},
             checkpoint_id=str(step), no_dist=True)
    cfg = dataclasses.replace(TrainConfig(), model="tiny", tokenizer="bytes")
    (step / "meta.json").write_text(json.dumps({"step": 3, "config": dataclasses.asdict(cfg)}))
    (step.parent / "latest").write_text("step_3\n")
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert hf.config.tie_word_embeddings
    x = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf.eval()(x).logits, atol=ATOL, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    s = "café — naïve\n\tx = 1"
    assert hf_tok(s)["input_ids"] == ByteTokenizer().encode(s)
    assert hf_tok.decode(ByteTokenizer().encode(s)) == s


@pytest.mark.timeout(240)
def test_init_from_hf_under_tensor_parallel_starts_from_the_hf_model(cache_dir, tmp_path):
    """`train --init-from-hf` with tp=2: the step-0 validation loss equals transformers' loss on
    the same validation rows (so every shard got its slice of the HF weights)."""
    hf, folder = _hf_model(tmp_path, tie=True, max_pos=64)
    text = tmp_path / "c.txt"
    text.write_text("".join(f"print('line {i}', {i * i})\n" for i in range(400)))
    out = tmp_path / "run"
    p = run_cli(["train", "--init-from-hf", folder, "--tp", "2", "--steps", "1", "--data", text,
                 "--seq-len", "32", "--global-batch", "2", "--micro-batch", "2",
                 "--eval-sequences", "4", "--sample-tokens", "4", "--out", out],
                cache_dir, timeout=240)
    assert p.returncode == 0, p.stdout
    val0 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["val_loss"]

    from shardwise.data import prepare_lm_data

    os.environ["SHARDWISE_CACHE"] = str(cache_dir)
    try:  # the folder's tokenizer.json (bytes as BPE) is what --tokenizer bpe resolves to
        data = prepare_lm_data(str(text), str(folder / "tokenizer.json"), 4096, 32)
    finally:
        os.environ.pop("SHARDWISE_CACHE")
    rows = data.val[:4]
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    assert val0 == pytest.approx(float(ref), rel=1e-5, abs=1e-6)


def test_export_lists_every_file_it_wrote(trained_run, cache_dir, tmp_path):
    out, _ = trained_run
    p = run_cli(["export", "--checkpoint", out, "--to", "hf", tmp_path / "hf"], cache_dir,
                timeout=120)
    assert p.returncode == 0, p.stdout
    written = sorted(f.name for f in (tmp_path / "hf").iterdir())
    assert "generation_config.json" in written
    assert all(name in p.stdout for name in written), (written, p.stdout)


@pytest.mark.timeout(240)
def test_a_large_export_is_written_one_weight_file_at_a_time(trained_run, exported, tmp_path,
                                                            monkeypatch):
    """With ``max_shard_bytes`` below the model's size, export writes several
    ``model-0000i-of-0000n.safetensors`` and the index, as ``save_pretrained`` shards: each
    file gets at most max(the bound, its one tensor) bytes in memory at once, every tensor of
    the checkpoint is read exactly once (``shardwise.lazy.counting``), and transformers loads
    the folder to the same weights as the one-file export."""
    import safetensors.torch

    from shardwise.lazy import counting

    out, _ = trained_run
    bound = 64 * 1024
    held = []
    real = safetensors.torch.save_file

    def save_file(tensors, path, metadata=None):
        held.append((sum(t.numel() * t.element_size() for t in tensors.values()),
                     max(t.numel() * t.element_size() for t in tensors.values())))
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with counting() as reads:
        export_hf(out, tmp_path / "hf", max_shard_bytes=bound)
    files = sorted(f.name for f in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) == len(held) > 2 and (tmp_path / "hf" / "model.safetensors.index.json"
                                             ).is_file()
    assert all(total <= max(bound, largest) for total, largest in held), held
    one = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
    sharded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    want = one.state_dict()
    for k, v in sharded.state_dict().items():
        assert torch.equal(v, want[k]), k
    n_params = sum(v.numel() for v in want.values())
    assert all(len(r) == 1 for r in reads.values()), reads
    assert sum(r[0] for r in reads.values()) == n_params
