"""Worker for tests/test_storage.py (issue 53): bf16 parameter storage (Megatron's recipe and
the guide's) and ``--offload optimizer`` in one spawned 4-rank world, results dumped.

Each case builds the tiny Llama (vocab 67, tied embeddings) with ``parallelize(precision=,
offload=)`` on a sub-topology and trains STEPS AdamW steps through ``train_step``, writing
``<out>/<case>_rank<r>.pt`` (an output folder without "slow" in its name: :data:`FAST`; else
the rest): per step the loss, the norm, every full (gathered) parameter in its
storage dtype and every full gradient (the fp32 main gradients under Megatron's recipe), the
ledger's offload bytes and the formula's; after the last step the full optimizer state (masters
included) and a resumed run's next step (checkpoint contract). The test compares them with a
single-process reference with the same storage that it computes itself (``Local``)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.formulas import step_bytes_formula
from shardwise.models import build_model
from shardwise.parallel.apply import Layout, parallelize
from shardwise.parallel.storage import fsdp2_offload_bytes_formula, storage_memory_formula
from shardwise.precision import Precision
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import SyntheticLMWorkload

STEPS, GLOBAL_BATCH, LR, SEQ = 3, 8, 1e-2, 16
RECIPES = {"megatron": ("bf16", "fp32", "none"), "megatron_off": ("bf16", "fp32", "optimizer"),
           "guide": ("bf16", "none", "none"), "guide_off": ("bf16", "none", "optimizer"),
           "fp32": ("fp32", "fp32", "none"), "fp32_off": ("fp32", "fp32", "optimizer"),
           # --offload params (ZeRO-3's shards on the host): the twins of the first three
           "megatron_offp": ("bf16", "fp32", "params"), "guide_offp": ("bf16", "none", "params"),
           "fp32_offp": ("fp32", "fp32", "params"),
           # the torch engine's --offload params: FSDP2's CPUOffloadPolicy
           "megatron_params": ("bf16", "fp32", "params"), "fp32_params": ("fp32", "fp32", "params"),
           "guide_params": ("bf16", "none", "params")}
PARAMS = ("megatron_offp", "guide_offp", "fp32_offp")
# ZeRO-2/3 inside the stages of pp 2 × dp 2 (1F1B; interleaved, two chunks per rank, for ZeRO-3)
PP_ZERO = ["pp=2,dp=2,zero=2,microbatches=2", "pp=2,dp=2,zero=3,microbatches=2",
           "pp=2,dp=2,zero=3,microbatches=2,schedule=interleaved-1f1b"]
# dp = 2 with one micro-batch per rank: the reference's two micro-batches are the ranks' (bitwise
# rule); the others: the offload twin bitwise, HSDP and dp 4 by the fp32 rule at step 1
BITWISE = ["dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3"]
OTHERS = ["dp=4,dp_replicate=2,zero=3", "dp=4,zero=3", "tp=2", "dp=2,tp=2,zero=1",
          "pp=2,microbatches=4", "pp=2,dp=2,zero=1,microbatches=2"] + PP_ZERO
# the torch engine: the guide's recipe under FSDP2 (MixedPrecisionPolicy(reduce_dtype=fp32));
# Megatron's recipe in FSDP2's form (an fp32 model gathered in bf16, its shards the masters) and
# --offload params (CPUOffloadPolicy) where FSDP2 is the sync: over dp, HSDP, over DTensor tp,
# inside pipeline stages (1F1B; interleaved)
TORCH = ["dp=2,zero=2@torch", "dp=2,zero=3@torch"]
TORCH_OTHERS = ["dp=4,dp_replicate=2,zero=3@torch", "dp=2,tp=2,zero=3@torch",
                "pp=2,dp=2,zero=3,microbatches=2@torch",
                "pp=2,dp=2,zero=3,microbatches=2,schedule=interleaved-1f1b@torch"]
TORCH_MEGATRON = [(lay, r) for lay in TORCH + TORCH_OTHERS for r in ("megatron", "megatron_params")]
CASES = ([(lay, r) for lay in BITWISE for r in RECIPES
          if not r.endswith("_params") and (r not in PARAMS or "zero=3" in lay)]
         + [(lay, "guide") for lay in TORCH] + [("dp=2,zero=2@torch", "guide_params")]
         + TORCH_MEGATRON
         + [("dp=2,zero=3@torch", r) for r in ("fp32", "fp32_params")]
         + [(lay, r) for lay in OTHERS for r in ("megatron", "megatron_off", "fp32", "fp32_off")])
# --offload params beyond dp 2's: dp 4 and HSDP, and two micro-batches per rank (n_micro=2,
# not a Layout field: the gathers repeat per micro-batch, the gradient comes down once)
OFFP = ["dp=4,zero=3", "dp=4,dp_replicate=2,zero=3", "dp=2,zero=3,n_micro=2",
        "dp=4,zero=3,n_micro=2"]
CASES += ([("dp=4,zero=3", r) for r in ("guide", "guide_offp", "megatron_offp", "fp32_offp")]
          + [("dp=4,dp_replicate=2,zero=3", "megatron_offp")]
          + [(lay, r) for lay in OFFP[2:] for r in ("megatron", "megatron_offp", "guide",
                                                    "guide_offp")]
          # inside pipeline stages (StageZero3: every unit gathered before each F and B)
          + [(PP_ZERO[1], "megatron_offp"), (PP_ZERO[2], "guide"), (PP_ZERO[2], "guide_offp")])
# ``make test``'s share (one world of these; the rest run under ``make test-slow``): ZeRO-3 with
# every recipe (the optimizer-offload twin of Megatron's; those of the guide's and fp32 run
# slow), HSDP and pp 2 × dp 2 ZeRO-3 interleaved under Megatron's recipe and its offloaded twin,
# pp 2 × dp 2 ZeRO-1 (1F1B) under Megatron's recipe
SLOWED = [("dp=2,zero=3", "guide_off"), ("dp=2,zero=3", "fp32_off"),
             ("pp=2,dp=2,zero=1,microbatches=2", "megatron_off")]
FAST = ([("dp=2,zero=3", r) for r in RECIPES
         if not r.endswith("_params") and (r not in PARAMS or r == "megatron_offp")]
        + [("dp=2,zero=3@torch", r) for r in ("guide", "megatron", "megatron_params")]
        + [(lay, r) for lay in ("dp=4,dp_replicate=2,zero=3", "pp=2,dp=2,zero=1,microbatches=2",
                                PP_ZERO[2]) for r in ("megatron", "megatron_off")])
FAST = [c for c in FAST if c not in SLOWED]


def case_name(layout: str, recipe: str) -> str:
    text = layout.replace("schedule=interleaved-1f1b", "i1f1b")
    return f"{text.replace(',', '_').replace('=', '').replace('@', '_')}_{recipe}"


def init_params(n_layers: int = 2) -> dict[str, torch.Tensor]:
    """The fp32 initial values of :func:`make_model`'s parameters: the masters FSDP2's form of
    Megatron's recipe starts from (docs/parity.md §7)."""
    return {n: p.detach().clone() for n, p in make_model(n_layers).named_parameters()}


