"""Worker for tests/test_zero.py: every ZeRO case in one spawned 4-rank world, results dumped.

Each case trains STEPS AdamW steps with clipping through ``train_step`` on a sub-topology and
writes ``<out>/<case>_rank<r>.pt``: per step the loss, the grad norm, every full (gathered)
gradient and parameter, the ledger's bytes by tag and the engine's own formula; after the last
step the model-state bytes, unit sizes and (explicit ZeRO-3) the gathered-parameter peak. The test
compares them with a single-process reference and hand-written formulas it computes itself.
"""

import itertools
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import TrainConfig
from shardwise.errors import ShardwiseConfigError
from shardwise.models import build_model
from shardwise.models.llama import generate
from shardwise.parallel.model import ParallelModel, PlainLoss
from shardwise.parallel.zero import ZeroRedundancySync, ZeroSync, zero_sync
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from shardwise.train.workload import RegressionWorkload, SyntheticLMWorkload

STEPS, GLOBAL_BATCH, LR, SAMPLE_TOKENS = 3, 8, 3e-4, 5
# name → (preset, build_model overrides, max grad norm that binds at every step)
MODELS = {
    "tiny": ("tiny", dict(vocab_size=67, tie_embeddings=True), 0.3),
    "tiny4": ("tiny", dict(vocab_size=67, tie_embeddings=True, n_layers=4), 0.3),
    "mlp": ("mlp-tiny", {}, 0.5),
    # d_ff 33: each block has 2·16·33 + 33 + 16 = 1105 parameters, which neither 2 nor 4 divides
    "mlp33": ("mlp-tiny", dict(d_ff=33), 0.5),
}


def case_name(model, stage, dp, engine, accum=1, prefetch=True, reshard=True, overlap=True):
    return (f"{model}_z{stage}_dp{dp}_{engine}_acc{accum}"
            f"{'' if prefetch else '_nopf'}{'' if reshard else '_noraf'}"
            f"{'' if overlap else '_noovl'}")


def _cases():
    """(model, stage, dp, engine, accum, prefetch, reshard_after_forward, overlap)."""
    out = []
    for stage, dp, engine, model in itertools.product((1, 2, 3), (2, 4), ("explicit", "torch"),
                                                      ("tiny", "mlp33")):
        out.append((model, stage, dp, engine, 1, True, True, True))
    for stage, engine in itertools.product((1, 2, 3), ("explicit", "torch")):
        out.append(("tiny", stage, 2, engine, 2, True, True, True))  # gradient accumulation
    for engine in ("explicit", "torch"):
        out.append(("mlp", 3, 4, engine, 1, True, True, True))
    for pf, raf in ((True, True), (False, True), (True, False)):
        out.append(("tiny4", 3, 2, "explicit", 1, pf, raf, True))
    out.append(("tiny", 2, 4, "explicit", 1, True, True, False))  # reduce-scatters after backward
    return out


CASES = _cases()


def is_slow(case) -> bool:
    """``make test-slow``'s cases (a world whose output folder's name has "slow"): the tiny
    Llama at dp=2 without accumulation (each stage × engine runs at dp=2 in the kept
    accumulation cases, and at dp=4) and mlp33 at dp=2 (each stage × engine stays at dp=4, where
    the padding is larger: 1105 → 1108)."""
    model, stage, dp, engine, accum, pf, raf, ovl = case
    return dp == 2 and accum == 1 and model in ("tiny", "mlp33")


def workload(model):
    if MODELS[model][0].startswith("mlp"):
        return RegressionWorkload(TrainConfig(model="mlp-tiny", seed=0), num_train=64, num_val=8)
    return SyntheticLMWorkload(vocab_size=67, seq_len=16, num_train=64, num_val=4, seed=0)


def make_model(model):
    preset, kw, _ = MODELS[model]
    torch.manual_seed(0)
    return build_model(preset, **kw)


