"""Issue 51: ``--device auto`` (the default) and the start-up lines that name the device and the
layout. The device choice is made once (:func:`shardwise.topology.resolve_device`) and the
launcher, ``init_distributed`` and the banner follow it; here CUDA's presence is faked (torch's
``cuda.is_available`` / ``device_count``), both ways, and ``cpu`` / ``cuda`` still force it.
``config.toml`` keeps what the user asked (``auto``: the same file picks again on the next
machine); the banner says what was picked and why."""

import datetime

import pytest
import torch

from shardwise import cli, topology
from shardwise.parallel.layout import Layout
from shardwise.train.report import describe_layout


def fake_cuda(monkeypatch, n: int) -> None:
    """torch sees ``n`` CUDA devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("gpus,want", [(2, ("cuda", "auto: CUDA available")),
                                       (0, ("cpu", "auto: no CUDA"))])
def test_auto_picks_cuda_when_torch_sees_it_else_cpu(monkeypatch, gpus, want):
    fake_cuda(monkeypatch, gpus)
    assert topology.resolve_device("auto") == want
    assert topology.backend_for("auto") == ("nccl" if gpus else "gloo")
    # cpu and cuda force the choice whatever torch sees
    assert topology.resolve_device("cpu") == ("cpu", "--device cpu")
    assert topology.resolve_device("cuda") == ("cuda", "--device cuda")
    assert topology.backend_for("cpu") == "gloo" and topology.backend_for("cuda") == "nccl"


@pytest.mark.parametrize("gpus", [2, 0])
def test_a_torchrun_rank_takes_its_local_rank_gpu_and_nccl_or_gloo(monkeypatch, gpus):
    """``init_distributed("auto")`` as torchrun's rank 1 of 2 on one node: with CUDA, the GPU of
    LOCAL_RANK 1 and NCCL (device_id bound); without, gloo and no device."""
    fake_cuda(monkeypatch, gpus)
    for k, v in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    calls = {}
    monkeypatch.setattr(topology.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(topology.dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(topology.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.update(set_device=i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls["set_device"])
    assert topology.init_distributed("auto", 5.0) == (1, 2)
    assert calls["timeout"] == datetime.timedelta(seconds=5.0)
    if gpus:
        assert calls["backend"] == "nccl" and calls["set_device"] == 1
        assert calls["device_id"] == torch.device("cuda", 1)
    else:
        assert calls["backend"] == "gloo" and "set_device" not in calls
        assert "device_id" not in calls


def test_more_ranks_on_a_node_than_gpus_is_one_line(monkeypatch):
    fake_cuda(monkeypatch, 2)
    with pytest.raises(topology.ShardwiseConfigError,
                       match=r"^4 ranks on this node but torch sees 2 CUDA devices \(--device "
                             r"auto found CUDA\): one GPU per rank; .*or use --device cpu"):
        topology.check_local_gpus("auto", 4)
    topology.check_local_gpus("auto", 2)
    topology.check_local_gpus("cpu", 4)  # CPU ranks share the cores
    fake_cuda(monkeypatch, 0)
    topology.check_local_gpus("auto", 4)


@pytest.mark.parametrize("gpus,flag,fork", [(2, [], False), (0, [], True),
                                            (2, ["--device", "cpu"], True)])
def test_the_launcher_forks_gloo_workers_only_on_cpu(monkeypatch, tmp_path, cache_dir, gpus,
                                                    flag, fork):
    """``shardwise train`` alone resolves the device as its workers will: on CPU it forks them
    (gloo), with CUDA it starts new interpreters (NCCL)."""
    fake_cuda(monkeypatch, gpus)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache_dir))
    seen = {}
    monkeypatch.setattr(cli, "spawn", lambda argv, n, **kw: seen.update(n=n, **kw) or 0)
    code = cli.main(["train", "--model", "tiny", "--dp", "2", "--tokenizer", "bytes",
                     "--seq-len", "32", "--global-batch", "8", "--out", str(tmp_path / "r"),
                     *flag])
    assert code == 0 and seen["n"] == 2 and seen["fork"] is fork


def test_layout_lines_name_zero_fsdp_hsdp_tp_and_the_pipeline():
    """The start-up lines in the field's words, with the implementation each engine runs."""
    z3 = describe_layout(Layout(dp=4, zero=3))
    assert z3 == ["  ZeRO-3 / FSDP: parameters, gradients and AdamW state sharded over dp = 4 "
                  "— our ZeRO-3: each unit all-gathered before use and freed after, gradients "
                  "reduce-scattered (parallel/zero)"]
    assert "— FSDP2 fully_shard: " in describe_layout(Layout(dp=4, zero=3), "torch")[0]
    z1 = describe_layout(Layout(dp=2, zero=1), "torch")[0]
    assert z1 == ("  ZeRO-1: AdamW state sharded over dp = 2 (parameters and gradients "
                  "replicated) — ZeroRedundancyOptimizer over DDP: gradients all-reduced, "
                  "updated parameters broadcast from their owners")
    assert describe_layout(Layout(dp=2, zero=2))[0].startswith(
        "  ZeRO-2: gradients and AdamW state sharded over dp = 2 (parameters replicated)")
    assert describe_layout(Layout(dp=2), "torch")[0].endswith("— DDP: gradients all-reduced "
                                                              "in buckets")
    hsdp = describe_layout(Layout(dp=4, zero=3, dp_replicate=2))[0]
    assert hsdp.startswith("  HSDP (dp = 2 replicas × 2 shards) with ZeRO-3 / FSDP: parameters, "
                           "gradients and AdamW state sharded over dp_shard = 2 within each "
                           "replica, the shards' gradients all-reduced across dp_replicate = 2")
    tp = describe_layout(Layout(dp=2, tp=2, zero=1, sp=True), "torch")
    assert tp[0].startswith("  ZeRO-1: ") and "parameters and gradients are sharded too" in tp[0]
    assert tp[1].startswith("  TP: Megatron tensor parallelism over tp = 2") \
        and "sequence parallelism" in tp[1] and tp[1].endswith("(parallel/tp/dtensor.py)")
    pp = describe_layout(Layout(pp=2, schedule="dualpipev"), microbatches=4)
    assert pp == ["  PP: 2 ranks × 2 stages each, schedule dualpipev, m = 4 micro-batches, "
                  "V placement: pp rank r holds stages r and 3−r — our schedule runner "
                  "(parallel/pp)"]
    assert "loop placement" in describe_layout(Layout(pp=2, schedule="interleaved-1f1b"))[0]
    assert describe_layout(Layout()) == ["  one process: no parallelism (the single-process "
                                         "reference)"]
    assert "optimizer state (Muon's and AdamW's) sharded" in describe_layout(
        Layout(dp=2, zero=1), optimizer="muon")[0]


def test_dp2_zero3_from_the_command_line_is_named_zero3():
    """``train --dp 2 --zero 3`` as the loop builds its layout lines (Layout.from_config of the
    parsed flags); a real run prints them: tests/test_first_commands.py (``--dp 8 --zero 3``)."""
    from shardwise.config import from_args

    args, _ = cli._parser().parse_known_args(["train", "--dp", "2", "--zero", "3"])
    cfg = from_args(args)
    lines = describe_layout(Layout.from_config(cfg), cfg.engine, optimizer=cfg.optimizer)
    assert lines[0].startswith("  ZeRO-3 / FSDP: parameters, gradients and AdamW state sharded "
                               "over dp = 2 — our ZeRO-3"), lines
