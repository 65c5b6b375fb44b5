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


class _Run:
    """One :func:`simulate` in progress: per rank its program counter (the next action), clock
    and compute time; the events so far; the messages in flight per (sender, receiver,
    channel), each ``(payload, arrival time)``; the actions done and the messages received."""

    def __init__(self, schedule: Schedule, costs: Costs):
        p = schedule.p
        self.schedule, self.costs = schedule, costs
        self.pc = [0] * p
        self.clock = [0.0] * p
        self.busy = [0.0] * p
        self.events: list[Event] = []
        self.queues: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.done: set[tuple] = set()  # (rank, kind, mb, chunk) executed
        self.received: set[tuple] = set()  # (rank, channel, mb, chunk)

    def stage(self, r, c):
        return self.schedule.stage_of(r, c)

    def local(self, r: int, s: int) -> bool:
        """Stage ``s`` exists and lives on rank r: its tensors are handed over locally."""
        return 0 <= s < self.schedule.num_stages and self.schedule.rank_of(s) == r

    def payload(self, r: int, a: Action) -> tuple:
        """(channel, mb, consumer stage) of a message, from either end."""
        s = self.stage(r, a.chunk)
        if a.kind == "SEND_F":
            return ("F", a.microbatch, s + 1)
        if a.kind == "SEND_B":
            return ("B", a.microbatch, s - 1)
        return (a.channel, a.microbatch, s)

    def check_compute(self, r: int, a: Action) -> None:
        schedule, done, received = self.schedule, self.done, self.received
        v, n_stages = schedule.v, schedule.num_stages
        s, key = self.stage(r, a.chunk), (a.microbatch, a.chunk)
        if a.microbatch < 0 or a.microbatch >= schedule.m or not 0 <= a.chunk < v:
            raise ScheduleError(f"rank {r}: {a} is out of range (m={schedule.m}, v={v})")
        if (r, a.kind, *key) in done:
            raise ScheduleError(f"rank {r}: {a} runs twice")
        if a.kind == "F":
            if self.local(r, s - 1):  # the previous stage is this rank's: its F must have run
                if (r, "F", a.microbatch, schedule.chunk_of(s - 1)) not in done:
                    raise ScheduleError(f"rank {r}: {a} runs before the forward of the "
                                        f"previous stage on this rank")
            elif s > 0 and (r, "F", *key) not in received:
                raise ScheduleError(f"rank {r}: {a} runs before its input was received")
        elif a.kind in ("B", "I"):
            if (r, "F", *key) not in done:
                raise ScheduleError(f"rank {r}: {a} runs before F{a.microbatch}")
            if self.local(r, s + 1):
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

    def check_send(self, r: int, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        need = ("F",) if a.kind == "SEND_F" else ("B", "I")
        if not any((r, k, *key) in self.done for k in need):
            raise ScheduleError(f"rank {r}: {a} sends a tensor not computed yet")
        s = self.stage(r, a.chunk)
        target = s + 1 if a.kind == "SEND_F" else s - 1
        if not 0 <= target < self.schedule.num_stages or self.schedule.rank_of(target) != a.peer:
            raise ScheduleError(f"rank {r}: {a} goes to rank {a.peer}, but stage {target} is "
                                f"not there")

    def record(self, r, a, start, end):
        self.events.append(Event(r, a.kind, a.microbatch, a.chunk, start, end, a.peer))

    def run_compute(self, r, a):
        self.check_compute(r, a)
        dt = self.costs.of(a.kind, self.schedule.v)
        self.record(r, a, self.clock[r], self.clock[r] + dt)
        self.clock[r] += dt
        self.busy[r] += dt
        self.done.add((r, a.kind, a.microbatch, a.chunk))

    def match_recv(self, r, a, msg):
        if msg != self.payload(r, a):
            raise ScheduleError(f"rank {r}: {a} expected {self.payload(r, a)} from rank "
                                f"{a.peer} but the next message on that channel is {msg}")
        self.received.add((r, a.channel, a.microbatch, a.chunk))

    def send_eager(self, r: int, a: Action) -> None:
        """The runtime's ``isend``: the message is queued, arriving ``t_comm`` later."""
        clock = self.clock
        self.check_send(r, a)
        self.queues[(r, a.peer, a.channel)].append((self.payload(r, a),
                                                    clock[r] + self.costs.t_comm))
        self.record(r, a, clock[r], clock[r])

    def recv_eager(self, r: int, a: Action) -> bool:
        """A blocking receive of the next message on its channel; False: none sent yet."""
        clock = self.clock
        q = self.queues[(a.peer, r, a.channel)]
        if not q:
            return False
        msg, arrival = q.popleft()
        self.match_recv(r, a, msg)
        t = max(clock[r], arrival)
        self.record(r, a, clock[r], t)
        clock[r] = t
        return True

    def rendezvous(self, r: int, a: Action) -> bool:
        """Both ends must be at the matching pair: run it (advancing the peer past its end);
        False: the peer is elsewhere."""
        clock, pc, progs = self.clock, self.pc, self.schedule.ranks
        q = a.peer
        if pc[q] >= len(progs[q]):
            return False
        b = progs[q][pc[q]]
        want = "RECV_" if a.kind.startswith("SEND") else "SEND_"
        if not (b.kind == want + a.channel and b.peer == r):
            return False
        send_r, send_a, recv_r, recv_a = ((r, a, q, b) if a.kind.startswith("SEND")
                                          else (q, b, r, a))
        self.check_send(send_r, send_a)
        self.match_recv(recv_r, recv_a, self.payload(send_r, send_a))
        t = max(clock[r], clock[q]) + self.costs.t_comm
        self.record(send_r, send_a, clock[send_r], t)
        self.record(recv_r, recv_a, clock[recv_r], t)
        clock[r] = clock[q] = t
        pc[q] += 1
        return True

    def advance(self, r: int, mode: str) -> bool:
        """Run rank r's actions until it blocks or ends; True if it ran any."""
        progs, progressed = self.schedule.ranks, False
        while self.pc[r] < len(progs[r]):
            a = progs[r][self.pc[r]]
            if a.is_compute:
                self.run_compute(r, a)
            elif mode == "eager" and a.kind.startswith("SEND"):
                self.send_eager(r, a)
            elif mode == "eager":  # RECV
                if not self.recv_eager(r, a):
                    break
            elif not self.rendezvous(r, a):
                break
            self.pc[r] += 1
            progressed = True
        return progressed

    def check_complete(self) -> None:
        """Every message received, every (microbatch, stage) forwarded and backwarded."""
        schedule, done = self.schedule, self.done
        leftover = {k: list(q) for k, q in self.queues.items() if q}
        if leftover:
            raise ScheduleError(f"messages sent but never received: {leftover}")
        for s in range(schedule.num_stages):
            r, c = schedule.rank_of(s), schedule.chunk_of(s)
            for mb in range(schedule.m):
                if (r, "F", mb, c) not in done:
                    raise ScheduleError(f"rank {r}: F{mb}.{c} never runs")
                full = (r, "B", mb, c) in done
                split = (r, "I", mb, c) in done and (r, "W", mb, c) in done
                if not (full or split):
                    raise ScheduleError(f"rank {r}: the backward of microbatch {mb} chunk {c} "
                                        f"never completes (needs B, or I and W)")


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
    p, progs = schedule.p, schedule.ranks
    run = _Run(schedule, costs)
    while True:
        progressed = False
        for r in range(p):
            if run.advance(r, mode):
                progressed = True
        if all(run.pc[r] == len(progs[r]) for r in range(p)):
            break
        if not progressed:
            blocked = {r: progs[r][run.pc[r]] for r in range(p) if run.pc[r] < len(progs[r])}
            raise DeadlockError(blocked, max(run.clock))
    run.check_complete()
    return SimResult(events=run.events, makespan=max(run.clock), busy=run.busy,
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
