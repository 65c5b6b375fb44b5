"""The frame every report page shares: the inline CSS and sorting script, the table and
section builders, :func:`page` (the whole document), the cell formatters and a run's layout
name; and :func:`verify_section`, ``shardwise verify --json`` as the parity matrix, which both
the run page (:mod:`.html`) and the comparison page (:mod:`.compare`) append.
"""

from __future__ import annotations

import json
import math
from html import escape

from .svg import heat_colour

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



def _fmt_val(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)



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

