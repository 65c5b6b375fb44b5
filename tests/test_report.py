"""``shardwise report`` without a browser: the page parses, every section is there, each chart
draws one point per logged value, the |Δloss| comparison finds the first step over 1e-5, the
warnings, the verify matrix, and the report a crashing run leaves. The browser test is
tests/test_report_browser.py."""

import json
import math
from html.parser import HTMLParser

import pytest

from shardwise.report import data as rd
from shardwise.tools.report import build, train_with_report
from shardwise.report.compare import COMPARE_SECTIONS
from shardwise.report.html import RUN_SECTIONS

from conftest import ROOT


class Page(HTMLParser):
    """Collects section ids, each chart's polylines (series → data-points and the number of
    coordinate pairs in ``points``) and elements by class."""

    def __init__(self):
        super().__init__()
        self.sections, self.lines, self.classes, self.stack = [], {}, {}, []
        self.chart = None
        self.scripts = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a["id"])
        if tag == "svg":
            self.chart = a.get("data-chart")
        if tag == "polyline":
            pairs = len(a["points"].split()) if a["points"] else 0
            self.lines.setdefault(self.chart, {})[a["data-series"]] = (int(a["data-points"]),
                                                                     pairs)
        for c in (a.get("class") or "").split():
            self.classes.setdefault(c, []).append((tag, a))
        if tag == "script":
            self.scripts.append(a)


def parse(path):
    p = Page()
    p.feed(path.read_text())
    return p


