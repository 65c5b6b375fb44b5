"""The report page: one self-contained HTML file (inline CSS, inline SVG, a few lines of inline
JavaScript that sort tables; nothing fetched from the network).

:func:`run_page` — one run, one ``<section id=…>`` per topic (:data:`RUN_SECTIONS`), here;
:func:`~.compare.compare_page` — two or more runs (:data:`~.compare.COMPARE_SECTIONS`), in
:mod:`.compare`; :func:`~.page.verify_section` — ``shardwise verify --json`` output as the
parity matrix, and the frame both pages share (CSS, script, tables, :func:`~.page.page`), in
:mod:`.page`.
"""

from __future__ import annotations

from html import escape

from . import data as rd
from .page import _b, _fmt_val, _layout_name, _r, _td, page, table, verify_section
from .svg import PALETTE, bar_chart, line_chart, mesh_chart, timeline_chart

RUN_SECTIONS = ("command", "layout", "loss", "throughput", "traffic", "memory", "collectives",
                "pipeline", "checkpoints", "sample", "warnings")


# -- one run ----------------------------------------------------------------------------------
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
