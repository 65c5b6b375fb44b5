"""The parallel axes (pp, dp, cp, tp) over torch's DeviceMesh: ranks, one process group per axis.

Ranks are laid out as one grid of shape ``(pp, dp, cp, tp)``, outermost first, so TP neighbours
are consecutive global ranks (on one node, on the fastest links), CP next (its ring sends K/V
blocks every layer), and PP is the outermost axis (Megatron-LM, Narayanan et al. 2021 §3.3;
Megatron-Core's tp-cp-ep-dp-pp order; torchtitan's ParallelDims). For global rank ``r``::

    r = ((pp_index · dp + dp_index) · cp + cp_index) · tp + tp_index

Parameters are replicated over dp *and* cp (CP splits the sequence, not the model), so the
gradient sync runs over the two flattened: :attr:`Topology.data_axis` is "dp", or "dp_cp" (the
dp × cp ranks of this rank's (pp, tp) position, dp-major) when cp > 1 — torchtitan's
``dp_shard_cp``.

A :class:`Topology` is created collectively by every rank of the world and passed explicitly to
whatever needs it (never a global). It owns the :class:`~shardwise.comm.Ledger` in which every
collective over its groups is booked.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from .comm.algorithms import check_collectives as check_algorithms
from .comm.fingerprint import CollectiveChecks
from .comm.groups import claim_p2p, group_device, new_groups
from .comm.ledger import Ledger
from .errors import ShardwiseConfigError

AXES = ("pp", "dp", "cp", "tp")


def validate_degrees(pp: int, dp: int, tp: int, world_size: int, cp: int = 1) -> None:
    """Raise :class:`ShardwiseConfigError` unless every degree ≥ 1 and pp·dp·cp·tp ==
    world_size."""
    for name, d in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
        if not isinstance(d, int) or d < 1:
            raise ShardwiseConfigError(f"--{name} {d} must be a positive integer")
    if pp * dp * cp * tp != world_size:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        names = "dp × cp × tp × pp" if cp > 1 else "dp × tp × pp"
        values = f"{dp} × {cp} × {tp} × {pp}" if cp > 1 else f"{dp} × {tp} × {pp}"
        product = dp * cp * tp * pp
        raise ShardwiseConfigError(
            f"{names} = {values} = {product} does not equal the world size "
            f"{world_size}: choose degrees whose product is {world_size} (each from {divisors}), "
            f"or launch {product} processes")


def check_ep_degree(ep, dp: int, cp: int = 1) -> None:
    """EP ⊆ dp × cp, the rule written once (:class:`Topology`, :func:`~shardwise.parallel.ep.
    validate_ep` and so :meth:`~shardwise.parallel.layout.Layout.check_rules`, the engine's and
    the planner's): raise :class:`ShardwiseConfigError` unless ``ep`` is a positive integer
    dividing dp × cp (the expert-parallel ranks split the ranks of the data axis)."""
    if not isinstance(ep, int) or ep < 1:
        raise ShardwiseConfigError(f"--ep {ep} must be a positive integer")
    n = dp * cp
    if n % ep:
        raise ShardwiseConfigError(
            f"--ep {ep} must divide dp × cp = {dp} × {cp} = {n}: expert parallelism splits the "
            f"ranks of the data axis (EP ⊆ dp × cp); choose --ep from "
            f"{[k for k in range(1, n + 1) if n % k == 0]} or raise --dp")


def check_dp_replicate(dp_replicate, dp: int) -> None:
    """HSDP's split dp = dp_replicate × dp_shard, the rule written once (:class:`Topology`,
    :meth:`~shardwise.parallel.layout.Layout.check_rules`, the engine's and the planner's):
    raise :class:`ShardwiseConfigError` unless ``dp_replicate`` is a positive integer dividing
    ``dp``."""
    if not isinstance(dp_replicate, int) or isinstance(dp_replicate, bool) or dp_replicate < 1:
        raise ShardwiseConfigError(f"--dp-replicate {dp_replicate!r} must be a positive integer")
    if dp % dp_replicate:
        raise ShardwiseConfigError(
            f"--dp-replicate {dp_replicate} must divide dp = {dp}: HSDP splits dp into "
            f"dp_replicate × dp_shard; choose from "
            f"{[k for k in range(1, dp + 1) if dp % k == 0]}")


def axis_lines(grid: torch.Tensor, ep: int = 1,
               dp_replicate: int = 1) -> dict[str, list[list[int]]]:
    """Axis → the ranks of each of its lines, for the rank ``grid`` [pp, dp, cp, tp], in the
    order :class:`Topology` creates the groups: every axis (its dim moved last, the others
    flattened; cp's only when cp > 1), "dp_cp" (dp × cp flattened, dp-major, for the gradient
    sync; when cp > 1), "ep" and "edp" (when ep > 1), "dp_shard" and "dp_replicate" (HSDP) and
    "pp_batch" (when pp > 1). No collective."""
    pp, dp, cp, tp = grid.shape
    lines_of = {axis: grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
                for dim, axis in enumerate(AXES) if axis != "cp" or cp > 1}
    data_lines = grid.permute(0, 3, 1, 2).reshape(pp * tp, dp * cp).tolist()
    if cp > 1:
        lines_of["dp_cp"] = data_lines
    # expert parallelism inside each data line: ep consecutive data ranks share out the
    # experts ("ep"); the ranks holding the same experts ("edp", expert-data-parallel) sum
    # their gradients (Megatron-Core's expert_model_parallel / expert_data_parallel)
    if 1 < ep:
        lines_of["ep"] = [line[g:g + ep] for line in data_lines for g in range(0, dp * cp, ep)]
    if 1 < ep < dp * cp:
        lines_of["edp"] = [line[j::ep] for line in data_lines for j in range(ep)]
    if dp_replicate > 1:  # HSDP inside each dp line: index r·S + s, S = dp / R
        shard = dp // dp_replicate
        dp_lines = lines_of["dp"]
        lines_of["dp_shard"] = [line[r:r + shard] for line in dp_lines
                                for r in range(0, dp, shard)]
        lines_of["dp_replicate"] = [line[j::shard] for line in dp_lines for j in range(shard)]
    # PyTorch's pipelining (batch_isend_irecv) gets its own communicator of the pp ranks:
    # never mixed with our single isend/irecv on "pp" (NCCL hazard 3, comm/groups.py)
    if pp > 1:
        lines_of["pp_batch"] = lines_of["pp"]
    return lines_of


def backend_for(device: str) -> str:
    """The process-group backend that follows the device type: gloo for cpu, nccl for cuda, …
    (``device`` "auto": of the type :func:`resolve_device` picks)."""
    dtype = torch.device(resolve_device(device)[0] if device == "auto" else device).type
    backend = dist.Backend.default_device_backend_map.get(dtype)
    if backend is None:
        raise ShardwiseConfigError(f"--device {device}: no torch.distributed backend for "
                                   f"device type {dtype!r}; use cpu or cuda")
    return backend


def resolve_device(device: str = "auto") -> tuple[str, str]:
    """The device type a run computes on and why, for ``--device`` ``device``: ``("cuda",
    "auto: CUDA available")`` when ``device`` is "auto" and torch sees a CUDA device, else
    ``("cpu", "auto: no CUDA")``; "cpu" and "cuda" force the choice (``("cuda", "--device
    cuda")``). The one place the choice is made: the launcher (fork gloo workers on CPU, new
    interpreters on GPU), :func:`init_distributed` (the backend follows the device type:
    :func:`backend_for`; on CUDA each rank takes its ``LOCAL_RANK``'s GPU), the config check
    and the start-up line call it. The index is not part of the choice: each rank's GPU is its
    ``LOCAL_RANK`` (set by torchrun and by :func:`shardwise.launch.spawn`)."""
    if device != "auto":
        return device, f"--device {device}"
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", "auto: CUDA available"
    return "cpu", "auto: no CUDA"


def check_local_gpus(device: str, local_ranks: int) -> None:
    """On CUDA, one GPU per local rank: raise :class:`ShardwiseConfigError` when ``local_ranks``
    ranks of this node (the launcher's world, torchrun's ``LOCAL_WORLD_SIZE``) would share
    fewer GPUs (NCCL refuses two ranks on one GPU). No-op on CPU."""
    kind = resolve_device(device)[0]
    if kind != "cuda":
        return
    have = torch.cuda.device_count()
    if 0 < have < local_ranks:  # none at all: config.validate refused --device cuda already
        auto = " (--device auto found CUDA)" if device == "auto" else ""
        raise ShardwiseConfigError(
            f"{local_ranks} ranks on this node but torch sees {have} CUDA device"
            f"{'' if have == 1 else 's'}{auto}: one GPU per rank; run at most {have} on this "
            f"node (a layout of {have} rank{'' if have == 1 else 's'}, or torchrun "
            f"--nproc-per-node {have}), or use --device cpu")


def free_port() -> int:
    """A free TCP port on localhost (for spawning a local world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "cpu", timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun-style env vars and return
    ``(rank, world_size)``. Without ``WORLD_SIZE`` in the environment, a world of one process
    (in-memory store). The backend follows ``device`` (cpu, cuda, or auto: resolved by
    :func:`resolve_device`; on CUDA this rank's ``LOCAL_RANK`` GPU, one per local rank:
    :func:`check_local_gpus`); every collective times out after
    ``timeout_s`` seconds (and sub-groups get the same timeout, see :class:`Topology`).

    Under torchrun with its shared rendezvous store (``TORCHELASTIC_USE_AGENT_STORE=True``, the
    default), the store outlives a restart attempt, and a restarted group can read a dead peer's
    address from the attempt before (gloo: ``connectFullMesh failed … Connection refused``;
    pytorch/pytorch#135712). So every attempt's keys live under their own prefix
    (``TORCHELASTIC_RESTART_COUNT``): ``--max-restarts`` works without
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    device = resolve_device(device)[0]
    if "WORLD_SIZE" in os.environ:
        check_local_gpus(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    bind = {}
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # eager NCCL init of the world communicator, and the device every sub-group binds to
        bind["device_id"] = group_device(torch.device("cuda", torch.cuda.current_device()))
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **bind)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's shared store
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world,
                                store=dist.PrefixStore(f"shardwise/attempt_{attempt}/", store),
                                **bind)
    else:
        dist.init_process_group(backend, timeout=timeout, **bind)
    return dist.get_rank(), dist.get_world_size()


class Topology:
    """The parallel axes of one layout over a set of ranks ``ranks`` (default: the whole world).

    Create it on **every** rank of the world, in the same order (group creation is collective);
    ranks outside ``ranks`` get an object with ``member == False`` and must not use it.

    Attributes: ``degrees`` {"pp","dp","cp","tp"} → int; ``coords`` this rank's index on each
    axis; ``data_axis`` "dp", or "dp_cp" when cp > 1 (the flattened dp × cp lines, dp-major:
    where gradients are summed); ``ep`` and the axes "ep"/"edp" (expert parallelism inside the
    data axis); ``dp_replicate`` R and ``shard_axis`` (HSDP: dp = R × S, replicate outer; ZeRO
    shards over "dp_shard" and all-reduces over "dp_replicate"; without HSDP the data axis);
    ``mesh`` a ``DeviceMesh`` with dims ("pp","dp","tp"), and "cp" between dp and tp when
    cp > 1 (HSDP: "dp" as "dp_replicate", "dp_shard"), for PyTorch's own parallel APIs;
    ``ledger`` where every collective on these groups is booked; ``device`` torch.device
    (from ``device`` "cpu", "cuda" or "auto": :func:`resolve_device`; CUDA's with the index);
    ``collectives`` which implementation :mod:`shardwise.comm.ops` runs its collectives with
    ("native": the backend's; "ring", "tree", "auto": :mod:`shardwise.comm.algorithms` over
    point-to-point sends), chosen once per run. Raises :class:`ShardwiseConfigError` for an
    unknown ``collectives``.
    ``checks`` the :class:`~shardwise.comm.fingerprint.CollectiveChecks` that fingerprint them
    and compare them across ranks (``check_collectives``: "off", "step" or "every").
    """

    def __init__(self, pp: int = 1, dp: int = 1, tp: int = 1, *, cp: int = 1, ep: int = 1,
                 dp_replicate: int = 1, device: str = "cpu", ranks: list[int] | None = None,
                 timeout_s: float = 300.0,
                 collectives: str = "native", check_collectives: str = "step"):
        self.collectives = check_algorithms(collectives)  # before any group is created
        world = dist.get_world_size()
        ranks = list(range(world)) if ranks is None else list(ranks)
        validate_degrees(pp, dp, tp, len(ranks), cp)
        check_ep_degree(ep, dp, cp)
        check_dp_replicate(dp_replicate, dp)
        self.degrees = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        self.ep = ep
        # HSDP: dp = dp_replicate × dp_shard (replicate outer): ZeRO shards over "dp_shard" and
        # all-reduces the shards over "dp_replicate" (the shard axis is the data axis without it)
        self.dp_replicate = dp_replicate
        self.shard_axis = "dp_shard" if dp_replicate > 1 else ("dp_cp" if cp > 1 else "dp")
        self.data_axis = "dp_cp" if cp > 1 else "dp"
        self.ranks = ranks
        self.rank = dist.get_rank()
        self.member = self.rank in ranks
        self.device = torch.device(resolve_device(device)[0] if device == "auto" else device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ledger = Ledger()
        # fingerprints of every collective on these groups, compared across ranks at each step
        # boundary (``check_collectives``: off | step | every; see comm/fingerprint.py)
        self.checks = CollectiveChecks(self, check_collectives, timeout_s)
        self.grid = torch.tensor(ranks, dtype=torch.long).reshape(pp, dp, cp, tp)
        timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._axis_ranks: dict[str, list[int]] = {}
        # every group, eagerly, in one recorded order; device_id bound on CUDA (hazards 1, 2)
        self.group_record: list[tuple[str, tuple[int, ...]]] = []
        for axis, (group, line) in new_groups(axis_lines(self.grid, ep, dp_replicate), self.rank,
                                              self.device, timeout,
                                              self.group_record).items():
            self._groups[axis], self._axis_ranks[axis] = group, line
        if cp == 1:  # one rank per cp line: this rank alone; dp_cp is dp
            self._axis_ranks["cp"] = [self.rank]
            if "dp" in self._groups:
                self._groups["dp_cp"], self._axis_ranks["dp_cp"] = (self._groups["dp"],
                                                                    self._axis_ranks["dp"])
        if ep == 1 and "dp_cp" in self._groups:  # no expert parallelism: edp is the data axis
            self._axis_ranks["ep"] = [self.rank]
            self._groups["edp"], self._axis_ranks["edp"] = (self._groups["dp_cp"],
                                                            self._axis_ranks["dp_cp"])
        elif ep == dp * cp:  # every data rank holds other experts: nothing to sum over
            self._axis_ranks["edp"] = [self.rank]
        # the whole layout as one more axis, for run-level agreement (output folder, verify)
        world_group = new_groups({"world": [ranks]}, self.rank, self.device, timeout,
                                 self.group_record).get("world")
        self._world_group = world_group[0] if world_group else None
        self._groups["world"], self._axis_ranks["world"] = self._world_group, ranks
        self.coords = {}
        self.mesh = None
        if self.member:
            idx = (self.grid == self.rank).nonzero()[0].tolist()
            self.coords = dict(zip(AXES, idx))
            from torch.distributed.device_mesh import DeviceMesh

            dims = tuple(a for a in AXES if a in self._groups)
            grid = self.grid if cp > 1 else self.grid.squeeze(2)
            if dp_replicate > 1:  # HSDP: dp as (dp_replicate, dp_shard), for FSDP2's 2-D mesh
                i = dims.index("dp")
                dims = dims[:i] + ("dp_replicate", "dp_shard") + dims[i + 1:]
                shape = list(grid.shape)
                grid = grid.reshape(*shape[:i], dp_replicate, dp // dp_replicate,
                                    *shape[i + 1:])
            self.mesh = DeviceMesh.from_group([self._groups[a] for a in dims], self.device.type,
                                              mesh=grid, mesh_dim_names=dims)

    # -- queries -----------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        """Degree of ``axis`` ("pp", "dp", "cp", "tp", "dp_cp" = dp·cp, or "world" = all ranks
        of the layout)."""
        if axis == "world":
            return self.world_size
        if axis == "dp_cp":
            return self.degrees["dp"] * self.degrees["cp"]
        if axis == "ep":
            return self.ep
        if axis == "edp":
            return self.degrees["dp"] * self.degrees["cp"] // self.ep
        if axis == "dp_replicate":
            return self.dp_replicate
        if axis == "dp_shard":
            return self.degrees["dp"] // self.dp_replicate
        return self.degrees[axis]

    def index(self, axis: str) -> int:
        """This rank's index along ``axis`` (0 ≤ index < size(axis); "dp_cp": dp·cp + cp)."""
        if axis == "world":
            return self.ranks.index(self.rank)
        if axis == "dp_cp":
            return self.coords["dp"] * self.degrees["cp"] + self.coords["cp"]
        if axis == "ep":
            return self.index("dp_cp") % self.ep
        if axis == "edp":
            return self.index("dp_cp") // self.ep
        if axis == "dp_replicate":
            return self.coords["dp"] // self.size("dp_shard")
        if axis == "dp_shard":
            return self.coords["dp"] % self.size("dp_shard")
        return self.coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank's line along ``axis`` ("dp_cp" is "dp"'s when cp = 1;
        KeyError for "cp" when cp = 1: nothing runs over a line of one rank)."""
        return self._groups[axis]

    def p2p_group(self, axis: str, style: str) -> dist.ProcessGroup:
        """The group of ``axis`` for point-to-point messages of ``style`` ("single": our
        ``comm.ops.send``/``recv``; "batch": ``batch_isend_irecv``, e.g. PyTorch's pipelining
        schedules, on a communicator of its own: "pp_batch" for "pp"). Claims the style
        (:func:`~shardwise.comm.groups.claim_p2p`: raises ``NcclHazard`` on a mix)."""
        group = self._groups[f"{axis}_batch" if style == "batch" and f"{axis}_batch" in
                             self._groups else axis]
        claim_p2p(group, style)
        return group

    def global_rank(self, axis: str, index: int) -> int:
        """Global rank of the member with ``index`` on this rank's line along ``axis``."""
        return self._axis_ranks[axis][index]

    def axis_of_ranks(self, ranks) -> str | None:
        """The axis whose line through this rank is exactly the global ``ranks`` (any order),
        or None. Lets code that only sees a process group (e.g. DTensor's collectives, which may
        run on an equal mesh created for an earlier layout) name its axis."""
        want = sorted(ranks)
        for axis in ("tp", "cp", "dp", "dp_cp", "dp_shard", "dp_replicate", "ep", "edp", "pp",
                     "world"):
            if axis in self._axis_ranks and sorted(self._axis_ranks[axis]) == want:
                return axis
        return None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        """E.g. ``"pp=1 × dp=2 × tp=1 (2 ranks)"``, ``"pp=1 × dp=2 × cp=2 × tp=1 (4 ranks)"``."""
        d = self.degrees
        cp = f" × cp={d['cp']}" if d["cp"] > 1 else ""
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        dp = (f"(dp_replicate={self.dp_replicate} × dp_shard={self.size('dp_shard')})"
              if self.dp_replicate > 1 else f"{d['dp']}")
        return f"pp={d['pp']} × dp={dp}{cp} × tp={d['tp']}{ep} ({self.world_size} rank{'' if self.world_size == 1 else 's'})"
