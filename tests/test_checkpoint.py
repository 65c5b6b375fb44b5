"""Checkpoints: exact resume (SIGKILL included), resharding across layouts, crash recovery under
torchrun, and the failures (corrupt/truncated files, another model, unwritable --out).

References are independent of the code under test: the uninterrupted run (same layout: bitwise),
and a single-process run computed here (other layouts: rtol 1e-5).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_pt, ROOT, run_cli, run_world

sys.path.insert(0, str(ROOT / "tests" / "workers"))
import ckpt_cases  # noqa: E402  (the matrix lists and the reference's settings)

# -- the resharding matrix: (from-layout, to-layout), verify's syntax, "@torch" = PyTorch engine.
# Saved after K steps under FROM, resumed under TO to step N; losses vs one process, rtol 1e-5.
# ``make test`` resumes ckpt_cases.FAST's pairs, ``make test-slow`` the rest.
MATRIX = [(f, t) for f in ckpt_cases.FROM for t in ckpt_cases.TO]

TRAIN = ["train", "--model", "tiny", "--dp", "2", "--steps", "6", "--seq-len", "32",
         "--global-batch", "8", "--micro-batch", "2", "--tokenizer", "bytes", "--save-every", "2",
         "--eval-every", "100", "--eval-sequences", "8", "--sample-tokens", "4", "--log-every",
         "1", "--timeout", "60"]


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def samples(d, rank):
    p = Path(d) / f"samples_rank{rank}.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()]


def final_params(run):
    """The final checkpoint's weights and AdamW state, read here in one process."""
    from torch.distributed.checkpoint import FileSystemReader

    from shardwise.checkpoint.load import _dcp_load, load_full_optimizer_state

    step = Path(run) / "checkpoints" / "step_6"
    md = FileSystemReader(str(step)).read_metadata()
    model = {k[6:]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    _dcp_load({"model": model}, step)
    return model, load_full_optimizer_state(step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    """6 steps, dp=2, a checkpoint every 2 steps, sample indices logged."""
    d = tmp_path_factory.mktemp("straight")
    (d / "samples").mkdir()
    r = run_cli([*TRAIN, "--out", d / "run"], cache_dir,
                env={"SHARDWISE_TEST_SAMPLE_LOG": str(d / "samples")})
    assert r.returncode == 0, r.stdout[-3000:]
    return d


@pytest.mark.timeout(400)
def test_sigkill_every_worker_then_resume_is_bitwise_exact(straight, tmp_path, cache_dir):
    out = tmp_path / "run"
    env = {"SHARDWISE_TEST_KILL_AT_STEP": "4"}  # every rank SIGKILLs itself after step 4's save
    r = run_cli([*TRAIN, "--out", out, "--async-save", "--keep", "1"], cache_dir, env=env)
    assert r.returncode != 0 and "SIGKILL rank 0" in r.stdout, r.stdout[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_4"]
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3, 4]
    r = run_cli([*TRAIN, "--out", out, "--async-save", "--keep", "1", "--resume", "auto"],
                cache_dir)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "resumed from" in r.stdout and "optimizer state restored" in r.stdout
    # every logged number of every step, bitwise (JSON floats round-trip exactly)
    ref, got = metrics(straight / "run"), metrics(out)
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss")
    assert [{k: m.get(k) for k in keys} for m in got] == [{k: m.get(k) for k in keys} for m in ref]
    # final weights and AdamW state, bitwise
    (pa, oa), (pb, ob) = final_params(straight / "run"), final_params(out)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert oa.keys() == ob.keys()
    assert all(torch.equal(oa[k][s], ob[k][s]) for k in oa for s in oa[k])
    # --keep 1: only the newest complete checkpoint is left
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_6"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"


@pytest.mark.timeout(500)  # torchrun's: make test-slow (tests/test_multinode.py runs train under
# torchrun; ours is the same elastic agent)
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.slow),
                                      "shardwise"])
