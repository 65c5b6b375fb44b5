"""The bad-input catalogue: every entry is one wrong thing a user can type or hand us (CLI, config,
data, HF folder, checkpoint, layout). Each must give exit status 2 (argparse or our
ShardwiseConfigError), a message that names the constraint and the fix (asserted by fragment), no
Traceback, and no hang (per-test timeout).

Most cases run ``shardwise.cli.main`` in this process (cheap: no interpreter start per case), with
the launcher's ``spawn`` and the training loop replaced by tripwires: a bad input that slipped
through validation fails the test instead of starting workers. The multi-rank cases run a real
worker process as rank 1 of a 2-rank world with no peer (``AS_RANK_1_OF_2``): had it reached the
rendezvous it would block there, so a prompt exit proves the check runs on every rank before any
collective.
"""

import errno
import json
import os
import shutil
import time
import warnings

import pytest
import torch

from conftest import ROOT, run_cli

AS_RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29998"}
Q = ["train", "--model", "tiny", "--dp", "2", "--steps", "2", "--tokenizer", "bytes", "--seq-len",
     "32"]
SFT = [*Q, "--task", "sft"]


def _mark(step):
    import hashlib

    files = {p.relative_to(step).as_posix(): {"bytes": p.stat().st_size,
                                              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(step.rglob("*")) if p.is_file()}
    (step / "COMPLETE").write_text(json.dumps({"step": 2, "files": files}))
    return step


def _hf_dir(root, name, mutate=None, weights=True, truncate=False, vocab=300):
    """A Llama folder written by hand (config.json + model.safetensors from our tiny model)."""
    from safetensors.torch import save_file

    from shardwise.interop.hf import llama_to_hf_config, to_hf_state_dict
    from shardwise.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_seq_len=64)
    folder = root / name
    folder.mkdir()
    hf = llama_to_hf_config(cfg, eos_id=256)
    if mutate:
        mutate(hf)
    (folder / "config.json").write_text(json.dumps(hf))
    if weights:
        sd = to_hf_state_dict({k: v.detach() for k, v in Llama(cfg).named_parameters()}, True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
        if truncate:
            data = (folder / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    """Every bad file the catalogue needs, made once."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from shardwise.config import TrainConfig
    from shardwise.models import build_model

    d = tmp_path_factory.mktemp("bad")
    files = {"dir": d}

    def put(name, text, mode="w"):
        p = d / name
        (p.write_bytes if mode == "wb" else p.write_text)(text)
        files[name] = p
        return p

    put("bad.toml", "steps = [\n")
    put("type.toml", 'steps = "ten"\n')
    put("key.toml", "stepz = 3\n")
    put("corpus.txt", "x = 1\n" * 3000)
    put("latin1.txt", "good text\n".encode() * 3 + b"caf\xe9 au lait\n", "wb")
    put("notext.jsonl", '{"body": "x"}\n' * 20)
    put("sft_notjson.jsonl", '{"instruction": "a", "output": "b"}\n{oops\n')
    put("sft_missing.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    put("sft_nonstr.jsonl",
        '{"instruction": "a", "output": 3}\n{"instruction": "a", "output": "b"}\n')
    put("sft_one.jsonl", '{"instruction": "a", "output": "b"}\n')
    put("sft_list.jsonl", '[1, 2]\n{"instruction": "a", "output": "b"}\n')
    put("not_a_tokenizer.json", '{"not": "a tokenizer"}')
    (d / "occupied").mkdir()
    put("occupied/metrics.jsonl", '{"step": 0, "val_loss": 5.0}\n')
    (d / "empty").mkdir()
    files["empty"] = d / "empty"
    files["hf_ok"] = _hf_dir(d, "hf_ok")
    files["hf_bert"] = _hf_dir(d, "hf_bert", lambda c: c.update(model_type="bert"), weights=False)
    files["hf_gpt2_llama_weights"] = _hf_dir(d, "hf_gpt2_llama_weights", lambda c: c.update(
        model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64))
    files["hf_noweights"] = _hf_dir(d, "hf_noweights", weights=False)
    files["hf_rope"] = _hf_dir(d, "hf_rope", lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}))
    files["hf_bias"] = _hf_dir(d, "hf_bias", lambda c: c.update(attention_bias=True))
    files["hf_gelu"] = _hf_dir(d, "hf_gelu", lambda c: c.update(hidden_act="gelu"))
    files["hf_trunc"] = _hf_dir(d, "hf_trunc", truncate=True)
    files["hf_shape"] = _hf_dir(d, "hf_shape", lambda c: c.update(intermediate_size=128))
    files["hf_smallvocab"] = _hf_dir(d, "hf_smallvocab", vocab=100)
    (d / "hf_badjson").mkdir()
    (d / "hf_badjson" / "config.json").write_text("{nope")
    files["hf_badjson"] = d / "hf_badjson"

    # checkpoints written the way checkpoint/ writes them (DCP "model" dict + meta.json)
    def ckpt(name, model="tiny"):
        torch.manual_seed(0)
        m = build_model("tiny", vocab_size=257)
        step = d / name / "checkpoints" / "step_2"
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": {k: v.detach() for k, v in m.named_parameters()}},
                     checkpoint_id=str(step), no_dist=True)
        cfg = dataclasses.replace(TrainConfig(), model=model, tokenizer="bytes")
        (step / "meta.json").write_text(json.dumps({"step": 2, "config":
                                                    dataclasses.asdict(cfg)}))
        (step.parent / "latest").write_text("step_2\n")
        files[name] = d / name
        return step

    ckpt("ck_ok")
    ckpt("ck_meta").joinpath("meta.json").write_text("{trunc")
    ckpt("ck_md").joinpath(".metadata").write_bytes(b"garbage")
    distcp = next(ckpt("ck_trunc").glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:1000])
    ckpt("ck_latest").parent.joinpath("latest").write_text("step_9\n")
    meta = ckpt("ck_layers") / "meta.json"
    m = json.loads(meta.read_text())
    m["config"]["n_layers"] = 3
    meta.write_text(json.dumps(m))
    ckpt("ck_mlp", model="mlp")
    # with the completion marker checkpoint/ writes (COMPLETE: every file's size and
    # SHA-256), so --resume gets past "incomplete" to the check under test
    _mark(ckpt("ck_marked"))
    distcp = next(_mark(ckpt("ck_marked_trunc")).glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:1000])
    put("a_file", "not a folder")
    (d / "occupied_out").mkdir()
    put("occupied_out/x", "")
    # complete checkpoints whose meta.json records the optimizer they hold (issue 51)
    for name, optimizer in (("ck_muon", "muon"), ("ck_adamw", "adamw")):
        meta = ckpt(name) / "meta.json"
        m = json.loads(meta.read_text())
        m["config"]["optimizer"], m["optimizer_saved"] = optimizer, True
        meta.write_text(json.dumps(m))
        _mark(meta.parent)
    # run folders for `shardwise report`: valid JSON of the wrong type (issue 51)
    good = '{"step": 1, "loss": 5.0}\n'
    for name, text in (("run_ok", good), ("run_step_str", good + '{"step": "three"}\n'),
                       ("run_list", good + "[1, 2]\n")):
        (d / name).mkdir()
        put(f"{name}/metrics.jsonl", text)
        files[name] = d / name
    (d / "run_meta_list" / "checkpoints" / "step_2").mkdir(parents=True)
    put("run_meta_list/metrics.jsonl", good)
    put("run_meta_list/checkpoints/step_2/meta.json", "[1]")
    files["run_meta_list"] = d / "run_meta_list"
    # `shardwise plan --cluster`: TOML's nan and inf literals
    put("cluster_nan.toml", "[gpu]\nbf16_tflops = nan\nhbm_gb = 80\n")
    put("cluster_inf.toml", "[gpu]\nbf16_tflops = 989\nhbm_gb = inf\n")
    put("cluster_flash.toml", '[gpu]\npreset = "h100"\nflash_efficiency = 2\n')
    return files


# (id, argv built from the files, fragments the message must contain)
CASES = [
    # --- CLI -----------------------------------------------------------------------------
    ("unknown-command", lambda f: ["frobnicate"], ["invalid choice: 'frobnicate'"]),
    ("unknown-flag", lambda f: ["train", "--bogus-flag", "3"],
     ["unrecognized arguments: --bogus-flag"]),
    ("int-flag-not-int", lambda f: ["train", "--dp", "abc"], ["--dp: invalid int value: 'abc'"]),
    ("engine-choice", lambda f: ["train", "--engine", "bogus"],
     ["--engine: invalid choice: 'bogus'", "'explicit', 'torch'"]),
    ("task-choice", lambda f: ["train", "--task", "chat"], ["--task: invalid choice: 'chat'"]),
    ("max-restarts-without-resume", lambda f: [*Q, "--max-restarts", "2"],
     ["--max-restarts 2 restarts every rank", "add --resume auto"]),
    ("max-restarts-negative", lambda f: [*Q, "--max-restarts", "-1"],
     ["--max-restarts -1 must be ≥ 0"]),
    ("device-choice", lambda f: ["train", "--device", "tpu"], ["--device: invalid choice: 'tpu'"]),
    ("collectives-train", lambda f: [*Q, "--collectives", "rings"],
     ["--collectives 'rings' is not an implementation", "choose native", "ring, tree", "auto"]),
    ("collectives-verify", lambda f: ["verify", "--collectives", "nccl"],
     ["--collectives 'nccl'", "e.g. --collectives ring"]),
    ("collectives-bench", lambda f: ["bench", "--suite", "collectives", "--collectives", "x"],
     ["--collectives 'x'", "choose native"]),
    ("export-needs-checkpoint", lambda f: ["export", "--to", "hf", "x"],
     ["the following arguments are required: --checkpoint"]),
    ("export-format", lambda f: ["export", "--checkpoint", f["ck_ok"], "--to", "onnx", "x"],
     ["--to: invalid choice: 'onnx'"]),
    ("verify-nproc-0", lambda f: ["verify", "--nproc", "0"], ["--nproc 0 must be at least 1"]),
    ("verify-layout-too-big", lambda f: ["verify", "--nproc", "2", "--layouts", "dp=4"],
     ["layout dp=4 needs 4 ranks but --nproc is 2", "raise --nproc"]),
    ("verify-layout-syntax", lambda f: ["verify", "--nproc", "2", "--layouts", "dq=2"],
     ["--layouts 'dq=2'", "e.g. dp=2,zero=3"]),
    # --- config file and values -----------------------------------------------------------
    ("config-missing", lambda f: ["train", "--config", f["dir"] / "none.toml"],
     ["none.toml: no such file"]),
    ("config-not-toml", lambda f: ["train", "--config", f["bad.toml"]], ["not valid TOML"]),
    ("config-unknown-key", lambda f: ["train", "--config", f["key.toml"]],
     ["unknown key 'stepz'", "valid keys:"]),
    ("config-wrong-type", lambda f: ["train", "--config", f["type.toml"]],
     ["steps = 'ten' should be a int"]),
    ("dp-0", lambda f: [*Q, "--dp", "0"], ["--dp 0 must be at least 1"]),
    ("steps-0", lambda f: [*Q, "--steps", "0"], ["--steps 0 must be at least 1"]),
    ("model-unknown", lambda f: [*Q, "--model", "huge"],
     ["--model 'huge' is not a preset: choose from"]),
    ("lr-0", lambda f: [*Q, "--lr", "0"], ["--lr 0.0 must be > 0"]),
    ("timeout-negative", lambda f: [*Q, "--timeout", "-1"], ["--timeout -1.0 must be > 0"]),
    ("hang-after-negative", lambda f: [*Q, "--hang-after", "-1"],
     ["--hang-after -1.0 must be ≥ 0 seconds (0 = half of --timeout, 150 s)"]),
    ("check-collectives-unknown", lambda f: [*Q, "--check-collectives", "always"],
     ["--check-collectives: invalid choice: 'always'"]),
    ("n-layers-negative", lambda f: [*Q, "--n-layers", "-1"], ["--n-layers -1 must be ≥ 1"]),
    ("global-batch-divisibility", lambda f: [*Q, "--global-batch", "10", "--micro-batch", "4"],
     ["--global-batch 10 is not divisible by dp × micro-batch = 2 × 4 = 8",
      "choose a multiple of 8"]),
    ("dp4-explicit-micro-batch", lambda f: [*Q, "--dp", "4", "--micro-batch", "8"],
     ["--global-batch 16 is not divisible by dp × micro-batch = 4 × 8 = 32",
      "change --micro-batch"]),
    ("no-micro-batch-fits-dp", lambda f: [*Q, "--dp", "32"],
     ["--global-batch 16 does not split over --dp 32", "no micro-batch fits",
      "choose --global-batch a multiple of 32", "--dp from [1, 2, 4, 8, 16]"]),
    ("no-microbatches-fit-pp", lambda f: [*Q, "--dp", "4", "--pp", "8"],
     ["--pp 8 needs at least 8 microbatches per step", "16 / 4 = 4 sequences per pipeline",
      "a multiple of dp × pp = 32"]),
    ("seq-len-beyond-context", lambda f: [*Q, "--seq-len", "4096"],
     ["--seq-len 4096 exceeds the tiny model's max_seq_len 256"]),
    # values that used to crash after start-up or misbehave silently (fixed in config.validate)
    ("eval-every-0", lambda f: [*Q, "--eval-every", "0"], ["--eval-every 0 must be ≥ 1"]),
    ("collectives-on-every-rank", lambda f: [*Q, "--collectives", "trees"],
     ["--collectives 'trees'"]),
    ("log-every-0", lambda f: [*Q, "--log-every", "0"], ["--log-every 0 must be ≥ 1"]),
    ("eval-sequences-0", lambda f: [*Q, "--eval-sequences", "0"],
     ["--eval-sequences 0 must be ≥ 1"]),
    ("warmup-negative", lambda f: [*Q, "--warmup-steps", "-1"],
     ["--warmup-steps -1 must be ≥ 0"]),
    ("grad-clip-negative", lambda f: [*Q, "--grad-clip", "-1"],
     ["--grad-clip -1.0 must be ≥ 0", "0 = no clipping"]),
    ("dropout-out-of-range", lambda f: [*Q, "--dropout", "1.5"],
     ["--dropout 1.5 must be in [0, 1)"]),
    ("bucket-mb-0", lambda f: [*Q, "--bucket-mb", "0"], ["--bucket-mb 0.0 must be > 0 MiB"]),
    ("beta1-out-of-range", lambda f: [*Q, "--beta1", "1.5"], ["--beta1 1.5 must be in [0, 1)"]),
    ("weight-decay-negative", lambda f: [*Q, "--weight-decay", "-1"],
     ["--weight-decay -1.0 must be ≥ 0"]),
    ("min-lr-ratio-above-1", lambda f: [*Q, "--min-lr-ratio", "2"],
     ["--min-lr-ratio 2.0 must be in [0, 1]"]),
    ("out-holds-a-run", lambda f: [*Q, "--out", f["dir"] / "occupied"],
     ["already holds a run", "choose a new --out"]),
    ("out-is-a-file", lambda f: [*Q, "--out", f["a_file"]],
     ["exists and is not a folder", "choose a folder path"]),
    ("out-under-a-file", lambda f: [*Q, "--out", f["a_file"] / "run"],
     ["cannot be created because", "is a file, not a folder", "choose another --out"]),
    ("out-unwritable", lambda f: [*Q, "--out", "/proc/shardwise-nope/run"],
     ["--out /proc/shardwise-nope/run: cannot write there", "choose a writable --out"]),
    # --- layout ---------------------------------------------------------------------------
    ("tp-does-not-divide-heads", lambda f: [*Q, "--tp", "3"],
     ["--tp 3 does not divide the model's n_heads=4", "choose --tp from {1, 2}"]),
    ("sp-without-tp", lambda f: [*Q, "--sp"], ["--sp (sequence parallelism) needs --tp > 1"]),
    ("tp-mlp-sp", lambda f: [*Q, "--tp", "2", "--sp", "--model", "mlp"],
     ["the stacked MLP's activations [b, D] have no sequence dimension", "drop --sp"]),
    ("tp-mlp-does-not-divide", lambda f: [*Q, "--tp", "3", "--model", "mlp"],
     ["--tp 3 does not divide the MLP's d_ff=64", "choose --tp from {1, 2, 4, 8, 16, 32, 64}"]),
    ("zero-without-dp", lambda f: [*Q, "--zero", "3", "--dp", "1"],
     ["--zero 3 shards the model state over the dp ranks, but dp=1", "Use --dp 2 or more"]),
    ("zero3-with-zb-h1", lambda f: [*Q, "--dp", "2", "--zero", "3", "--pp", "2",
                                     "--schedule", "zb-h1"],
     ["ZeRO-3 with the split-backward schedule zb-h1", "use --schedule 1f1b"]),
    ("pp-too-few-microbatches", lambda f: [*Q, "--pp", "4", "--micro-batch", "8"],
     ["--pp 4 needs at least 4 microbatches", "--microbatches M"]),
    ("pp-too-few-layers", lambda f: [*Q, "--pp", "4", "--microbatches", "4"],
     ["too few for 4 pipeline stages", "--n-layers 4"]),
    ("layers-per-stage-syntax", lambda f: [*Q, "--pp", "2", "--microbatches", "4",
                                           "--layers-per-stage", "a,b"],
     ["--layers-per-stage 'a,b': write comma-separated layer counts"]),
    ("layers-per-stage-sum", lambda f: [*Q, "--pp", "2", "--microbatches", "4",
                                        "--layers-per-stage", "1,5"],
     ["summing to the model's 2 layers (they sum to 6)"]),
    # context parallelism (each sequence split over the cp ranks)
    ("cp-seq-not-divisible", lambda f: [*Q, "--cp", "2", "--seq-len", "30"],
     ["--cp 2 cuts each sequence into 2·cp = 4 chunks", "--seq-len 30 is not divisible by 4",
      "choose a --seq-len that is a multiple of 4"]),
    ("cp-torch-engine-on-cpu", lambda f: [*Q, "--cp", "2", "--engine", "torch"],
     ["--engine torch --cp 2: PyTorch's context_parallel does not run on CPU",
      "does not have a sharding strategy registered", "use --engine explicit"]),
    ("cp-with-mlp", lambda f: [*Q, "--cp", "2", "--model", "mlp"],
     ["--cp 2 splits each sequence over ranks, but this model (MLPConfig) has no sequence",
      "choose --model tiny"]),
    ("cp-unknown-method", lambda f: [*Q, "--cp", "2", "--cp-method", "ulysses"],
     ["--cp-method 'ulysses': choose ring", "or allgather"]),
    ("cp-with-dropout", lambda f: [*Q, "--cp", "2", "--dropout", "0.1"],
     ["--cp 2 with dropout=0.1: ring attention has no attention dropout", "set dropout 0"]),
    # --- data and tokenizer ---------------------------------------------------------------
    ("data-missing", lambda f: [*Q, "--data", f["dir"] / "nope.txt"],
     ["nope.txt: no such file or folder"]),
    ("data-empty-folder", lambda f: [*Q, "--data", f["empty"]], ["empty"]),
    ("data-not-utf8", lambda f: [*Q, "--data", f["latin1.txt"]],
     ["latin1.txt", "byte offset 33", "UTF-8"]),
    ("jsonl-without-text", lambda f: [*Q, "--data", f["notext.jsonl"]],
     ["line 1 has no 'text' field", "rename the field"]),
    ("corpus-too-small-for-batch", lambda f: [*Q, "--data", f["corpus.txt"], "--global-batch",
                                              "4096", "--micro-batch", "8"],
     ["one global batch needs 4096", "a smaller --global-batch"]),
    ("tokenizer-not-a-file", lambda f: [*Q, "--tokenizer", "sentencepiece", "--data",
                                        f["corpus.txt"]],
     ["--tokenizer 'sentencepiece' is not one of 'bpe', 'bytes'"]),
    ("tokenizer-unparsable", lambda f: [*Q, "--tokenizer", f["not_a_tokenizer.json"],
                                        "--data", f["corpus.txt"]],
     ["not a HF tokenizers file"]),
    ("bpe-vocab-too-small", lambda f: [*Q, "--tokenizer", "bpe", "--vocab-size", "100",
                                       "--data", f["corpus.txt"]],
     ["--vocab-size 100 is too small for byte-level BPE", "at least 258"]),
    # --- SFT ------------------------------------------------------------------------------
    ("sft-without-data", lambda f: SFT, ["--task sft needs --data FILE.jsonl"]),
    ("sft-not-jsonl", lambda f: [*SFT, "--data", f["corpus.txt"]],
     ["expected a .jsonl file of"]),
    ("pack-with-torch-cp", lambda f: [*SFT, "--pack", "--cp", "2", "--engine", "torch",
                                      "--data", f["sft_one.jsonl"]],
     ["--pack with --engine torch --cp 2", "takes no attention mask", "use --engine explicit"]),
    ("sft-with-mlp", lambda f: [*SFT, "--model", "mlp", "--data", f["sft_one.jsonl"]],
     ["--task sft trains a language model", "choose --model tiny"]),
    ("sft-line-not-json", lambda f: [*SFT, "--data", f["sft_notjson.jsonl"]],
     ["sft_notjson.jsonl:2: not valid JSON", "one JSON object per line"]),
    ("sft-record-not-object", lambda f: [*SFT, "--data", f["sft_list.jsonl"]],
     ["sft_list.jsonl:1: expected a JSON object"]),
    ("sft-missing-output", lambda f: [*SFT, "--data", f["sft_missing.jsonl"]],
     ["sft_missing.jsonl:2: missing field 'output'"]),
    ("sft-field-not-string", lambda f: [*SFT, "--data", f["sft_nonstr.jsonl"]],
     ["sft_nonstr.jsonl:1: field 'output' is int, not a string"]),
    ("sft-one-record", lambda f: [*SFT, "--data", f["sft_one.jsonl"]],
     ["1 record(s); SFT needs at least 2"]),
    ("sft-prompts-longer-than-seq-len", lambda f: [*SFT, "--data",
                                                   ROOT / "examples" / "sft_sample.jsonl"],
     ["every train prompt is longer than --seq-len 32 tokens", "raise --seq-len"]),
    ("sft-too-few-examples", lambda f: [*SFT, "--seq-len", "256", "--data",
                                        ROOT / "examples" / "sft_sample.jsonl",
                                        "--global-batch", "64"],
     ["--global-batch 64 needs 64 training examples", "lower --global-batch"]),
    # --- Hugging Face folders -------------------------------------------------------------
    ("hf-no-folder", lambda f: [*Q, "--init-from-hf", f["dir"] / "nope"],
     ["--init-from-hf", "no such folder"]),
    ("hf-no-config", lambda f: [*Q, "--init-from-hf", f["empty"]], ["no config.json there"]),
    ("hf-config-not-json", lambda f: [*Q, "--init-from-hf", f["hf_badjson"]],
     ["config.json: not valid JSON"]),
    ("hf-architecture-refused", lambda f: [*Q, "--init-from-hf", f["hf_bert"]],
     ["model_type 'bert' is not supported", "shardwise loads LlamaForCausalLM ('llama')",
      "GPT2LMHeadModel ('gpt2')", "Qwen3ForCausalLM ('qwen3')"]),
    ("hf-gpt2-config-llama-weights",
     lambda f: [*Q, "--init-from-hf", f["hf_gpt2_llama_weights"]],
     ["tensors with no place in shardwise's GPT-2", "is this a GPT2LMHeadModel folder?"]),
    ("hf-no-weights", lambda f: [*Q, "--init-from-hf", f["hf_noweights"]],
     ["no weights (model.safetensors"]),
    ("hf-rope-scaling", lambda f: [*Q, "--init-from-hf", f["hf_rope"]],
     ["RoPE scaling 'yarn' is not implemented", "'llama3'"]),  # llama3 loads (test_hf_llama3)
    ("hf-biases", lambda f: [*Q, "--init-from-hf", f["hf_bias"]],
     ["attention_bias = True", "no biases"]),
    ("hf-activation", lambda f: [*Q, "--init-from-hf", f["hf_gelu"]], ["hidden_act 'gelu'"]),
    ("hf-truncated-weights", lambda f: [*Q, "--init-from-hf", f["hf_trunc"]],
     ["model.safetensors: cannot be read", "corrupt or truncated"]),
    ("hf-weights-do-not-fit-config", lambda f: [*Q, "--init-from-hf", f["hf_shape"]],
     ["the weights do not fit its config.json", "mismatched"]),
    ("hf-seq-len-beyond-positions", lambda f: [*Q, "--seq-len", "128", "--init-from-hf",
                                                   f["hf_ok"]],
     ["--seq-len 128 exceeds the HF model's max_position_embeddings 64"]),
    ("hf-tokenizer-larger-than-vocab", lambda f: [*Q, "--init-from-hf", f["hf_smallvocab"],
                                                  "--data", f["corpus.txt"]],
     ["has 257 ids but the model only 100 embeddings"]),
    ("hf-with-mlp", lambda f: [*Q, "--model", "mlp", "--init-from-hf", f["hf_ok"]],
     ["--init-from-hf loads a Llama"]),
    # --- checkpoints (export) -------------------------------------------------------------
    ("export-no-checkpoint", lambda f: ["export", "--checkpoint", f["dir"] / "nope", "--to",
                                        "hf", f["dir"] / "o"],
     ["--checkpoint", "no such folder"]),
    ("export-not-a-checkpoint", lambda f: ["export", "--checkpoint", f["empty"], "--to", "hf",
                                           f["dir"] / "o"], ["no checkpoint there"]),
    ("export-latest-dangling", lambda f: ["export", "--checkpoint", f["ck_latest"], "--to", "hf",
                                          f["dir"] / "o"],
     ["names 'step_9', which does not exist"]),
    ("export-meta-corrupt", lambda f: ["export", "--checkpoint", f["ck_meta"], "--to", "hf",
                                       f["dir"] / "o"],
     ["meta.json: not valid JSON", "use an earlier checkpoints/step_N"]),
    ("export-metadata-corrupt", lambda f: ["export", "--checkpoint", f["ck_md"], "--to", "hf",
                                           f["dir"] / "o"],
     [".metadata: cannot be read", "corrupt or incomplete"]),
    ("export-truncated-tensor-file", lambda f: ["export", "--checkpoint", f["ck_trunc"], "--to",
                                                "hf", f["dir"] / "o"],
     [".distcp: truncated (1000 of", "use an earlier checkpoints/step_N"]),
    ("export-other-model-config", lambda f: ["export", "--checkpoint", f["ck_layers"], "--to",
                                             "hf", f["dir"] / "o"],
     ["do not fit its model config", "layers.2.attention.wq.weight: checkpoint missing"]),
    ("export-mlp", lambda f: ["export", "--checkpoint", f["ck_mlp"], "--to", "hf",
                              f["dir"] / "o"], ["'mlp' is not a Llama preset"]),
    ("export-out-not-empty", lambda f: ["export", "--checkpoint", f["ck_ok"], "--to", "hf",
                                        f["dir"] / "occupied_out"],
     ["already exists and is not empty", "choose a new output folder"]),
    ("export-out-unwritable", lambda f: ["export", "--checkpoint", f["ck_ok"], "--to", "hf",
                                         "/proc/shardwise-nope/x"],
     ["cannot create /proc/shardwise-nope/x.tmp", "choose a writable output folder"]),
    ("export-tokenizer-missing", lambda f: ["export", "--checkpoint", f["ck_ok"], "--to", "hf",
                                            f["dir"] / "o", "--tokenizer", f["dir"] / "t.json"],
     ["t.json: no such file", "pass --tokenizer DIR|FILE.json"]),
    # --- issue 51: refused before any collective, nothing written -------------------------
    # a checkpoint of the other optimizer, refused from its meta.json (config.validate)
    ("resume-muon-with-adamw", lambda f: [*Q, "--resume", f["ck_muon"] / "checkpoints" /
                                          "step_2"],
     ["holds Muon's optimizer state (--optimizer muon), but this run uses AdamW",
      "resume with --optimizer muon, or start a new run"]),
    ("resume-adamw-with-muon", lambda f: [*Q, "--optimizer", "muon", "--resume", f["ck_adamw"]],
     ["holds AdamW's optimizer state (--optimizer adamw), but this run uses Muon",
      "resume with --optimizer adamw"]),
    ("resume-auto-muon-with-adamw", lambda f: [*Q, "--out", f["ck_muon"], "--resume", "auto"],
     ["holds Muon's optimizer state", "resume with --optimizer muon"]),
    ("bench-nproc-negative", lambda f: ["bench", "--suite", "dp", "--nproc", "-1"],
     ["--nproc -1 must be ≥ 1 ranks", "or 0, the default"]),
    ("report-step-not-int", lambda f: ["report", f["run_step_str"]],
     ["metrics.jsonl:2: \"step\" is \"three\", not an integer", "give a folder that shardwise "
      "train wrote"]),
    ("report-record-not-object", lambda f: ["report", f["run_list"]],
     ["metrics.jsonl:2: a JSON list ([1, 2]), not a record", "give a folder that shardwise "
      "train wrote"]),
    ("report-meta-not-object", lambda f: ["report", f["run_meta_list"]],
     ["step_2/meta.json holds a JSON list ([1]), not the object"]),
    ("report-out-under-a-file", lambda f: ["report", f["run_ok"], "--out",
                                           f["a_file"] / "r.html"],
     ["r.html: cannot be written because", "a_file is a file, not a folder",
      "choose another --out"]),
    ("report-out-is-a-folder", lambda f: ["report", f["run_ok"], "--out", f["empty"]],
     ["is a folder: give a file path, e.g."]),
    ("plan-cluster-nan", lambda f: ["plan", "--gpus", "8", "--cluster", f["cluster_nan.toml"]],
     ["bf16_tflops = nan must be a finite positive number"]),
    ("plan-cluster-inf", lambda f: ["plan", "--gpus", "8", "--cluster", f["cluster_inf.toml"]],
     ["hbm_gb = inf must be a finite positive number"]),
    ("plan-cluster-flash-efficiency", lambda f: ["plan", "--gpus", "8", "--cluster",
                                                 f["cluster_flash.toml"]],
     ["flash_efficiency = 2 is a fraction of the bf16 peak", "(0, 1]"]),
]


@pytest.fixture
def cli(monkeypatch, capsys, cache_dir):
    """``shardwise.cli.main`` in this process, outside any world; spawning or training trips."""
    import shardwise.cli as cli_mod
    import shardwise.train.loop as loop

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache_dir))

    def tripwire(*a, **k):
        raise AssertionError("the bad input was not caught: workers would start")

    monkeypatch.setattr(cli_mod, "spawn", tripwire)
    monkeypatch.setattr(loop, "train", tripwire)

    def run(argv):
        try:
            code = cli_mod.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
        out = capsys.readouterr()
        return code, out.out + out.err

    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_the_constraint_and_the_fix(cli, f, argv, fragments):
    code, out = cli(argv(f))
    assert code == 2, out
    for frag in fragments:
        assert frag in out, f"{frag!r} not in:\n{out}"
    assert "Traceback" not in out, out
    assert "error:" in out.strip().splitlines()[-1], out  # the message is the last line


def test_the_catalogue_is_at_least_thirty_distinct_inputs():
    assert len({c[0] for c in CASES}) == len(CASES) >= 30


def _one_line_exit_2(code, out, fragments):
    assert code == 2, out
    for frag in fragments:
        assert frag in out, f"{frag!r} not in:\n{out}"
    assert "Traceback" not in out, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), out


@pytest.mark.timeout(60)
def test_issue51_refusals_leave_nothing_behind(cli, f, tmp_path, monkeypatch):
    """Issue 51's inputs, each one line and exit 2 with nothing written: no --out folder (so
    no empty metrics.jsonl to block the next run), no report page, no export folder."""
    out = tmp_path / "run"
    # 2. a Muon checkpoint resumed with AdamW, refused from its meta.json before --out exists
    _one_line_exit_2(*cli([*Q, "--out", out, "--resume", f["ck_muon"]]), ["Muon's optimizer"])
    assert not out.exists()
    # the same --out then takes a fresh run (the launcher's checks pass; spawn is the tripwire)
    with pytest.raises(AssertionError, match="workers would start"):
        cli([*Q, "--out", out])
    # an empty metrics.jsonl (what a run that failed before its first record leaves) does not
    # block a fresh run either; one with a record does
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(AssertionError, match="workers would start"):
        cli([*Q, "--out", out])
    (out / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
    _one_line_exit_2(*cli([*Q, "--out", out]), ["already holds a run"])
    shutil.rmtree(out)
    # 5, 6. report: nothing written into the run folder or next to the file
    for argv in (["report", f["run_step_str"]], ["report", f["run_meta_list"]],
                 ["report", f["run_ok"], "--out", f["a_file"] / "r.html"]):
        _one_line_exit_2(*cli(argv), [])
    assert not any(f[r].joinpath("report.html").exists()
                   for r in ("run_step_str", "run_meta_list", "run_ok"))
    # 3. WORLD_SIZE left in the shell, without the rest of a launcher's environment
    monkeypatch.setenv("WORLD_SIZE", "2")
    _one_line_exit_2(*cli([*Q, "--out", out]),
                     ["WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not",
                      "a partial torchrun environment", "unset WORLD_SIZE",
                      "or run under torchrun"])
    monkeypatch.setenv("RANK", "0")
    _one_line_exit_2(*cli([*Q, "--out", out]), ["MASTER_ADDR, MASTER_PORT are not"])
    _one_line_exit_2(*cli(["verify", "--nproc", "2"]), ["a partial torchrun environment"])
    assert not out.exists()


def _safetensor_error(msg):
    from safetensors import SafetensorError

    return SafetensorError(msg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [
    lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    lambda: _safetensor_error("Error while serializing: I/O error: No space left on device "
                              "(os error 28)"),
], ids=["oserror-enospc", "safetensor-error"])
def test_export_onto_a_full_disk_removes_its_partial_folder(cli, f, tmp_path, monkeypatch,
                                                           error):
    """Issue 51, 8: the weights' write fails half way (a full disk, simulated: a partial file
    written, then the error safetensors or the OS raises): one line naming the folder and the
    fix, and no OUT.tmp left taking the space."""
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 4096)  # what was written before the disk filled up
        raise error()

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "hf"
    _one_line_exit_2(*cli(["export", "--checkpoint", f["ck_ok"], "--to", "hf", out]),
                     [f"export: writing {out}.tmp failed", "No space left on device",
                      "the partial folder was removed", "free space there",
                      "or export to another OUT"])
    assert not out.exists() and not out.with_name("hf.tmp").exists()
    assert list(tmp_path.iterdir()) == []


# Multi-rank: as rank 1 of 2 with no peer, the error must come before the rendezvous.
RANK_CASES = [
    ("sft-bad-record", lambda f: [*SFT, "--data", f["sft_missing.jsonl"]],
     ["missing field 'output'"]),
    ("hf-truncated-weights", lambda f: [*Q, "--init-from-hf", f["hf_trunc"]],
     ["corrupt or truncated"]),
    ("hf-architecture", lambda f: [*Q, "--init-from-hf", f["hf_bert"]], ["model_type 'bert'"]),
    ("eval-every-0", lambda f: [*Q, "--eval-every", "0"], ["--eval-every 0 must be ≥ 1"]),
    ("collectives-on-every-rank", lambda f: [*Q, "--collectives", "trees"],
     ["--collectives 'trees'"]),
    ("cp-seq-on-every-rank", lambda f: [*Q, "--dp", "1", "--cp", "2", "--seq-len", "30"],
     ["--seq-len 30 is not divisible by 4"]),
    # checkpoints given to --resume (checkpoint/'s checks, on every rank)
    ("resume-incomplete-checkpoint", lambda f: [*Q, "--resume",
                                                f["ck_ok"] / "checkpoints" / "step_2"],
     ["has no completion marker", "resume from an earlier checkpoint"]),
    ("resume-truncated-checkpoint", lambda f: [*Q, "--resume",
                                               f["ck_marked_trunc"] / "checkpoints" / "step_2"],
     ["is corrupt", "truncated", ".distcp"]),
    ("resume-other-model-config", lambda f: [*Q, "--n-layers", "3", "--resume",
                                             f["ck_marked"] / "checkpoints" / "step_2"],
     ["was saved from another model configuration", "layers.2.attention.wq.weight",
      "--model tiny"]),
    ("resume-past-steps", lambda f: [*Q, "--steps", "1", "--resume",
                                     f["ck_marked"] / "checkpoints" / "step_2"],
     ["is at step 2, past --steps 1", "pass --steps greater than 2"]),
    ("resume-other-optimizer", lambda f: [*Q, "--resume", f["ck_muon"]],
     ["holds Muon's optimizer state", "resume with --optimizer muon"]),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv,fragments", [c[1:] for c in RANK_CASES],
                         ids=[c[0] for c in RANK_CASES])
def test_every_rank_refuses_before_any_collective(cache_dir, f, argv, fragments):
    t0 = time.time()
    p = run_cli(argv(f), cache_dir, timeout=80, env=AS_RANK_1_OF_2)
    assert p.returncode == 2, p.stdout
    for frag in fragments:
        assert frag in p.stdout, p.stdout
    assert "Traceback" not in p.stdout, p.stdout
    assert time.time() - t0 < 75  # a rank stuck in the rendezvous would wait for its peer


def test_a_warmup_longer_than_the_run_is_one_warning():
    """Issue 51: --warmup-steps past --steps trains, but says once (rank 0, at start-up) that
    the LR never reaches --lr; the CLI run in tests/test_pipeline_derived_m.py shows it once."""
    import dataclasses

    from shardwise.config import TrainConfig
    from shardwise.train.optim import lr_multiplier, warmup_warning

    cfg = dataclasses.replace(TrainConfig(), steps=10, warmup_steps=40, lr=3e-4)
    line = warmup_warning(cfg)
    assert line == ("warning: --warmup-steps 40 is longer than the run (--steps 10): the LR "
                    "climbs only to 25% of --lr 0.0003 and never decays; choose --warmup-steps "
                    "≤ 10 (e.g. 1) for the whole warm-up + cosine schedule")
    assert lr_multiplier(cfg.steps - 1, 40, 10, 0.1) == 0.25  # the last step's LR, as said
    assert warmup_warning(dataclasses.replace(cfg, warmup_steps=10)) is None