def make_run(folder, losses, *, grad_clip=1.0, grad_norms=None, val=None, config=None):
    """A hand-made run folder: metrics.jsonl (steps 1…n) and config.toml."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "val_loss": (val or {}).get(0, losses[0])}]
    for i, loss in enumerate(losses, start=1):
        rec = {"step": i, "loss": loss, "lr": 1e-3, "tokens": 64 * i,
               "grad_norm": (grad_norms or {}).get(i, 0.5), "tokens_per_s": 1000.0 + i,
               "step_time_s": 0.1, "mfu": 0.01, "comm_bytes": 300.0, "comm_dp_bytes": 100.0,
               "comm_tp_bytes": 200.0, "mem_params_bytes": 10, "mem_grads_bytes": 10,
               "mem_optimizer_bytes": 20}
        if val and i in val:
            rec["val_loss"] = val[i]
        rows.append(rec)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": "tiny", "dp": 2, "tp": 1, "pp": 1, "cp": 1, "grad_clip": grad_clip,
           "steps": len(losses), "out": str(folder), **(config or {})}
    (folder / "config.toml").write_text("".join(
        f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
    return folder


def curve(n, seed=0.0):
    return [4.0 - 0.01 * i + 0.001 * math.sin(i + seed) for i in range(1, n + 1)]


def test_loss_delta_finds_the_first_step_over_the_threshold():
    a = [(s, v) for s, v in enumerate(curve(20), start=1)]
    same = rd.loss_delta(a, list(a))
    assert same["equal"] and same["first_over"] is None and same["max"] == 0.0
    # just under the threshold everywhere: still equal; over it from step 7: step 7
    under = [(s, v + 0.9e-5) for s, v in a]
    assert rd.loss_delta(a, under)["equal"]
    over = [(s, v + (2e-5 if s >= 7 else 0.0)) for s, v in a]
    d = rd.loss_delta(a, over)
    assert not d["equal"] and d["first_over"] == 7
    assert d["max"] == pytest.approx(2e-5, rel=1e-6)
    # a NaN in one curve only counts as over; the same NaN in both does not
    nan = [(s, math.nan if s == 3 else v) for s, v in a]
    assert rd.loss_delta(a, nan)["first_over"] == 3
    assert rd.loss_delta(nan, list(nan))["equal"]
    # verify's relative rule: 2e-5 at |loss| ≈ 4 is within 1e-6 + 1e-5·4
    assert d["rel_over"] == []
    assert rd.loss_delta(a, [(s, v + 1e-4) for s, v in a])["rel_over"] == list(range(1, 21))
    from shardwise import parity

    assert (rd.RTOL, rd.ATOL) == (parity.RTOL, parity.ATOL)
    # only the steps both logged are compared
    short = rd.loss_delta(a, a[:10])
    assert short["common"] == 10 and short["only_a"] == list(range(11, 21))


def test_warnings_name_clipped_and_nonfinite_steps(tmp_path):
    run = make_run(tmp_path / "r", curve(6) + [math.nan], grad_clip=1.0,
                   grad_norms={2: 1.5, 5: 3.0})
    ws = {w["kind"]: w for w in rd.warnings(rd.load_run(run))}
    assert ws["clipped"]["steps"] == [2, 5]
    assert ws["nonfinite"]["steps"] == [7]


def test_one_run_page_has_every_section_and_one_point_per_logged_step(tmp_path):
    n = 13
    run = make_run(tmp_path / "r", curve(n), val={5: 3.9, 10: 3.8, 13: 3.7})
    # a torn last line, as a crash can leave, is skipped
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 14, "lo')
    out = build([str(run)])
    assert out == run / "report.html"
    p = parse(out)
    assert p.sections == list(RUN_SECTIONS)
    assert p.lines["chart-loss"]["train loss"] == (n, n)
    assert p.lines["chart-loss"]["validation loss"] == (4, 4)  # steps 0, 5, 10, 13
    assert p.lines["chart-tokens"]["tokens/s"] == (n, n)
    assert set(p.lines["chart-traffic"]) == {"dp axis", "tp axis"}
    assert all(v == (n, n) for v in p.lines["chart-traffic"].values())
    # nothing is fetched: no src/href pointing off the page
    text = out.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and not any("src" in s for s in p.scripts)


def test_comparison_marks_the_first_diverging_step(tmp_path):
    a = make_run(tmp_path / "a", curve(30))
    same = make_run(tmp_path / "same", curve(30), config={"dp": 1, "tp": 2})
    k = 17
    bent = curve(30)
    bent[k - 1] += 1e-3  # step k only
    b = make_run(tmp_path / "b", bent, config={"dp": 1, "pp": 2})
    p = parse(build([str(a), str(same), str(b)], out=str(tmp_path / "cmp.html")))
    assert p.sections == list(COMPARE_SECTIONS)
    verdicts = {dict(a_)["data-run"]: dict(a_) for _, a_ in p.classes["verdict"]}
    assert verdicts["1"]["data-equal"] == "true"
    assert verdicts["2"]["data-equal"] == "false" and verdicts["2"]["data-first-step"] == str(k)
    marks = [a_["data-step"] for tag, a_ in p.classes["first-divergence"] if tag == "g"]
    assert marks and set(marks) == {str(k)}
    rows = [a_ for tag, a_ in p.classes["first-divergence"] if tag == "tr"]
    assert len(rows) == 1
    # the config diff names the keys that differ
    text = (tmp_path / "cmp.html").read_text()
    assert "equal within 1e-05 at every one of the 30 steps" in text


def test_verify_json_renders_as_a_matrix_with_one_cell_per_case(tmp_path):
    src = ROOT / "benchmarks" / "baselines" / "verify_n4.json"
    cases = json.loads(src.read_text())["cases"]
    p = parse(build([str(src)], out=str(tmp_path / "v.html")))
    assert p.sections == ["verify"]
    cells = [a for tag, a in p.classes["heat"] if tag == "td" and "data-v" in a]
    assert len(cells) == len(cases)
    worst = max(max(c[k] for k in ("max_loss_diff", "max_grad_diff", "max_grad_norm_diff"))
                for c in cases)
    assert max(float(a["data-v"]) for a in cells) == pytest.approx(worst)
    # a failed case is marked, and the page says how many failed
    v = json.loads(src.read_text())
    v["cases"][5]["pass"] = False
    (tmp_path / "bad.json").write_text(json.dumps(v))
    text = build([str(tmp_path / "bad.json")], out=str(tmp_path / "bad.html")).read_text()
    assert text.count(" ✗</td>") == 1 and "1 fail" in text and "all pass" not in text


def test_report_rejects_a_path_that_is_neither_a_run_nor_verify_json(tmp_path):
    from shardwise.errors import ShardwiseConfigError

    with pytest.raises(ShardwiseConfigError, match="no such run folder"):
        build([str(tmp_path / "nope")])
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ShardwiseConfigError, match="cases"):
        build([str(tmp_path / "x.json")])


def test_a_crashing_run_writes_its_report_and_keeps_its_error(tmp_path, monkeypatch):
    import dataclasses

    import shardwise.train.loop as loop
    from shardwise.config import TrainConfig

    class Boom(RuntimeError):
        pass

    from pathlib import Path

    from shardwise.report import record

    def crash(cfg):  # a run that recorded its start (as RunRecorder.start does), then failed
        make_run_folder = dataclasses.asdict(cfg)["out"]
        make_run(tmp_path / "tmp", curve(4))
        import shutil

        shutil.copytree(tmp_path / "tmp", make_run_folder, dirs_exist_ok=True)
        record._started.add(str(Path(make_run_folder).resolve()))
        raise Boom("step 5 went wrong")

    # refused before it started (e.g. a busy folder): the folder is left untouched
    busy = make_run(tmp_path / "busy", curve(3))
    monkeypatch.setattr(loop, "train", lambda cfg: (_ for _ in ()).throw(Boom("busy")))
    with pytest.raises(Boom, match="busy"):
        train_with_report(TrainConfig(out=str(busy)))
    assert not (busy / "report.html").exists()

    monkeypatch.setattr(loop, "train", crash)
    out = tmp_path / "run"
    with pytest.raises(Boom, match="step 5 went wrong"):
        train_with_report(TrainConfig(out=str(out)))
    p = parse(out / "report.html")
    assert p.sections == list(RUN_SECTIONS) and p.lines["chart-loss"]["train loss"] == (4, 4)

    # a report that cannot be written does not replace the run's own error
    def crash_unwritable(cfg):
        raise Boom("the original error")

    monkeypatch.setattr(loop, "train", crash_unwritable)
    monkeypatch.setattr("shardwise.tools.report.build", lambda *a, **k: 1 / 0)
    (tmp_path / "run2").mkdir()
    record._started.add(str((tmp_path / "run2").resolve()))
    with pytest.raises(Boom, match="the original error"):
        train_with_report(TrainConfig(out=str(tmp_path / "run2")))


Q = ["train", "--model", "tiny", "--tokenizer", "bytes", "--seq-len", "16", "--global-batch",
     "4", "--micro-batch", "2", "--eval-sequences", "4", "--eval-every", "100",
     "--sample-tokens", "4", "--timeout", "60", "--steps", "4", "--save-every", "2"]


@pytest.mark.timeout(300)
def test_a_killed_run_leaves_a_report_and_its_resume_under_another_layout_is_shown(
        tmp_path, cache_dir):
    from conftest import run_cli

    out = tmp_path / "run"
    # every rank SIGKILLs itself after step 2's checkpoint: rank 0 cannot write the report,
    # the launcher writes what the folder holds
    r = run_cli([*Q, "--dp", "2", "--out", out], cache_dir,
                env={"SHARDWISE_TEST_KILL_AT_STEP": "2"})
    assert r.returncode != 0 and "SIGKILL rank 0" in r.stdout, r.stdout[-3000:]
    p = parse(out / "report.html")
    assert p.sections == list(RUN_SECTIONS)
    assert p.lines["chart-loss"]["train loss"] == (2, 2)
    # resumed on a tp=2 layout: the report names where, and both layouts
    r = run_cli([*Q, "--dp", "1", "--tp", "2", "--resume", "auto", "--out", out], cache_dir)
    assert r.returncode == 0, r.stdout[-3000:]
    run = rd.load_run(out)
    invs = run["extra"]["invocations"]
    assert [i["start_step"] for i in invs] == [0, 2]
    assert invs[1]["resumed_from"].endswith("step_2")
    assert invs[1]["resumed_layout"].startswith("pp=1 × dp=2 × tp=1")
    assert invs[1]["layout"].startswith("pp=1 × dp=1 × tp=2")
    p = parse(out / "report.html")
    assert p.lines["chart-loss"]["train loss"] == (4, 4)
    text = (out / "report.html").read_text()
    assert "Resumes" in text and "resumed at step 2" in text
