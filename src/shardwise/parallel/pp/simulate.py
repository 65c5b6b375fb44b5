"""Execute a :class:`~.schedules.Schedule` on paper: per-action costs, deadlock detection, bubble.

The runtime's semantics (:mod:`.runner`: asynchronous sends, blocking receives, FIFO matching per
channel) on a clock per rank, with the zero-bubble paper's costs T_F, T_B, T_W (Qi et al. 2023
§2). ``bubble = 1 − Σ_r busy_r / (p · makespan)``, busy = compute only. Closed forms for equal
stages and free communication (:func:`bubble_formula`):

* GPipe and 1F1B: ``(p−1)/(m+p−1)`` (GPipe §2.3; Narayanan et al. 2021 §2.2.1);
* interleaved 1F1B with v chunks: ``(p−1)/(v·m+p−1)`` (Narayanan et al. 2021 §2.2.2);
* ZB-H1: ``(p−1)(T_F+T_B−T_W) / (m(T_F+T_B+T_W) + (p−1)(T_F+T_B−T_W))`` for T_W ≤ T_F + T_B
  (Qi et al. 2023 §3.1).
* ZB-V and DualPipeV at T_F = T_B = T_W (= T): ``(p−1) / (6m + p−1)``, an idle of (p−1)·T/2
  per rank (one chunk-forward per hop to rank p−1: the fill no order can avoid), a sixth of
  1F1B's (p−1)·3T. ZB-V (Qi et al. 2023 §6) for m ≥ 2p−1; DualPipeV for m ≥ 2p: DeepSeek-V3
  technical report §3.2.1, Table 2, bubble (PP/2−1)(F&B + B − 3W) with PP/2 = p ranks and
  per-chunk costs, F&B = F + B + W when the pair is not overlapped: (p−1)(T/2·3 + T/2 − 3T/2).

The derivations and what the tests check: docs/pipeline-parallel.md §3.
"""

from __future__ import annotations

import collections
import dataclasses

from .schedules import Action, Schedule, peak_activations


class ScheduleError(ValueError):
    """The schedule is malformed: a dependency missing, a RECV matched with the wrong message,
    a (microbatch, stage) computed twice or never."""


class DeadlockError(RuntimeError):
    """No rank can make progress. ``blocked``: {rank: the action it waits on}."""

    def __init__(self, blocked: dict[int, Action], time: float):
        self.blocked = blocked
        what = ", ".join(f"rank {r} at {a}" for r, a in sorted(blocked.items()))
        super().__init__(f"deadlock at t={time:g}: {what}")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action for one rank's whole share of the model: ``t_f``
    forward, ``t_b`` input-gradient backward, ``t_w`` weight-gradient backward (a full backward
    ``B`` costs t_b + t_w), ``t_comm`` one point-to-point transfer's latency."""

    t_f: float = 1.0
    t_b: float = 1.0
    t_w: float = 1.0
    t_comm: float = 0.0

    def of(self, kind: str, v: int) -> float:
        return {"F": self.t_f, "B": self.t_b + self.t_w, "I": self.t_b, "W": self.t_w}[kind] / v


