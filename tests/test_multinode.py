"""Multi-node launch, simulated on loopback: two ``torchrun --nnodes 2 --nproc-per-node 1``
processes (two "nodes") meet through the c10d rendezvous on 127.0.0.1 and train dp=2 together.
Reference: the same run in one process (dp=1, same global batch), losses within rtol 1e-5."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

TRAIN = ["train", "--model", "tiny", "--steps", "3", "--seq-len", "32", "--global-batch", "8",
         "--micro-batch", "2", "--tokenizer", "bytes", "--eval-every", "100",
         "--eval-sequences", "8", "--sample-tokens", "4", "--log-every", "1", "--timeout", "60"]


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.timeout(400)
def test_two_nodes_on_loopback_train_like_one_process(tmp_path, cache_dir):
    from shardwise.topology import free_port

    ref = run_cli([*TRAIN, "--dp", "1", "--out", tmp_path / "ref"], cache_dir)
    assert ref.returncode == 0, ref.stdout[-3000:]

    out, port = tmp_path / "run", free_port()
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # the loopback interface, as a real job names its NIC
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "shardwise-test", "--max-restarts", "0",
               "-m", "shardwise", *TRAIN, "--dp", "2", "--out", str(out)]
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in nodes:
        try:
            codes.append(p.wait(timeout=360))
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
    text = "\n".join((tmp_path / f"node{n}.log").read_text() for n in range(2))
    assert codes == [0, 0], text[-4000:]
    assert "pp=1 × dp=2 × tp=1 (2 ranks)" in text
    got, want = losses(out), losses(tmp_path / "ref")
    assert len(got) == len(want) == 3
    assert all(abs(a - b) <= 1e-6 + 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
    # both "nodes" wrote their part of the final checkpoint into the shared folder
    step = out / "checkpoints" / "step_3"
    assert (step / "COMPLETE").is_file()
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
