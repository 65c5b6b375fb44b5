"""Worker for tests/test_gpu_path.py (``pytest -m gpu``, run by benchmarks/gpu.sh): the GPU
correctness subset in one process, a world of one rank on ``DEVICE`` (``cuda``: NCCL; ``cpu``:
gloo, the ``--cpu-dry-run`` path). Writes ``OUT/gpu_cases_<device>.json`` with one record per
case; the test module checks each against its stated bound.

Cases:
``process_group``  the backend of a world of one, and a comm.all_reduce through it;
``compile``        the tiny Llama compiled (--compile) vs eager, fp32: loss and every gradient,
                   with ``--ac none`` and ``selective``;
``bf16``           20 AdamW steps in fp32 and in bf16 autocast from one seed (learnable data):
                   the final losses;
``engines``        explicit vs torch engine at dp=1: loss of 5 steps, then every gradient;
``adamw``          fused vs for-loop AdamW on fixed gradients (no feedback through the model).

Usage: python tests/workers/gpu_cases.py DEVICE OUT
"""

import json
import sys

import torch

from shardwise import comm
from shardwise.config import TrainConfig
from shardwise.models import build_model, loss_sum_and_count, set_activation_checkpointing
from shardwise.models.compile import compile_blocks
from shardwise.parallel.apply import Layout, parallelize
from shardwise.topology import Topology, init_distributed
from shardwise.train.optim import adamw_kwargs, build_optimizer
from shardwise.train.step import train_step

V, S, B = 67, 32, 4


def batch(step: int, device, b: int = B) -> dict:
    """[b, S] sequences counting up by a stride 1-3 from a random start (mod V): learnable."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, V, (b, 1), generator=g)
    k = torch.randint(1, 4, (b, 1), generator=g)
    seq = (start + k * torch.arange(S + 1)) % V
    return {"input_ids": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device)}


def case_process_group(topo, device) -> dict:
    x = torch.full((4,), 3.0, device=device)
    comm.all_reduce(x, topo, "dp", tag="test")
    return {"backend": torch.distributed.get_backend(), "value": x.tolist()}


def case_compile(device) -> dict:
    out = {}
    for ac in ("none", "selective"):
        res = []
        for compiled in (False, True):
            torch.compiler.reset()
            torch.manual_seed(0)
            with torch.device(device):
                model = build_model("tiny", vocab_size=V)
            set_activation_checkpointing(model, ac)
            if compiled:
                compile_blocks(model)
            loss, count = loss_sum_and_count(model, batch(0, device))
            (loss / count).backward()
            res.append((float(loss.detach()), {n: p.grad.detach().cpu() for n, p in
                                      model.named_parameters()}))
        (le, ge), (lc, gc) = res
        out[ac] = {"loss_eager": le, "loss_compiled": lc,
                   "grad_max_abs_err": {n: float((ge[n] - gc[n]).abs().max()) for n in ge},
                   "grad_max_abs": {n: float(ge[n].abs().max()) for n in ge}}
    return out


def case_bf16(topo, device) -> dict:
    cfg = TrainConfig(model="tiny", lr=1e-2)
    out = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model("tiny", vocab_size=V)
        engine = parallelize(model, topo, Layout())
        opt = build_optimizer(engine, cfg)
        losses = [train_step(engine, [batch(s, device)], opt, topo, max_norm=1.0,
                             dtype=dtype).loss for s in range(20)]
        out[dtype] = losses
    return out


def case_engines(topo, device) -> dict:
    cfg = TrainConfig(model="tiny", lr=1e-2)
    out = {}
    for name in ("explicit", "torch"):
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model("tiny", vocab_size=V)
        engine = parallelize(model, topo, Layout(), engine=name)
        opt = build_optimizer(engine, cfg)
        losses = [train_step(engine, [batch(s, device)], opt, topo, max_norm=1.0,
                             zero_grad=False).loss for s in range(5)]
        grads = {n: g.detach().cpu() for n, g in engine.named_full_gradients().items()}
        out[name] = {"losses": losses, "grads": grads}
    e, t = out["explicit"], out["torch"]
    return {"losses_explicit": e["losses"], "losses_torch": t["losses"],
            "grad_max_abs_err": max(float((e["grads"][n] - t["grads"][n]).abs().max())
                                    for n in e["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in e["grads"].values())}


def case_adamw(device, steps: int = 20, lr: float = 3e-3) -> dict:
    shapes = [(256, 64), (64,), (100, 17), (5,)]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    finals = {}
    for impl in ("for-loop", "fused"):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in init]
        opt = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                                 {"params": params[2:], "weight_decay": 0.0}], lr=lr,
                                betas=(0.9, 0.95), eps=1e-8, **adamw_kwargs(impl))
        for t in range(steps):
            for p, gr in zip(params, grads[t]):
                p.grad = gr.to(device)
            opt.step()
        finals[impl] = [p.detach().cpu() for p in params]
    a, b = finals["for-loop"], finals["fused"]
    return {"steps": steps, "lr": lr,
            "max_abs_err": max(float((x - y).abs().max()) for x, y in zip(a, b)),
            "max_abs_param": max(float(x.abs().max()) for x in a)}


def main(device: str, out: str) -> None:
    init_distributed(device, 120)
    topo = Topology(1, 1, 1, device=device, timeout_s=120)
    dev = topo.device
    rec = {"device": str(dev), "torch": torch.__version__,
           "process_group": case_process_group(topo, dev), "compile": case_compile(dev),
           "bf16": case_bf16(topo, dev), "engines": case_engines(topo, dev),
           "adamw": case_adamw(dev)}
    with open(f"{out}/gpu_cases_{device}.json", "w") as f:
        json.dump(rec, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
