"""Predicted MFU against the number of GPUs, one line per strategy family (PNG).

For each GPU count, :func:`shardwise.plan.search.search` ranks every layout; each family
(:func:`shardwise.plan.search.family`: DP, ZeRO-1/2, FSDP (ZeRO-3), TP + DP, PP + DP,
TP + PP + DP, CP + any, EP + any) contributes its best layout that fits. A family with no
fitting layout at a count leaves a gap in its line, so the plot also shows where each strategy
stops fitting in memory.
"""

from __future__ import annotations

from .layout import Assumptions
from .hardware import Cluster
from .models import ModelSpec
from .search import FAMILIES, Fixed, best_by_family, search


def mfu_by_family(model: ModelSpec, cluster: Cluster, gpu_counts: list[int], global_batch: int,
                  precision: str | list[str] | None = None,
                  assumptions: Assumptions = Assumptions(), fixed: Fixed = Fixed()) -> dict[str, list[float | None]]:
    """{family: [best fitting MFU at each count, or None]} for ``gpu_counts``. Counts whose
    layouts cannot split ``global_batch`` give None everywhere."""
    from ..errors import ShardwiseConfigError

    out: dict[str, list[float | None]] = {f: [] for f in FAMILIES}
    for g in gpu_counts:
        try:
            best = best_by_family(search(model, cluster, g, global_batch, fixed, precision,
                                         assumptions))
        except ShardwiseConfigError:
            best = {}
        for fam in FAMILIES:
            out[fam].append(best[fam].mfu if fam in best else None)
    return out


def plot_mfu_vs_gpus(model: ModelSpec, cluster: Cluster, gpu_counts: list[int],
                     global_batch: int, path: str, precision: str | list[str] | None = None,
                     assumptions: Assumptions = Assumptions(), fixed: Fixed = Fixed()) -> dict:
    """Write the PNG to ``path``; returns the data plotted (:func:`mfu_by_family`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = mfu_by_family(model, cluster, gpu_counts, global_batch, precision, assumptions, fixed)
    fig, ax = plt.subplots(figsize=(8, 5))
    for fam, ys in data.items():
        pts = [(g, 100 * y) for g, y in zip(gpu_counts, ys) if y is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=fam)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted MFU (%)")
    ax.set_ylim(bottom=0)
    tokens = global_batch * model.seq_len
    ax.set_title(f"{model.name} on {cluster.gpu.name}, {tokens / 2**20:g}M tokens/step: best "
                 "layout that fits, per family", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return data
