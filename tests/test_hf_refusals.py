"""Loading refuses what it cannot mean (issue 50): an ``--init-from-hf`` folder whose weights are
quantized or hold a NaN, or whose RoPE keys we would read otherwise than transformers does.

- A tensor stored as int8 (a quantized checkpoint) is refused from the safetensors header, on
  every rank before any collective; in a ``pytorch_model.bin`` when it is read.
- A NaN in a weight is refused before any worker starts by the launcher's scan, and by the rank
  that reads it while it materialises its part (torchrun: no launcher), with the same line.
- A folder with no tokenizer is refused unless ``--tokenizer`` names one (a BPE trained here
  would give ids that mean nothing to the model).
- The RoPE keys: for several ``config.json`` variants our θ and llama3 scaling equal what
  transformers' own config object holds (computed here, not written down), and a tiny Llama
  with ``rope_scaling`` beside a plain ``rope_parameters`` gives transformers' logits.

Each refusal through the CLI: exit status 2, one line naming the file and the tensor, no
Traceback, nothing in the run folder. Folders are built by transformers from tiny random
configs (no downloads) and then damaged with safetensors.
"""

import copy
import json
import shutil

import pytest
import torch

from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
from safetensors.torch import load_file, save_file  # noqa: E402

from shardwise.errors import ShardwiseConfigError  # noqa: E402
from shardwise.interop.hf import (  # noqa: E402
    hf_model_overrides,
    hf_to_llama_config,
    hf_weight_stream,
    load_hf_weights,
)
from shardwise.interop.hf_import import _SliceReader, read_hf_weights  # noqa: E402
from shardwise.lazy import materialize  # noqa: E402
from shardwise.models import Llama, LlamaConfig  # noqa: E402
from test_hf_llama3 import max_err, randomize  # noqa: E402

V = 300
INT8 = "model.layers.0.mlp.up_proj.weight"
NAN = "model.layers.1.self_attn.k_proj.weight"
TRAIN = ["train", "--steps", "1", "--tokenizer", "bytes", "--seq-len", "32", "--global-batch",
         "4", "--micro-batch", "2", "--eval-sequences", "4"]
AS_RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29996"}
AS_RANK_0_OF_1 = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29995"}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_llama(**kw):
    return transformers.LlamaConfig(**{
        "vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def damaged(root, name, base, change):
    """A copy of folder ``base`` whose ``model.safetensors`` has ``change(tensors)`` applied."""
    folder = root / name
    shutil.copytree(base, folder)
    sd = load_file(str(folder / "model.safetensors"))
    change(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def put_nan(sd):
    t = sd[NAN].clone()
    t[5, 3] = float("nan")
    sd[NAN] = t


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_refusals")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama()).save_pretrained(root / "ok")
    f = {"ok": root / "ok", "root": root}
    f["int8"] = damaged(root, "int8", f["ok"], lambda sd: sd.update(
        {INT8: (sd[INT8] * 100).to(torch.int8)}))
    f["nan"] = damaged(root, "nan", f["ok"], put_nan)
    (root / "bin").mkdir()  # the same int8 tensor in a pytorch_model.bin
    shutil.copy(f["ok"] / "config.json", root / "bin" / "config.json")
    torch.save(load_file(str(f["int8"] / "model.safetensors")), root / "bin" / "pytorch_model.bin")
    f["bin"] = root / "bin"
    return f


def refused(p, out, fragments):
    """Exit 2, exactly one line of output, the error naming ``fragments``, nothing left."""
    lines = [x for x in p.stdout.splitlines() if x.strip()]
    assert p.returncode == 2, p.stdout
    assert "Traceback" not in p.stdout, p.stdout
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), p.stdout
    for frag in fragments:
        assert frag in lines[0], p.stdout
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


# ------------------------------------------------------------------------------ through the CLI


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,dp,env", [
    ("int8", "2", None),  # the launcher, before it spawns
    ("int8", "2", AS_RANK_1_OF_2),  # a torchrun rank without its peer: before the rendezvous
    ("nan", "2", None),  # the launcher's scan, before it spawns
    ("nan", "1", None),  # one rank run in-process: the same scan, before the run folder
], ids=["int8-launcher", "int8-every-rank", "nan-launcher", "nan-one-rank"])
def test_the_cli_refuses_in_one_line_and_leaves_nothing(folders, cache_dir, case, dp, env):
    out = folders["root"] / f"run-{case}-{dp}-{env is not None}"
    p = run_cli([*TRAIN, "--dp", dp, "--init-from-hf", folders[case], "--out", out], cache_dir,
                timeout=100, env=env)
    name, why = (INT8, ["is stored as I8", "quantized checkpoints are not supported",
                        "give a float (fp32/bf16/fp16) checkpoint"]) if case == "int8" else (
        NAN, ["holds NaN or inf values", "weights are all finite"])
    refused(p, out, [str(folders[case] / "model.safetensors"), f"tensor {name}", *why])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", ["2", "1"], ids=["launcher", "one-rank"])