def precision_of(recipe: str) -> tuple[Precision, str]:
    param, master, offload = RECIPES[recipe]
    return Precision.stored(param, master, compute="fp32"), offload


def layout_of(text: str) -> Layout:
    """``"dp=2,zero=3@torch"`` → its Layout (the engine, after @, is :func:`engine_of`'s)."""
    text = text.split("@")[0]
    return Layout(**{k: v if k == "schedule" else int(v)
                     for k, v in (kv.split("=") for kv in text.split(","))
                     if k != "n_micro"})


def n_micro_of(text: str) -> int:
    """Micro-batches per rank per step: a pipeline's ``microbatches``, else ``n_micro`` (1)."""
    keys = dict(kv.split("=") for kv in text.split("@")[0].split(","))
    return int(keys.get("microbatches", keys.get("n_micro", 1)))


def engine_of(text: str) -> str:
    return text.split("@")[1] if "@" in text else "explicit"


def workload():
    return SyntheticLMWorkload(vocab_size=67, seq_len=SEQ, num_train=64, num_val=4, seed=0)


def make_model(n_layers: int = 2):
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=67, tie_embeddings=True, n_layers=n_layers)


def n_layers_of(layout: Layout) -> int:
    """The tiny Llama's 2 layers; 4 for an interleaved pipeline (pp 2 × 2 chunks: a layer each)."""
    return 4 if layout.schedule.startswith("interleaved") else 2


