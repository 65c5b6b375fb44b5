"""``shardwise report``: one self-contained HTML page per run, or per comparison of runs.

* :mod:`.record` — what the training loop records for the report (``RUN/report_data.json``,
  per-axis bytes in ``metrics.jsonl``);
* :mod:`.data` — a run folder read back (pure Python), the warnings, the per-step |Δloss|;
* :mod:`.svg` — inline SVG charts (no JavaScript library, nothing vendored: the page opens
  offline and the tests count the drawn points);
* :mod:`.html` — the page: one ``<section id=…>`` per topic;
* :mod:`.wandb_log` — the optional Weights & Biases mirror of ``metrics.jsonl``.
"""