def run_case(out, topo, rank, model, stage, dp, engine, accum, prefetch, reshard, overlap):
    work = workload(model)
    plain = make_model(model)
    if engine == "explicit":
        sync = zero_sync(plain, topo, stage, prefetch=prefetch, reshard_after_forward=reshard,
                         overlap=overlap)
    else:
        sync = ZeroRedundancySync(plain, topo, stage)
    # the one engine around the gradient sync, as parallelize() builds it for dp-only layouts
    wrapped = ParallelModel(plain, topo, loss_fn=PlainLoss(sync.forward_module), grad_sync=sync)
    opt = build_optimizer(wrapped, TrainConfig(lr=LR, weight_decay=0.1))
    sampler = work.sampler(GLOBAL_BATCH, dp, topo.index("dp"), 0)
    micro = GLOBAL_BATCH // dp // accum
    rec = {k: [] for k in ("loss", "grad_norm", "grads", "params", "bytes", "formula", "pad")}
    (val,) = work.batches(torch.arange(4), 4, split="val")
    x = val.get("input_ids", val.get("inputs"))
    if engine == "explicit":  # a forward with grad enabled and no backward (an evaluation not
        wrapped.module(x)  # under no_grad): the training steps must still start sharded
    for _ in range(STEPS):
        res = train_step(wrapped, work.batches(sampler.next_local_batch(), micro), opt, topo,
                         max_norm=MODELS[model][2], zero_grad=False)
        rec["bytes"].append({t: topo.ledger.step_bytes(t)
                             for t in ("grad", "param", "grad_norm", "loss", None)})
        rec["formula"].append(sync.step_bytes_formula(accum))
        rec["loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        rec["grads"].append({n: g.clone() for n, g in wrapped.named_full_gradients().items()})
        rec["params"].append({n: p.detach().clone()
                              for n, p in wrapped.named_full_parameters().items()})
        if engine == "explicit":  # the padding of this rank's slices: must stay exactly zero
            pads = [t[max(u.numel - u.lo, 0):] for u in sync.units
                    for t in (u.shard, u.shard_grad)]
            rec["pad"].append(max([float(p.abs().max()) for p in pads if p.numel()] + [0.0]))
    rec["state_bytes"] = wrapped.model_state_bytes(opt)
    if engine == "explicit":
        with torch.no_grad():  # an evaluation forward on the wrapped model: freed after
            rec["eval_out"] = wrapped.module(x)
        rec["params_bytes_after_eval"] = wrapped.model_state_bytes(opt)["params"]
        first = len(topo.ledger.records)
        with torch.no_grad(), wrapped.full_model() as full:  # sampling: gathered once for all
            rec["full_model_out"] = [full(x), full(x)]
        rec["full_model_gathers"] = sum(r.op == "all_gather" for r in topo.ledger.records[first:])
        rec["params_bytes_after_full_model"] = wrapped.model_state_bytes(opt)["params"]
        if not MODELS[model][0].startswith("mlp"):  # a seeded sample, as train's last one
            rec.update(_samples(wrapped, topo, x[:1, :3]))
    rec["memory_formula"] = wrapped.memory_formula()
    rec["numel"], rec["padded_numel"] = sync.numel, sync.padded_numel
    if engine == "explicit":
        rec["unit_sizes"] = sync.unit_sizes()
        rec["n_pieces"] = sum(len(g["params"]) for g in opt.param_groups)
    name = case_name(model, stage, dp, engine, accum, prefetch, reshard, overlap)
    torch.save(rec, f"{out}/{name}_rank{rank}.pt")


def _samples(wrapped, topo, prompt) -> dict:
    """SAMPLE_TOKENS tokens after ``prompt`` [1, 3], seeded, through ``full_model()`` (the
    whole model gathered once) and through ``sampling_model()`` (ZeRO-3: a unit at a time),
    with the all_gathers the latter ran and the parameter bytes it leaves."""
    out = {}
    for key, ctx in (("full", wrapped.full_model), ("sharded", wrapped.sampling_model)):
        first = len(topo.ledger.records)
        with ctx() as m:
            out[f"sample_{key}"] = generate(m, prompt, SAMPLE_TOKENS,
                                            generator=torch.Generator().manual_seed(0))
        out[f"sample_{key}_gathers"] = sum(r.op == "all_gather"
                                           for r in topo.ledger.records[first:])
    out["params_bytes_after_sample"] = wrapped.model_state_bytes()["params"]
    return out


def _catch(fn) -> str:
    try:
        fn()
    except ShardwiseConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - the test reports the wrong kind of error
        return "WRONG ERROR TYPE: " + traceback.format_exc()
    return "NO ERROR"


def error_cases(out, rank):
    """Bad input must fail with ShardwiseConfigError on every rank before any collective (a
    hang here would time the world out)."""
    msgs = {}
    one = Topology(dp=1, ranks=[0], timeout_s=60)
    two = Topology(dp=2, ranks=range(2), timeout_s=60)
    if one.member:
        msgs["explicit_dp1"] = _catch(lambda: ZeroSync(make_model("tiny"), one, 2))
        msgs["torch_dp1"] = _catch(lambda: ZeroRedundancySync(make_model("tiny"), one, 3))
    if two.member:
        msgs["split_tied"] = _catch(lambda: zero_sync(
            make_model("tiny"), two, 3, units=["tok_embeddings", "output"]))
        msgs["bad_unit"] = _catch(lambda: zero_sync(make_model("tiny"), two, 3,
                                                    units=["layers.9"]))
        msgs["nested"] = _catch(lambda: ZeroSync(make_model("tiny"), two, 1,
                                                 units=["layers", "layers.0"]))
        good = ZeroSync(make_model("tiny"), two, 2)
        msgs["optimizer"] = _catch(lambda: good.make_optimizer(
            [{"params": list(good.module.parameters())}], optimizer_class=torch.optim.Adafactor))
    torch.save(msgs, f"{out}/errors_rank{rank}.pt")


def main(out: str) -> None:
    init_distributed("cpu", timeout_s=60)
    rank = dist.get_rank()
    topos = {dp: Topology(dp=dp, ranks=range(dp), timeout_s=60) for dp in (2, 4)}
    slow = "slow" in Path(out).name
    for case in CASES:
        topo = topos[case[2]]
        if topo.member and is_slow(case) == slow:
            run_case(out, topo, rank, *case)
    if not slow:
        error_cases(out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
