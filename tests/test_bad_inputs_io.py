"""Bad input and data I/O (issue 13, items 12–13).

- Every float flag of :class:`~shardwise.config.TrainConfig` refuses NaN and ±infinity (flag or
  TOML), and ``--timeout`` below :data:`~shardwise.config.MIN_TIMEOUT_S` (train, verify, bench).
- A cache folder that cannot be written (under a regular file; read-only — as root, where chmod
  does not stop writes, a ``/proc`` path instead) is a clear error.
- A damaged token cache entry or cached tokenizer is detected and rebuilt, equal to a fresh build.
- A long single-line document is trained on and encoded in pieces with the same tokens as whole.

As in test_bad_inputs.py: exit status 2, the message on the last line, no Traceback; the
multi-rank cases run rank 1 of a 2-rank world with no peer, so a prompt exit proves the check
runs before any collective. Peak memory on a 24 MB line is measured by
benchmarks/data_memory.py, not here.
"""

import dataclasses
import math
import random
import time
import typing

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from shardwise.config import MIN_TIMEOUT_S, TrainConfig, validate
from shardwise.data import dataset as dataset_mod
from shardwise.data import tokenizer as tok_mod
from shardwise.data.dataset import prepare_lm_data
from shardwise.data.tokenizer import HFTokenizer, load_tokenizer, split_long_text
from shardwise.errors import ShardwiseConfigError

AS_RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29997"}
Q = ["train", "--model", "tiny", "--dp", "2", "--steps", "2", "--tokenizer", "bytes", "--seq-len",
     "32"]
_HINTS = typing.get_type_hints(TrainConfig)
FLOAT_FLAGS = [f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)
               if _HINTS[f.name] is float]


@pytest.fixture
def cli(monkeypatch, capsys, cache_dir):
    """``shardwise.cli.main`` in this process, outside any world; spawning or training trips."""
    import shardwise.cli as cli_mod
    import shardwise.train.loop as loop

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache_dir))

    def tripwire(*a, **k):
        raise AssertionError("the bad input was not caught: workers would start")

    monkeypatch.setattr(cli_mod, "spawn", tripwire)
    monkeypatch.setattr(loop, "train", tripwire)

    def run(argv):
        try:
            code = cli_mod.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
        out = capsys.readouterr()
        return code, out.out + out.err

    return run


def _refused(code, out, fragments):
    assert code == 2, out
    for frag in fragments:
        assert frag in out, f"{frag!r} not in:\n{out}"
    assert "Traceback" not in out, out
    assert "error:" in out.strip().splitlines()[-1], out  # the message is the last line


# ----------------------------------------------------------------------- float flags, timeout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e39"])  # 1e39: finite, not in fp32
@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_every_float_flag_refuses_nan_and_infinity(cli, flag, value):
    code, out = cli([*Q, f"--{flag}={value}"])  # "=": argparse would take -inf for an option
    _refused(code, out, [f"--{flag} {float(value)} must be a finite number", "give a finite"])


