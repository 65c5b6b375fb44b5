"""HSDP (dp = dp_replicate × dp_shard): the flags, the refusals, the bytes formula worked by
hand, and ``shardwise trace --dp-replicate 2 --dp-shard 2 --zero 3`` with every axis's ledger
equal to the formula. Parity with one process of both engines is ``shardwise verify``'s
(tests/test_verify_n4.py: R = 2 × S = 2 with ZeRO-1/2/3; tests/test_verify_n8.py: × tp = 2);
checkpoints in and out of HSDP: tests/test_checkpoint.py's resharding matrix."""

import argparse
import re

import pytest

from conftest import run_cli
from shardwise.config import TrainConfig, add_config_flags, from_args, validate
from shardwise.errors import ShardwiseConfigError
from shardwise.parallel.layout import Layout, parse_layout
from shardwise.parallel.zero.formulas import hsdp_replicate_bytes


def _args(*argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return from_args(p.parse_args(list(argv)))


def test_flags_make_dp_the_product():
    cfg = _args("--model", "tiny", "--dp-replicate", "2", "--dp-shard", "2", "--zero", "3")
    assert (cfg.dp, cfg.dp_replicate, cfg.tp, cfg.zero) == (4, 2, 1, 3)
    assert Layout.from_config(cfg).name() == "dp=4,dp_replicate=2,zero=3"
    assert parse_layout("dp=4,dp_replicate=2,zero=3") == Layout(dp=4, dp_replicate=2, zero=3)
    cfg = _args("--model", "tiny", "--dp", "8", "--dp-replicate", "4", "--zero", "1")
    assert Layout.from_config(cfg).dp_shard == 2


@pytest.mark.parametrize("kw, pattern", [
    (dict(dp=4, dp_replicate=3, zero=3), r"--dp-replicate 3 must divide dp = 4"),
    (dict(dp=4, dp_replicate=2, zero=0), r"--dp-replicate 2 with --zero 0"),
    (dict(dp=4, dp_replicate=4, zero=3), r"leaves dp_shard = 1"),
    (dict(dp=4, dp_replicate=2, cp=2, zero=1), r"with --cp 2: HSDP composes with tp and pp here"),
    (dict(dp=4, pp=2, dp_replicate=2, zero=1, engine="torch"),
     r"--engine torch runs --zero 1 --dp-replicate 2 \(FSDP2\) without a pipeline"),
    (dict(dp=4, dp_replicate=2, dp_shard=3, zero=1), r"--dp-shard 3 × --dp-replicate 2 must "
     r"equal --dp 4"),
])
def test_bad_input_is_refused_before_any_collective(kw, pattern):
    cfg = TrainConfig(**{**dict(model="tiny", tp=1, tokenizer="bytes", seq_len=32,
                                global_batch=8, micro_batch=1), **kw})
    with pytest.raises(ShardwiseConfigError, match=pattern):
        validate(cfg)


def test_replica_all_reduce_bytes_by_hand():
    """2(R−1)/R · Ψb/S: Ψ = 1200 padded fp32 elements, S = 4, R = 2 → 2·½·4800/4 = 1200 B;
    R = 1 sends nothing; R = 4, S = 2: 2·¾·4800/2 = 3600 B."""
    assert hsdp_replicate_bytes(1200, 4, 2, 4) == 1200.0
    assert hsdp_replicate_bytes(1200, 4, 1, 4) == 0.0
    assert hsdp_replicate_bytes(1200, 2, 4, 4) == 3600.0


@pytest.mark.timeout(240)
def test_trace_shows_each_axis_equal_to_the_formula(cache_dir):
    """The issue's command: gradients reduce-scattered and parameters gathered over dp_shard,
    the shards all-reduced over dp_replicate, the loss over dp; each axis's ledger bytes equal
    the formula's, and the replica all-reduce moves 2(R−1)/R·Ψb/S = Ψb/2 for R = S = 2, the
    reduce-scatter (S−1)/S·Ψb = Ψb/2 too."""
    p = run_cli(["trace", "--dp-replicate", "2", "--dp-shard", "2", "--zero", "3"], cache_dir)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = dict(re.findall(r"\] (dp_shard|dp_replicate|dp)\s+([\d,.]+\s+[\d,.]+\s+1\.0000)",
                           p.stdout))
    assert set(rows) == {"dp", "dp_shard", "dp_replicate"}, p.stdout[-3000:]
    tags = dict(re.findall(r"\] (grad|grad_replicate)\s+([\d,.]+)\s", p.stdout))
    assert tags["grad"] == tags["grad_replicate"], tags
    assert "all 4 ranks: ledger / formula within 0.00e+00 of 1" in p.stdout
