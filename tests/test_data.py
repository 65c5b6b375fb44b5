"""Tests for shardwise.data: corpus loading, tokenizers, packing, caching, the sampler.

Fast (a few seconds) and offline: every corpus is made in tmp_path, except the embedded default,
which is the interpreter's own standard library.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from shardwise.data import (
    ByteTokenizer,
    DistributedSampler,
    load_documents,
    load_tokenizer,
    microbatches,
    prepare_lm_data,
    stdlib_corpus_files,
)
from shardwise.data import dataset as dataset_mod
from shardwise.errors import ShardwiseConfigError

EOS = ByteTokenizer.eos_id


@pytest.fixture(autouse=True)
def _offline_tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))


def _write_docs(folder, texts):
    """One .txt per text, named so sorted order is the given order."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- sampler


def _global_batches(sampler, steps):
    return [sampler.next_global_batch() for _ in range(steps)]


def test_sampler_ranks_partition_the_global_batch_across_epochs():
    num, batch, dp = 10, 4, 2  # 2 batches per epoch, tail of 2 dropped; 5 steps cross 2 epochs
    reference = _global_batches(DistributedSampler(num, batch, seed=3), steps=5)
    ranks = [DistributedSampler(num, batch, dp_size=dp, dp_rank=r, seed=3) for r in range(dp)]
    for step, expected in enumerate(reference):
        local = [s.next_local_batch() for s in ranks]
        assert all(x.shape == (batch // dp,) and x.dtype == torch.int64 for x in local)
        assert torch.equal(torch.cat(local), expected), step
        assert len(set(local[0].tolist()) & set(local[1].tolist())) == 0
    assert ranks[0].epoch == 2  # steps 0-1 epoch 0, 2-3 epoch 1, 4 epoch 2


def test_sampler_epochs_are_permutations_minus_the_tail():
    sampler = DistributedSampler(10, 4, seed=0)
    epoch0 = torch.cat(_global_batches(sampler, 2))
    assert len(set(epoch0.tolist())) == 8
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(0))[:8]
    assert torch.equal(epoch0, expected)
    epoch1 = torch.cat(_global_batches(sampler, 2))
    assert torch.equal(epoch1, torch.randperm(10, generator=torch.Generator().manual_seed(1))[:8])


def test_sampler_resume_reproduces_the_sequence():
    run = DistributedSampler(13, 3, dp_size=3, dp_rank=1, seed=7)
    for _ in range(5):
        run.next_local_batch()
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    assert {"epoch", "offset", "seed"} <= state.keys()
    expected = [run.next_local_batch() for _ in range(8)]

    resumed = DistributedSampler(13, 3, dp_size=3, dp_rank=1, seed=999)
    resumed.load_state_dict(state)  # adopts the saved seed
    assert all(torch.equal(resumed.next_local_batch(), e) for e in expected)

    # the state is layout-independent: resuming at dp=1 gives the same global batches
    global_run = DistributedSampler(13, 3, seed=0)
    global_run.load_state_dict(state)
    run2 = DistributedSampler(13, 3, dp_size=3, dp_rank=1, seed=7)
    run2.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(global_run.next_global_batch(), run2.next_global_batch())


def test_sampler_is_deterministic_by_seed():
    a = _global_batches(DistributedSampler(50, 8, seed=1), 10)
    b = _global_batches(DistributedSampler(50, 8, seed=1), 10)
    c = _global_batches(DistributedSampler(50, 8, seed=2), 10)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_samples=10, global_batch=6, dp_size=4), "not divisible by --dp 4"),
        (dict(num_samples=5, global_batch=8), "larger than the 5 sequences"),
        (dict(num_samples=5, global_batch=2, dp_size=2, dp_rank=2), "outside"),
    ],
)
def test_sampler_rejects_bad_sizes(kwargs, words):
    with pytest.raises(ShardwiseConfigError, match=words):
        DistributedSampler(**kwargs)


