"""The compute orders (F/B/I/W per rank) of the loop placement's schedules, stage s on rank
s % p (:mod:`.schedule_data`), with the bubble for equal stages and free communication
(:func:`.simulate.bubble_formula`):

* ``gpipe`` (Huang et al. 2019 §2.3): all m forwards, then all m backwards; (p−1)/(m+p−1).
* ``1f1b`` (PipeDream-flush, Narayanan et al. 2021 "Memory-Efficient Pipeline-Parallel DNN
  Training" §3.1; Megatron-LM §2.2.1): the same bubble, ≤ p microbatches alive.
* ``interleaved-1f1b`` (Megatron-LM §2.2.2; rounds as PyTorch's ``ScheduleInterleaved1F1B``):
  v ≥ 2 chunks per rank; (p−1)/(v·m+p−1).
* ``zb-h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1): 1F1B with ``B`` split
  into ``I`` and ``W``, rank r delaying its ``W`` by r microbatches; idle (p−1)(T_F+T_B−T_W)
  instead of (p−1)(T_F+T_B+T_W).

The orders and the tests: docs/pipeline-parallel.md §2–3.
"""

from __future__ import annotations

from .schedule_data import Action, B, F, I, W, rounds_of


def gpipe(m: int) -> list[Action]:
    return [F(i) for i in range(m)] + [B(i) for i in range(m)]


def one_f_one_b(p: int, m: int, r: int, split_backward: bool = False) -> list[Action]:
    """1F1B; with ``split_backward`` each B becomes I and the W of microbatch j − r follows the
    I of microbatch j (ZB-H1: W delayed by r microbatches, the rest flushed at the end)."""
    warmup = min(p - 1 - r, m)
    order = [F(i) for i in range(warmup)]
    w_next = 0

    def backward(j: int) -> None:
        nonlocal w_next
        if not split_backward:
            order.append(B(j))
            return
        order.append(I(j))
        if j >= r:
            order.append(W(w_next))
            w_next += 1

    for j in range(m - warmup):
        order.append(F(warmup + j))
        backward(j)
    for j in range(m - warmup, m):
        backward(j)
    if split_backward:
        order.extend(W(j) for j in range(w_next, m))
    return order


def interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
    """Interleaved 1F1B: forwards through the chunks in rounds of g = :func:`rounds_of` (p, m)
    microbatches, backwards in reverse chunk order; warm-up (v−1)·g + 2(p−1−r) chunk-forwards."""
    g = rounds_of(p, m)
    total = m * v
    warmup = min((v - 1) * g + 2 * (p - 1 - r), total)
    f_next = [0] * v
    b_next = [0] * v

    def fwd(k: int) -> Action:
        c = (k // g) % v
        f_next[c] += 1
        return F(f_next[c] - 1, c)

    def bwd(k: int) -> Action:
        c = v - 1 - (k // g) % v
        b_next[c] += 1
        return B(b_next[c] - 1, c)

    order = [fwd(k) for k in range(warmup)]
    for k in range(warmup, total):
        order.append(fwd(k))
        order.append(bwd(k - warmup))
    for k in range(total - warmup, total):
        order.append(bwd(k))
    return order