def test_a_folder_without_a_tokenizer_is_refused_unless_tokenizer_names_one(folders, cache_dir,
                                                                           dp):
    """The folder has weights and config.json but no tokenizer files: the default --tokenizer
    would train a new BPE whose ids mean nothing to the model. One line naming the folder and
    the fix, exit 2, before any worker or collective. (With --tokenizer named, such folders
    train: the other cases here pass --tokenizer bytes and fail only on their weights.)"""
    out = folders["root"] / f"run-notok-{dp}"
    no_tok = [a for a in TRAIN if a not in ("--tokenizer", "bytes")]
    p = run_cli([*no_tok, "--dp", dp, "--init-from-hf", folders["ok"], "--out", out],
                cache_dir, timeout=100)
    refused(p, out, [f"--init-from-hf {folders['ok']}: the folder has no tokenizer",
                     "ids that mean nothing to the model", "--tokenizer DIR|FILE.json|bytes"])


@pytest.mark.timeout(120)
def test_a_torchrun_rank_refuses_the_nan_it_reads_with_the_same_line(folders, cache_dir):
    """No launcher: the rank's own read (the slice reader) finds the NaN after the world exists
    and before step 0; the line is the launcher's. (The run folder has begun: config.toml.)"""
    out = folders["root"] / "run-nan-torchrun"
    p = run_cli([*TRAIN, "--dp", "1", "--init-from-hf", folders["nan"], "--out", out],
                cache_dir, timeout=100, env=AS_RANK_0_OF_1)
    launcher = run_cli([*TRAIN, "--dp", "1", "--init-from-hf", folders["nan"], "--out",
                        folders["root"] / "run-nan-again"], cache_dir, timeout=100)
    assert p.returncode == 2 and "Traceback" not in p.stdout, p.stdout
    errors = [x for x in p.stdout.splitlines() if "error:" in x]
    assert errors == [launcher.stdout.strip()], p.stdout
    assert not (out / "metrics.jsonl").exists()  # no step ran


# ------------------------------------------------------------------------- the checks directly


def test_the_slice_reader_refuses_a_nan_in_the_box_it_reads(folders):
    path = folders["nan"] / "model.safetensors"
    read = _SliceReader(path, NAN)
    assert read((0, 0), (4, 32)).shape == (4, 32)  # rows 0-3: finite, read as usual
    with pytest.raises(ShardwiseConfigError, match=rf"{path}: tensor {NAN} holds NaN"):
        read((4, 0), (4, 32))  # row 5 holds it
    model = Llama(LlamaConfig(**hf_model_overrides(folders["nan"])))
    with pytest.raises(ShardwiseConfigError, match=f"tensor {NAN} holds NaN"):
        for _, t in hf_weight_stream(model, folders["nan"]):  # the per-rank stream, whole
            materialize(t)


