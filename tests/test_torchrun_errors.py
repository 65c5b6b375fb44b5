"""Issue 51: a configuration error under real torchrun is one line. The worker exits 2 and writes
that line (no traceback) to torchrun's error file, so torchrun's summary names it as the root
cause; only the first rank of the node to meet it prints it; torchrun itself exits 1, as it does
for any failed worker (cli.report_config_error)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_a_layout_that_does_not_fit_torchruns_world_is_one_line_and_exit_2(tmp_path, cache_dir):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "run"
    # --standalone: a free rendezvous port (the suite runs two test files at once)
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                        "shardwise", "train",
                        "--dp", "4", "--model", "tiny", "--tokenizer", "bytes", "--steps", "1",
                        "--out", str(out)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=240)
    text = p.stdout
    assert p.returncode == 1, text  # torchrun's own status for a failed worker
    line = ("shardwise: error: dp × tp × pp = 4 × 1 × 1 = 4 does not equal the world size 2: "
            "choose degrees whose product is 2 (each from [1, 2]), or launch 4 processes")
    before, _, summary = text.partition("Failures:")
    assert summary, text
    assert before.count("shardwise: error:") == 1 and line in before, text  # printed once
    root = summary[summary.index("Root Cause (first observed failure):"):]
    assert "exitcode  : 2" in root, root  # the worker's status
    assert f"traceback : {line}" in root, root
    # no traceback of ours anywhere (torchrun's own ChildFailedError is torchrun's)
    assert not re.search(r'File ".*/shardwise/', text), text
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
