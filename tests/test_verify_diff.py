"""benchmarks/verify_diff.py, the before/after check of a behaviour-preserving refactor, on
hand-made reports: equal reports give no difference; a changed loss, changed bytes, a failed
case, a missing case and a renamed tag are each reported; an accepted rename is not."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import verify_diff  # noqa: E402


def case(layout="dp=2", losses=(5.0, 4.5), bytes_per_tag=None, ok=True):
    return {"layout": layout, "engine": "explicit", "model": "llama", "pass": ok,
            "losses": list(losses),
            "bytes_per_tag": bytes_per_tag or {"grad all_reduce dp": 1000.0,
                                               "loss all_reduce dp": 16.0}}


def run(tmp_path, before, after, *flags):
    for name, cases in (("b.json", before), ("a.json", after)):
        (tmp_path / name).write_text(json.dumps({"cases": cases}))
    return verify_diff.main([str(tmp_path / "b.json"), str(tmp_path / "a.json"), *flags])


def test_equal_reports_have_no_difference(tmp_path, capsys):
    assert run(tmp_path, [case()], [case()]) == 0
    assert "1 cases, 0 difference(s)" in capsys.readouterr().out


def test_each_kind_of_difference_is_reported(tmp_path, capsys):
    before = [case(), case("tp=2"), case("pp=2")]
    after = [case(losses=(5.0, 4.5000005)),
             case("tp=2", bytes_per_tag={"grad all_reduce dp": 1024.0,
                                         "loss all_reduce dp": 16.0}, ok=False)]
    assert run(tmp_path, before, after) == 1
    out = capsys.readouterr().out
    assert "dp=2 explicit llama: step 1 loss 4.5 → 4.5000005" in out
    assert "tp=2 explicit llama: pass True → False" in out
    assert "grad all_reduce dp: 1,000 B → 1,024 B" in out
    assert "pp=2 explicit llama: only in the before report" in out
    assert run(tmp_path, before[:1], after[:1], "--rtol", "1e-6") == 0  # within rtol


def test_a_renamed_tag_is_named_and_accepted_only_when_asked(tmp_path, capsys):
    renamed = case(bytes_per_tag={"grad all_reduce dp": 1000.0, "loss_sum all_reduce dp": 16.0})
    assert run(tmp_path, [case()], [renamed]) == 1
    assert "renamed to loss_sum all_reduce dp?" in capsys.readouterr().out
    assert run(tmp_path, [case()], [renamed], "--renames", "loss=loss_sum") == 0


def test_a_rename_on_one_axis_and_a_retag(tmp_path, capsys):
    before = case(bytes_per_tag={"grad all_reduce dp": 1000.0, "grad all_reduce tp": 64.0,
                                 "tp_fwd all_reduce tp": 500.0})
    after = case(bytes_per_tag={"grad all_reduce dp": 1000.0, "sp_grad all_reduce tp": 64.0,
                                "tp_fwd all_reduce tp": 400.0, "ce all_reduce tp": 100.0})
    key_rename = ["--renames", "grad all_reduce tp=sp_grad all_reduce tp"]
    assert run(tmp_path, [before], [after], *key_rename) == 1  # the split is still reported
    out = capsys.readouterr().out
    assert "retag: tp_fwd all_reduce tp: 500 B → 400 B" in out and "grad all_reduce dp" not in out
    assert run(tmp_path, [before], [after], *key_rename, "--allow-retag") == 0
    assert "accepted retags: 2" in capsys.readouterr().out
    moved = case(bytes_per_tag={"grad all_reduce dp": 1000.0, "grad all_reduce tp": 64.0,
                                "tp_fwd all_reduce tp": 501.0})  # the total changed: not a retag
    assert run(tmp_path, [before], [moved], "--allow-retag") == 1