def test_restarts_after_a_worker_is_killed(launcher, straight, tmp_path, cache_dir):
    """rank 1 SIGKILLs itself after step 3 (checkpoint at 2): torchrun (``--max-restarts 2``), or
    our own launcher (``shardwise train --max-restarts 2``: the same elastic agent), restarts
    both workers, they resume from step 2 and finish with the uninterrupted run's losses,
    bitwise."""
    out, log = tmp_path / "run", tmp_path / "samples"
    log.mkdir()
    env = {**os.environ, "SHARDWISE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1",
           "SHARDWISE_TEST_KILL_AT_STEP": "3", "SHARDWISE_TEST_KILL_RANK": "1",
           "SHARDWISE_TEST_SAMPLE_LOG": str(log)}
    # as the README's torchrun line is written: torchrun's shared rendezvous store, which keeps
    # the first attempt's keys (pytorch/pytorch#135712; init_distributed prefixes each attempt's)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(k, None)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--max-restarts", "2", "--monitor-interval", "0.5", "-m", "shardwise", *TRAIN,
               "--out", str(out), "--resume", "auto"]
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=480)
    else:
        r = run_cli([*TRAIN, "--out", out, "--resume", "auto", "--max-restarts", "2"], cache_dir,
                    timeout=480, env={k: env[k] for k in env if k.startswith("SHARDWISE_TEST")})
    assert r.returncode == 0, r.stdout[-4000:]
    assert "SIGKILL rank 1" in r.stdout and "resumed from" in r.stdout, r.stdout[-4000:]
    ref, got = metrics(straight / "run"), metrics(out)
    assert [m["step"] for m in got] == list(range(7))  # each step once (metrics truncated)
    assert [m.get("loss") for m in got] == [m.get("loss") for m in ref]
    assert got[-1]["loss"] == ref[-1]["loss"]
    # the samples: attempt 0 trained 1..3 (+ rank 0 drew step 4 before it was stopped), the
    # restart begins exactly after the checkpoint (step 3) and draws what the straight run drew
    for rank in (0, 1):
        want = {s["step"]: s["indices"] for s in samples(straight / "samples", rank)}
        recs = samples(log, rank)
        first = [s for s in recs if s["restart"] == 0]
        again = [s for s in recs if s["restart"] > 0]
        assert [s["step"] for s in first][:3] == [1, 2, 3]
        assert [s["step"] for s in again] == [3, 4, 5, 6]
        kept = [s for s in first if s["step"] <= 2] + again  # what the final model trained on
        assert [s["step"] for s in kept] == list(range(1, 7))
        assert all(s["indices"] == want[s["step"]] for s in kept)
        assert all(s["indices"] == want[s["step"]] for s in recs)  # and the redone step too
    flat = [i for rank in (0, 1) for s in samples(log, rank)
            if s["restart"] > 0 or s["step"] <= 2 for i in s["indices"]]
    assert len(flat) == len(set(flat)) == 6 * 8  # no sample twice, none missing


def test_the_run_records_each_phases_memory_peak_apart(straight):
    """host_memory.json: every rank's peak RSS of start-up, the steps, the final save and the
    sample, each window reset at its start (``VmHWM``, Linux), and the RSS each window ends at,
    which a high-water mark bounds (benchmarks/host_memory.py --run reads them)."""
    rec = json.loads((straight / "run" / "host_memory.json").read_text())
    phases = rec["phases"]
    assert list(phases) == ["startup", "steps", "save", "sample"]
    for ph in phases.values():
        assert ph["device"] is None  # CPU: the device is the host, reported once
        assert len(ph["host"]) == len(ph["host_now"]) == 2
        if ph["host_reset"]:
            assert all(0 < now <= peak for now, peak in zip(ph["host_now"], ph["host"]))


# ------------------------------------------------------------------------- resharding matrix

def _matrix_world(tmp_path_factory, name):
    """The worker's world: every FROM saved; resumed in ckpt_cases.FAST's pairs, or in every
    pair when ``name`` ends in "slow"."""
    out = tmp_path_factory.mktemp(name)
    run_world(ROOT / "tests" / "workers" / "ckpt_cases.py", out, nproc=4)
    merged = {}
    for r in range(4):
        for key, val in load_pt(out / f"matrix_rank{r}.pt").items():
            merged.setdefault(key, []).append(val)
    merged["_out"] = out
    return merged


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _matrix_world(tmp_path_factory, "matrix")


@pytest.fixture(scope="module")
def matrix_slow(tmp_path_factory):
    return _matrix_world(tmp_path_factory, "matrix_slow")


