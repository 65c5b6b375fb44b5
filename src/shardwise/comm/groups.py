"""Process groups created the way NCCL needs them, and the point-to-point style of each.

Hazards that pass on gloo and hang or corrupt on NCCL (docs/troubleshooting.md "NCCL hazards"):

1. A sub-group created without ``device_id`` gets its NCCL communicator lazily, at its first
   collective; pipeline stages reach their first collective in different orders, and a lazy
   ``ncclCommInitRank`` on one rank waits for a peer that is blocked in another group's
   collective: a deadlock. :func:`new_groups` passes ``device_id`` (the topology's CUDA device)
   to ``torch.distributed.new_group``, which binds the communicator eagerly (torch ≥ 2.3;
   ``new_group(..., device_id=...)``), and passes None on any other device (gloo needs none).
2. Every rank must create every group (group creation is collective over the world), in one
   order. :func:`new_groups` creates all lines of all axes in the order of ``lines_of`` (a dict:
   insertion order), and appends ``(axis, line)`` to ``record`` for every group, so a test can
   gather every rank's record and compare them (``tests/test_nccl_hazards.py``).
3. NCCL must not see blocking/individual ``send``/``recv`` (``isend``/``irecv``) and
   ``batch_isend_irecv`` mixed on one communicator (a grouped launch interleaved with single
   ones can pair mismatched messages or hang). :func:`claim_p2p` records the one style each
   communicator is used with and raises :class:`NcclHazard` on a second style; shardwise's own
   sends (``comm.ops.send``/``recv``, ``comm.algorithms``) claim ``"single"``, PyTorch's
   pipelining schedules (``batch_isend_irecv``) get their own communicator of the same ranks
   (``Topology.p2p_group("pp", "batch")``).

On CPU every sub-group is a gloo group on this process's one gloo device (:data:`SHARED_GLOO`):
``new_group(backend="gloo")`` gives each group a device of its own, whose TCP event loop wakes
every 10 ms; a verify world holds hundreds of groups, and their idle wake-ups took up to half of
two cores in kernel time (``vmstat``: sys 28–50 %, 120k context switches/s in the suite).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

P2P_STYLES = ("single", "batch")  # isend/irecv (or blocking send/recv) | batch_isend_irecv
SHARED_GLOO = "gloo_shared"  # the backend of CPU sub-groups: gloo on one device per process
_DEVICES: dict[int, list] = {}  # pid → [its gloo device] (a forked worker makes its own)


def _shared_gloo(store, rank: int, size: int, timeout):
    """A ``ProcessGroupGloo`` of ``size`` ranks on this process's one gloo device (one TCP event
    loop for all its groups), with ``timeout``; registered as backend :data:`SHARED_GLOO`."""
    devices = _DEVICES.setdefault(os.getpid(), [])
    if not devices:
        devices.append(dist.ProcessGroupGloo.create_default_device())
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout, opts._devices = timeout, devices
    group = dist.ProcessGroupGloo(store, rank, size, opts)
    group._set_sequence_number_for_group()  # as torch does for its own gloo groups
    return group


if dist.is_available() and SHARED_GLOO.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(SHARED_GLOO, _shared_gloo, devices=["cpu"])


class NcclHazard(RuntimeError):
    """A use of torch.distributed that works on gloo but can hang or corrupt on NCCL."""


def group_device(device: torch.device) -> torch.device | None:
    """The ``device_id`` to bind a new group's communicator to: ``device`` when it is a CUDA
    device with an index (eager NCCL init), else None (gloo, CPU: nothing to bind)."""
    device = torch.device(device)
    if device.type == "cuda":
        return device if device.index is not None else torch.device(
            "cuda", torch.cuda.current_device())
    return None


def new_groups(lines_of: dict[str, list[list[int]]], rank: int, device, timeout,
               record: list[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[dist.ProcessGroup,
                                                                              list[int]]]:
    """Create one process group per line of every axis, on every rank, in the order of
    ``lines_of`` (axis → its lines, each a list of global ranks) and of each axis's lines.

    ``device``: the topology's device; a CUDA device is bound as ``device_id`` (eager NCCL
    communicators, hazard 1). ``timeout``: ``datetime.timedelta`` for every group. Appends
    ``(axis, tuple(line))`` to ``record`` for each group created (identical on every rank when
    the order is deterministic, hazard 2). Returns axis → (this rank's group, its line) for the
    axes where ``rank`` is on a line. Collective: every rank of the world must call it with the
    same ``lines_of``.
    """
    device_id = group_device(device)
    kwargs = {"timeout": timeout}
    if device_id is not None:
        kwargs["device_id"] = device_id
    elif device.type == "cpu" and dist.get_backend() == "gloo":  # not a fake world (estimate)
        kwargs["backend"] = SHARED_GLOO
    mine: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
    for axis, lines in lines_of.items():
        for line in lines:
            group = dist.new_group(list(line), **kwargs)
            record.append((axis, tuple(line)))
            if rank in line:
                mine[axis] = (group, list(line))
    return mine


def compare_records(records: list[list[tuple[str, tuple[int, ...]]]]) -> None:
    """Raise :class:`NcclHazard` unless every rank's group-creation record (``records[r]``, as
    :func:`new_groups` appends it; gathered from every rank) is the same as rank 0's: the
    message names the first rank and position that differ (hazard 2)."""
    first = records[0]
    for r, rec in enumerate(records[1:], 1):
        for i, (a, b) in enumerate(zip(first, rec)):
            if a != b:
                raise NcclHazard(
                    f"rank {r} created group #{i} {b} where rank 0 created {a}: every rank "
                    "must create every group in one order (NCCL initialises communicators "
                    "collectively); create groups only in comm.groups.new_groups")
        if len(rec) != len(first):
            raise NcclHazard(f"rank {r} created {len(rec)} groups, rank 0 {len(first)}: every "
                             "rank must create every group")


# communicator (its unique ``group_name`` in this process) → the point-to-point style it carries
_STYLES: dict[str, str] = {}


def _key(group) -> str:
    group = dist.group.WORLD if group is None else group
    return getattr(group, "group_name", None) or str(id(group))


def claim_p2p(group, style: str) -> None:
    """Record that ``group`` carries point-to-point messages of ``style`` ("single":
    ``isend``/``irecv``/``send``/``recv``; "batch": ``batch_isend_irecv``). Raises
    :class:`NcclHazard` if it was claimed with the other style (hazard 3), ValueError for an
    unknown style. ``group`` None is the default (world) group."""
    if style not in P2P_STYLES:
        raise ValueError(f"point-to-point style {style!r}: choose from {P2P_STYLES}")
    name = _key(group)
    held = _STYLES.get(name)
    if held is None:
        _STYLES[name] = style
    elif held != style:
        raise NcclHazard(
            f"process group {name} carries {held!r} point-to-point messages and now "
            f"{style!r}: NCCL can hang when batch_isend_irecv and single send/recv share a "
            "communicator; give the batched path its own group "
            "(Topology.p2p_group(axis, 'batch'))")


def p2p_style(group) -> str | None:
    """The style ``group`` was claimed with, or None."""
    return _STYLES.get(_key(group))
