"""Worker for tests/test_pack_layouts.py: packed SFT rows against the same examples one per row,
in dp, ZeRO-3, tp and pp layouts of one 2-rank world.

For each layout the tiny Llama (seed 0) takes one step on the unpacked rows and, rebuilt from the
same seed, one step on the packed rows (:func:`batches`: the examples of examples/chat_sample.jsonl
chosen by the test). Each rank writes ``<out>/<layout>_<kind>_rank<r>.pt``: the step's loss
(the global token mean) and every full-shape gradient this rank holds.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.data.pack import pack_examples, unpadded
from shardwise.data.sft import prepare_sft_data
from shardwise.models import Llama, LlamaConfig
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

CHAT = Path(__file__).parent.parent.parent / "examples" / "chat_sample.jsonl"
SEQ, EXAMPLES = 256, 12
LAYOUTS = {"dp2": (Layout(dp=2), (1, 2, 1, 1)),
           "dp2_zero3": (Layout(dp=2, zero=3), (1, 2, 1, 1)),
           "tp2": (Layout(tp=2), (1, 1, 2, 1)),
           "tp2_sp": (Layout(tp=2, sp=True), (1, 1, 2, 1)),
           "pp2": (Layout(pp=2, microbatches=2), (2, 1, 1, 1))}


def batches() -> dict[str, dict]:
    """The global batch both ways: ``unpacked`` (EXAMPLES rows, one example each) and
    ``packed`` (the same examples packed; an even number of rows, checked)."""
    data = prepare_sft_data(CHAT, "bytes", seq_len=SEQ)
    tok, lab, n = data.train[:EXAMPLES], data.train_labels[:EXAMPLES], \
        data.train_lengths[:EXAMPLES]
    p = pack_examples(*unpadded(tok, lab, n), SEQ, data.tokenizer.eos_id)
    packed = {"input_ids": p.input_ids, "labels": p.labels, "position_ids": p.position_ids,
              "document_ids": p.document_ids}
    if len(p) % 2:  # an extra row of padding only: the dp and pp splits need an even count
        packed = {k: torch.cat([v, v[-1:] if k != "labels" else torch.full_like(v[-1:], -100)])
                  for k, v in packed.items()}
    return {"unpacked": {"input_ids": tok[:, :-1], "labels": lab}, "packed": packed}


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=64, max_seq_len=SEQ))


def run_case(topo, name, layout, kind, batch, out, rank):
    engine = parallelize(model(), topo, layout, seed=0)
    opt = build_optimizer(engine, TrainConfig(model="tiny", lr=1e-3))
    dp, i = topo.size("dp"), topo.index("dp")
    rows = batch["input_ids"].shape[0] // dp
    local = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
    m = layout.microbatches or 1
    mbs = [dict(zip(local, parts)) for parts in zip(*(v.split(rows // m)
                                                      for v in local.values()))]
    res = train_step(engine, mbs, opt, topo, max_norm=0.0, zero_grad=False)
    torch.save({"loss": res.loss, "grads": {n: g.detach().clone() for n, g in
                                            engine.named_full_gradients().items()}},
               f"{out}/{name}_{kind}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=120)
    rank = dist.get_rank()
    both = batches()
    topos = {}
    for _, degrees in LAYOUTS.values():
        if degrees not in topos:
            pp, dp, tp, cp = degrees
            topos[degrees] = Topology(pp=pp, dp=dp, tp=tp, cp=cp, ranks=range(2), timeout_s=120)
    for name, (layout, degrees) in LAYOUTS.items():
        for kind, batch in both.items():
            run_case(topos[degrees], name, layout, kind, batch, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