@pytest.fixture(scope="module")
def reference():
    """Single process, the worker's model/data/optimizer: the losses of steps 1..N."""
    from shardwise.parallel.model import Local
    from shardwise.train.optim import build_optimizer, build_scheduler
    from shardwise.train.step import train_step

    work = ckpt_cases.workload()
    torch.manual_seed(ckpt_cases.CFG.seed)
    model = ckpt_cases.build_model("tiny", vocab_size=67, tie_embeddings=True)
    eng = Local(model)
    opt = build_optimizer(eng, ckpt_cases.CFG)
    sched = build_scheduler(opt, ckpt_cases.CFG)
    sampler = work.sampler(ckpt_cases.GLOBAL_BATCH, 1, 0, ckpt_cases.CFG.seed)
    return [train_step(eng, work.batches(sampler.next_local_batch(), ckpt_cases.MICRO), opt,
                       max_norm=ckpt_cases.CFG.grad_clip, scheduler=sched).loss
            for _ in range(ckpt_cases.N)]


def _close(got, want):
    return len(got) == len(want) and all(abs(a - b) <= 1e-6 + 1e-5 * abs(b)
                                         for a, b in zip(got, want))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("src,dst", [pytest.param(
    *pair, marks=() if pair in ckpt_cases.FAST else pytest.mark.slow) for pair in MATRIX])
def test_resharding_matrix(request, reference, src, dst):
    """``make test``: the pairs of ckpt_cases.FAST (every FROM and every TO once); the others
    run in ``make test-slow``'s world, which resumes every pair."""
    K = ckpt_cases.K
    matrix = request.getfixturevalue("matrix" if (src, dst) in ckpt_cases.FAST else
                                     "matrix_slow")
    for rank_res in matrix[(src, "save")]:  # every member rank saw the reference's first K
        assert rank_res["error"] is None, rank_res["error"]
        assert _close(rank_res["losses"], reference[:K])
    runs = matrix[(src, dst)]
    for rank_res in runs:
        assert rank_res["error"] is None, rank_res["error"]
        assert _close(rank_res["losses"], reference[K:]), (rank_res["losses"], reference[K:])


@pytest.mark.timeout(400)
def test_matrix_detects_a_lost_optimizer_state(matrix, reference):
    """Control: resuming without the AdamW moments must move the loss past the tolerance."""
    for rank_res in matrix[(ckpt_cases.FROM[0], "control")]:
        assert rank_res["error"] is None, rank_res["error"]
        assert not _close(rank_res["losses"], reference[ckpt_cases.K:])


# ------------------------------------------------------------- Muon's momentum (issue 41)

@pytest.fixture(scope="module")
def muon_reference():
    """Single process, the worker's Muon run: the losses of steps 1..N."""
    from shardwise.parallel.model import Local
    from shardwise.train.optim import build_optimizer, build_scheduler
    from shardwise.train.step import train_step

    cfg = ckpt_cases.CFG_MUON
    work = ckpt_cases.workload()
    torch.manual_seed(cfg.seed)
    eng = Local(ckpt_cases.build_model("tiny", vocab_size=67, tie_embeddings=True))
    opt = build_optimizer(eng, cfg)
    sched = build_scheduler(opt, cfg)
    sampler = work.sampler(ckpt_cases.GLOBAL_BATCH, 1, 0, cfg.seed)
    return [train_step(eng, work.batches(sampler.next_local_batch(), ckpt_cases.MICRO), opt,
                       max_norm=cfg.grad_clip, scheduler=sched).loss for _ in range(ckpt_cases.N)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("i,src", list(enumerate(ckpt_cases.FROM_MUON)))
def test_muon_momentum_resumes_in_another_layout_bitwise(matrix, muon_reference, i, src,
                                                         tmp_path):
    """Muon's state saved under ZeRO-3 over 4 ranks (pieces of matrices) is the full-shape
    momentum buffer (AdamW's moments for the rest); restored into one process and into ZeRO-1
    × TP it gathers back bit for bit, and the resumed losses follow one process's Muon run by
    the parity rule."""
    K = ckpt_cases.K
    for rank_res in matrix[("muon " + src, "save")]:
        assert rank_res["error"] is None, rank_res["error"]
        assert _close(rank_res["losses"], muon_reference[:K])
    saved = load_pt(matrix["_out"] / f"muon_state_{i}.pt")
    assert any("momentum_buffer" in st for st in saved.values())
    for dst in ckpt_cases.TO_MUON:
        runs = matrix[("muon " + src, dst)]
        for rank_res in runs:
            assert rank_res["error"] is None, rank_res["error"]
            assert _close(rank_res["losses"], muon_reference[K:]), (dst, rank_res["losses"])
        (state,) = [r["state"] for r in runs if r["state"] is not None]
        assert state.keys() == saved.keys()
        for fqn, st in saved.items():
            assert st.keys() == state[fqn].keys(), fqn
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(state[fqn][k]), torch.as_tensor(v)), (fqn, k)