def test_sampler_rejects_a_state_from_another_global_batch():
    state = DistributedSampler(10, 2).state_dict()
    with pytest.raises(ShardwiseConfigError, match="global_batch"):
        DistributedSampler(10, 4).load_state_dict(state)


def test_microbatches_shift_labels_and_split_rows():
    data = torch.arange(5 * 4).view(5, 4)  # 5 rows of seq_len + 1 = 4
    mbs = microbatches(data, torch.tensor([4, 0, 2, 1]), micro_batch=2)
    assert len(mbs) == 2
    assert torch.equal(mbs[0]["input_ids"], torch.tensor([[16, 17, 18], [0, 1, 2]]))
    assert torch.equal(mbs[0]["labels"], torch.tensor([[17, 18, 19], [1, 2, 3]]))
    assert torch.equal(mbs[1]["input_ids"], torch.tensor([[8, 9, 10], [4, 5, 6]]))
    with pytest.raises(ShardwiseConfigError, match="does not divide the 4 sequences"):
        microbatches(data, torch.tensor([0, 1, 2, 3]), micro_batch=3)


# ----------------------------------------------------------------------------- packing


def test_packing_by_hand_with_bytes(tmp_path):
    # documents 0, 1, 2; val_every=2 holds out document 1 ("cd")
    folder = _write_docs(tmp_path / "d", ["ab", "cd", "ef"])
    data = prepare_lm_data(str(folder), "bytes", seq_len=2, val_every=2)
    a, b, c, d, e, f = b"abcdef"
    assert data.train.dtype == torch.int64 and data.vocab_size == 257
    assert data.train.tolist() == [[a, b, EOS], [e, f, EOS]]
    assert data.val.tolist() == [[c, d, EOS]]



def test_packing_drops_the_remainder(tmp_path):
    folder = _write_docs(tmp_path / "d", ["abc", "wxyz", "de"])
    data = prepare_lm_data(str(folder), "bytes", seq_len=3, val_every=2)
    # train stream a b c EOS d e EOS → one row of 4, "d e EOS" dropped; val w x y z EOS → one row
    assert data.train.tolist() == [[*b"abc", EOS]]
    assert data.val.tolist() == [[*b"wxyz"]]
    assert data.stats["train_tokens"] == 7 and data.stats["val_tokens"] == 5


def test_packing_val_split_is_every_kth_document(tmp_path):
    texts = [chr(ord("a") + i) for i in range(7)]  # "a".."g"
    folder = _write_docs(tmp_path / "d", texts)
    data = prepare_lm_data(str(folder), "bytes", seq_len=1, val_every=3)
    # val: documents 2 and 5 ("c", "f"); each row is [letter, EOS]
    assert data.val.tolist() == [[ord("c"), EOS], [ord("f"), EOS]]
    assert [row[0] for row in data.train.tolist()] == [ord(x) for x in "abdeg"]
    assert data.stats["val_documents"] == 2 and data.stats["val_split"] == "documents"


def test_single_document_holds_out_the_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghi")  # stream: a..i EOS = 10 tokens; val = last 10 // 5 = 2
    data = prepare_lm_data(str(path), "bytes", seq_len=1, val_every=5)
    assert data.val.tolist() == [[ord("i"), EOS]]
    assert data.train.tolist() == [[ord("a"), ord("b")], [ord("c"), ord("d")],
                                   [ord("e"), ord("f")], [ord("g"), ord("h")]]
    assert data.stats["val_split"] == "tail"


def test_jsonl_parquet_and_nested_folders_in_sorted_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp_path / "mixed"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text("T")
    (root / "b" / "c.jsonl").write_text('{"text": "J1"}\n\n{"text": "J2", "id": 3}\n')
    pq.write_table(pa.table({"text": ["P1", ""]}), root / "b" / "d.parquet")
    (root / "notes.md").write_text("ignored")
    assert load_documents(str(root)) == ["T", "J1", "J2", "P1"]  # the empty record is dropped


