"""The compute orders (F/B/I/W per rank) of the V placement's schedules, two chunks per rank:
rank r holds stages r and 2p−1−r (:mod:`.schedule_data`):

* ``zbv`` (Qi et al. 2023 §6, "ZB-V"; the order of PyTorch's ``ScheduleZBVZeroBubble``): the V
  placement, backward split into I and W; warm-up 2(p−r)−1 forwards of chunk 0, then chunk 1's
  forwards interleaved, steady state F/I/W on both chunks, W's filling the drain. m ≥ p.
* ``dualpipev`` (DeepSeek-V3 technical report §3.2.1, DualPipe "cut in half" to p ranks; the
  order of PyTorch's ``ScheduleDualPipeV`` after deepseek-ai/DualPipe): the V placement, steady
  state pairs (F of one chunk, full B of the other) meant to overlap compute and communication,
  I/W split only where it fills the drain. m ≥ 2p.

Their bubble (:func:`.simulate.bubble_formula`), the orders and the tests:
docs/pipeline-parallel.md §2–3.
"""

from __future__ import annotations

from .schedule_data import Action, W


class _Program:
    """A rank's compute order under construction: ``add(kind, chunk)`` appends the chunk's next
    microbatch of that kind (I and B share a counter: both are the microbatch's backward)."""

    def __init__(self):
        self.order: list[Action] = []
        self.next = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}

    def add(self, kind: str, chunk: int) -> int:
        counter = "B" if kind == "I" else kind
        mb = self.next[counter][chunk]
        self.order.append(Action(kind, mb, chunk))
        self.next[counter][chunk] += 1
        return mb


def zbv(p: int, m: int, r: int) -> list[Action]:
    """ZB-V (Qi et al. 2023 §6) on rank r, in the order of PyTorch's ``ScheduleZBVZeroBubble``:
    chunk 0 is stage r, chunk 1 stage 2p−1−r. Built for n = max(m, 2p−1) microbatches, then the
    actions of microbatches ≥ m are dropped (a filtered order keeps its dependencies).

    warm-up   2(p−r)−1 × F.0;  r × (F.1, F.0);  p−r × (F.1, I.1, W.1)
    steady    (F.0 while any left), I.0, W.0, F.1, I.1, W.1 — until every F.1 has run
    drain     r × (I.0, I.1);  p−r × (I.0, W.0);  the W.1 left, then the W.0 left"""
    n = max(m, 2 * p - 1)
    g = _Program()
    for _ in range(2 * (p - r) - 1):
        g.add("F", 0)
    for _ in range(r):
        g.add("F", 1)
        g.add("F", 0)
    for _ in range(p - r):
        for kind in ("F", "I", "W"):
            g.add(kind, 1)
    while g.next["F"][1] < g.next["F"][0] or g.next["F"][0] < n:
        if g.next["F"][0] < n:
            g.add("F", 0)
        for chunk, kind in ((0, "I"), (0, "W"), (1, "F"), (1, "I"), (1, "W")):
            g.add(kind, chunk)
    for _ in range(r):
        g.add("I", 0)
        g.add("I", 1)
    for _ in range(p - r):
        g.add("I", 0)
        g.add("W", 0)
    for chunk in (1, 0):
        while g.next["W"][chunk] < g.next["B"][chunk]:
            g.add("W", chunk)
    return [a for a in g.order if a.microbatch < m]


def dualpipev(p: int, m: int, r: int) -> list[Action]:
    """DualPipeV on rank r (DeepSeek-V3 technical report §3.2.1: DualPipe, here in its V-shaped
    "cut in half" form on p ranks; the order of deepseek-ai/DualPipe's ``DualPipeV`` as PyTorch's
    ``ScheduleDualPipeV`` writes it). Chunk 0 is stage r, chunk 1 stage 2p−1−r; m ≥ 2p. A
    W pass is queued by each I and run, oldest first, where the order says W.

    1. 2(p−r−1) × F.0                          5. p−r−1 × (B.1; F.1, B.0)
    2. r+1 × (F.0, F.1)                        6. r+1 × (B.1, B.0), split into I from the middle
    3. p−r−1 × (I.1, W, F.1)                   7. p−r−1 × (W, B.0 or I.0)
    4. m−2p+r+1 × (F.0, B.1; F.1, B.0)         8. r+1 × W

    In steps 4 and 5 each (F of one chunk, B of the other) is the pair DualPipe overlaps (one
    microbatch's forward computing while the other's backward communicates); here, as in
    PyTorch's runtime without a custom overlap function, the pair runs one after the other."""
    g, pending = _Program(), []

    def backward(chunk: int, split: bool) -> None:
        mb = g.add("I" if split else "B", chunk)
        if split:
            pending.append((mb, chunk))

    def weight() -> None:
        if pending:
            mb, chunk = pending.pop(0)
            g.order.append(W(mb, chunk))

    for _ in range(2 * (p - r - 1)):
        g.add("F", 0)
    for _ in range(r + 1):
        g.add("F", 0)
        g.add("F", 1)
    for _ in range(p - r - 1):
        backward(1, True)
        weight()
        g.add("F", 1)
    for _ in range(m - 2 * p + r + 1):
        g.add("F", 0)
        backward(1, False)
        g.add("F", 1)
        backward(0, False)
    for _ in range(p - r - 1):
        backward(1, False)
        g.add("F", 1)
        backward(0, False)
    split, half = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        backward(1, split)
        split = split or (i == half and r % 2 == 0)
        backward(0, split)
    for _ in range(p - r - 1):
        weight()
        backward(0, split)
    for _ in range(r + 1):
        weight()
    return g.order
