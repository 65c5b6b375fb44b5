"""Bad input: a clear error naming the constraint and the fix, a non-zero exit, no hang — on every
rank, before any collective. A rank that crashes takes the others down with its message shown."""

import sys
import textwrap
import time


from conftest import run_cli
from shardwise.launch import spawn

# A worker started with WORLD_SIZE=2 and no peer would block in the rendezvous if it got as far
# as creating the process group; finishing quickly with the error proves the check comes first.
AS_RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29999"}
# --dp 2: the 2-rank world of AS_RANK_1_OF_2, named (the default layout would follow it too)
QUICK = ["--model", "tiny", "--steps", "2", "--tokenizer", "bytes", "--seq-len", "32", "--dp", "2"]


def expect_error(proc, *words):
    assert proc.returncode != 0, proc.stdout
    for w in words:
        assert w in proc.stdout, f"{w!r} not in:\n{proc.stdout}"
    assert "Traceback" not in proc.stdout, proc.stdout  # a message, not a crash dump


def test_unknown_flag(cache_dir):
    p = run_cli(["train", "--bogus-flag", "3"], cache_dir, timeout=60)
    assert p.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in p.stdout


def test_degrees_must_multiply_to_world_size_checked_before_any_collective(cache_dir):
    t0 = time.time()
    p = run_cli(["train", *QUICK, "--dp", "4"], cache_dir, timeout=60, env=AS_RANK_1_OF_2)
    expect_error(p, "dp × tp × pp = 4 × 1 × 1 = 4 does not equal the world size 2")
    assert time.time() - t0 < 50


def test_cp_times_degrees_must_equal_the_world_size_before_any_collective(cache_dir):
    t0 = time.time()
    p = run_cli(["train", *QUICK, "--dp", "2", "--cp", "2"], cache_dir, timeout=60,
                env=AS_RANK_1_OF_2)
    expect_error(p, "dp × cp × tp × pp = 2 × 2 × 1 × 1 = 4 does not equal the world size 2",
                 "launch 4 processes")
    assert time.time() - t0 < 50


def test_global_batch_not_divisible_by_dp_times_micro_batch(cache_dir):
    for env in (None, AS_RANK_1_OF_2):
        p = run_cli(["train", *QUICK, "--dp", "2", "--global-batch", "10", "--micro-batch", "4"],
                    cache_dir, timeout=60, env=env)
        expect_error(p, "--global-batch 10 is not divisible by dp × micro-batch = 2 × 4 = 8",
                     "choose a multiple of 8")


def test_missing_data_path(cache_dir, tmp_path):
    for env in (None, AS_RANK_1_OF_2):
        p = run_cli(["train", *QUICK, "--data", tmp_path / "nope.txt"], cache_dir, timeout=60,
                    env=env)
        expect_error(p, "nope.txt", "no such file or folder")


def test_empty_data_folder(cache_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    p = run_cli(["train", *QUICK, "--data", tmp_path / "empty"], cache_dir, timeout=60,
                env=AS_RANK_1_OF_2)
    expect_error(p, "empty")


def test_invalid_utf8_names_file_and_byte_offset(cache_dir, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("good text\n".encode() * 3 + b"caf\xe9 au lait\n")  # 0xE9 at offset 33
    for env in (None, AS_RANK_1_OF_2):
        p = run_cli(["train", *QUICK, "--data", bad], cache_dir, timeout=60, env=env)
        expect_error(p, "latin1.txt", "byte offset 33", "UTF-8")


def test_sequence_longer_than_corpus_allows(cache_dir, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x = 1\n" * 50)  # 300 bytes: far fewer than 16 sequences of 129
    p = run_cli(["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "128",
                 "--dp", "2", "--data", small], cache_dir, timeout=60, env=AS_RANK_1_OF_2)
    expect_error(p, "--seq-len 128 is longer than the corpus allows")


def test_seq_len_beyond_model_context(cache_dir):
    p = run_cli(["train", "--model", "tiny", "--seq-len", "4096"], cache_dir, timeout=60)
    expect_error(p, "--seq-len 4096 exceeds the tiny model's max_seq_len 256")


def test_zero_2_3_with_pipeline_on_the_torch_engine_refused_clearly(cache_dir):
    p = run_cli(["train", *QUICK, "--dp", "2", "--zero", "3", "--pp", "2", "--engine", "torch"],
                cache_dir, timeout=60)
    expect_error(p, "--engine torch runs --zero 3 (FSDP2) without a pipeline",
                 "use --engine explicit")


def test_bad_config_file(cache_dir, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("stepz = 3\n")
    p = run_cli(["train", "--config", f], cache_dir, timeout=60)
    expect_error(p, "unknown key 'stepz'")


CRASHER = textwrap.dedent("""
    import os, sys, torch
    from shardwise import comm
    from shardwise.topology import Topology, init_distributed
    init_distributed("cpu", timeout_s=120)
    topo = Topology(dp=int(os.environ["WORLD_SIZE"]), timeout_s=120)
    if topo.rank == 1:
        raise RuntimeError("rank one fell over on purpose")
    comm.all_reduce(torch.ones(4), topo, "dp")  # the others wait here for rank 1
    print("unreachable: the all-reduce completed")
""")


def test_a_crashing_worker_takes_the_others_down_with_its_message(tmp_path, capfd):
    script = tmp_path / "crash.py"
    script.write_text(CRASHER)
    t0 = time.time()
    code = spawn([], 4, program=[sys.executable, str(script)],
                 env={"OMP_NUM_THREADS": "1"})
    elapsed = time.time() - t0
    cap = capfd.readouterr()
    out = cap.out + cap.err  # the ranks' stderr is echoed to the launcher's stderr
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.0f} s: the others were not stopped promptly"
    assert "rank one fell over on purpose" in out
    assert "[launcher] rank 1" in out or "[launcher] rank" in out
    assert "unreachable" not in out


def test_an_out_folder_that_holds_a_run_is_refused(cache_dir, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
    p = run_cli(["train", *QUICK, "--out", tmp_path], cache_dir, timeout=60, env=AS_RANK_1_OF_2)
    expect_error(p, "already holds a run", "choose a new --out")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "val_loss": 5.0}\n'


def test_pipeline_without_enough_microbatches_names_the_flags(cache_dir):
    # an explicit micro-batch that leaves too few microbatches: 16 / (dp 2 × 8) = 1 < 4
    p = run_cli(["train", *QUICK, "--pp", "4", "--micro-batch", "8"], cache_dir, timeout=60)
    expect_error(p, "--pp 4 needs at least 4 microbatches", "--microbatches M")
    p = run_cli(["train", *QUICK, "--pp", "4", "--microbatches", "4"], cache_dir, timeout=60)
    expect_error(p, "too few for 4 pipeline stages", "--n-layers 4")
