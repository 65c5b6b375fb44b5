"""The commands that check and measure the core, built on it and outside it: ``verify``
(:mod:`.verify`, parity of every layout with one process), ``trace`` (:mod:`.trace`, one step's
collectives and a pipeline's timeline) and ``bench`` (:mod:`.bench`). :mod:`shardwise.cli`
parses their flags and imports each lazily."""