def test_cache_is_reused_and_built_once_under_concurrency(tmp_path, monkeypatch):
    folder = _write_docs(tmp_path / "d", ["hello world", "second doc", "third doc"])
    builds = []
    real_build = dataset_mod._build_entry

    def counting_build(*args, **kwargs):
        builds.append(threading.get_ident())
        real_build(*args, **kwargs)

    monkeypatch.setattr(dataset_mod, "_build_entry", counting_build)
    results = [None] * 4
    barrier = threading.Barrier(4)

    def rank(i):
        barrier.wait()
        results[i] = prepare_lm_data(str(folder), "bytes", seq_len=3, val_every=2)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert all(torch.equal(r.train, results[0].train) for r in results)

    # another seq_len re-packs the cached stream without rebuilding
    prepare_lm_data(str(folder), "bytes", seq_len=2, val_every=2)
    assert len(builds) == 1
    # a changed file changes the key
    (folder / "doc000.txt").write_text("hello there, world")
    prepare_lm_data(str(folder), "bytes", seq_len=2, val_every=2)
    assert len(builds) == 2


# ----------------------------------------------------------------------------- errors


def test_error_missing_path(tmp_path):
    with pytest.raises(ShardwiseConfigError, match="no such file or folder") as err:
        load_documents(str(tmp_path / "nope"))
    assert "nope" in str(err.value)


def test_error_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("not a corpus")
    with pytest.raises(ShardwiseConfigError, match="empty"):
        load_documents(str(tmp_path / "empty"))


def test_error_only_empty_documents(tmp_path):
    _write_docs(tmp_path / "d", ["", ""])
    with pytest.raises(ShardwiseConfigError, match="empty"):
        load_documents(str(tmp_path / "d"))


def test_error_jsonl_without_text(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text here"}\n')
    with pytest.raises(ShardwiseConfigError, match="line 3 has no 'text' field") as err:
        load_documents(str(path))
    assert "bad.jsonl" in str(err.value)
    # datasets would silently turn mixed types into their JSON spelling ('"fine"', '3')
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ShardwiseConfigError, match="line 2 has no 'text' field"):
        load_documents(str(path))
    path.write_text('{"text": "fine"}\n{"text": "unterminated}\n')
    with pytest.raises(ShardwiseConfigError, match="line 2 is not valid JSON"):
        load_documents(str(path))


def test_error_parquet_without_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ShardwiseConfigError, match="no 'text' column"):
        load_documents(str(tmp_path / "t.parquet"))


def test_error_invalid_utf8_txt(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"hello\nw\xf6rld")  # 0xf6 is latin-1 o-umlaut at byte offset 7
    with pytest.raises(ShardwiseConfigError, match="byte offset 7 ") as err:
        load_documents(str(path))
    assert "latin.txt" in str(err.value) and "iconv" in str(err.value)


def test_error_invalid_utf8_jsonl(tmp_path):
    path = tmp_path / "latin.jsonl"
    good = b'{"text": "ok"}\n'
    path.write_bytes(good + b'{"text": "caf\xe9"}\n')
    offset = len(good) + len(b'{"text": "caf')
    with pytest.raises(ShardwiseConfigError, match=f"byte offset {offset} ") as err:
        load_documents(str(path))
    assert "latin.jsonl" in str(err.value)


def test_error_seq_len_too_long(tmp_path):
    folder = _write_docs(tmp_path / "d", ["abcdefgh", "ijklmnop"] * 2)
    with pytest.raises(ShardwiseConfigError, match="--seq-len 64 is longer than the corpus"):
        prepare_lm_data(str(folder), "bytes", seq_len=64, val_every=2)
    # train stream: 2 docs x 9 tokens = 18 → 2 rows of 9; a global batch of 4 does not fit
    with pytest.raises(ShardwiseConfigError, match="18 tokens → 2 sequences of 9, but one global"):
        prepare_lm_data(str(folder), "bytes", seq_len=8, val_every=2, min_train_sequences=4)


