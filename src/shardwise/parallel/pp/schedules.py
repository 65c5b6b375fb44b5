"""Pipeline schedules as pure data: for every pipeline rank, an ordered list of :class:`Action` s,
to print (:func:`format_schedule`), simulate (:mod:`.simulate`), draw
(:mod:`shardwise.viz.timeline`) and execute (:mod:`.runner`). Nothing here touches a model or a
process group.

``p`` ranks, ``m`` microbatches per step (m ≥ p), ``v`` chunks ("virtual stages") per rank: the
model is cut into ``S = p·v`` stages; stage ``s`` lives on rank ``s % p`` as its local chunk
``s // p`` (Megatron-LM, Narayanan et al. 2021, §2.2). Schedules, with the bubble for equal
stages and free communication (:func:`.simulate.bubble_formula`):

* ``gpipe`` (Huang et al. 2019 §2.3): all m forwards, then all m backwards; (p−1)/(m+p−1).
* ``1f1b`` (PipeDream-flush, Narayanan et al. 2021 "Memory-Efficient Pipeline-Parallel DNN
  Training" §3.1; Megatron-LM §2.2.1): the same bubble, ≤ p microbatches alive.
* ``interleaved-1f1b`` (Megatron-LM §2.2.2; rounds as PyTorch's ``ScheduleInterleaved1F1B``):
  v ≥ 2 chunks per rank; (p−1)/(v·m+p−1).
* ``zb-h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1): 1F1B with ``B`` split
  into ``I`` and ``W``, rank r delaying its ``W`` by r microbatches; idle (p−1)(T_F+T_B−T_W)
  instead of (p−1)(T_F+T_B+T_W).

The orders, the simulator's checks and the tests: docs/pipeline-parallel.md §2–3.
"""

from __future__ import annotations

import dataclasses

from ...errors import ShardwiseConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank's program, about one ``(microbatch, chunk)``.

    =========  ==========================================================================
    ``F``      forward of the chunk on the microbatch; stores what backward needs
    ``B``      full backward: input gradient *and* weight gradients
    ``I``      input-gradient half of ``B`` only (zero-bubble; Qi et al. 2023 call it "B")
    ``W``      weight-gradient half of ``B`` (zero-bubble), any time after its ``I``
    ``SEND_F`` send the chunk's output activation to the rank holding the next stage (``peer``)
    ``RECV_F`` receive the chunk's input activation from the rank of the previous stage (``peer``)
    ``SEND_B`` send the gradient w.r.t. the chunk's input to the previous stage's rank
    ``RECV_B`` receive the gradient w.r.t. the chunk's output from the next stage's rank
    =========  ==========================================================================

    ``microbatch`` 0-based index into the step's microbatches; ``chunk`` local chunk index
    (0 ≤ chunk < v): for SEND the sender's, for RECV the receiver's; ``peer`` the other rank's
    pp index, for SEND/RECV only. Raises ``ValueError`` for an unknown kind or a misplaced peer."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in COMPUTE + COMM:
            raise ValueError(f"unknown action kind {self.kind!r}: one of {COMPUTE + COMM}")
        if (self.peer is None) != (self.kind in COMPUTE):
            raise ValueError(f"{self.kind}: peer must be set for SEND/RECV and only for them")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def channel(self) -> str:
        """"F" (activations) or "B" (gradients) for SEND/RECV actions."""
        return self.kind[-1]

    def __str__(self) -> str:
        base = f"{self.kind}{self.microbatch}"
        if self.chunk:
            base += f".{self.chunk}"
        if self.peer is not None:
            base += ("→" if self.kind.startswith("SEND") else "←") + str(self.peer)
        return base


