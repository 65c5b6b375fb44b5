"""Worker for tests/test_core_structure.py's reading test: in one world of 2 gloo ranks, build
each layout of :data:`LAYOUTS` on the tiny Llama with ``parallelize`` and run two training
steps, recording (``sys.setprofile``) which files of ``parallel/`` run a function on this rank
when called from ``parallelize()`` or the engine's methods (not the data path's hooks, not the
layout's refusals :data:`SKIP`) — the files a reader opens from ``parallelize()`` to see that
layout whole. Writes
``<out>/<case>_rank<r>.txt``, one path (relative to ``parallel/``) per line."""

import inspect
import re
import sys
from pathlib import Path

import torch.distributed as dist

import shardwise.parallel as parallel_pkg
from shardwise.config import TrainConfig
from shardwise.parallel.apply import Layout, parallelize
from shardwise.tools.verify import build_case, verify_workload
from shardwise.topology import Topology, init_distributed
from shardwise.train.step import train_step

PAR = Path(parallel_pkg.__file__).resolve().parent
# the layout's refusals and predicates (``Layout.check`` calls every strategy's ``validate_*``):
# rules, not the algorithm a reader follows
SKIP = re.compile(r"_?(validate|check|valid_|is_)")
LAYOUTS = {"pp_1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
           "zero3": dict(dp=2, zero=3), "tp": dict(tp=2)}


def _entry(code) -> bool:
    """``parallelize`` or a method of the engine (``model.py``): where a reader starts."""
    return code.co_filename == str(PAR / "model.py") or (
        code.co_filename == str(PAR / "apply.py") and code.co_name == "parallelize")


def files_run(case: str) -> set[str]:
    """The ``parallel/`` files whose functions ran while ``case`` was built and stepped."""
    kw = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, **LAYOUTS[case]}
    cfg = TrainConfig(model="tiny", global_batch=8, micro_batch=8 // kw["dp"]
                      if kw["pp"] == 1 else 0, seq_len=16, seed=0, **kw)
    topo = Topology(cfg.pp, cfg.dp, cfg.tp, ranks=range(2), timeout_s=60)
    work = verify_workload("tiny", 0, cfg.model_overrides())
    seen: set[str] = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(str(PAR)) \
                or not code.co_flags & inspect.CO_OPTIMIZED:
            return  # not parallel/, or an import's module or class body
        up = frame
        while up is not None and not _entry(up.f_code):
            if up.f_code.co_filename.startswith(str(PAR)) and SKIP.match(up.f_code.co_name):
                return  # inside a refusal
            up = up.f_back
        if up is not None:  # reached from parallelize() or the engine
            seen.add(str(Path(code.co_filename).relative_to(PAR)))

    sys.setprofile(profile)
    try:
        _, engine, opt, sched = build_case("tiny", work, cfg, lambda m: parallelize(
            m, topo, Layout.from_config(cfg), engine="explicit", seed=0))
        micro, _ = cfg.microbatching()
        sampler = work.sampler(cfg.global_batch, topo.size("dp"), topo.index("dp"), 0)
        for _ in range(2):
            train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                       scheduler=sched)
    finally:
        sys.setprofile(None)
    return seen


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    for case in LAYOUTS:
        files = sorted(files_run(case))
        Path(out, f"{case}_rank{dist.get_rank()}.txt").write_text("\n".join(files) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
