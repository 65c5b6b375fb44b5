"""The report page: one self-contained HTML file (inline CSS, inline SVG, a few lines of inline
JavaScript that sort tables; nothing fetched from the network).

:func:`run_page` — one run, one ``<section id=…>`` per topic (:data:`RUN_SECTIONS`);
:func:`compare_page` — two or more runs (:data:`COMPARE_SECTIONS`): the curves overlaid, the
config diff, the per-step |Δloss| against the first run with the first step over 1e-5 marked
(``class="first-divergence" data-step``), traffic and memory side by side;
:func:`verify_section` — ``shardwise verify --json`` output as the parity matrix.
"""

from __future__ import annotations

import json
import math
from html import escape

from . import data as rd
from .svg import PALETTE, bar_chart, heat_colour, line_chart, mesh_chart, timeline_chart

RUN_SECTIONS = ("command", "layout", "loss", "throughput", "traffic", "memory", "collectives",
                "pipeline", "checkpoints", "sample", "warnings")
COMPARE_SECTIONS = ("runs", "compare-loss", "delta", "config-diff", "compare-throughput",
                    "compare-traffic", "compare-memory")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;
background:#fafafa}
header{background:#263238;color:#eceff1;padding:14px 24px}
header h1{margin:0;font-size:20px} header p{margin:4px 0 0;color:#b0bec5}
nav{padding:6px 24px;background:#eceff1;font-size:13px} nav a{margin-right:12px;color:#37474f}
main{padding:8px 24px 40px;max-width:1200px}
section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;margin:14px 0;padding:10px 16px}
h2{font-size:16px;margin:4px 0 8px} h3{font-size:14px;margin:10px 0 4px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #e0e0e0;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f5f5f5} td.n{text-align:right;font-variant-numeric:tabular-nums}
table.sortable th{cursor:pointer;user-select:none} table.sortable th:after{content:" \\2195";
color:#aaa}
code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}
pre{background:#f5f5f5;padding:8px;white-space:pre-wrap;word-break:break-all;max-height:320px;
overflow:auto}
.ok{color:#1b5e20;font-weight:600} .bad{color:#b71c1c;font-weight:600} .muted{color:#757575}
.charts{display:flex;flex-wrap:wrap;gap:8px}
svg .plot{fill:#fff;stroke:#bbb} svg .grid{stroke:#eee} svg .tick{font-size:10px;fill:#555}
svg .axis{font-size:11px;fill:#333} svg .legend{font-size:11px;fill:#333}
svg .ctitle{font-size:12px;font-weight:600} svg .marklabel{font-size:11px;fill:#C44E52}
svg .panel{fill:#fcfcfc;stroke:#ccc} svg .rlabel{font-size:11px;font-weight:600}
svg .evlabel{font-size:9px;fill:#fff} svg .empty{font-size:13px;fill:#999}
tr.over td{background:#ffebee} tr.first-divergence td{background:#ffcdd2;font-weight:600}
td.heat{min-width:70px;text-align:right}
"""

# click a header: sort by that column (numbers by data-v, else text); click again: reverse
JS = """
document.querySelectorAll('table.sortable').forEach(function(t){
 t.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
  var b=t.tBodies[0],rows=Array.from(b.rows),d=th.dataset.dir==='asc'?-1:1;
  rows.sort(function(x,y){var a=x.cells[i],c=y.cells[i];
   var u=a.dataset.v,w=c.dataset.v;
   if(u!==undefined&&w!==undefined){return d*(parseFloat(u)-parseFloat(w));}
   return d*a.textContent.localeCompare(c.textContent);});
  rows.forEach(function(r){b.appendChild(r);});th.dataset.dir=d===1?'asc':'desc';});});});
"""


def _b(v) -> str:
    """Bytes, grouped."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:,.0f}"


def _r(a, f) -> str:
    return f"{a / f:.4f}" if a is not None and f else "—"


def _td(v, text: str | None = None) -> str:
    """A numeric cell (sortable by its value)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return f'<td class="n" data-v="{v}">{escape(text if text is not None else str(v))}</td>'
    return f'<td class="n" data-v="-1e300">{escape(text if text is not None else "—")}</td>'


def table(head: list[str], rows: list[list[str]], *, sortable: bool = False, cls: str = "",
          row_cls: list[str] | None = None, tid: str = "") -> str:
    """A table; cells in ``rows`` are HTML already (``<td>…</td>``) or plain text."""
    c = " ".join(x for x in ("sortable" if sortable else "", cls) if x)
    out = [f'<table{f" id={chr(34)}{tid}{chr(34)}" if tid else ""}'
           f'{f" class={chr(34)}{c}{chr(34)}" if c else ""}><thead><tr>'
           + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, r in enumerate(rows):
        rc = row_cls[i] if row_cls and row_cls[i] else ""
        cells = "".join(x if x.startswith("<td") else f"<td>{escape(x)}</td>" for x in r)
        out.append(f'<tr{f" class={chr(34)}{rc}{chr(34)}" if rc else ""}>{cells}</tr>')
    out.append("</tbody></table>")
    return "".join(out)


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{escape(sid)}"><h2>{escape(title)}</h2>{body}</section>'


def page(title: str, subtitle: str, sections: list[tuple[str, str, str]]) -> str:
    """The whole document: header, a table of contents, the sections, the sorting script."""
    nav = "".join(f'<a href="#{escape(s)}">{escape(t)}</a>' for s, t, _ in sections)
    body = "".join(section(*s) for s in sections)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p></header>"
            f"<nav>{nav}</nav><main>{body}</main><script>{JS}</script></body></html>")


# -- one run ----------------------------------------------------------------------------------
def _layout_name(run: dict) -> str:
    inv = (run["extra"].get("invocations") or [{}])[-1]
    if inv.get("layout"):
        return inv["layout"]
    c = run["config"]
    if not c:
        return "layout unknown"
    return f"pp={c.get('pp', 1)} × dp={c.get('dp', 1)} × tp={c.get('tp', 1)}" + (
        f" × cp={c['cp']}" if c.get("cp", 1) > 1 else "")


def _label(run: dict) -> str:
    return f"{run['name']} ({_layout_name(run)})"


def command_section(run: dict) -> str:
    invs = run["extra"].get("invocations") or []
    parts = []
    if invs:
        for i, inv in enumerate(invs):
            what = ("fresh start" if not inv.get("resumed_from") else
                    f"resumed at step {inv.get('start_step')} from {inv['resumed_from']}")
            parts.append(f"<p>{'Invocation ' + str(i + 1) + ': ' if len(invs) > 1 else ''}"
                         f"{escape(what)}, {escape(inv.get('started', ''))}</p>"
                         f"<pre class=\"cmd\">{escape(inv.get('command', ''))}</pre>")
    else:
        parts.append('<p class="muted">The command was not recorded (a run from before '
                     'report_data.json).</p>')
    cfg = run["config"]
    if cfg:
        rows = [[k, _fmt_val(v)] for k, v in cfg.items()]
        parts.append("<details><summary>Effective config (config.toml, "
                     f"{len(rows)} keys)</summary>" + table(["key", "value"], rows,
                                                            sortable=True) + "</details>")
    else:
        parts.append('<p class="muted">No config.toml in the run folder.</p>')
    s = run["summary"]
    if s:
        parts.append("<details><summary>summary.json</summary>" + table(
            ["summary", "value"], [[k, _fmt_val(v)] for k, v in s.items()]) + "</details>")
    return "".join(parts)


def _sentence(text: str | None) -> str:
    """``text`` with a capital first letter and a full stop ("" for None)."""
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def _fmt_val(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def layout_section(run: dict) -> str:
    mesh = run["extra"].get("mesh")
    if not mesh:
        c = run["config"]
        if not c:
            return '<p class="muted">No layout recorded.</p>'
        from .record import mesh_groups

        mesh = mesh_groups(c.get("pp", 1), c.get("dp", 1), c.get("cp", 1), c.get("tp", 1))
    parts = [f"<p>{escape(_layout_name(run))}; rank r = ((pp·dp + dp)·cp + cp)·tp + tp, tp "
             "innermost.</p>",
             mesh_chart("mesh", mesh, run["extra"].get("stages"))]
    rows = []
    what = {"pp": "pipeline neighbours: activations forward, gradients back",
            "dp": "gradient sync (all-reduce; ZeRO: reduce-scatter + all-gather)",
            "tp": "Megatron f/g all-reduces of activations (SP: all-gather/reduce-scatter)",
            "cp": "ring attention: K/V blocks and dK/dV"}
    for axis, lines in mesh.get("groups", {}).items():
        rows.append([axis, " ".join("{" + ",".join(map(str, g)) + "}" for g in lines),
                     what.get(axis, "")])
    if rows:
        parts.append(table(["axis", "groups (global ranks)", "what travels"], rows))
    else:
        parts.append("<p>One rank: no groups.</p>")
    if mesh.get("lines"):
        parts.append("<details><summary>As the training log printed it</summary><pre>"
                     + escape("\n".join(mesh["lines"])) + "</pre></details>")
    return "".join(parts)


def loss_section(run: dict) -> str:
    loss, val = rd.series(run, "loss"), rd.series(run, "val_loss")
    s = [{"name": "train loss", "points": loss}]
    if val:
        s.append({"name": "validation loss", "points": val, "markers": True})
    body = line_chart("chart-loss", s, ylabel="cross-entropy (nats/token)")
    if loss:
        body += (f"<p>{len(loss)} steps logged; loss {loss[0][1]:.4f} (step {loss[0][0]}) → "
                 f"{loss[-1][1]:.4f} (step {loss[-1][0]})"
                 + (f"; validation {val[0][1]:.4f} → {val[-1][1]:.4f}" if val else "")
                 + ".</p>")
    return body


def throughput_section(run: dict) -> str:
    tok, st, mfu = (rd.series(run, k) for k in ("tokens_per_s", "step_time_s", "mfu"))
    charts = [line_chart("chart-tokens", [{"name": "tokens/s", "points": tok}],
                         ylabel="tokens / s", width=380, height=220),
              line_chart("chart-steptime", [{"name": "step time", "points":
                                             [(x, y * 1e3) for x, y in st]}],
                         ylabel="ms", width=380, height=220),
              line_chart("chart-mfu", [{"name": "MFU", "points":
                                        [(x, y * 100) for x, y in mfu]}],
                         ylabel="% of peak", width=380, height=220)]
    body = '<div class="charts">' + "".join(charts) + "</div>"
    s = run["summary"]
    if s and s.get("median_step_s"):
        body += (f"<p>Median step {s['median_step_s'] * 1e3:,.1f} ms, "
                 f"{s.get('tokens_per_s') or 0:,.0f} tokens/s, {s.get('tflops') or 0:.4f} "
                 f"TFLOP/s = MFU {(s.get('mfu') or 0):.2%} of {s.get('peak_tflops', 0):.3f} "
                 "TFLOP/s peak (flops.py: 6·N + 12·L·d·s per token). The first step includes "
                 "warm-up.</p>")
    return body


def traffic_section(run: dict) -> str:
    rows = [r for r in run["metrics"] if "loss" in r]
    axes = sorted({k[5:-6] for r in rows for k in r if k.startswith("comm_")
                   and k.endswith("_bytes") and k != "comm_bytes"})
    series = [{"name": f"{a} axis", "points": rd.series(run, f"comm_{a}_bytes")} for a in axes]
    if not series:
        series = [{"name": "all axes", "points": rd.series(run, "comm_bytes")}]
    body = line_chart("chart-traffic", series, ylabel="bytes sent by rank 0 per step")
    at = rd.axis_traffic(run)
    if at:
        body += "<h3>Step 1 per axis: ledger next to the formula (rank 0)</h3>" + table(
            ["axis", "ledger bytes", "formula bytes", "ledger / formula"],
            [[a["axis"], _td(a["ledger"], _b(a["ledger"])), _td(a["formula"], _b(a["formula"])),
              _td(a["ratio"], f"{a['ratio']:.4f}" if a["ratio"] else "—")] for a in at])
    first = run["extra"].get("first_step") or {}
    per = first.get("per_rank")
    if per:
        worst = max((abs(p["ledger_bytes"] / p["formula_bytes"] - 1) for p in per
                     if p["formula_bytes"]), default=None)
        body += ("<h3>Every rank, step 1</h3>" + table(
            ["rank", "ledger bytes", "formula bytes", "ratio"],
            [[_td(p["rank"]), _td(p["ledger_bytes"], _b(p["ledger_bytes"])),
              _td(p["formula_bytes"], _b(p["formula_bytes"])),
              _td((p["ledger_bytes"] / p["formula_bytes"]) if p["formula_bytes"] else None,
                  _r(p["ledger_bytes"], p["formula_bytes"]))] for p in per], sortable=True)
            + (f"<p>All {len(per)} ranks: ledger / formula within {worst:.2e} of 1.</p>"
               if worst is not None else ""))
    elif run["ledger"]:
        led = run["ledger"]
        body += (f"<p>ledger.json: {_b(led.get('measured_total'))} B measured, formula "
                 f"{_b((led.get('formula') or {}).get('total'))} B, ratio "
                 f"{led.get('ratio') if led.get('ratio') is not None else '—'}.</p>")
    return body


def memory_section(run: dict) -> str:
    first = run["extra"].get("first_step") or {}
    per = first.get("per_rank")
    keys = ("params", "grads", "optimizer")
    if per:
        groups = [f"rank {p['rank']}" for p in per]
        series = []
        for i, k in enumerate(keys):
            series.append({"name": f"{k} measured", "values": [p["mem"].get(k) for p in per],
                           "colour": PALETTE[i]})
            series.append({"name": f"{k} formula", "values": [p["mem_formula"].get(k)
                                                              for p in per],
                           "colour": PALETTE[i] + "80"})
        body = bar_chart("chart-memory", groups, series, ylabel="bytes per rank")
        rows = []
        for p in per:
            tot = sum(v for v in p["mem"].values() if v is not None)
            ftot = (sum(p["mem_formula"].values())
                    if all(v is not None for v in p["mem_formula"].values()) else None)
            rows.append([_td(p["rank"])] + [c for k in keys for c in (
                _td(p["mem"].get(k), _b(p["mem"].get(k))),
                _td(p["mem_formula"].get(k), _b(p["mem_formula"].get(k))))]
                + [_td(tot, _b(tot)), _td(ftot, _b(ftot)),
                   _td(tot / ftot if ftot else None, _r(tot, ftot))])
        body += table(["rank"] + [f"{k} {w}" for k in keys for w in ("measured", "formula")]
                      + ["total", "formula total", "ratio"], rows, sortable=True)
        no_formula = all(v is None for p in per for v in p["mem_formula"].values())
        body += ("<p class=\"muted\">Model state after the optimizer step (fp32 master "
                 "weights, gradients, AdamW m and v); "
                 + ("no closed form is wired for this engine's memory (as <code>shardwise "
                    "trace</code> says): measured only. " if no_formula else
                    "the formula is the engine's (ZeRO paper §3.1: 4Ψ + 4Ψ + 8Ψ, sharded by "
                    "stage); its 8Ψ leaves out AdamW's fp32 step counter per tensor. ")
                 + escape(_sentence(first.get("memory_note"))) + "</p>")
        if first.get("cuda_peak_bytes_rank0"):
            body += (f"<p>CUDA peak allocated on rank 0 (state + activations): "
                     f"{_b(first['cuda_peak_bytes_rank0'])} B.</p>")
        return body
    pts = {k: rd.series(run, f"mem_{k}_bytes") for k in keys}
    if any(pts.values()):
        last = {k: v[-1][1] for k, v in pts.items() if v}
        return (bar_chart("chart-memory", ["rank 0"],
                          [{"name": k, "values": [last.get(k)]} for k in keys])
                + "<p class=\"muted\">Rank 0's measured model state (metrics.jsonl); the run "
                  "has no report_data.json with the formula and the other ranks.</p>")
    return '<p class="muted">No memory recorded.</p>'


def collectives_section(run: dict) -> str:
    first = run["extra"].get("first_step") or {}
    recs = first.get("records")
    if recs:
        rows = [[_td(i), r["op"], r["axis"], _td(r["n"]), r["tag"], r["dtype"],
                 str(r["shape"]), _td(r["size_bytes"], _b(r["size_bytes"])),
                 _td(r["wire_bytes"], f"{r['wire_bytes']:,.1f}"),
                 _td(r["sent_bytes"], _b(r["sent_bytes"])), r["impl"],
                 _td(r["ms"], f"{r['ms']:.2f}")] for i, r in enumerate(recs)]
        return (f"<p>Step {first.get('step', 1)}, rank 0: {len(recs)} collectives "
                "(what <code>shardwise trace</code> prints; click a header to sort). Booked: "
                "the ring formula's bytes; sent: measured under --collectives ring|tree|auto."
                "</p>" + table(["#", "op", "axis", "n", "tag", "dtype", "shape", "S bytes",
                                "booked bytes", "sent bytes", "impl", "ms"], rows,
                               sortable=True, tid="collective-table"))
    led = run["ledger"]
    if led and led.get("collectives"):
        rows = [[r["op"], r["axis"], _td(r["group_size"]), r["tag"], r["dtype"],
                 str(r["shape"]), _td(r["count"]), _td(r["size_bytes"], _b(r["size_bytes"])),
                 _td(r["wire_bytes"], f"{r['wire_bytes']:,.1f}"), r["impl"],
                 _td(r["seconds"] * 1e3, f"{r['seconds'] * 1e3:.2f}")]
                for r in led["collectives"]]
        return ("<p>Step 1, rank 0, grouped (ledger.json).</p>"
                + table(["op", "axis", "n", "tag", "dtype", "shape", "count", "S bytes",
                         "booked bytes", "impl", "ms"], rows, sortable=True,
                        tid="collective-table"))
    return '<p class="muted">No collectives recorded (the run stopped before step 1).</p>'


def pipeline_section(run: dict) -> str:
    tl = run["extra"].get("timeline")
    pp = run["config"].get("pp", 1)
    if tl and tl.get("bubble") is None:
        f = tl.get("formula")
        return (timeline_chart("chart-timeline", tl["events"], tl["p"])
                + f"<p>{escape(str(tl.get('schedule')))}: p = {tl['p']}, m = {tl['m']}. This "
                  "engine exposes only each rank's whole step (STEP), not its actions: no "
                  "bubble to measure; (p − 1)/(m + p − 1) = "
                + (f"{f:.3f}" if f else "—") + ".</p>")
    if tl:
        f = tl.get("formula")
        ratio = f"{tl['bubble'] / f:.2f}" if f else "—"
        vm = f"{tl['v']}·{tl['m']}" if tl.get("v", 1) > 1 else f"{tl['m']}"
        return (timeline_chart("chart-timeline", tl["events"], tl["p"])
                + f"<p>{escape(str(tl.get('schedule')))}: p = {tl['p']}, m = {tl['m']}"
                + (f", v = {tl['v']}" if tl.get("v", 1) > 1 else "")
                + f". Measured bubble <b>{tl['bubble']:.3f}</b> (1 − busy / (p · makespan) "
                  f"of one warm step) next to (p − 1)/({vm} + p − 1) = <b>"
                + (f"{f:.3f}" if f else "—") + f"</b>; ratio {ratio}. On a shared CPU the "
                  "measured bubble also holds the send/receive waits and scheduling noise.</p>")
    if pp > 1:
        return ('<p class="muted">pp > 1 but no timeline was recorded (the run stopped '
                'before its second step, or the engine exposes no action timestamps).</p>')
    return ("<p>pp = 1: no pipeline, so no bubble; (p − 1)/(m + p − 1) = 0.</p>")


def checkpoints_section(run: dict) -> str:
    cks = run["checkpoints"]
    parts = []
    if cks:
        rows = [[c["name"], _td(c["step"]), str(c["layout"]), _td(c["world_size"]),
                 "yes" if c["complete"] else "NO", str(c["finite"]), str(c["optimizer"]),
                 "latest" if c["latest"] else ""] for c in cks]
        parts.append(table(["folder", "step", "layout", "ranks", "complete", "finite",
                            "optimizer saved", ""], rows, sortable=True))
    else:
        parts.append('<p class="muted">No checkpoints in the run folder.</p>')
    resumes = [i for i in run["extra"].get("invocations") or [] if i.get("resumed_from")]
    if resumes:
        parts.append("<h3>Resumes</h3>" + table(
            ["resumed at step", "from", "saved under layout", "resumed under layout"],
            [[_td(i["start_step"]), i["resumed_from"], str(i.get("resumed_layout")),
              i["layout"]] for i in resumes]))
    elif run["extra"].get("invocations"):
        parts.append("<p>Not resumed: one invocation from step 0.</p>")
    return "".join(parts)


def sample_section(run: dict) -> str:
    if run["sample"] is None:
        return '<p class="muted">No sample (sample.txt missing: --sample-tokens 0, or the run ' \
               'did not finish).</p>'
    return f"<pre id=\"sample-text\">{escape(run['sample'])}</pre>"


def warnings_section(run: dict) -> str:
    ws = rd.warnings(run)
    if not ws:
        return '<p class="ok">None: no clipped steps, no non-finite steps, nothing dropped.</p>'
    items = []
    for w in ws:
        steps = w["steps"]
        shown = (": steps " + ", ".join(map(str, steps[:30])) + (" …" if len(steps) > 30
                                                                 else "")) if steps else ""
        items.append(f'<li class="warn-{w["kind"]}">{escape(w["text"] + shown)}</li>')
    return "<ul>" + "".join(items) + "</ul>"


RUN_TITLES = {"command": "Command and effective config", "layout": "Layout",
              "loss": "Loss", "throughput": "Tokens/s, step time, MFU",
              "traffic": "Traffic per axis", "memory": "Memory per rank",
              "collectives": "Step-1 collectives", "pipeline": "Pipeline timeline",
              "checkpoints": "Checkpoints and resumes", "sample": "Sampled text",
              "warnings": "Warnings"}
_RUN_BODY = {"command": command_section, "layout": layout_section, "loss": loss_section,
             "throughput": throughput_section, "traffic": traffic_section,
             "memory": memory_section, "collectives": collectives_section,
             "pipeline": pipeline_section, "checkpoints": checkpoints_section,
             "sample": sample_section, "warnings": warnings_section}


def run_sections(run: dict) -> list[tuple[str, str, str]]:
    """(id, title, body) of each section of one run; a section whose data is broken says so
    rather than failing the page."""
    out = []
    for sid in RUN_SECTIONS:
        try:
            body = _RUN_BODY[sid](run)
        except Exception as e:  # noqa: BLE001 — one unreadable field must not lose the page
            body = f'<p class="bad">Could not draw this section: {escape(repr(e))}</p>'
        out.append((sid, RUN_TITLES[sid], body))
    return out


def run_page(run: dict, verify: list[dict] | None = None) -> str:
    secs = run_sections(run)
    for i, v in enumerate(verify or []):
        secs.append(verify_section(v, sid=f"verify{i or ''}"))
    return page(f"shardwise run {run['name']}", f"{_layout_name(run)} — {run['path']}", secs)


# -- several runs -------------------------------------------------------------------------------
def compare_sections(runs: list[dict], threshold: float = rd.THRESHOLD) -> list[tuple]:
    base = runs[0]
    labels = [_label(r) for r in runs]
    secs = []
    secs.append(("runs", "Runs", table(
        ["#", "run", "layout", "command", "steps logged", "final loss"],
        [[_td(i), r["path"], _layout_name(r),
          ((r["extra"].get("invocations") or [{}])[-1].get("command") or "—"),
          _td(len(rd.series(r, "loss"))),
          _td((rd.series(r, "loss") or [(0, None)])[-1][1],
              f"{(rd.series(r, 'loss') or [(0, float('nan'))])[-1][1]:.6f}")]
         for i, r in enumerate(runs)])))
    deltas = [rd.loss_delta(rd.series(base, "loss"), rd.series(r, "loss"), threshold)
              for r in runs[1:]]
    marks = []
    for i, d in enumerate(deltas):
        if d["first_over"] is not None:
            marks.append({"x": d["first_over"], "cls": "first-divergence",
                          "label": f"run {i + 1}: |Δ| > {threshold:g} from step "
                                   f"{d['first_over']}"})
    s = [{"name": f"{i}: {labels[i]}", "points": rd.series(r, "loss"), "dash": i > 0}
         for i, r in enumerate(runs)]
    s += [{"name": f"{i}: val", "points": rd.series(r, "val_loss"), "markers": True,
           "colour": PALETTE[i % len(PALETTE)]} for i, r in enumerate(runs)
          if rd.series(r, "val_loss")]
    secs.append(("compare-loss", "Loss curves overlaid",
                 line_chart("chart-compare-loss", s, ylabel="cross-entropy (nats/token)",
                            marks=marks)))
    parts = []
    for i, d in enumerate(deltas, start=1):
        who = f"run {i} ({escape(labels[i])}) against run 0 ({escape(labels[0])})"
        if not d["common"]:
            parts.append(f"<p class=\"bad\">{who}: no step in common.</p>")
            continue
        if d["equal"]:
            parts.append(f'<p class="ok verdict" data-run="{i}" data-equal="true">{who}: the '
                         f"loss curves are equal within {threshold:g} at every one of the "
                         f"{d['common']} steps both logged (largest |Δloss| "
                         f"{d['max']:.2e}).</p>")
        else:
            k = d["first_over"]
            dk = d["delta"][d["steps"].index(k)]
            parts.append(f'<p class="bad verdict" data-run="{i}" data-equal="false" '
                         f'data-first-step="{k}">{who}: the curves first differ by more than '
                         f"{threshold:g} at <b>step {k}</b> (|Δloss| = {dk:.3e}); largest "
                         f"|Δloss| {d['max']:.3e} over {d['common']} common steps.</p>")
        ro = d["rel_over"]
        parts.append(f'<p class="rule" data-run="{i}" data-rel-over="{len(ro)}">Against '
                     f"verify's per-step rule |Δ| ≤ {rd.ATOL:g} + {rd.RTOL:g}·|loss|: "
                     + ("within it at every step.</p>" if not ro else
                        f"over it at {len(ro)} of {d['common']} steps (first: step {ro[0]}). "
                        "Over many steps training amplifies the fp32 round-off of two "
                        "summation orders; `shardwise verify` checks a few steps against "
                        "that rule.</p>"))
        if d["only_a"] or d["only_b"]:
            parts.append(f"<p class=\"muted\">Steps only run 0 logged: {len(d['only_a'])}; "
                         f"only run {i}: {len(d['only_b'])}.</p>")
    floor = threshold / 1e4  # |Δ| = 0 drawn at the chart's floor (a log axis has no zero)
    dseries = [{"name": f"|Δloss| run {i} − run 0", "points":
                [(s_, max(v, floor)) for s_, v in zip(d["steps"], d["delta"])]}
               for i, d in enumerate(deltas, start=1)]
    dseries.append({"name": f"threshold {threshold:g}", "colour": "#999", "dash": True,
                    "points": [(min(d["steps"]), threshold) for d in deltas if d["steps"]][:1]
                    + [(max(d["steps"]), threshold) for d in deltas if d["steps"]][:1]})
    parts.append(line_chart("chart-delta", dseries, ylabel="|Δloss| (0 shown at the floor)",
                            log_y=True, marks=marks))
    for i, d in enumerate(deltas, start=1):
        rc = ["first-divergence" if s_ == d["first_over"] else
              ("over" if not v <= threshold else "") for s_, v in zip(d["steps"], d["delta"])]
        parts.append(f"<details{' open' if d['first_over'] is not None else ''}><summary>"
                     f"Per-step |Δloss|, run {i} − run 0</summary>" + table(
                         ["step", "run 0 loss", f"run {i} loss", "|Δloss|"],
                         [[_td(s_), _td(a, f"{a:.8f}"), _td(b, f"{b:.8f}"), _td(v, f"{v:.3e}")]
                          for s_, v, a, b in zip(d["steps"], d["delta"],
                                                 [dict(rd.series(base, "loss"))[x]
                                                  for x in d["steps"]],
                                                 [dict(rd.series(runs[i], "loss"))[x]
                                                  for x in d["steps"]])],
                         sortable=True, row_cls=rc, tid=f"delta-table-{i}") + "</details>")
    secs.append(("delta", f"Per-step |Δloss| (threshold {threshold:g})", "".join(parts)))
    diff = rd.config_diff(runs)
    secs.append(("config-diff", "Config diff", table(
        ["key"] + [f"run {i}" for i in range(len(runs))],
        [[k] + [_fmt_val(v) for v in vals] for k, vals in diff])
        if diff else "<p>The configs are the same (apart from --out).</p>"))
    tp = [{"name": f"{i}: {labels[i]}", "points": rd.series(r, "tokens_per_s")}
          for i, r in enumerate(runs)]
    secs.append(("compare-throughput", "Tokens/s side by side",
                 line_chart("chart-compare-tokens", tp, ylabel="tokens / s")))
    trows = []
    for i, r in enumerate(runs):
        for a in rd.axis_traffic(r):
            trows.append([_td(i), _layout_name(r), a["axis"], _td(a["ledger"], _b(a["ledger"])),
                          _td(a["formula"], _b(a["formula"])),
                          _td(a["ratio"], f"{a['ratio']:.4f}" if a["ratio"] else "—")])
    axes = sorted({a["axis"] for r in runs for a in rd.axis_traffic(r)})
    bars = [{"name": f"run {i}", "values": [next((a["ledger"] for a in rd.axis_traffic(r)
                                                  if a["axis"] == ax), None) for ax in axes]}
            for i, r in enumerate(runs)]
    secs.append(("compare-traffic", "Traffic per axis, step 1, rank 0",
                 bar_chart("chart-compare-traffic", axes, bars, ylabel="bytes")
                 + table(["run", "layout", "axis", "ledger bytes", "formula bytes", "ratio"],
                         trows, sortable=True)))
    mrows = []
    for i, r in enumerate(runs):
        per = (r["extra"].get("first_step") or {}).get("per_rank") or []
        for p in per:
            tot = sum(v for v in p["mem"].values() if v is not None)
            mrows.append([_td(i), _layout_name(r), _td(p["rank"])]
                         + [_td(p["mem"].get(k), _b(p["mem"].get(k)))
                            for k in ("params", "grads", "optimizer")] + [_td(tot, _b(tot))])
    mbars = [{"name": f"run {i}", "values": [
        max((sum(v for v in p["mem"].values() if v is not None)
             for p in (r["extra"].get("first_step") or {}).get("per_rank") or []),
            default=None)]} for i, r in enumerate(runs)]
    secs.append(("compare-memory", "Model-state memory per rank",
                 bar_chart("chart-compare-memory", ["largest rank's model state"], mbars)
                 + table(["run", "layout", "rank", "params", "grads", "optimizer", "total"],
                         mrows, sortable=True)))
    return secs


def compare_page(runs: list[dict], verify: list[dict] | None = None,
                 threshold: float = rd.THRESHOLD) -> str:
    secs = compare_sections(runs, threshold)
    for i, v in enumerate(verify or []):
        secs.append(verify_section(v, sid=f"verify{i or ''}"))
    return page(f"shardwise: {len(runs)} runs compared",
                " vs ".join(_layout_name(r) for r in runs), secs)


# -- verify --------------------------------------------------------------------------------------
def verify_section(v: dict, sid: str = "verify") -> tuple[str, str, str]:
    """``shardwise verify --json`` as a matrix: rows = layouts, columns = model × engine, each
    cell the largest of the case's max loss / grad / grad-norm differences, coloured by that
    error over verify's tolerance (``diff_over_tolerance``, log scale: green ≤ 1 %, red ≥
    100 %; the raw error, green ≤ 1e-9 and red ≥ 1e-4, where a file lacks it), a failed case
    outlined in red."""
    cases = v.get("cases", [])
    cols = sorted({(c.get("model", ""), c.get("engine", "")) for c in cases})
    layouts = list(dict.fromkeys(c["layout"] for c in cases))
    cell = {(c["layout"], c.get("model", ""), c.get("engine", "")): c for c in cases}
    rows = []
    for lay in layouts:
        r = [lay]
        for m, e in cols:
            c = cell.get((lay, m, e))
            if c is None:
                r.append('<td class="heat">·</td>')
                continue
            err = max((c.get(k) or 0.0) for k in ("max_loss_diff", "max_grad_diff",
                                                  "max_grad_norm_diff"))
            ok = c.get("pass", True)
            tip = ", ".join(f"{k} {c[k]:.2e}" for k in ("max_loss_diff", "max_grad_diff",
                                                        "max_grad_norm_diff", "max_param_diff")
                            if isinstance(c.get(k), (int, float)))
            frac = c.get("diff_over_tolerance")  # the error over verify's tolerance
            colour = (heat_colour(frac, lo=1e-2, hi=1.0) if isinstance(frac, (int, float))
                      else heat_colour(err))
            if isinstance(frac, (int, float)):
                tip += f", {frac:.1%} of the tolerance"
            r.append(f'<td class="heat" data-v="{err}" title="{escape(tip)}" '
                     f'style="background:{colour}'
                     f'{"" if ok else ";outline:2px solid #b71c1c"}">{err:.1e}'
                     f'{"" if ok else " ✗"}</td>')
        rows.append(r)
    n_fail = sum(1 for c in cases if not c.get("pass", True))
    head = (f"<p>{len(cases)} cases, {len(layouts)} layouts, {v.get('steps', '?')} steps each; "
            f"rtol {v.get('rtol')}, atol {v.get('atol')}; "
            + ('<span class="ok">all pass</span>' if not n_fail else
               f'<span class="bad">{n_fail} fail</span>')
            + ". Cell: the largest of max |Δloss|, |Δgrad|, |Δgrad norm| against the "
              "single-process reference; colour: that error as a fraction of verify's "
              "tolerance (<code>diff_over_tolerance</code>) on a log scale, green ≤ 1%, yellow "
              "10%, red ≥ 100% (a failure, also outlined); hover a cell for every diff. "
              "Without that field: the error itself, green ≤ 1e-9, red ≥ 1e-4.</p>")
    body = head + table(["layout"] + [f"{m} · {e}" for m, e in cols], rows, sortable=True,
                        tid="verify-matrix")
    if v.get("rule"):
        body += f"<p class=\"muted\">{escape(v['rule'])}</p>"
    return (sid, "Parity matrix (shardwise verify --json)", body)
