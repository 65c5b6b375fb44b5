"""Worker for tests/test_learn.py: in one world of 4 ranks, run every learn script (and the
deliberately broken copies the test wrote into ``out``), then the framework's explicit engine on
the same model and layouts (dp = 4, dp = 4 ZeRO-3, pp = 4 1F1B, m = 4, tp = 4, dp = 2 × tp = 2
ZeRO-3), saving each rank's ledger
bytes per tag of one step to ``<out>/fw_<case>_rank<r>.pt``."""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.learn import _common as C
from shardwise.parallel.apply import Layout, parallelize
from shardwise.tools.verify import build_case, verify_workload
from shardwise.topology import Topology, init_distributed
from shardwise.train.step import train_step

SCRIPTS = (("collectives", []), ("dp", []), ("fsdp", []), ("tp", []), ("fsdp_tp", []),
           ("pp", ["--schedule", "gpipe"]), ("pp", ["--schedule", "1f1b"]))
FRAMEWORK = {"dp": dict(dp=4), "zero3": dict(dp=4, zero=3),
             "pp": dict(pp=4, schedule="1f1b", microbatches=4), "tp": dict(tp=4),
             "fsdp_tp": dict(dp=2, tp=2, zero=3)}


def framework(case: str, out: str) -> None:
    """One step of the framework's explicit engine on mlp-tiny with the learn scripts' sizes
    (D, F, L) and batch (B rows, one micro-batch per rank, or m = 4 under pp)."""
    kw = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, **FRAMEWORK[case]}
    cfg = TrainConfig(model="mlp-tiny", n_layers=C.L, global_batch=C.B,
                      micro_batch=C.B // kw["dp"] if kw["pp"] == 1 else 0, seed=0,
                      lr=C.LR, **kw)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, ranks=range(4), timeout_s=60)
    over = {**cfg.model_overrides(), "d_model": C.D, "d_ff": C.F}
    work = verify_workload("mlp-tiny", 0, over)
    layout = Layout.from_config(cfg)
    _, engine, opt, sched = build_case("mlp-tiny", work, cfg, lambda m: parallelize(
        m, topo, layout, engine="explicit", seed=0), overrides=over)
    micro, _ = cfg.microbatching()
    sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), 0)
    for _ in range(2):  # the second step's records (a pipeline's first one warms up)
        train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                   scheduler=sched)
    tags = {}
    for r in topo.ledger.step_records():
        tags[r.tag] = tags.get(r.tag, 0.0) + r.wire_bytes
    torch.save(tags, f"{out}/fw_{case}_rank{dist.get_rank()}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    for name, args in SCRIPTS:
        importlib.import_module(f"shardwise.learn.{name}").main(["--out", out, *args])
    for path in sorted(Path(out).glob("broken_*.py")):  # the test's broken copies
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(["--out", out])
    for case in FRAMEWORK:
        framework(case, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
