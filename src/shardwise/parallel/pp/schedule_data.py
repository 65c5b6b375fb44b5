"""What a pipeline schedule is, as data: :class:`Action` (one step of one rank's program),
:class:`Schedule` (every rank's actions), where each stage lives, the schedule names and
:func:`check_schedule` (which (schedule, p, m, v) are valid), and what a schedule shows
(:func:`format_schedule`, :func:`peak_activations`). Nothing here touches a model or a process
group; the orders are built in :mod:`.loop_schedules` and :mod:`.v_schedules`, which
:mod:`.schedules` dispatches to (adding the sends and receives).

``p`` ranks, ``m`` microbatches per step (m ≥ p), ``v`` chunks ("virtual stages") per rank: the
model is cut into ``S = p·v`` stages. Where each stage lives is the schedule's *placement*
(:func:`stage_of`, :func:`rank_of`, :func:`chunk_of`, the one place it is written):

* ``"loop"``: stage ``s`` on rank ``s % p`` as its local chunk ``s // p`` (Megatron-LM,
  Narayanan et al. 2021, §2.2);
* ``"v"`` (the V schedules, v = 2): rank r holds stage r as chunk 0 and stage 2p−1−r as chunk 1,
  so rank 0 holds the first and the last stage and rank p−1 the two middle ones, handing the
  activation from stage p−1 to stage p without a message (Qi et al. 2023 §6, ZB-V; PyTorch's
  ``generate_stage_to_rank_mapping(style="v")``).
"""

from __future__ import annotations

import dataclasses

from ...errors import ShardwiseConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # the V placement, two chunks per rank
PLACEMENTS = ("loop", "v")
COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def default_chunks(name: str) -> int:
    """Chunks per rank when ``--virtual-stages`` is not given: 2 for interleaved-1f1b and the
    V schedules, else 1."""
    return 2 if name == "interleaved-1f1b" or name in V_SCHEDULES else 1


def min_microbatches(name: str, p: int) -> int:
    """The fewest microbatches schedule ``name`` runs over ``p`` ranks (:func:`check_schedule`):
    2p for dualpipev, else p. What a bench or verify case without ``m=`` takes."""
    return 2 * p if name == "dualpipev" else p


def placement_of(name: str) -> str:
    """The placement of schedule ``name``: "v" for :data:`V_SCHEDULES`, else "loop"."""
    return "v" if name in V_SCHEDULES else "loop"


def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """Global stage index of local ``chunk`` on pp ``rank`` of ``p``: loop ``chunk·p + rank``;
    v ``rank`` for chunk 0 and ``2p−1−rank`` for chunk 1. Raises ``ValueError`` for an unknown
    placement or a chunk ≥ 2 under "v"."""
    _check_placement(placement)
    if placement == "loop":
        return chunk * p + rank
    if chunk not in (0, 1):
        raise ValueError(f"the V placement has two chunks per rank, got chunk {chunk}")
    return rank if chunk == 0 else 2 * p - 1 - rank


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: one of {PLACEMENTS}")


def rank_of(stage: int, p: int, placement: str = "loop") -> int:
    """The pp rank holding global ``stage``: loop ``stage % p``; v ``stage`` for the first p
    stages, ``2p−1−stage`` for the others."""
    _check_placement(placement)
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def chunk_of(stage: int, p: int, placement: str = "loop") -> int:
    """The local chunk index of global ``stage`` on its rank: loop ``stage // p``; v 0 for the
    first p stages, 1 for the others."""
    _check_placement(placement)
    if placement == "v":
        return 0 if stage < p else 1
    return stage // p


def stages_of(rank: int, p: int, v: int, placement: str = "loop") -> list[int]:
    """Global stage indices of ``rank``'s chunks, in local chunk order (ascending in both
    placements)."""
    return [stage_of(rank, c, p, placement) for c in range(v)]


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
    """A schedule: ``ranks[r]`` is rank r's ordered tuple of :class:`Action` s; ``placement``
    "loop" or "v" (module docstring: where each stage lives).

    Indexing and iteration go over ranks, so a Schedule reads like ``list[list[Action]]``."""

    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def stage_of(self, rank: int, chunk: int) -> int:
        """Global stage of ``rank``'s local ``chunk`` (:func:`stage_of`)."""
        return stage_of(rank, chunk, self.p, self.placement)

    def rank_of(self, stage: int) -> int:
        """The rank holding global ``stage`` (:func:`rank_of`)."""
        return rank_of(stage, self.p, self.placement)

    def chunk_of(self, stage: int) -> int:
        """The local chunk of global ``stage`` on its rank (:func:`chunk_of`)."""
        return chunk_of(stage, self.p, self.placement)

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
    interleaving with p < 2, v < 2, or m that does not split into m // p equal rounds; a V
    schedule (zbv, dualpipev: v = 2 by default) with p < 2 or v ≠ 2; dualpipev with m < 2p."""
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
    if name in V_SCHEDULES:
        v = 2 if v is None else v
        if p < 2:
            raise ShardwiseConfigError(f"--schedule {name} places two chunks per rank in a V "
                                       f"across the ranks, which needs --pp ≥ 2; use 1f1b or "
                                       f"zb-h1 for pp=1")
        if v != 2:
            raise ShardwiseConfigError(f"--schedule {name} runs exactly 2 model chunks per rank "
                                       f"(the V placement), got {v} virtual stages: leave "
                                       f"--virtual-stages unset or set it to 2")
        if name == "dualpipev" and m < 2 * p:
            raise ShardwiseConfigError(
                f"dualpipev with --pp {p} needs --microbatches ≥ 2·pp = {2 * p} (its steady "
                f"state pairs a forward of one chunk with a backward of the other; DeepSeek's "
                f"DualPipe, and PyTorch's ScheduleDualPipeV, ask m ≥ stages): got {m}, choose "
                f"{2 * p} or more (or --schedule zbv, which needs m ≥ {p})")
        return v
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


def format_schedule(schedule: Schedule, compute_only: bool = False) -> str:
    """One line per rank, e.g. ``rank 0: F0 SEND_F0→1 F1 SEND_F1→1 RECV_B0←1 B0 …``.
    With ``compute_only`` the SEND/RECV actions are left out."""
    head = (f"{schedule.name}: p={schedule.p} ranks, m={schedule.m} microbatches, "
            f"v={schedule.v} chunk(s) per rank")
    if schedule.placement == "v":
        head += f", V placement (rank r holds stages r and {2 * schedule.p - 1}−r)"
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