@dataclasses.dataclass(frozen=True)
class Event:
    """One executed action: ``rank`` did ``kind`` on (``microbatch``, ``chunk``) from ``start``
    to ``end`` (for RECV: from when it started waiting until the tensor was there)."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    peer: int | None = None


@dataclasses.dataclass
class SimResult:
    events: list[Event]
    makespan: float
    busy: list[float]  # per rank, compute time
    peak_alive: list[int]  # per rank, see schedules.peak_activations

    @property
    def p(self) -> int:
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - sum(self.busy) / (self.p * self.makespan) if self.makespan > 0 else 0.0


def simulate(schedule: Schedule, costs: Costs = Costs(), mode: str = "eager") -> SimResult:
    """Run ``schedule`` with ``costs`` (a compute action costs :meth:`Costs.of`); returns the
    timeline and the bubble. ``mode="eager"`` (the runtime's ``isend``): a SEND returns at once,
    its message arriving ``t_comm`` later; a RECV blocks until it has arrived. Messages are
    matched first-in first-out per (sender, receiver, channel); a RECV that meets another
    message than the one it names (on a real backend: swapped tensors) is a
    :class:`ScheduleError`. ``mode="rendezvous"``: a SEND also blocks until the matching RECV.

    Raises :class:`DeadlockError` if the ranks block each other, :class:`ScheduleError` if the
    schedule is malformed (a missing input, a RECV mismatch, a computation twice or never),
    ``ValueError`` for an unknown ``mode``."""
    if mode not in ("eager", "rendezvous"):
        raise ValueError(f"mode {mode!r}: choose eager or rendezvous")
    p, v, n_stages = schedule.p, schedule.v, schedule.num_stages
    progs = schedule.ranks
    pc = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    events: list[Event] = []
    queues: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    done: set[tuple] = set()  # (rank, kind, mb, chunk) executed
    received: set[tuple] = set()  # (rank, channel, mb, chunk)

    def stage(r, c):
        return schedule.stage_of(r, c)

    def local(r: int, s: int) -> bool:
        """Stage ``s`` exists and lives on rank r: its tensors are handed over locally."""
        return 0 <= s < n_stages and schedule.rank_of(s) == r

    def payload(r: int, a: Action) -> tuple:
        """(channel, mb, consumer stage) of a message, from either end."""
        s = stage(r, a.chunk)
        if a.kind == "SEND_F":
            return ("F", a.microbatch, s + 1)
        if a.kind == "SEND_B":
            return ("B", a.microbatch, s - 1)
        return (a.channel, a.microbatch, s)

    def check_compute(r: int, a: Action) -> None:
        s, key = stage(r, a.chunk), (a.microbatch, a.chunk)
        if a.microbatch < 0 or a.microbatch >= schedule.m or not 0 <= a.chunk < v:
            raise ScheduleError(f"rank {r}: {a} is out of range (m={schedule.m}, v={v})")
        if (r, a.kind, *key) in done:
            raise ScheduleError(f"rank {r}: {a} runs twice")
        if a.kind == "F":
            if local(r, s - 1):  # the previous stage is this rank's: its F must have run
                if (r, "F", a.microbatch, schedule.chunk_of(s - 1)) not in done:
                    raise ScheduleError(f"rank {r}: {a} runs before the forward of the "
                                        f"previous stage on this rank")
            elif s > 0 and (r, "F", *key) not in received:
                raise ScheduleError(f"rank {r}: {a} runs before its input was received")
        elif a.kind in ("B", "I"):
            if (r, "F", *key) not in done:
                raise ScheduleError(f"rank {r}: {a} runs before F{a.microbatch}")
            if local(r, s + 1):
                nxt = (a.microbatch, schedule.chunk_of(s + 1))
                if (r, "B", *nxt) not in done and (r, "I", *nxt) not in done:
                    raise ScheduleError(f"rank {r}: {a} runs before the backward of the next "
                                        f"stage on this rank")
            elif s < n_stages - 1 and (r, "B", *key) not in received:
                raise ScheduleError(f"rank {r}: {a} runs before its output gradient arrived")
            other = "I" if a.kind == "B" else "B"
            if (r, other, *key) in done:
                raise ScheduleError(f"rank {r}: microbatch {key} has both B and I")
        elif a.kind == "W":
            if (r, "I", *key) not in done:
                raise ScheduleError(f"rank {r}: {a} runs before I{a.microbatch}")

    def check_send(r: int, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        need = ("F",) if a.kind == "SEND_F" else ("B", "I")
        if not any((r, k, *key) in done for k in need):
            raise ScheduleError(f"rank {r}: {a} sends a tensor not computed yet")
        s = stage(r, a.chunk)
        target = s + 1 if a.kind == "SEND_F" else s - 1
        if not 0 <= target < n_stages or schedule.rank_of(target) != a.peer:
            raise ScheduleError(f"rank {r}: {a} goes to rank {a.peer}, but stage {target} is "
                                f"not there")

    def record(r, a, start, end):
        events.append(Event(r, a.kind, a.microbatch, a.chunk, start, end, a.peer))

    def run_compute(r, a):
        check_compute(r, a)
        dt = costs.of(a.kind, v)
        record(r, a, clock[r], clock[r] + dt)
        clock[r] += dt
        busy[r] += dt
        done.add((r, a.kind, a.microbatch, a.chunk))

    def match_recv(r, a, msg):
        if msg != payload(r, a):
            raise ScheduleError(f"rank {r}: {a} expected {payload(r, a)} from rank {a.peer} "
                                f"but the next message on that channel is {msg}")
        received.add((r, a.channel, a.microbatch, a.chunk))

    while True:
        progressed = False
        for r in range(p):
            while pc[r] < len(progs[r]):
                a = progs[r][pc[r]]
                if a.is_compute:
                    run_compute(r, a)
                elif mode == "eager" and a.kind.startswith("SEND"):
                    check_send(r, a)
                    queues[(r, a.peer, a.channel)].append((payload(r, a), clock[r] + costs.t_comm))
                    record(r, a, clock[r], clock[r])
                elif mode == "eager":  # RECV
                    q = queues[(a.peer, r, a.channel)]
                    if not q:
                        break
                    msg, arrival = q.popleft()
                    match_recv(r, a, msg)
                    t = max(clock[r], arrival)
                    record(r, a, clock[r], t)
                    clock[r] = t
                else:  # rendezvous: both ends must be at the matching pair
                    q = a.peer
                    if pc[q] >= len(progs[q]):
                        break
                    b = progs[q][pc[q]]
                    want = "RECV_" if a.kind.startswith("SEND") else "SEND_"
                    if not (b.kind == want + a.channel and b.peer == r):
                        break
                    send_r, send_a, recv_r, recv_a = ((r, a, q, b) if a.kind.startswith("SEND")
                                                      else (q, b, r, a))
                    check_send(send_r, send_a)
                    match_recv(recv_r, recv_a, payload(send_r, send_a))
                    t = max(clock[r], clock[q]) + costs.t_comm
                    record(send_r, send_a, clock[send_r], t)
                    record(recv_r, recv_a, clock[recv_r], t)
                    clock[r] = clock[q] = t
                    pc[q] += 1
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(progs[r]) for r in range(p)):
            break
        if not progressed:
            blocked = {r: progs[r][pc[r]] for r in range(p) if pc[r] < len(progs[r])}
            raise DeadlockError(blocked, max(clock))

    leftover = {k: list(q) for k, q in queues.items() if q}
    if leftover:
        raise ScheduleError(f"messages sent but never received: {leftover}")
    for s in range(n_stages):
        r, c = schedule.rank_of(s), schedule.chunk_of(s)
        for mb in range(schedule.m):
            if (r, "F", mb, c) not in done:
                raise ScheduleError(f"rank {r}: F{mb}.{c} never runs")
            full = (r, "B", mb, c) in done
            split = (r, "I", mb, c) in done and (r, "W", mb, c) in done
            if not (full or split):
                raise ScheduleError(f"rank {r}: the backward of microbatch {mb} chunk {c} "
                                    f"never completes (needs B, or I and W)")
    return SimResult(events=events, makespan=max(clock), busy=busy,
                     peak_alive=peak_activations(schedule))


def bubble_formula(name: str, p: int, m: int, v: int = 1, costs: Costs = Costs()) -> float:
    """Closed-form bubble fraction (module docstring); ``costs`` matters for zb-h1 only, and
    zbv/dualpipev have a closed form only at T_F = T_B = T_W (and zbv for m ≥ 2p−1, where no
    action of the full order is dropped). Raises ``ValueError`` for an unknown schedule, or a
    zbv/dualpipev case outside that."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        idle = (p - 1) * (costs.t_f + costs.t_b - costs.t_w)
        return idle / (m * (costs.t_f + costs.t_b + costs.t_w) + idle)
    if name in ("zbv", "dualpipev"):
        if not costs.t_f == costs.t_b == costs.t_w:
            raise ValueError(f"{name}: the closed form holds at T_F = T_B = T_W only; use "
                             f"simulate() for other costs")
        if name == "zbv" and m < 2 * p - 1:
            raise ValueError(f"zbv: the closed form holds for m ≥ 2p−1 = {2 * p - 1}; below, "
                             f"the fill is not amortised: use simulate()")
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(f"unknown schedule {name!r}")
