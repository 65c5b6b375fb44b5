"""Worker for tests/test_cp_pack.py: packed SFT rows under context parallelism, one 4-rank world.

The tiny Llama (seed 0) takes one step on packed rows (chat examples of
examples/chat_sample.jsonl, several per row, most longer than a cp = 4 chunk of 32 tokens,
assistant-only labels) in each case of :data:`CASES`: cp = 2 (ranks 0, 1) and cp = 4 with ring
and all-gather attention, cp = 2 × dp = 2, cp = 2 × tp = 2, pp = 2 × cp = 2, cp = 4 on one
row holding one short document (ranks whose chunks hold no counted token; blocks skipped), and
learned positions at cp = 2. The planted breaks, at cp = 2 (ring):

* ``positions_continue``: the rows' positions 0..s−1 instead of restarting at each document
  (learned positions: RoPE is relative, so within a document a constant shift is invisible to it);
* ``positions_per_chunk``: RoPE positions restarting at each rank's chunks instead of at each
  document;
* ``mask_dropped_at_chunk_boundary``: the document mask applied inside a chunk only (a key
  block of another chunk fully visible, none skipped).

Each rank writes ``<out>/<case>_rank<r>.pt``: the step's loss, its token count (global) and
this rank's, every full-shape gradient, and the ledger's bytes of the cp tags with the formula's.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.data.pack import pack_examples, unpadded
from shardwise.data.sft import prepare_sft_data
from shardwise.formulas import step_bytes_formula
from shardwise.models import Llama, LlamaConfig, count_items
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.cp import attention as cp_attention
from shardwise.parallel.cp import chunk_ids, shard_sequence, zigzag_positions
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

CHAT = Path(__file__).parent.parent.parent / "examples" / "chat_sample.jsonl"
SEQ, EXAMPLES = 256, 10


def examples(which: str = "all") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first EXAMPLES chat examples ("all"; "one": the first only): (inputs, labels), each
    [n_i] int64."""
    data = prepare_sft_data(CHAT, "bytes", seq_len=SEQ)
    n = EXAMPLES if which == "all" else 1
    return unpadded(data.train[:n], data.train_labels[:n], data.train_lengths[:n])


def batches(which: str = "all") -> dict:
    """The packed global batch of :func:`examples` (an even number of rows for "all": a row of
    padding only is added when the examples fill an odd number, for cp × dp = 2 × 2)."""
    p = pack_examples(*examples(which), SEQ, 0)
    packed = {"input_ids": p.input_ids, "labels": p.labels, "position_ids": p.position_ids,
              "document_ids": p.document_ids}
    if which == "all" and len(p) % 2:
        pad = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long),
               "labels": torch.full((1, SEQ), -100), "position_ids": torch.arange(SEQ)[None],
               "document_ids": torch.full((1, SEQ), -1)}
        packed = {k: torch.cat([v, pad[k]]) for k, v in packed.items()}
    return packed


def model(pos: str = "rope") -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=64, max_seq_len=SEQ, pos=pos))


def continuing(batch: dict) -> dict:
    """Planted: positions 0..s−1 along the row, not restarting at each document."""
    return {**batch, "position_ids": torch.arange(SEQ).expand_as(batch["input_ids"])}


