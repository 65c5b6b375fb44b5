"""What every bench shares: the workload, one variant's run, a timed step, A B A B … timing,
and the report (a Markdown table printed and written as ``<name>.md``, the numbers as
``<name>.json``).

A *run* is one variant of a benchmark (an engine over a model): a dict with ``engine``,
``opt``, ``sampler`` and ``times`` (seconds of each timed step), built by :func:`make_run` from
the same seed for every variant, so all variants start from identical weights and see the same
batches. :func:`alternate` times the variants in turn (A B C A B C …) so that drift in the
machine's speed (other jobs on the same cores) hits every variant alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ...config import TrainConfig
from ...models import build_model
from ...train.optim import build_optimizer
from ...train.step import train_step
from ...train.workload import RegressionWorkload, SyntheticLMWorkload


def make_workload(model: str, seq_len: int, vocab: int, num_train: int, seed: int = 0):
    """The benchmark's data: random token sequences for the Llama presets (``vocab``,
    ``seq_len``), the synthetic regression task for ``mlp*``. ``num_train`` sequences."""
    if model.startswith("mlp"):
        return RegressionWorkload(TrainConfig(model=model, seed=seed), num_train=num_train,
                                  num_val=1)
    return SyntheticLMWorkload(vocab_size=vocab, seq_len=seq_len, num_train=num_train,
                               num_val=1, seed=seed)


def make_run(wrap, model: str, work, cfg: TrainConfig, global_batch: int, dp: int,
             dp_index: int, seed: int = 0, **model_kw) -> dict:
    """One benchmark variant: seed the RNG, build ``model`` (so every variant starts from the
    same weights), wrap it with ``wrap(model) -> Engine``, build its optimizer and a sampler of
    ``global_batch`` sequences per step over ``dp`` replicas. Returns the run dict the timing
    helpers use (``engine``, ``opt``, ``sampler``, ``times``)."""
    torch.manual_seed(seed)
    kw = {"vocab_size": work.vocab_size} if work.kind == "lm" else {}
    engine = wrap(build_model(model, **kw, **model_kw))
    return {"engine": engine, "opt": build_optimizer(engine, cfg), "times": [],
            "sampler": work.sampler(global_batch, dp, dp_index, seed)}


def timed_step(run: dict, work, micro_batch: int, topo, *, dtype: str = "fp32",
               measure_memory: bool = False, zero_grad: bool = True):
    """One optimizer step of ``run`` on its next batch (cut into ``micro_batch``-sequence
    micro-batches), clipping at global norm 1.0; returns (wall seconds of ``train_step``, its
    StepResult). ``zero_grad=False`` leaves the gradients allocated until the next step."""
    batch = work.batches(run["sampler"].next_local_batch(), micro_batch)
    t0 = time.perf_counter()
    res = train_step(run["engine"], batch, run["opt"], topo, max_norm=1.0, dtype=dtype,
                     measure_memory=measure_memory, zero_grad=zero_grad)
    return time.perf_counter() - t0, res


def alternate(runs: dict, rounds: int, steps: int, step_fn, order: list | None = None) -> None:
    """Time ``runs`` alternately: ``rounds`` × (for each run in order: ``steps`` calls of
    ``step_fn(run) -> seconds``, appended to ``run["times"]``), i.e. A B A B … so that drift in
    the machine's speed hits every variant alike. ``order`` (if given) receives the name of each
    timed block as it runs."""
    for _ in range(rounds):
        for name, r in runs.items():
            if r.get("error"):
                continue
            if order is not None:
                order.append(name)
            r["times"] += [step_fn(r) for _ in range(steps)]


# A column of a report's table: (title, alignment row cell such as "---" or "---:", the cell of
# a row: a string, or None for a cell left blank because it does not apply to that row).
Column = tuple[str, str, Callable[[object], "str | None"]]


def markdown_table(rows: Sequence, columns: Sequence[Column]) -> str:
    """A Markdown table: the titles, the alignment row, one line per row of ``rows``."""
    def line(cells) -> str:
        return "|" + "|".join(" " if c is None else f" {c} " for c in cells) + "|"

    head = [line(title for title, _, _ in columns),
            "|" + "|".join(align for _, align, _ in columns) + "|"]
    return "\n".join(head + [line(cell(r) for _, _, cell in columns) for r in rows])


def write_report(rows: Sequence, columns: Sequence[Column], out, name: str, *, head: str,
                 data: dict, tail: Sequence[str] = ()) -> str:
    """Rank 0 of a bench: print the report and write ``out/<name>.md`` and ``out/<name>.json``.

    The report is ``head``, a blank line, :func:`markdown_table` of ``rows`` by ``columns``, then
    each line of ``tail``; ``<name>.json`` is ``data`` (values JSON cannot hold are written as
    their ``str``). Creates ``out``. Returns the report's text."""
    md = head + "\n\n" + markdown_table(rows, columns) + "".join("\n" + t for t in tail)
    print(md, flush=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(md + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str))
    return md