@pytest.mark.timeout(60)
def test_a_config_file_with_nan_is_refused_too(cli, tmp_path):
    (tmp_path / "c.toml").write_text("lr = nan\n")  # TOML has nan and inf literals
    _refused(*cli([*Q, "--config", tmp_path / "c.toml"]), ["--lr nan must be a finite number"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [
    [*Q, "--timeout", "0.001"],
    [*Q, "--timeout", "0.5"],
    ["verify", "--nproc", "2", "--layouts", "dp=2", "--timeout", "0.001"],
    ["bench", "--layout", "dp=2", "--timeout", "0.001"],
], ids=["train", "train-half-second", "verify", "bench"])
def test_a_timeout_below_the_minimum_is_refused(cli, argv):
    t = argv[-1]
    _refused(*cli(argv), [f"--timeout {float(t)} s is too short to be meaningful",
                          f"choose --timeout ≥ {MIN_TIMEOUT_S:g} s"])


def test_the_minimum_timeout_is_the_boundary():
    cfg = dataclasses.replace(TrainConfig(), model="tiny", dp=2, tp=1, zero=0, seq_len=32)
    validate(dataclasses.replace(cfg, timeout=MIN_TIMEOUT_S))  # the floor itself is accepted
    with pytest.raises(ShardwiseConfigError, match="too short to be meaningful"):
        validate(dataclasses.replace(cfg, timeout=math.nextafter(MIN_TIMEOUT_S, 0)))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("extra,fragments", [
    (["--lr", "nan"], ["--lr nan must be a finite number"]),
    (["--timeout", "0.001"], ["--timeout 0.001 s is too short"]),
], ids=["lr-nan", "timeout-0.001"])
def test_every_rank_refuses_before_any_collective(cache_dir, extra, fragments):
    t0 = time.time()
    p = run_cli([*Q, *extra], cache_dir, timeout=80, env=AS_RANK_1_OF_2)
    _refused(p.returncode, p.stdout, fragments)
    assert time.time() - t0 < 75  # a rank stuck in the rendezvous would wait for its peer


# ------------------------------------------------------------------- a cache that cannot be written


def _unwritable_folder(tmp_path):
    """A folder this process cannot write in: chmod 0o555 if that stops us; as root (where it
    does not) a path under /proc, where nobody can create folders."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").write_text("")
    except OSError:
        return ro  # not root: permission bits apply
    (ro / "probe").unlink()
    ro.chmod(0o755)
    return "/proc/shardwise-no-such-folder/cache"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["under-a-file", "read-only-folder"])
@pytest.mark.parametrize("argv", [
    [*Q],
    [*Q, "--tokenizer", "bpe", "--vocab-size", "300", "--task", "sft", "--data",
     ROOT / "examples" / "sft_sample.jsonl", "--seq-len", "256"],
], ids=["lm-bytes", "sft-bpe"])
def test_an_unwritable_cache_folder_is_refused(cli, monkeypatch, tmp_path, where, argv):
    if where == "under-a-file":
        (tmp_path / "a_file").write_text("not a folder")
        cache, frags = tmp_path / "a_file" / "cache", ["is a file, not a folder"]
    else:
        cache, frags = _unwritable_folder(tmp_path), ["is not writable"]
    print("cache folder used:", cache)
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache))
    code, out = cli(argv)
    _refused(code, out, [*frags, "set SHARDWISE_CACHE to a writable folder"])


@pytest.mark.timeout(90)
def test_every_rank_refuses_an_unwritable_cache_before_any_collective(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    t0 = time.time()
    p = run_cli(Q, tmp_path / "a_file" / "cache", timeout=80, env=AS_RANK_1_OF_2)
    _refused(p.returncode, p.stdout, ["is a file, not a folder", "SHARDWISE_CACHE"])
    assert time.time() - t0 < 75


# ------------------------------------------------------------------------- a damaged token cache

_DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 23}" for j in range(60)) for i in range(9)]


def _corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    for i, d in enumerate(_DOCS):
        (folder / f"d{i}.txt").write_text(d)
    return str(folder)


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "train-npy-truncated": ("train.npy", _truncate),
    "val-npy-truncated": ("val.npy", lambda p: _truncate(p, 0.1)),
    "val-npy-missing": ("val.npy", lambda p: p.unlink()),
    "train-npy-one-byte-flipped": ("train.npy", _flip_last_byte),
    "meta-json-truncated": ("meta.json", _truncate),
    "tokenizer-json-truncated": ("tokenizer.json", _truncate),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_token_cache_is_detected_and_rebuilt(tmp_path, monkeypatch, capsys, damage):
    data = _corpus(tmp_path)
    tok = "bpe"  # its entry reads tokenizer.json back (the bytes tokenizer needs no file)
    ref = prepare_lm_data(data, tok, 300, seq_len=8, val_every=3, cache_dir=tmp_path / "ref")
    builds = []
    real = dataset_mod._build_entry
    monkeypatch.setattr(dataset_mod, "_build_entry", lambda *a, **k: (builds.append(1),
                                                                       real(*a, **k)))
    cache = tmp_path / "cache"
    first = prepare_lm_data(data, tok, 300, seq_len=8, val_every=3, cache_dir=cache)
    name, how = DAMAGE[damage]
    (entry,) = [d for d in (cache / "tokens").iterdir() if d.is_dir()]
    how(entry / name)
    again = prepare_lm_data(data, tok, 300, seq_len=8, val_every=3, cache_dir=cache)
    assert len(builds) == 2, "the damaged entry was not rebuilt"
    assert "is damaged" in capsys.readouterr().err
    for got in (first, again):
        assert torch.equal(got.train, ref.train) and torch.equal(got.val, ref.val)
        assert got.tokenizer.encode(_DOCS[0]) == ref.tokenizer.encode(_DOCS[0])
    prepare_lm_data(data, tok, 300, seq_len=8, val_every=3, cache_dir=cache)
    assert len(builds) == 2, "a repaired entry must be read, not rebuilt again"


@pytest.mark.timeout(60)
def test_a_truncated_cached_tokenizer_is_retrained(tmp_path):
    ref = load_tokenizer("bpe", _DOCS, 300, tmp_path / "ref")
    load_tokenizer("bpe", _DOCS, 300, tmp_path / "c")
    (path,) = (tmp_path / "c" / "tokenizers").glob("*.json")
    _truncate(path)
    again = load_tokenizer("bpe", _DOCS, 300, tmp_path / "c")
    assert [again.encode(d) for d in _DOCS] == [ref.encode(d) for d in _DOCS]
    assert path.read_bytes() == next((tmp_path / "ref" / "tokenizers").glob("*.json")).read_bytes()


# --------------------------------------------------------------------- long single-line documents


def _long_line(chars=200_000):
    """Stdlib source as one line, plus the whitespace cases a cut must respect."""
    from shardwise.data import stdlib_corpus_files

    text = ""
    for p in stdlib_corpus_files():
        text += p.read_text(errors="replace").replace("\n", " ")
        if len(text) > chars:
            break
    odd = "  x's  12\t345 ünï\u00a0nbsp \u3000ideo \x1c sep  \t  it'll  end "
    return (text[:chars] + odd) * 2


@pytest.mark.timeout(120)
def test_a_long_line_gives_the_same_tokens_in_pieces(monkeypatch):
    text = _long_line()
    pieces = split_long_text(text, 1000)
    assert "".join(pieces) == text and len(pieces) > 300
    assert all(len(p) <= 1000 for p in pieces)
    # the reference: trained on and encoded as one whole text, no cutting anywhere
    whole = tok_mod._train_bpe([text], 400)
    tok = HFTokenizer(whole, "whole")
    assert tok.chunk_safe
    expected = tok.encode(text) + [tok.eos_id]
    # trained on the pieces: the same pre-tokens, so the same merges
    assert tok_mod._train_bpe(pieces, 400).to_str() == whole.to_str()
    # the data pipeline encodes in pieces (batches of a few pieces) with the same ids
    monkeypatch.setattr(tok_mod, "LONG_TEXT_CHUNK_CHARS", 1000)
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 5000)
    got = dataset_mod._encode_stream(tok, [text])
    assert got.dtype == np.int32 and got.tolist() == expected


@pytest.mark.timeout(60)
def test_a_tokenizer_that_joins_across_spaces_is_encoded_whole(monkeypatch):
    from tokenizers import normalizers

    text = _long_line(20_000)
    t = tok_mod._train_bpe([text], 300)
    t.normalizer = normalizers.Strip()  # per encode call: each piece would lose its first space
    tok = HFTokenizer(t, "strip")
    assert not tok.chunk_safe
    monkeypatch.setattr(tok_mod, "LONG_TEXT_CHUNK_CHARS", 1000)
    got = dataset_mod._encode_stream(tok, [text]).tolist()
    assert got == tok.encode(text) + [tok.eos_id]
    pieces = split_long_text(text, 1000)  # (in pieces it would differ: the test is not vacuous)
    assert [i for p in pieces for i in tok.encode(p)] != tok.encode(text)


def test_split_long_text_cuts_at_the_last_border_else_hard():
    """Against a brute-force reading of the rule: a cut goes before the last space/newline/tab
    after a non-whitespace character within ``max_chars``, else exactly at ``max_chars``."""
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("ab  \n\t\u00a0\x1c.'") for _ in range(rng.randint(0, 2000)))
        m = rng.randint(1, 150)
        pieces = split_long_text(text, m)
        assert "".join(pieces) == text and all(0 < len(p) <= m for p in pieces if text)
        borders = {i for i in range(1, len(text)) if text[i] in " \n\t"
                   and not text[i - 1].isspace()}
        start = 0
        for p in pieces[:-1]:
            ok = [i for i in borders if start < i <= start + m]
            assert start + len(p) == (max(ok) if ok else start + m)
            start += len(p)
    assert split_long_text("x" * 10, 0) == ["x" * 10]  # 0 = never cut


def test_bpe_training_keeps_its_budget_on_one_huge_document(monkeypatch):
    monkeypatch.setattr(tok_mod, "LONG_TEXT_CHUNK_CHARS", 1000)
    doc = "word " * 40_000  # 200,000 characters, one document
    sample = tok_mod.bpe_training_sample([doc], budget=20_000)
    chars = sum(map(len, sample))
    assert 20_000 * 0.9 <= chars <= 20_000 * 1.1  # ceil(200,000 / 20,000) = every 10th piece
    assert all(len(p) <= 1000 for p in sample)
    small = ["a b", "c d e"]  # below the chunk size and the budget: unchanged
    assert tok_mod.bpe_training_sample(small, budget=20_000) == small