def config() -> TrainConfig:
    return TrainConfig(lr=LR, weight_decay=0.1)


def run_case(out, topos, rank, text, recipe):
    layout = layout_of(text)
    topo = topos[(layout.pp, layout.dp, layout.tp, layout.dp_replicate)]
    if not topo.member:
        return
    precision, offload = precision_of(recipe)
    engine = parallelize(make_model(n_layers_of(layout)), topo, layout, precision=precision, offload=offload,
                         engine=engine_of(text))
    opt = build_optimizer(engine, config())
    work = workload()
    sampler = work.sampler(GLOBAL_BATCH, layout.dp, topo.index("dp"), 0)
    m = n_micro_of(text)  # micro-batches per step
    micro = GLOBAL_BATCH // layout.dp // m
    rec = {k: [] for k in ("loss", "grad_norm", "params", "grads", "ledger", "formula", "tags")}
    rec["fsdp2_copies"] = fsdp2_offload_bytes_formula(engine, m)  # --offload params, torch
    # device / host, by formula: explicit ZeRO-3 outside pipelines, and the torch engine
    rec["memory"] = (storage_memory_formula(engine) if engine_of(text) == "torch"
                     or ("zero=3" in text and layout.pp == 1) else None)
    rec["offloaded"] = [getattr(u, "offload", None) is not None
                        for u in getattr(engine.grad_sync, "units", ())]
    for _ in range(STEPS):
        res = train_step(engine, work.batches(sampler.next_local_batch(), micro), opt, topo,
                         zero_grad=False)
        rec["ledger"].append({t: topo.ledger.step_bytes(t) for t in ("offload_d2h", "offload_h2d")})
        rec["tags"].append({t: topo.ledger.step_bytes(t) for t in ("param", "grad")})
        formula = step_bytes_formula(engine, topo, micro_steps=m, sequences=micro * m,
                                     seq_len=SEQ)
        rec["formula"].append({t: formula.get(t, 0.0) for t in ("offload_d2h", "offload_h2d")})
        rec.setdefault("totals", []).append((topo.ledger.step_bytes(), formula["total"]))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in engine.named_full_gradients().items()})
        rec["params"].append({n: p.detach().clone()
                              for n, p in engine.named_full_parameters().items()})
    state = engine.full_optimizer_state(opt)
    rec["state"] = {n: {k: v.clone() for k, v in st.items()} for n, st in state.items()}
    # the checkpoint contract: a fresh engine given the saved parameters and state continues
    # exactly as this one does (the masters restored, not re-rounded from the bf16 parameters)
    params = {n: p.clone() for n, p in engine.named_full_parameters().items()}
    with torch.device("meta"):  # as train resumes: a meta model given the saved weights
        meta = build_model("tiny", vocab_size=67, tie_embeddings=True,
                           n_layers=n_layers_of(layout))
    again = parallelize(meta, topo, layout, precision=precision, offload=offload,
                        weights=list(params.items()), engine=engine_of(text))
    again_opt = build_optimizer(again, config())
    again.load_full_optimizer_state(again_opt, {n: {k: v.clone() for k, v in st.items()}
                                                 for n, st in state.items()})  # as from disk
    batch = work.batches(sampler.next_local_batch(), micro)
    a = train_step(engine, batch, opt, topo, zero_grad=False)
    b = train_step(again, batch, again_opt, topo, zero_grad=False)
    rec["resume"] = (a.loss, b.loss, engine.named_full_parameters(),
                     again.named_full_parameters())
    torch.save(rec, f"{out}/{case_name(text, recipe)}_rank{rank}.pt")


