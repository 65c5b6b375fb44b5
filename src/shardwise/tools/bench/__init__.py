"""``shardwise bench``: our engines against PyTorch's, timed alternately.

:mod:`.harness` (runs, timed steps, A B A B … timing, the report files), :mod:`.layouts` (any
layout, explicit vs torch engine) and :mod:`.suites` (one strategy each: dp, zero, tp, pp)."""
