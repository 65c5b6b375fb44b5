"""The three file readers (shardwise.readers): the value on a good file; on a bad one a
ShardwiseFileError (a ShardwiseConfigError) whose one line starts with the flag or role given,
names the path and what is wrong, and ends with the fix when one is given."""

import pytest

from shardwise.errors import ShardwiseConfigError, ShardwiseFileError
from shardwise.readers import iter_jsonl, read_json, read_jsonl, read_toml


def test_good_files(tmp_path):
    (tmp_path / "a.json").write_text('{"step": 3, "files": {"x": 1}}')
    (tmp_path / "a.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    (tmp_path / "a.toml").write_text('steps = 20\nmodel = "tiny"\n[gpu]\nhbm = 80\n')
    assert read_json(tmp_path / "a.json", "meta.json") == {"step": 3, "files": {"x": 1}}
    assert read_jsonl(tmp_path / "a.jsonl", "metrics") == [{"step": 1}, {"step": 2}]
    assert read_toml(tmp_path / "a.toml", "--config") == {"steps": 20, "model": "tiny",
                                                          "gpu": {"hbm": 80}}


def test_missing_file_names_the_flag_the_path_and_the_fix(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ShardwiseFileError) as e:
        read_toml(p, "--config", "give an existing TOML file")
    assert str(e.value) == f"--config {p}: no such file: give an existing TOML file"
    assert isinstance(e.value, ShardwiseConfigError)  # every caller's except still holds
    with pytest.raises(ShardwiseFileError, match="no such file$"):
        read_json(p, "meta.json")


def test_bad_toml_and_json_name_line_and_column(tmp_path):
    (tmp_path / "b.toml").write_text("steps = \n")
    with pytest.raises(ShardwiseFileError) as e:
        read_toml(tmp_path / "b.toml", "--cluster")
    assert str(e.value).startswith(f"--cluster {tmp_path / 'b.toml'}: not valid TOML (")
    assert "line 1" in str(e.value)
    (tmp_path / "b.json").write_text('{"step": }')
    with pytest.raises(ShardwiseFileError, match=r"not valid JSON \(.*line 1 column 10"):
        read_json(tmp_path / "b.json", "meta.json")


def test_jsonl_names_the_line_and_may_skip_a_torn_last_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # a crash mid-write
    with pytest.raises(ShardwiseFileError, match=rf"^metrics {p}:3: not valid JSON"):
        read_jsonl(p, "metrics")
    assert read_jsonl(p, "metrics", skip_torn_last=True) == [{"step": 1}, {"step": 2}]
    p.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # a bad line in the middle is not torn
    with pytest.raises(ShardwiseFileError, match=":2: not valid JSON"):
        read_jsonl(p, "metrics", skip_torn_last=True)


def test_not_utf8(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ShardwiseFileError, match=r"not UTF-8 \(byte offset 7\)"):
        read_json(p, "meta.json")


def test_jsonl_numbered_streams_and_names_a_bad_line_by_path_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\r\n')
    assert read_jsonl(p, "--data", numbered=True) == [(1, {"a": 1}), (3, {"a": 2})]
    it = iter_jsonl(p, "--data")
    assert next(it) == (1, {"a": 1})  # a generator: one line at a time
    p.write_text('{"a": 1}\n{"a": }\n')
    with pytest.raises(ShardwiseFileError) as e:
        read_jsonl(p, "--data", "write one object per line")
    # the column within the line, not the parser's "line 1" of that one line
    assert str(e.value) == (f"--data {p}:2: not valid JSON (Expecting value at column 7): "
                            "write one object per line")
    with pytest.raises(ShardwiseFileError, match=rf"^{p}: line 2 is bad \(Expecting value"):
        list(iter_jsonl(p, "--data", bad_line=lambda no, err: f"{p}: line {no} is bad ({err})"))


def test_jsonl_not_utf8_names_the_byte_offset_in_the_file(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    with pytest.raises(ShardwiseFileError, match=r"not UTF-8 \(byte offset 16\)"):
        read_jsonl(p, "--data")


class _OwnError(ValueError):
    pass


def test_error_class_and_a_fix_per_problem(tmp_path):
    fix = {"missing": "the save did not finish", "syntax": "the file is corrupt"}
    p = tmp_path / "meta.json"
    with pytest.raises(_OwnError, match=r"meta.json: no such file: the save did not finish$"):
        read_json(p, "checkpoint", fix, error=_OwnError)
    p.write_text("{")
    with pytest.raises(_OwnError, match=r"meta.json: not valid JSON \(.*\): the file is corrupt$"):
        read_json(p, "checkpoint", fix, error=_OwnError)
    p.write_bytes(b'"\xff"')  # a problem without a key: no fix
    with pytest.raises(_OwnError, match=r"not UTF-8 \(byte offset 1\)$"):
        read_json(p, "checkpoint", fix, error=_OwnError)
    with pytest.raises(_OwnError, match=r"l.jsonl:1: not valid JSON"):
        (tmp_path / "l.jsonl").write_text("{\n")
        read_jsonl(tmp_path / "l.jsonl", "metrics", error=_OwnError)
    with pytest.raises(_OwnError, match="no such file"):
        read_toml(tmp_path / "none.toml", "--config", error=_OwnError)