def test_error_unknown_tokenizer_and_missing_file(tmp_path):
    with pytest.raises(ShardwiseConfigError, match="not one of 'bpe', 'bytes'"):
        load_tokenizer("gpt2", None, 0, tmp_path)
    with pytest.raises(ShardwiseConfigError, match="no such file"):
        load_tokenizer(str(tmp_path / "tok.json"), None, 0, tmp_path)


# ----------------------------------------------------------------------------- embedded corpus


def test_embedded_corpus_is_the_stdlib_without_tests():
    files = stdlib_corpus_files()
    assert len(files) > 100
    assert sum(p.stat().st_size for p in files) > 5_000_000
    assert files == sorted(files)
    for p in files:
        assert not {"test", "tests", "idle_test", "site-packages"} & set(p.parts)
        assert p.suffix == ".py" and not p.name.startswith("test_")
    docs = load_documents(None)  # decodes with errors="replace": never raises
    assert len(docs) > 100 and all(isinstance(d, str) and d for d in docs)


# ----------------------------------------------------------------------------- tokenizers

_BPE_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 5


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve ∑ <|endoftext|>"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids + [EOS]) == text


def test_bpe_trains_deterministically_and_round_trips(tmp_path):
    a = load_tokenizer("bpe", _BPE_TEXT, 300, tmp_path / "c1")
    b = load_tokenizer("bpe", _BPE_TEXT, 300, tmp_path / "c2")
    assert a.vocab_size <= 300 and a.eos_id == 0
    samples = ["def mul(a, b):\n    return a * b\n", "ünïcödé ✓ 🙂", "x<|endoftext|>y", ""]
    for s in samples:
        assert a.encode(s) == b.encode(s)
        assert a.decode(a.encode(s)) == s
    assert a.eos_id not in a.encode("x<|endoftext|>y")  # text cannot forge a document boundary
    assert len(a.encode("def add(a, b):")) < len("def add(a, b):".encode())  # merges happened
    assert a.encode_batch(samples) == [a.encode(s) for s in samples]

    cached = sorted((tmp_path / "c1" / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    again = load_tokenizer("bpe", _BPE_TEXT, 300, tmp_path / "c1")  # from the cache
    assert again.encode(samples[0]) == a.encode(samples[0])


def test_tokenizer_files_load_back(tmp_path):
    bpe = load_tokenizer("bpe", _BPE_TEXT, 300, tmp_path)
    bpe.save(tmp_path / "bpe.json")
    loaded = load_tokenizer(str(tmp_path / "bpe.json"), None, 0, tmp_path)
    assert loaded.encode(_BPE_TEXT[2]) == bpe.encode(_BPE_TEXT[2]) and loaded.eos_id == bpe.eos_id

    ByteTokenizer().save(tmp_path / "bytes.json")
    assert isinstance(load_tokenizer(str(tmp_path / "bytes.json"), None, 0, tmp_path), ByteTokenizer)


def test_tokenizer_file_without_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
    with pytest.raises(ShardwiseConfigError, match="no end-of-text token"):
        load_tokenizer(str(tmp_path / "t.json"), None, 0, tmp_path)


def test_prepare_with_bpe_end_to_end(tmp_path):
    folder = _write_docs(tmp_path / "d", _BPE_TEXT)
    data = prepare_lm_data(str(folder), "bpe", vocab_size=300, seq_len=8, val_every=4)
    assert data.train.shape[1] == 9 and data.val.shape[0] >= 1
    assert int(data.train.max()) < data.vocab_size == data.tokenizer.vocab_size
    eos = data.tokenizer.eos_id
    assert (data.train == eos).sum() + (data.val == eos).sum() <= len(_BPE_TEXT)
    again = prepare_lm_data(str(folder), "bpe", vocab_size=300, seq_len=8, val_every=4)
    assert torch.equal(again.train, data.train) and again.tokenizer.name == data.tokenizer.name