@pytest.mark.timeout(400)
def test_muon_matrix_detects_a_lost_momentum(matrix, muon_reference):
    for rank_res in matrix[("muon " + ckpt_cases.FROM_MUON[0], "control")]:
        assert rank_res["error"] is None, rank_res["error"]
        assert not _close(rank_res["losses"], muon_reference[ckpt_cases.K:])


# ------------------------------------------------- shard by shard (issue 53): every rank its boxes

import ckpt_shard_cases  # noqa: E402


def _merge(dicts):
    """One {key: value} from every rank's; a key several ranks hold must agree bitwise."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            if k in out:
                assert _same(out[k], v), k
            out[k] = v
    return out


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def _shard_world(tmp_path_factory, name):
    """The worker's world; ``name`` ending in "slow" also runs ckpt_shard_cases.SLOW."""
    out = tmp_path_factory.mktemp(name)
    run_world(ROOT / "tests" / "workers" / "ckpt_shard_cases.py", out, nproc=4)
    ranks = [load_pt(out / f"shard_rank{r}.pt") for r in range(4)]
    return {k: [r[k] for r in ranks if k in r] for k in set().union(*ranks)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _shard_world(tmp_path_factory, "shards")


@pytest.fixture(scope="module")
def shards_slow(tmp_path_factory):
    return _shard_world(tmp_path_factory, "shards_slow")


def _read_back_one_process(spec, step):
    """The checkpoint read here, in one process, two ways: DCP's full tensors (as ``export``
    and ``load_model`` see them), and a resume into the single-process engine (``load_model``
    into a plain model from another seed, ``restore_training_state`` into
    :class:`~shardwise.parallel.model.Local`'s AdamW)."""
    from torch.distributed.checkpoint import FileSystemReader

    from shardwise.checkpoint import load_model, restore_training_state
    from shardwise.checkpoint.load import _dcp_load, load_full_optimizer_state
    from shardwise.parallel.model import Local
    from shardwise.train.optim import build_optimizer

    md = FileSystemReader(str(step)).read_metadata()
    model = {k[6:]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    _dcp_load({"model": model}, step)
    plain = ckpt_shard_cases.model_of(spec, 1234)
    load_model(step, plain)
    eng = Local(plain)
    opt = build_optimizer(eng, ckpt_cases.CFG)
    restore_training_state(step, eng, opt)
    return (model, load_full_optimizer_state(step), eng.named_full_parameters(),
            eng.full_optimizer_state(opt), md)


def _check_shard_case(runs, spec):
    for r in runs:
        assert r["error"] is None, r["error"]
    ref_model = _merge([r["ref"][0] for r in runs])
    ref_optim = _merge([r["ref"][1] for r in runs])
    step = Path(runs[0]["folder"]) / "checkpoints" / f"step_{ckpt_shard_cases.K}"
    model, optim, local_model, local_optim, md = _read_back_one_process(spec, step)
    # bitwise: what the old gather gives on the saving ranks = what one process reads back
    assert model.keys() == ref_model.keys() == local_model.keys()
    assert all(torch.equal(model[k], ref_model[k]) for k in model)
    assert all(torch.equal(local_model[k], ref_model[k]) for k in model)
    assert _same(optim, ref_optim) and set(optim) == set(model)
    assert _same({k: {s: v for s, v in st.items()} for k, st in local_optim.items()}, ref_optim)
    # each rank wrote only boxes it holds, each box once: DCP's storage index names the file
    # (``__<rank>_<i>_0.distcp``) of every stored chunk
    held = {r["rank"]: set(r["boxes"]) for r in runs}
    stored = [(idx.fqn, tuple(idx.offset), int(info.relative_path.split("_")[2]))
              for idx, info in md.storage_data.items()]
    assert {(k, o) for k, o, _ in stored} == set().union(*held.values())
    assert len(stored) == len({(k, o) for k, o, _ in stored})
    assert all((k, o) in held[rank] for k, o, rank in stored)


def test_a_flat_range_is_cut_into_boxes_that_tile_it_exactly():
    """``boxes.flat_boxes``: for every range [lo, lo + n) of row-major tensors of 1 to 3 dims,
    the boxes, read from ``arange`` in that shape, give back exactly the range's elements in
    order (each box a contiguous run starting at its ``start``), at most 2·ndim − 1 of them."""
    import math

    from shardwise.parallel.boxes import flat_boxes

    for shape in [(7,), (3, 5), (4, 3, 5)]:
        total = math.prod(shape)
        full = torch.arange(total).view(shape)
        for lo in range(total):
            for n in range(1, total - lo + 1):
                boxes = flat_boxes(shape, lo, n)
                assert 1 <= len(boxes) <= 2 * len(shape) - 1
                assert sum(math.prod(sz) for _, sz, _ in boxes) == n  # no overlap
                got = torch.full((n,), -1)
                for off, sizes, start in boxes:
                    box = full[tuple(slice(o, o + z) for o, z in zip(off, sizes))]
                    assert tuple(box.shape) == tuple(sizes)
                    got[start: start + box.numel()] = box.reshape(-1)
                assert torch.equal(got, torch.arange(lo, lo + n)), (shape, lo, n)

@pytest.mark.timeout(400)
@pytest.mark.parametrize("spec", ckpt_shard_cases.SAVE)
def test_shard_by_shard_save_loads_back_bitwise(shards, spec):
    """Saved shard by shard under ``spec`` (ZeRO-1/2/3 slices, TP chunks with the vocabulary's
    padding cut, a pipeline's stages, HSDP, EP experts, FSDP2's DTensor shards): read back in
    one process, the weights and AdamW's state equal bitwise the full-shape state the saving
    ranks gather the old way (all-gathers), and each rank's file holds only boxes it holds,
    each box stored once (replicas: by one rank)."""
    _check_shard_case(shards[spec], spec)


@pytest.mark.timeout(400)
def test_a_save_holds_at_most_one_box_of_copies(shards):
    """The copies DCP's writer holds while it writes (a clone of each box that is a view into a
    larger buffer; counted by ``ckpt_shard_cases.CopiesDcpHolds``) never add up to more than
    the largest box this rank holds: the save's peak is training's plus one box (issue 53).
    Before the writer cut each rank's boxes into files of at most that size
    (``checkpoint/save.py: _writer``), DCP kept every key's copy until the rank's one file
    was closed: ZeRO's model slices alone were several boxes."""
    for spec in ckpt_shard_cases.SAVE:
        for r in shards[spec]:
            peak, largest = r["copies"]
            assert peak <= largest, (spec, r["rank"], peak, largest)
    # the hook sees the copies: ZeRO-3's boxes are views into the flat slice, each one cloned
    assert all(r["copies"][0] > 0 for r in shards["dp=4,zero=3"])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", ckpt_shard_cases.SLOW)
def test_shard_by_shard_save_loads_back_bitwise_more_layouts(shards_slow, spec):
    _check_shard_case(shards_slow[spec], spec)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("spec,to", list(ckpt_shard_cases.RESUME.items()))
def test_dp4_zero3_checkpoint_resumes_at_tp2_pp2_bitwise(shards, spec, to):
    """The checkpoint saved at dp 4 ZeRO-3 (each rank a quarter of every unit) resumed at
    tp 2 × pp 2 (each rank a tp half of one stage): the model and AdamW state gathered there
    equal bitwise what was saved (and the one-process resume: test above)."""
    runs = shards["resumed " + spec]
    for r in runs:
        assert r["error"] is None, r["error"]
    saved = shards[spec]
    assert _same(_merge([r["ref"][0] for r in runs]), _merge([r["ref"][0] for r in saved]))
    assert _same(_merge([r["ref"][1] for r in runs]), _merge([r["ref"][1] for r in saved]))


# ------------------------------------------------------------------------------- failures

def rank_file(step, rank: int) -> Path:
    """Rank ``rank``'s first data file of checkpoint folder ``step`` (``__<rank>_<i>_0.distcp``:
    each rank writes its boxes into files of at most its largest box, checkpoint/save.py)."""
    return sorted(step.glob(f"__{rank}_*.distcp"))[0]


def _copy_run(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight / "run" / "checkpoints", run / "checkpoints")
    return run


def test_truncated_and_corrupt_checkpoints_are_named_and_skipped(straight, tmp_path):
    from shardwise.checkpoint import CheckpointError, find_resume_checkpoint

    run = _copy_run(straight, tmp_path)
    ck = run / "checkpoints"
    shard = rank_file(ck / "step_6", 1)
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    warnings = []
    assert find_resume_checkpoint("auto", str(run), warn=warnings.append) == ck / "step_4"
    assert len(warnings) == 1 and str(shard) in warnings[0] and "truncated" in warnings[0]
    with pytest.raises(CheckpointError, match=f"{shard}.*truncated"):
        find_resume_checkpoint(str(ck / "step_6"), str(run))
    # same size, one byte flipped: only the hash can tell
    meta = rank_file(ck / "step_4", 0)
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{meta} does not match the SHA-256"):
        find_resume_checkpoint(str(ck / "step_4"), str(run))
    # an interrupted save (a .tmp folder, or a folder without its marker) is skipped by name
    shutil.copytree(ck / "step_2", ck / "step_8.tmp")
    (ck / "step_8.tmp" / "COMPLETE").unlink()
    warnings.clear()
    assert find_resume_checkpoint("auto", str(run), warn=warnings.append) == ck / "step_2"
    assert "step_8.tmp" in warnings[0] and "no completion marker" in warnings[0]
    assert len(warnings) == 3  # step_8.tmp, step_6 (truncated), step_4 (hash)


@pytest.mark.timeout(300)
def test_cli_errors_name_the_file_the_keys_and_the_folder(straight, tmp_path, cache_dir):
    run = _copy_run(straight, tmp_path)
    shard = rank_file(run / "checkpoints" / "step_6", 0)
    shard.write_bytes(shard.read_bytes()[:100])
    base = [a if a != "2" or i != TRAIN.index("--dp") + 1 else "1" for i, a in enumerate(TRAIN)]
    # a truncated checkpoint named explicitly: exit 2, the file named, no traceback
    r = run_cli([*base, "--out", tmp_path / "a", "--resume", run / "checkpoints" / "step_6"],
                cache_dir)
    assert r.returncode == 2 and f"{shard} has 100 bytes" in r.stdout, r.stdout[-2000:]
    assert "Traceback" not in r.stdout
    # another model configuration: every mismatched key and shape listed
    r = run_cli([*base, "--out", tmp_path / "b", "--n-layers", "3", "--resume",
                 run / "checkpoints" / "step_4"], cache_dir)
    assert r.returncode == 2, r.stdout[-2000:]
    assert "saved from another model configuration" in r.stdout
    assert "'layers.2.attention.wq.weight'" in r.stdout and "--model tiny" in r.stdout
    # an --out that cannot be written: refused by the launcher before any worker starts
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli([*TRAIN, "--out", blocker / "run"], cache_dir)
    assert r.returncode == 2 and f"{blocker} is a file, not a folder" in r.stdout, r.stdout
    assert "[rank" not in r.stdout


def test_model_mismatch_lists_shapes(straight):
    from shardwise.models import build_model
    from shardwise.checkpoint import CheckpointError, check_model_compatible

    step = straight / "run" / "checkpoints" / "step_2"
    with torch.device("meta"):
        other = build_model("tiny", vocab_size=300)
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight: \[257, 32\] in the "
                                              r"checkpoint vs \[300, 32\] in this model"):
        check_model_compatible(step, other)


def test_disk_space_and_out_checks(tmp_path):
    from shardwise.config import TrainConfig, validate
    from shardwise.errors import ShardwiseConfigError
    from shardwise.checkpoint import check_disk_space, checkpoint_bytes_estimate

    with pytest.raises(ShardwiseConfigError, match="MiB free on its file system"):
        check_disk_space(str(tmp_path / "x"), 1 << 62)
    check_disk_space(str(tmp_path / "x"), 1)
    assert checkpoint_bytes_estimate(1000, keep=2) == 3 * 4 * 1000 * 3
    # a folder with a run's records is refused (an empty metrics.jsonl, left by a run that failed
    # before its first record, is not a run: tests/test_bad_inputs.py, issue 51)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    cfg = TrainConfig(model="tiny", out=str(tmp_path))
    with pytest.raises(ShardwiseConfigError, match="--resume auto to continue"):
        validate(cfg)
    validate(TrainConfig(model="tiny", out=str(tmp_path), resume="auto"))  # allowed
    with pytest.raises(ShardwiseConfigError, match="no --out was given"):
        validate(TrainConfig(model="tiny", resume="auto"))
    with pytest.raises(ShardwiseConfigError, match="--keep -1"):
        validate(TrainConfig(model="tiny", keep=-1))