def run_explicit_to_torch(out, topo, rank):
    """A checkpoint of Megatron's recipe on the explicit engine (bf16 parameters, fp32 masters
    in its optimizer state) resumed by the torch engine's FSDP2 form, dp 2 ZeRO-3: after 2 steps
    on the explicit engine, the torch engine is built from the saved parameters and state; both
    then take the same next step. Dumped: the masters saved, the torch engine's fp32 parameters
    after the load, its state's keys, and the next step of each (loss, masters / parameters)."""
    precision, _ = precision_of("megatron")
    layout, work = layout_of("dp=2,zero=3"), workload()
    sampler = work.sampler(GLOBAL_BATCH, 2, topo.index("dp"), 0)
    batches = [work.batches(sampler.next_local_batch(), GLOBAL_BATCH // 2) for _ in range(3)]
    a = parallelize(make_model(), topo, layout, precision=precision)
    a_opt = build_optimizer(a, config())
    for b in batches[:2]:
        train_step(a, b, a_opt, topo, zero_grad=False)
    params = a.named_full_parameters()
    state = a.full_optimizer_state(a_opt)
    with torch.device("meta"):
        meta = build_model("tiny", vocab_size=67, tie_embeddings=True, n_layers=2)
    t = parallelize(meta, topo, layout, precision=precision, engine="torch",
                    weights=list(params.items()))
    t_opt = build_optimizer(t, config())
    t.load_full_optimizer_state(t_opt, {n: {k: v.clone() for k, v in st.items()}
                                        for n, st in state.items()})
    rec = {"saved_masters": {n: st["master"].clone() for n, st in state.items()},
           "loaded": {n: p.clone() for n, p in t.named_full_parameters().items()},
           "torch_state_keys": {n: sorted(st) for n, st in t.full_optimizer_state(t_opt).items()}}
    ra = train_step(a, batches[2], a_opt, topo, zero_grad=False)
    rt = train_step(t, batches[2], t_opt, topo, zero_grad=False)
    rec["next"] = (ra.loss, rt.loss,
                   {n: st["master"].clone() for n, st in a.full_optimizer_state(a_opt).items()},
                   {n: p.clone() for n, p in t.named_full_parameters().items()})
    torch.save(rec, f"{out}/explicit_to_torch_rank{rank}.pt")


def main(out: str, which: str) -> None:
    # ranks outside a 2-rank case wait at the next 4-rank collective while it runs its steps
    init_distributed("cpu", timeout_s=180)
    rank = dist.get_rank()
    topos = {}
    cases = FAST if which == "fast" else [c for c in CASES if c not in FAST]
    for text in dict.fromkeys(c[0] for c in cases):
        lay = layout_of(text)
        key = (lay.pp, lay.dp, lay.tp, lay.dp_replicate)
        if key not in topos:
            topos[key] = Topology(lay.pp, lay.dp, lay.tp, dp_replicate=lay.dp_replicate,
                                  ranks=range(lay.pp * lay.dp * lay.tp), timeout_s=180)
    for case in cases:
        run_case(out, topos, rank, *case)
    if which == "fast" and topos[(1, 2, 1, 1)].member:
        run_explicit_to_torch(out, topos[(1, 2, 1, 1)], rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # which share: named by the output folder (tests/test_storage.py's fixtures)
    main(sys.argv[1], "slow" if "slow" in Path(sys.argv[1]).name else "fast")
