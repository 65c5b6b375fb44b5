"""Test-only fault hooks of the training loop, driven by ``SHARDWISE_TEST_*`` environment variables
(documented in docs/checkpointing.md, "Test-only environment variables"). Unset, each is a no-op;
production runs never set them. The restart tests use them to kill a worker after a committed
checkpoint and to log which samples each rank trained on, so that a restarted job can be shown to
skip and repeat nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def log_samples(step: int, local: torch.Tensor, topo) -> None:
    """``SHARDWISE_TEST_SAMPLE_LOG=DIR`` (tests only): append this rank's sample indices of
    ``step`` to ``DIR/samples_rank<r>.jsonl``, with torchrun's restart count, to prove that a
    restarted job skips and repeats nothing."""
    d = os.environ.get("SHARDWISE_TEST_SAMPLE_LOG")
    if d:
        rec = {"step": step, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
               "indices": local.tolist()}
        with open(Path(d) / f"samples_rank{topo.index('world')}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def kill_at_step(step: int, checkpointer) -> None:
    """``SHARDWISE_TEST_KILL_AT_STEP=K`` (tests only): after step K (and its checkpoint, waited
    for), SIGKILL this worker (``SHARDWISE_TEST_KILL_MODE=raise``: raise RuntimeError instead),
    or only rank ``SHARDWISE_TEST_KILL_RANK`` if set; only in the first
    attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restart runs on."""
    at = os.environ.get("SHARDWISE_TEST_KILL_AT_STEP")
    if not at or int(at) != step or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        return
    checkpointer.wait(barrier=True)
    who = os.environ.get("SHARDWISE_TEST_KILL_RANK")
    if who is None or int(who) == checkpointer.topo.index("world"):
        import signal

        if os.environ.get("SHARDWISE_TEST_KILL_MODE") == "raise":  # an exception, not a signal
            raise RuntimeError(f"SHARDWISE_TEST_KILL_AT_STEP={step}: test fault raised on rank "
                               f"{checkpointer.topo.index('world')}")

        print(f"[test] SHARDWISE_TEST_KILL_AT_STEP={step}: SIGKILL rank "
              f"{checkpointer.topo.index('world')}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def rank_only_collective(step: int, topo) -> None:
    """``SHARDWISE_TEST_RANK0_GATHER=K`` (tests only): after step K, world rank 0 alone
    all-gathers a float32 [3] shard per rank over dp (tag "checkpoint", phase "checkpoint"), as
    a checkpoint save on rank 0 only would; the collective check before step K+1 names it."""
    at = os.environ.get("SHARDWISE_TEST_RANK0_GATHER")
    if not at or int(at) != step or topo.index("world") != 0:
        return
    from .. import comm

    n = topo.size("dp")
    with topo.ledger.phase("checkpoint"):
        comm.all_gather(torch.empty(3 * n, device=topo.device),
                        torch.ones(3, device=topo.device), topo, "dp", tag="checkpoint")