def per_chunk(batch: dict) -> dict:
    """Planted: positions that become 0..s/2−1 on each cp = 2 rank after the split."""
    pos = torch.empty(SEQ, dtype=torch.long)
    for r in range(2):
        pos[zigzag_positions(SEQ, 2, r)] = torch.arange(SEQ // 2)
    return {**batch, "position_ids": pos.expand_as(batch["input_ids"])}


# name: (layout, (dp, cp, tp[, pp]), ranks (None: all four), examples, model positions,
#        batch tweak)
CASES = {"cp2": (Layout(cp=2), (1, 2, 1), [0, 1], "all", "rope", None),
         "cp2_allgather": (Layout(cp=2, cp_method="allgather"), (1, 2, 1), [0, 1], "all", "rope",
                           None),
         "cp4": (Layout(cp=4), (1, 4, 1), None, "all", "rope", None),
         "cp4_allgather": (Layout(cp=4, cp_method="allgather"), (1, 4, 1), None, "all", "rope",
                           None),
         "cp2_dp2": (Layout(dp=2, cp=2), (2, 2, 1), None, "all", "rope", None),
         "cp2_tp2": (Layout(cp=2, tp=2), (1, 2, 2), None, "all", "rope", None),
         "cp2_pp2": (Layout(pp=2, cp=2, microbatches=2), (1, 2, 1, 2), None, "all", "rope",
                     None),
         "cp4_one_document": (Layout(cp=4), (1, 4, 1), None, "one", "rope", None),
         "cp2_learned": (Layout(cp=2), (1, 2, 1), [0, 1], "all", "learned", None),
         # the planted breaks
         "positions_continue": (Layout(cp=2), (1, 2, 1), [0, 1], "all", "learned", continuing),
         "positions_per_chunk": (Layout(cp=2), (1, 2, 1), [0, 1], "all", "rope", per_chunk),
         "mask_dropped_at_chunk_boundary": (Layout(cp=2), (1, 2, 1), [0, 1], "all", "rope",
                                            None)}
BREAKS = ("positions_continue", "positions_per_chunk", "mask_dropped_at_chunk_boundary")


def run_case(topo, layout, batch, pos: str = "rope") -> dict:
    engine = parallelize(model(pos), topo, layout, seed=0)
    opt = build_optimizer(engine, TrainConfig(model="tiny", lr=1e-3))
    dp, i = topo.size("dp"), topo.index("dp")
    rows = batch["input_ids"].shape[0] // dp
    local = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
    m = layout.microbatches or 1
    mbs = [dict(zip(local, parts)) for parts in zip(*(v.split(rows // m)
                                                      for v in local.values()))]
    topo.ledger.records.clear()
    res = train_step(engine, mbs, opt, topo, max_norm=0.0, zero_grad=False)
    formula = step_bytes_formula(engine, topo, micro_steps=1, sequences=rows, seq_len=SEQ)
    return {"loss": res.loss, "tokens": res.tokens,
            "local_tokens": sum(count_items(shard_sequence(mb, topo)) for mb in mbs),
            "grads": {n: g.detach().clone() for n, g in engine.named_full_gradients().items()},
            "ledger": {t: topo.ledger.step_bytes(t) for t in ("cp_kv", "cp_dkv")},
            "formula": {t: formula.get(t, 0.0) for t in ("cp_kv", "cp_dkv")}}


def mask_dropped_at_chunk_boundary(topo):
    """The planted break: the document mask kept inside each chunk only (a key block of another
    chunk fully visible and never skipped). Returns the undo."""
    hidden, packed = cp_attention._hidden, cp_attention._packed
    me = topo.index("cp")

    def inside_only(starts, qa, key_chunk, c):
        return hidden(starts, qa, key_chunk, c) if key_chunk == chunk_ids(2, me)[qa] else None

    cp_attention._hidden = inside_only
    cp_attention._packed = lambda mask, c: (packed(mask, c)[0], None)

    def undo():
        cp_attention._hidden, cp_attention._packed = hidden, packed
    return undo


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=120)
    rank = dist.get_rank()
    topos = {}
    for name, (layout, (dp, cp, tp, *pp), ranks, which, pos, tweak) in CASES.items():
        key = (dp, cp, tp, *pp, tuple(ranks or range(4)))
        if key not in topos:
            topos[key] = Topology(pp=pp[0] if pp else 1, dp=dp, cp=cp, tp=tp,
                                  ranks=ranks or range(4), timeout_s=120)
        topo = topos[key]
        if not topo.member:
            continue
        batch = batches(which) if tweak is None else tweak(batches(which))
        undo = mask_dropped_at_chunk_boundary(topo) \
            if name == "mask_dropped_at_chunk_boundary" else None
        try:
            torch.save(run_case(topo, layout, batch, pos), f"{out}/{name}_rank{rank}.pt")
        finally:
            if undo is not None:
                undo()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
