"""The load-balanced causal split of a sequence over the cp ranks, and the checks of a cp layout.

Each sequence of s tokens is cut into 2·cp chunks of c = s / (2·cp) tokens; cp rank i holds
chunks i and 2·cp − 1 − i (the "head-tail" / zig-zag split of Megatron-Core's context
parallelism and PyTorch's ``_HeadTailLoadBalancer``). Under a causal mask query chunk a attends
to key chunks 0..a, the diagonal pair half-masked: counting that pair as ½, rank i does
(i + ½) + (2·cp − 1 − i + ½) = 2·cp chunk-pairs of work, the same on every rank, where a
contiguous split (rank i holds chunks 2i, 2i + 1) gives rank i 4i + 2, the last rank 2·cp − 1
times rank 0's work. docs/context-parallel.md §1.
"""

from __future__ import annotations

import torch

from ...errors import ShardwiseConfigError

CP_METHODS = ("ring", "allgather")


def chunk_ids(cp: int, index: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank ``index`` holds: (index, 2·cp − 1 − index)."""
    return index, 2 * cp - 1 - index


def zigzag_positions(seq_len: int, cp: int, index: int, device=None) -> torch.Tensor:
    """Token positions [s/cp] (int64) of cp rank ``index``'s two chunks, in the order it holds
    them: [i·c, (i+1)·c) then [(2·cp−1−i)·c, (2·cp−i)·c), c = s / (2·cp). Raises
    :class:`ShardwiseConfigError` unless 2·cp divides ``seq_len``."""
    if seq_len % (2 * cp):
        raise ShardwiseConfigError(_seq_message(seq_len, cp))
    c = seq_len // (2 * cp)
    lo, hi = chunk_ids(cp, index)
    return torch.cat([torch.arange(lo * c, (lo + 1) * c, device=device),
                      torch.arange(hi * c, (hi + 1) * c, device=device)])


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """For a packed row's ``documents`` [b, s] (int64, each document one contiguous run of
    equal ids, as :func:`shardwise.data.pack.pack_examples` lays them out): the position [b, s]
    at which each token's document starts. Equal within a document and different between two,
    so it names the documents as well as the ids do, and it says more: under the block-diagonal
    causal mask query t attends exactly the keys u with start(t) ≤ u ≤ t — a rule that needs
    nothing of the keys but their positions (docs/context-parallel.md §1, packed rows)."""
    b, s = documents.shape
    index = torch.arange(s, device=documents.device).expand(b, s)
    new = torch.ones(b, s, dtype=torch.bool, device=documents.device)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]  # the first token of each run
    return torch.where(new, index, 0).cummax(dim=1).values  # [b, s]


def shard_sequence(batch: dict, topo) -> dict:
    """This cp rank's share of a language-model micro-batch: every [b, s] tensor of ``batch``
    (``input_ids``, ``labels``, …) cut to its two chunks [b, s/cp], and ``position_ids``
    [b, s/cp] (int64) added, so RoPE and the labels follow the chunks. The batch unchanged when
    ``topo`` is None, cp = 1, or it has no ``input_ids`` (a regression batch has no sequence).

    A packed batch (``document_ids``, :mod:`shardwise.data.pack`) keeps its own per-document
    ``position_ids``, cut like the tokens (RoPE restarts at every document on every rank), and
    its ``document_ids`` become :func:`document_starts` cut to the chunks: the global position
    where each local token's document starts, which is all the cp core attention needs to mask
    every K/V block it meets (no ids travel). No collective: each cp rank selects its own
    columns of the same rows."""
    if topo is None or topo.size("cp") == 1 or "input_ids" not in batch:
        return batch
    b, s = batch["input_ids"].shape
    pos = zigzag_positions(s, topo.size("cp"), topo.index("cp"), batch["input_ids"].device)
    if "document_ids" in batch:
        batch = {**batch, "document_ids": document_starts(batch["document_ids"])}
    out = {k: (v.index_select(1, pos) if v.dim() == 2 and v.shape == (b, s) else v)
           for k, v in batch.items()}
    if "position_ids" not in batch:
        out["position_ids"] = pos.expand(b, -1)
    return out


def _seq_message(seq_len, cp: int) -> str:
    below = seq_len // (2 * cp) * 2 * cp  # the nearest multiples of 2·cp around it
    good = [m for m in (below, below + 2 * cp) if m > 0]
    return (f"--cp {cp} cuts each sequence into 2·cp = {2 * cp} chunks (the load-balanced causal "
            f"split), but --seq-len {seq_len} is not divisible by {2 * cp}: choose a --seq-len "
            f"that is a multiple of {2 * cp} (e.g. {', '.join(map(str, good))}), or another --cp")


def validate_cp(model_config, cp: int, method: str = "ring", *, seq_len: int | None = None,
                engine: str = "explicit", device: str | None = None) -> None:
    """Raise :class:`ShardwiseConfigError` (no collective) unless context parallelism over
    ``cp`` ranks can run: cp ≥ 1; ``method`` in :data:`CP_METHODS`; not the torch engine on a
    CPU ``device`` (PyTorch's ``context_parallel`` has no CPU attention kernel with a sharding
    rule); with a ``model_config``: a Llama-style model (an MLP has no sequence) without dropout
    (ring attention has no attention dropout, and residual dropout masks would not match one
    process), and 2·cp dividing ``seq_len``."""
    if not isinstance(cp, int) or cp < 1:
        raise ShardwiseConfigError(f"--cp {cp} must be a positive integer")
    if cp == 1:
        return
    if method not in CP_METHODS:
        raise ShardwiseConfigError(
            f"--cp-method {method!r}: choose ring (K/V blocks passed around the cp ring, "
            "overlapped with compute) or allgather (K/V all-gathered, Llama 3's way)")
    if engine == "torch" and (device or "cpu") == "cpu":
        raise ShardwiseConfigError(
            f"--engine torch --cp {cp}: PyTorch's context_parallel does not run on CPU (torch "
            "2.13 under gloo: NotImplementedError: Operator "
            "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
            "strategy registered); use --engine explicit (our ring attention) on CPU, or "
            "--device cuda")
    if model_config is None:
        return
    if not hasattr(model_config, "n_kv_heads"):
        raise ShardwiseConfigError(
            f"--cp {cp} splits each sequence over ranks, but this model "
            f"({type(model_config).__name__}) has no sequence: choose --model tiny, small or "
            "base, or --cp 1")
    if getattr(model_config, "dropout", 0.0):
        raise ShardwiseConfigError(
            f"--cp {cp} with dropout={model_config.dropout}: ring attention has no attention "
            "dropout, and each cp rank would draw its own residual dropout masks (docs/"
            "context-parallel.md, pitfalls): set dropout 0 (Llama-style pretraining uses "
            "none), or --cp 1")
    if seq_len is not None and seq_len % (2 * cp):
        raise ShardwiseConfigError(_seq_message(seq_len, cp))