def F(mb: int, chunk: int = 0) -> Action:
    return Action("F", mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    return Action("B", mb, chunk)


def I(mb: int, chunk: int = 0) -> Action:  # noqa: E743  (the paper's name)
    return Action("I", mb, chunk)


def W(mb: int, chunk: int = 0) -> Action:
    return Action("W", mb, chunk)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule: ``ranks[r]`` is rank r's ordered tuple of :class:`Action` s.

    Indexing and iteration go over ranks, so a Schedule reads like ``list[list[Action]]``."""

    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]

    def __getitem__(self, r: int) -> tuple[Action, ...]:
        return self.ranks[r]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self):
        return iter(self.ranks)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def __str__(self) -> str:
        return format_schedule(self)


def rounds_of(p: int, m: int) -> int | None:
    """Interleaved schedules: microbatches per round ``g = m / (m // p)``, or None if ``m`` does
    not split into ``m // p`` equal rounds (or m < p)."""
    if m < p:
        return None
    n_rounds = m // p
    return m // n_rounds if m % n_rounds == 0 else None


def check_schedule(name: str, p: int, m: int, v: int | None = None) -> int:
    """Validate (schedule, p, m, v); return the effective v (default 2 for interleaved, else 1).

    Raises :class:`ShardwiseConfigError` naming the constraint and the fix: unknown schedule;
    p < 1; m < p (most of the step would be bubble); v ≠ 1 for a non-interleaved schedule;
    interleaving with p < 2, v < 2, or m that does not split into m // p equal rounds."""
    if name not in SCHEDULES:
        raise ShardwiseConfigError(f"--schedule {name!r} is unknown: choose one of "
                                   f"{', '.join(SCHEDULES)}")
    if not isinstance(p, int) or p < 1:
        raise ShardwiseConfigError(f"--pp {p} must be a positive integer")
    if not isinstance(m, int) or m < p:
        raise ShardwiseConfigError(
            f"--microbatches {m} is less than --pp {p}: a pipeline needs at least as many "
            f"microbatches as stages (ranks) to fill; choose --microbatches ≥ {p} "
            f"(e.g. {p} or {2 * p})")
    if name == "interleaved-1f1b":
        v = 2 if v is None else v
        if p < 2:
            raise ShardwiseConfigError("--schedule interleaved-1f1b needs --pp ≥ 2 (it "
                                       "interleaves chunks across ranks); use 1f1b for pp=1")
        if not isinstance(v, int) or v < 2:
            raise ShardwiseConfigError(f"interleaved-1f1b needs ≥ 2 virtual stages (model "
                                       f"chunks) per rank, got {v}: choose 2 or more")
        if rounds_of(p, m) is None:
            ok = [k for k in range(p, 4 * p + 1) if rounds_of(p, k) is not None]
            raise ShardwiseConfigError(
                f"interleaved-1f1b with pp={p} needs --microbatches that split into "
                f"m // pp = {m // p} rounds of equal size; m={m} does not: choose m from "
                f"{ok[:8]} (any multiple of {p} works)")
        return v
    v = 1 if v is None else v
    if v != 1:
        raise ShardwiseConfigError(f"--schedule {name} runs one model chunk per rank, got "
                                   f"{v} virtual stages: use --schedule interleaved-1f1b or 1")
    return v


def _gpipe(m: int) -> list[Action]:
    return [F(i) for i in range(m)] + [B(i) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int, split_backward: bool = False) -> list[Action]:
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


def _interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
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


def compute_order(name: str, p: int, m: int, v: int | None = None) -> list[list[Action]]:
    """Per rank, the compute actions (F/B/I/W) of schedule ``name`` in execution order."""
    v = check_schedule(name, p, m, v)
    if name == "gpipe":
        return [_gpipe(m) for _ in range(p)]
    if name == "1f1b":
        return [_one_f_one_b(p, m, r) for r in range(p)]
    if name == "zb-h1":
        return [_one_f_one_b(p, m, r, split_backward=True) for r in range(p)]
    return [_interleaved(p, m, v, r) for r in range(p)]


def insert_comms(order: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Add the point-to-point actions to compute orders: each RECV right before the compute that
    consumes the tensor, each SEND right after the compute that produces it."""
    n_stages = p * v
    out = []
    for r, acts in enumerate(order):
        lst = []
        for a in acts:
            s = a.chunk * p + r
            if a.kind == "F":
                if s > 0 and (s - 1) % p != r:
                    lst.append(Action("RECV_F", a.microbatch, a.chunk, (s - 1) % p))
                lst.append(a)
                if s < n_stages - 1 and (s + 1) % p != r:
                    lst.append(Action("SEND_F", a.microbatch, a.chunk, (s + 1) % p))
            elif a.kind in ("B", "I"):
                if s < n_stages - 1 and (s + 1) % p != r:
                    lst.append(Action("RECV_B", a.microbatch, a.chunk, (s + 1) % p))
                lst.append(a)
                if s > 0 and (s - 1) % p != r:
                    lst.append(Action("SEND_B", a.microbatch, a.chunk, (s - 1) % p))
            else:
                lst.append(a)
        out.append(lst)
    return out


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The full schedule (compute and communication actions per rank) for ``p`` ranks, ``m``
    microbatches and ``v`` chunks per rank. Raises :class:`ShardwiseConfigError` for invalid
    combinations (:func:`check_schedule`)."""
    v = check_schedule(name, p, m, v)
    order = compute_order(name, p, m, v)
    ranks = tuple(tuple(acts) for acts in insert_comms(order, p, v))
    return Schedule(name=name, p=p, m=m, v=v, ranks=ranks)


def format_schedule(schedule: Schedule, compute_only: bool = False) -> str:
    """One line per rank, e.g. ``rank 0: F0 SEND_F0→1 F1 SEND_F1→1 RECV_B0←1 B0 …``.
    With ``compute_only`` the SEND/RECV actions are left out."""
    head = (f"{schedule.name}: p={schedule.p} ranks, m={schedule.m} microbatches, "
            f"v={schedule.v} chunk(s) per rank")
    lines = [head]
    for r, acts in enumerate(schedule.ranks):
        shown = [str(a) for a in acts if a.is_compute or not compute_only]
        lines.append(f"rank {r}: " + " ".join(shown))
    return "\n".join(lines)


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most (microbatch, chunk) pairs holding activations at once: from ``F`` until
    ``B`` (or ``W``: the weight gradient still needs the layer inputs)."""
    peaks = []
    for acts in schedule.ranks:
        alive, peak = 0, 0
        for a in acts:
            if a.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif a.kind in ("B", "W"):
                alive -= 1
        peaks.append(peak)
    return peaks
