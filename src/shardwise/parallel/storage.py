"""Where and in which dtype the model state lives: the parameters' storage dtype, their master
copy (:class:`~shardwise.precision.Precision`) and host offload (``--offload``), and the rules
of what the engines wire (:func:`check_storage`, called by :meth:`~.layout.Layout.check`).
"""

from __future__ import annotations

from ..errors import ShardwiseConfigError
from ..precision import Precision

OFFLOADS = ("none", "optimizer", "params")


def check_storage(layout, precision: Precision, offload: str, engine: str) -> None:
    """Where and in which dtype the model state lives — ``precision.param_dtype`` (and its
    master copy) and ``offload`` ("none" | "optimizer" | "params") — against what the engines
    wire for ``layout`` on ``engine``: the one definition ``train`` and the planner share.
    Raises :class:`ShardwiseConfigError`."""
    if offload not in OFFLOADS:
        raise ShardwiseConfigError(f"--offload {offload!r}: choose none, optimizer or params")
    if precision.param_dtype != "fp32":
        raise ShardwiseConfigError(
            f"--param-dtype {precision.param_dtype} is not wired in {layout.name()} yet: use "
            "--param-dtype fp32 (with --dtype bf16 for bf16 compute)")
    if offload != "none":
        raise ShardwiseConfigError(f"--offload {offload} is not wired in {layout.name()} yet: "
                                   "use --offload none")
