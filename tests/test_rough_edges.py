"""Issue 36's smaller items, each where a test can see it: MoE counts of 0 refused, an empty
report folder refused, Hub names answered with the fetch recipe, the default layout following
torchrun's WORLD_SIZE, and the launcher's diagnosis naming the ranks it stopped as stopped."""

import pytest

from conftest import run_cli
from shardwise.cli import _parser
from shardwise.config import from_args, validate
from shardwise.errors import ShardwiseConfigError


def _cfg(*argv):
    args, _ = _parser().parse_known_args(["train", *argv])
    return from_args(args)


@pytest.mark.parametrize("flag", ["--n-experts", "--top-k", "--moe-every"])
def test_moe_count_zero_is_refused_not_read_as_not_given(flag):
    with pytest.raises(ShardwiseConfigError, match=rf"^{flag} 0 must be at least 1: .*omit"):
        _cfg("--model", "moe-tiny", flag, "0")


def test_report_of_an_empty_or_unrelated_folder_exits_2_in_one_line(tmp_path, cache_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run_cli(["report", empty], cache_dir, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout
    assert "is empty" in lines[0] and "shardwise train wrote" in lines[0]
    assert not (empty / "report.html").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    p = run_cli(["report", other], cache_dir, timeout=120)
    assert p.returncode == 2 and "holds no run files" in p.stdout


def test_hub_names_get_the_fetch_recipe(tmp_path):
    with pytest.raises(ShardwiseConfigError) as e:
        validate(_cfg("--init-from-hf", "openai-community/gpt2", "--dp", "1"))
    assert "snapshot_download('openai-community/gpt2', local_dir='models/gpt2')" in str(e.value)
    assert "--init-from-hf models/gpt2" in str(e.value)
    with pytest.raises(ShardwiseConfigError) as e:
        validate(_cfg("--data", "tatsu-lab/alpaca", "--task", "sft", "--dp", "1"))
    assert "load_dataset('tatsu-lab/alpaca', split='train').to_json('alpaca.jsonl')" \
        in str(e.value)
    # a real (missing) path keeps the plain message
    with pytest.raises(ShardwiseConfigError, match="no such file or folder"):
        validate(_cfg("--data", str(tmp_path / "x.txt"), "--dp", "1"))


# the default layout under torchrun's WORLD_SIZE (dp = W): tests/test_default_layout.py


def test_diagnosis_names_the_rank_the_launcher_stopped_as_stopped():
    import torch.distributed as dist

    from shardwise.comm.diagnosis import diagnose_store

    store = dist.HashStore()
    store.set("shardwise/topologies", "t0\n")
    ps = dist.PrefixStore("t0", store)
    ps.set("ranks", "[0, 1]")
    line, _ = diagnose_store(store, {0: -9, 1: -15}, first=0)
    assert "rank 0 died (killed by SIGKILL)" in line
    assert "rank 1 was stopped by the launcher (killed by SIGTERM)" in line


def test_torchrun_shows_the_raising_rank_as_root_cause_and_default_layout_follows_world(
        tmp_path, cache_dir):
    """Under torchrun with no layout flag (the default adapts to WORLD_SIZE = 2: dp = 2), rank 1
    raises after step 1: its error file holds the message, the rank and the traceback, and
    torchrun's failure summary prints it as the root cause (not ``error_file: <N/A>``)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1",
           "SHARDWISE_TEST_KILL_AT_STEP": "1", "SHARDWISE_TEST_KILL_RANK": "1",
           "SHARDWISE_TEST_KILL_MODE": "raise"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--log-dir", str(tmp_path / "logs"), "-m", "shardwise", "train", "--model",
           "tiny", "--steps", "3", "--seq-len", "32", "--global-batch", "8", "--tokenizer",
           "bytes", "--eval-every", "100", "--eval-sequences", "8", "--sample-tokens", "0",
           "--timeout", "60", "--out", str(tmp_path / "run")]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    out = r.stdout
    assert r.returncode != 0, out[-3000:]
    assert "dp=2 × tp=1 (2 ranks)" in out, out[-3000:]  # the default followed the world
    root = out[out.index("Root Cause"):]
    assert "rank      : 1" in root and "<N/A>" not in root, root
    # torchrun prints the error file's traceback as the root cause
    assert "RuntimeError: SHARDWISE_TEST_KILL_AT_STEP=1: test fault raised on rank 1" in root
    assert "kill_at_step" in root, root
    import json
    import re

    path = re.search(r"error_file: (\S+)", root).group(1)
    err = json.loads(open(path).read())["message"]
    assert err["message"] == ("RuntimeError on rank 1: SHARDWISE_TEST_KILL_AT_STEP=1: test "
                              "fault raised on rank 1")
    assert "faults.py" in err["extraInfo"]["py_callstack"]


def test_mixtral_folder_router_coefficients_are_the_runs_unless_a_flag_gives_them(tmp_path):
    """A run trained at α = 0.05, β = 0.002 exports them (router_aux_loss_coef,
    router_z_loss_coef) and --init-from-hf on that folder trains at 0.05 / 0.002 again; a flag
    overrides; the start-up line says where each came from."""
    transformers = pytest.importorskip("transformers")
    import dataclasses

    from shardwise.interop.hf import describe_source, llama_to_hf_config
    from shardwise.models import preset_config

    cfg = preset_config("moe-tiny", 257, aux_loss_coef=0.05, z_loss_coef=0.002,
                        capacity_factor=None)
    hf = llama_to_hf_config(cfg)
    assert (hf["router_aux_loss_coef"], hf["router_z_loss_coef"]) == (0.05, 0.002)
    hf_cfg = transformers.MixtralConfig(**{k: v for k, v in hf.items()
                                           if k not in ("architectures", "model_type")})
    transformers.MixtralForCausalLM(hf_cfg).save_pretrained(tmp_path / "mx")
    folder = str(tmp_path / "mx")
    c = _cfg("--init-from-hf", folder, "--dp", "1")
    assert (c.model, c.aux_loss_coef, c.z_loss_coef) == ("moe-small", 0.05, 0.002)
    line = describe_source(c)
    assert "aux_loss_coef 0.05 from config.json's router_aux_loss_coef" in line, line
    c = _cfg("--init-from-hf", folder, "--dp", "1", "--aux-loss-coef", "0.02")
    assert (c.aux_loss_coef, c.z_loss_coef) == (0.02, 0.002)
    assert "aux_loss_coef 0.02 from --aux-loss-coef" in describe_source(c)
    assert dataclasses.asdict(c)["z_loss_coef"] == 0.002
