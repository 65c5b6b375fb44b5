"""Worker for tests/test_ep_pp.py: a mixture of experts in the explicit pipeline engine, with and
without expert parallelism, in one spawned 4-rank world (pp=2 × dp=2, ep ∈ {1, 2}).

Cases (:data:`CASES`, one :class:`Case` each) on a 4-layer ``moe-tiny`` (d 32, 4 experts of
hidden 32, vocab 67, tied embeddings), one AdamW step with binding clipping: top-1 and top-2,
with and without a shared expert, 1f1b and gpipe, plus interleaved-1f1b (a dense block between
MoE blocks: ``moe_every=2``), zb-h1 (split backward), ZeRO-1 (ep = 1) and a deliberately skewed
routing (every router zeroed: all logits tie, so every token goes to experts 0..k−1, which live
on ep rank 0).

Each rank writes ``<out>/<case>_rank<r>.pt``: the logged loss and grad norm, every gradient of
its stage gathered to full shape (experts over ep), its parameters after the step (full shape),
the ledger's bytes per tag and :func:`shardwise.formulas.step_bytes_formula` per tag, its
coordinates and the number of MoE layers its stage holds.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model, moe_layers
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

PP, DP, N_LAYERS, SEQ, V, GLOBAL = 2, 2, 4, 16, 67, 8  # GLOBAL: sequences per step, all dp
MAX_NORM, LR = 0.3, 1e-3
TIMEOUT = 300  # seconds, process groups


@dataclasses.dataclass(frozen=True)
class Case:
    ep: int
    schedule: str
    top_k: int = 2
    shared: int = 0  # n_shared_experts
    moe_every: int = 1
    m: int = 2  # microbatches per step
    zero: int = 0
    skew: bool = False  # routers zeroed: every token to experts 0..k-1

    @property
    def name(self) -> str:
        return (f"ep{self.ep}_{self.schedule}_top{self.top_k}_shared{self.shared}"
                f"_every{self.moe_every}_m{self.m}_zero{self.zero}{'_skew' if self.skew else ''}")

    def model_kw(self) -> dict:
        return dict(vocab_size=V, n_layers=N_LAYERS, top_k=self.top_k,
                    n_shared_experts=self.shared, moe_every=self.moe_every)


CASES = [
    Case(2, "1f1b"),
    Case(2, "gpipe", top_k=1, shared=1),
    Case(1, "gpipe", shared=1),
    Case(1, "1f1b", top_k=1),
    Case(2, "interleaved-1f1b", moe_every=2, m=4),
    Case(2, "zb-h1"),
    Case(1, "1f1b", zero=1),
    Case(2, "1f1b", zero=1),
    Case(2, "1f1b", skew=True),
]


def build(case: Case):
    """The plain model of ``case``, seeded identically here and in the test's reference."""
    torch.manual_seed(0)
    model = build_model("moe-tiny", **case.model_kw())
    if case.skew:
        with torch.no_grad():
            for m in moe_layers(model):
                m.router.weight.zero_()
    return model


def run_case(work, topo, case: Case, out, rank):
    model = build(case)
    layout = Layout(pp=PP, dp=DP, ep=case.ep, zero=case.zero, schedule=case.schedule,
                    microbatches=case.m)
    eng = parallelize(model, topo, layout)
    opt = build_optimizer(eng, TrainConfig(model="moe-tiny", lr=LR, weight_decay=0.1))
    local = work.sampler(GLOBAL, DP, topo.index("dp"), seed=0).next_local_batch()
    res = train_step(eng, work.batches(local, len(local) // case.m), opt, topo,
                     max_norm=MAX_NORM, zero_grad=False)
    by_tag = {}
    for r in topo.ledger.step_records():
        by_tag[r.tag] = by_tag.get(r.tag, 0.0) + r.wire_bytes
    formula = step_bytes_formula(eng, topo, micro_steps=case.m, sequences=len(local),
                                 seq_len=SEQ)
    rec = {"loss": res.loss, "grad_norm": res.grad_norm, "bytes": by_tag, "formula": formula,
           "coords": dict(topo.coords), "ep_index": topo.index("ep"),
           "moe_layers": len(moe_layers(eng.module)),
           "grads": {n: g.clone() for n, g in eng.named_full_gradients().items()},
           "params": {n: t.clone() for n, t in eng.named_full_parameters().items()}}
    torch.save(rec, f"{out}/{case.name}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=TIMEOUT)
    rank = dist.get_rank()
    work = SyntheticLMWorkload(vocab_size=V, seq_len=SEQ, num_train=64, num_val=4, seed=0)
    topos = {ep: Topology(pp=PP, dp=DP, ep=ep, timeout_s=TIMEOUT) for ep in (1, 2)}
    for case in CASES:
        run_case(work, topos[case.ep], case, out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
