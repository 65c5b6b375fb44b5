"""A pipeline whose microbatch count m the batch decides (``--micro-batch``, no
``--microbatches``; issue 51): ``parallelize`` checked the schedule with m = pp instead of the
derived m, so ``--pp 2 --schedule dualpipev --micro-batch 2`` over a global batch of 8 (m = 4 =
2·pp, accepted by the launcher) was refused on every rank with "got 2". In process: every
schedule's derived m and chunks are what the batch and the schedule give; one CLI run of that
command trains."""

import json

import pytest

from conftest import run_cli
from shardwise.cli import _parser
from shardwise.config import from_args, validate
from shardwise.errors import ShardwiseConfigError
from shardwise.parallel.apply import Layout, pipeline_chunks
from shardwise.parallel.pp import SCHEDULES

S = ["--model", "tiny", "--tokenizer", "bytes", "--seq-len", "32", "--global-batch", "8"]


def _cfg(*argv):
    args, _ = _parser().parse_known_args(["train", *argv])
    return from_args(args)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_takes_the_batchs_m(schedule):
    """m = global batch / (dp × micro-batch) = 8 / 2 = 4 for every schedule (the fix does not
    touch the derivation), the layout leaves m to the batch (0), and the chunks per rank are
    the schedule's own: 2 for interleaved-1f1b, zbv and dualpipev, else 1."""
    cfg = _cfg(*S, "--pp", "2", "--schedule", schedule, "--n-layers", "4", "--micro-batch", "2")
    validate(cfg, cfg.world_size())
    assert cfg.microbatching() == (2, 4)
    layout = Layout.from_config(cfg)
    assert layout.microbatches == 0
    assert pipeline_chunks(layout) == layout.chunks
    # the m a derived run is cut into is what the schedule is built for, on every rank
    from shardwise.parallel.pp import build_schedule

    build_schedule(schedule, 2, cfg.microbatching()[1], layout.chunks)


def test_a_given_m_is_still_checked_where_the_engine_is_built():
    with pytest.raises(ShardwiseConfigError, match="dualpipev with --pp 2 needs --microbatches ≥ "
                       "2·pp = 4 .* got 2"):
        pipeline_chunks(Layout(pp=2, schedule="dualpipev", microbatches=2))
    assert pipeline_chunks(Layout(pp=2, schedule="dualpipev", microbatches=4)) == 2
    assert pipeline_chunks(Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=3)) == 3


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_fewest_microbatches_a_schedule_runs(schedule):
    """What bench --layout and verify take when a layout gives no m= (they took pp, which
    dualpipev refuses at runtime: "got 2"): every schedule runs min_microbatches and refuses
    one fewer."""
    from shardwise.parallel.pp.schedules import check_schedule, min_microbatches

    for p in (2, 3, 4):
        m = min_microbatches(schedule, p)
        assert m == (2 * p if schedule == "dualpipev" else p)
        check_schedule(schedule, p, m)
        with pytest.raises(ShardwiseConfigError):
            check_schedule(schedule, p, m - 1)


@pytest.mark.timeout(180)
def test_dualpipev_with_a_derived_m_trains(cache_dir, tmp_path):
    """The command of issue 51 runs its two steps on two ranks (m = 4 = 2·pp)."""
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    out = tmp_path / "run"
    p = run_cli(["train", *S, "--data", tmp_path / "corpus.txt", "--pp", "2", "--schedule",
                 "dualpipev", "--n-layers", "4", "--micro-batch", "2", "--steps", "2",
                 "--out", out], cache_dir, timeout=170)
    assert p.returncode == 0, p.stdout
    assert "got 2" not in p.stdout
    # the default --warmup-steps 30 is longer than these 2 steps: said once (issue 51)
    assert p.stdout.count("--warmup-steps 30 is longer than the run (--steps 2)") == 1, p.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2], rows
