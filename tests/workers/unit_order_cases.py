"""Worker for tests/test_unit_order.py: ZeRO-3 (explicit) and FSDP2 (``--engine torch``, zero 3)
over dp=2 on a 3-block MLP whose forward runs its blocks in a given order.

* ``<engine>_rank_dependent``: rank 0 runs blocks 0, 1, 2, rank 1 runs 2, 1, 0. One training
  step must fail on both ranks with ShardwiseConfigError before any mismatched all-gather (so
  long before the groups' TIMEOUT_S): the message and the seconds it took are recorded.
* ``<engine>_same_<order>``: both ranks run the blocks in the same order, ``module`` (0, 1, 2)
  or ``reversed`` (2, 1, 0: not module order, but the same everywhere): STEPS steps are
  recorded for a parity check against one process (loss, grad norm, full gradients and
  parameters after each step), with the ledger's step bytes by tag and the records of phase
  "order_check" of each step.

Run with 4 ranks instead, the worker checks dp=2 × tp=2 at zero 3 (``2d_<engine>``: TP inside,
ZeRO-3 / FSDP2 over dp) on the tiny Llama with 3 layers, where only rank 1 (tp peer of rank 0,
dp peer of rank 3) runs its layers reversed: all four ranks must fail with the same error
(the check spans the whole layout, not only the dp line, or ranks 0 and 2 would go on to TP
collectives that their tp peers never issue).

Writes ``<out>/<case>_rank<r>.pt``."""

import sys
import time
import traceback

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.errors import ShardwiseConfigError
from shardwise.models import preset_config
from shardwise.models.llama import Llama
from shardwise.models.mlp import MLPConfig, StackedMLP
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.model import ParallelModel, PlainLoss
from shardwise.parallel.zero import Zero3Sync, ZeroRedundancySync
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import RegressionWorkload, SyntheticLMWorkload

STEPS, GLOBAL_BATCH, LR, MAX_NORM = 2, 8, 3e-4, 0.5
TIMEOUT_S = 20  # process-group timeout: a hang (before the check existed) costs this much
N_LAYERS = 3
SAME_ORDERS = {"module": [0, 1, 2], "reversed": [2, 1, 0]}
ENGINES = ("explicit", "torch")
TAGS = ("grad", "param", "grad_norm", "loss", None)


class OrderedMLP(StackedMLP):
    """The stacked MLP (mlp-tiny sizes, ``N_LAYERS`` blocks) whose forward runs its blocks in
    ``order`` (block indices) instead of module order."""

    def __init__(self, order):
        super().__init__(MLPConfig(d_model=16, d_ff=32, n_layers=N_LAYERS))
        self.order = list(order)

    def forward(self, x):
        for i in self.order:
            x = self.layers[i](x)
        return x


class OrderedLlama(Llama):
    """The tiny Llama whose forward runs its layers in ``order``."""

    def __init__(self, order):
        super().__init__(preset_config("tiny", 67, n_layers=N_LAYERS, n_heads=8, n_kv_heads=4))
        self.order = list(order)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok_embeddings(tokens)  # [b, s, d]
        for i in self.order:
            x = self.layers[i](x, cos, sin)
        return self.output(self.norm(x))  # [b, s, V]


def make_model(order):
    torch.manual_seed(0)
    return OrderedMLP(order)


def workload():
    return RegressionWorkload(TrainConfig(model="mlp-tiny", seed=0), num_train=64, num_val=8)


def rank_dependent_2d(out, topo, rank, engine):
    order = list(reversed(range(N_LAYERS))) if rank == 1 else list(range(N_LAYERS))
    work = SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)
    torch.manual_seed(0)
    wrapped = parallelize(OrderedLlama(order), topo, Layout(dp=2, tp=2, zero=3), engine=engine)
    opt = build_optimizer(wrapped, TrainConfig(lr=LR, weight_decay=0.1))
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), 0)
    rec = {"order": order}
    t0 = time.perf_counter()
    try:
        train_step(wrapped, work.batches(sampler.next_local_batch(), GLOBAL_BATCH // 2), opt,
                   topo, max_norm=MAX_NORM)
        rec["error"] = "NO ERROR"
    except ShardwiseConfigError as e:
        rec["error"], rec["type"] = str(e), type(e).__name__
    except Exception:  # noqa: BLE001 - e.g. a gloo timeout: the test reports it
        rec["error"], rec["type"] = "WRONG ERROR TYPE: " + traceback.format_exc(), "other"
    rec["seconds"] = time.perf_counter() - t0
    torch.save(rec, f"{out}/2d_{engine}_rank_dependent_rank{rank}.pt")


def _wrap(model, topo, engine):
    sync = Zero3Sync(model, topo, 3) if engine == "explicit" else ZeroRedundancySync(model, topo, 3)
    return ParallelModel(model, topo, loss_fn=PlainLoss(sync.forward_module), grad_sync=sync)


def _batches(work, sampler, dp):
    return work.batches(sampler.next_local_batch(), GLOBAL_BATCH // dp)


def rank_dependent(out, topo, rank, engine):
    order = list(range(N_LAYERS)) if rank == 0 else list(reversed(range(N_LAYERS)))
    work = workload()
    wrapped = _wrap(make_model(order), topo, engine)
    opt = build_optimizer(wrapped, TrainConfig(lr=LR, weight_decay=0.1))
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), 0)
    rec = {"order": order}
    t0 = time.perf_counter()
    try:
        train_step(wrapped, _batches(work, sampler, 2), opt, topo, max_norm=MAX_NORM)
        rec["error"] = "NO ERROR"
    except ShardwiseConfigError as e:
        rec["error"], rec["type"] = str(e), type(e).__name__
    except Exception:  # noqa: BLE001 - e.g. a gloo timeout: the test reports it
        rec["error"], rec["type"] = "WRONG ERROR TYPE: " + traceback.format_exc(), "other"
    rec["seconds"] = time.perf_counter() - t0
    torch.save(rec, f"{out}/{engine}_rank_dependent_rank{rank}.pt")


def same_order(out, topo, rank, engine, name):
    work = workload()
    wrapped = _wrap(make_model(SAME_ORDERS[name]), topo, engine)
    opt = build_optimizer(wrapped, TrainConfig(lr=LR, weight_decay=0.1))
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), 0)
    rec = {k: [] for k in ("loss", "grad_norm", "grads", "params", "bytes", "order_checks")}
    for _ in range(STEPS):
        first = len(topo.ledger.records)
        res = train_step(wrapped, _batches(work, sampler, 2), opt, topo, max_norm=MAX_NORM,
                         zero_grad=False)
        rec["order_checks"].append([vars(r) for r in topo.ledger.records[first:]
                                    if r.phase == "order_check"])
        rec["bytes"].append({t: topo.ledger.step_bytes(t) for t in TAGS})
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in wrapped.named_full_gradients().items()})
        rec["params"].append({n: p.detach().clone()
                              for n, p in wrapped.named_full_parameters().items()})
    torch.save(rec, f"{out}/{engine}_same_{name}_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    if dist.get_world_size() == 4:
        for engine in ENGINES:
            rank_dependent_2d(out, Topology(dp=2, tp=2, timeout_s=TIMEOUT_S), rank, engine)
        dist.barrier()
        dist.destroy_process_group()
        return
    for engine in ENGINES:
        rank_dependent(out, Topology(dp=2, timeout_s=TIMEOUT_S), rank, engine)
    for engine in ENGINES:
        for name in SAME_ORDERS:
            same_order(out, Topology(dp=2, timeout_s=TIMEOUT_S), rank, engine, name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
