"""The report of a real run, opened in headless Chromium (Debian's ``chromium``, driven by
Playwright from PyPI with ``executable_path``: Playwright's own browser download is not needed).

Checks: no console errors; every section present and filled; each chart draws exactly the
points it claims (``polyline.points.numberOfItems`` = ``data-points`` = the values logged);
the pipeline timeline draws every recorded action; the sortable table sorts; the comparison
with a copy of the run whose loss is bent by 1e-3 at step k marks step k (the mark's line
stands on the k-th point of the |Δloss| curve). A PNG screenshot goes to the test's temp
folder.

Under ``CI=true`` a missing browser or driver fails the test (``make install`` installs
both); elsewhere it skips, naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import run_cli
from shardwise.report.compare import COMPARE_SECTIONS
from shardwise.report.html import RUN_SECTIONS

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
K = 3  # the step whose loss the perturbed copy bends


def _missing(what: str):
    msg = (f"{what} (make install puts it in place: apt-get install chromium; "
           "pip install -e .[browser])")
    if CI:
        pytest.fail(f"CI=true but {msg}")
    pytest.skip(msg)


def chromium() -> str:
    for name in (os.environ.get("SHARDWISE_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    _missing("no Chromium found (chromium, chromium-browser, google-chrome or "
             "$SHARDWISE_CHROMIUM)")


@pytest.fixture(scope="module")
def browser():
    exe = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the Playwright Python package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, cache_dir):
    """A real 2-rank pipeline run (tiny model, 4 steps: the timeline, checkpoints, a sample);
    the byte tokenizer and 8 validation sequences (not the defaults' BPE and 64) keep it short:
    what the report draws does not depend on them."""
    out = tmp_path_factory.mktemp("report-run") / "run"
    p = run_cli(["train", "--model", "tiny", "--dp", "1", "--tp", "1", "--pp", "2",
                 "--tokenizer", "bytes", "--eval-sequences", "8",
                 "--steps", "4", "--eval-every", "2", "--save-every", "2",
                 "--sample-tokens", "24", "--out", out], cache_dir)
    assert p.returncode == 0, p.stdout
    assert (out / "report.html").is_file(), "train did not write RUN/report.html"
    return out


def open_page(browser, path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    return page, errors


POLYLINES = """() => Array.from(document.querySelectorAll('svg[data-chart] polyline')).map(
  e => [e.closest('svg').dataset.chart, e.dataset.series, +e.dataset.points,
        e.points.numberOfItems])"""


def test_run_report_in_chromium(browser, real_run, tmp_path):
    metrics = [json.loads(x) for x in (real_run / "metrics.jsonl").read_text().splitlines()]
    extra = json.loads((real_run / "report_data.json").read_text())
    page, errors = open_page(browser, real_run / "report.html")
    ids = page.eval_on_selector_all("section", "s => s.map(e => e.id)")
    assert ids == list(RUN_SECTIONS)
    # every section filled: a chart, a table or text, and no "could not draw"
    for sid in ids:
        filled = page.eval_on_selector(
            f"#{sid}", "s => s.querySelectorAll('svg, table, pre, li').length > 0 || "
                       "s.innerText.length > 40")
        assert filled, f"section {sid} is empty"
        assert "Could not draw" not in page.inner_text(f"#{sid}")
    lines = {(c, s): (n, m) for c, s, n, m in page.evaluate(POLYLINES)}
    for (chart, series), (claimed, drawn) in lines.items():
        assert claimed == drawn, f"{chart}/{series}: data-points {claimed}, drawn {drawn}"
    n_loss = sum(1 for r in metrics if "loss" in r)
    n_val = sum(1 for r in metrics if "val_loss" in r)
    assert n_loss == 4 and n_val == 3  # steps 0, 2, 4
    assert lines["chart-loss", "train loss"] == (n_loss, n_loss)
    assert lines["chart-loss", "validation loss"] == (n_val, n_val)
    assert lines["chart-tokens", "tokens/s"][1] == n_loss
    assert lines["chart-traffic", "pp axis"][1] == n_loss
    # the timeline: one box per recorded action of the warm step; the mesh: one box per rank
    n_events = len(extra["timeline"]["events"])
    assert n_events > 0
    assert page.eval_on_selector_all("#chart-timeline rect.ev", "e => e.length") == n_events
    assert page.eval_on_selector_all("#mesh g.rank", "e => e.length") == 2
    # the step-1 collective table sorts by a numeric column when its header is clicked
    col = page.eval_on_selector_all("#collective-table th", "h => h.map(x => x.textContent)")
    i = col.index("booked bytes")
    page.click(f"#collective-table th:nth-child({i + 1})")
    got = page.eval_on_selector_all(
        f"#collective-table tbody tr td:nth-child({i + 1})", "c => c.map(x => +x.dataset.v)")
    assert len(got) == len(extra["first_step"]["records"]) > 0
    assert got == sorted(got)
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert errors == []
    page.close()


def test_comparison_marks_the_perturbed_step_in_chromium(browser, real_run, tmp_path):
    from shardwise.tools.report import build

    bent = tmp_path / "bent"
    shutil.copytree(real_run, bent, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    rows = [json.loads(x) for x in (bent / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] == K and "loss" in r:
            r["loss"] += 1e-3
    (bent / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    same = tmp_path / "same"
    shutil.copytree(real_run, same, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    out = build([str(real_run), str(same), str(bent)], out=str(tmp_path / "compare.html"))
    page, errors = open_page(browser, out)
    assert page.eval_on_selector_all("section", "s => s.map(e => e.id)") == list(
        COMPARE_SECTIONS)
    verdicts = page.eval_on_selector_all(
        ".verdict", "v => v.map(e => [e.dataset.run, e.dataset.equal, e.dataset.firstStep])")
    assert verdicts == [["1", "true", None], ["2", "false", str(K)]]
    assert "equal within 1e-05" in page.inner_text(".verdict[data-run='1']")
    # the mark on the |Δloss| chart stands on the K-th point of run 2's curve
    mark_x = page.eval_on_selector("#chart-delta g.first-divergence",
                                   "g => [g.dataset.step, g.querySelector('line').x1.baseVal"
                                   ".value]")
    assert mark_x[0] == str(K)
    point_x = page.eval_on_selector(
        "#chart-delta polyline[data-series='|Δloss| run 2 − run 0']",
        f"p => p.points.getItem({K - 1}).x")
    assert mark_x[1] == pytest.approx(point_x, abs=0.2)
    row = page.eval_on_selector("#delta-table-2 tr.first-divergence td", "t => t.textContent")
    assert row == str(K)
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
    assert errors == []
    page.close()