def test_a_pytorch_bin_with_an_int8_tensor_is_refused_when_read(folders):
    with pytest.raises(ShardwiseConfigError, match=rf"tensor {INT8} is stored as torch.int8.*"
                                                   "quantized checkpoints are not supported"):
        read_hf_weights(folders["bin"])


# ------------------------------------------------------------------------------------- RoPE

L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}
ROPE_VARIANTS = {
    "neither": {},
    "theta-top-level": {"rope_theta": 5e5},
    "only-rope-scaling": {"rope_scaling": dict(L3), "rope_theta": 5e5},
    "only-rope-scaling-legacy-type": {
        "rope_scaling": {"type": "llama3", **{k: v for k, v in L3.items() if k != "rope_type"}}},
    "only-rope-parameters": {"rope_parameters": {**L3, "rope_theta": 2e5}},
    "both-scaling-wins": {"rope_parameters": {"rope_type": "default", "rope_theta": 3e5},
                          "rope_scaling": {**L3, "factor": 4.0}},
    "both-scaling-wins-theta-lost": {"rope_parameters": {**L3, "rope_theta": 3e5},
                                     "rope_scaling": {**L3, "factor": 2.0}},
    "theta-inside-beats-top-level": {"rope_theta": 1e6,
                                     "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 3e5}},
    "rope-scaling-null": {"rope_scaling": None, "rope_parameters": {"rope_type": "default",
                                                                    "rope_theta": 3e5}},
    "llama3-without-original-context": {
        "rope_parameters": {k: v for k, v in L3.items()
                            if k != "original_max_position_embeddings"}},
}
FAMILIES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen3": {"head_dim": 8},
            "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1}}


def _config(model_type, variant):
    return {"model_type": model_type, "vocab_size": V, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64,
            **FAMILIES[model_type], **copy.deepcopy(ROPE_VARIANTS[variant])}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rope_keys_are_read_as_transformers_reads_them(tmp_path, model_type):
    for variant in ROPE_VARIANTS:
        hf = _config(model_type, variant)
        folder = tmp_path / variant
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf))
        theirs = transformers.AutoConfig.from_pretrained(folder).rope_parameters
        ours = hf_to_llama_config(hf)
        assert ours.rope_theta == theirs["rope_theta"], (variant, theirs)
        if theirs["rope_type"] == "default":
            assert ours.rope_scaling is None, (variant, theirs)
        else:
            assert ours.rope_scaling == {k: theirs[k] for k in ("rope_type", *L3)}, variant


@pytest.mark.parametrize("key,rope", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
])
def test_unsupported_rope_types_are_refused_naming_the_type_and_the_file(key, rope):
    hf = {**_config("llama", "neither"), "rope_parameters": {"rope_type": "default"}, key: rope}
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ShardwiseConfigError,
                       match=rf"^DIR/config.json: {key}: RoPE scaling '{kind}' is not implemented"):
        hf_to_llama_config(hf, source="DIR/config.json")


def test_rope_scaling_beside_rope_parameters_gives_transformers_logits(tmp_path):
    """transformers 5 honours a ``rope_scaling`` written beside a plain ``rope_parameters``
    (convert_rope_params_to_dict): so must we, or every position past the original context
    turns by other angles."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama(max_position_embeddings=256)).eval()
    randomize(base, 1)
    folder = tmp_path / "llama3-beside"
    base.save_pretrained(folder)
    meta = json.loads((folder / "config.json").read_text())
    assert meta["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in meta
    meta["rope_scaling"] = {**L3, "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(meta))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    over = hf_model_overrides(folder)
    assert over["rope_scaling"]["factor"] == 8.0
    ours = Llama(LlamaConfig(**over)).eval()
    load_hf_weights(ours, folder)
    x = torch.randint(0, V, (2, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        max_err(ours(x), hf(x).logits)
        assert (base(x).logits - hf(x).logits).abs().max() > 1e-3  # the scaling matters here
