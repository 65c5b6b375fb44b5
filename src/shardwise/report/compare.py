"""The comparison page: two or more runs (:data:`COMPARE_SECTIONS`), the curves overlaid, the
config diff, the per-step |Δloss| against the first run with the first step over 1e-5 marked
(``class="first-divergence" data-step``), traffic and memory side by side. The frame and the
parity matrix: :mod:`.page`; one run's page: :mod:`.html`.
"""

from __future__ import annotations

from html import escape

from . import data as rd
from .page import _b, _fmt_val, _label, _layout_name, _td, page, table, verify_section
from .svg import PALETTE, bar_chart, line_chart

COMPARE_SECTIONS = ("runs", "compare-loss", "delta", "config-diff", "compare-throughput",
                    "compare-traffic", "compare-memory")



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

