"""Memory per rank without a GPU: the real model under FakeTensorMode, one step of our engine in
a fake process group of any world size, and the bytes counted.

:func:`estimate_memory` (one process, no allocation):

1. ``torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)``
   (``torch.testing._internal.distributed.fake_pg``): collectives return at once, but they run
   through :mod:`shardwise.comm`, so the ledger books what rank 0 would send.
2. Under ``torch._subclasses.fake_tensor.FakeTensorMode`` the real :class:`~shardwise.models.Llama`
   is built at full size (8B: 32 GB of fp32 weights that are never allocated), wrapped by
   :func:`shardwise.parallel.apply.parallelize` over ``Topology(dp=N)``, with the engine's own
   optimizer (:func:`shardwise.train.optim.build_optimizer`).
3. One optimizer step, following :func:`shardwise.train.step.train_step`'s sync points (that
   function reads the global token count with ``.item()``, which fake tensors cannot answer, so
   the count is the known micro-batch size): all-reduce of the token count, the engine's
   ``forward_backward`` over ``microbatches`` micro-batches, ``finish_gradient_sync``,
   ``clip_grad_norm_``, ``optimizer.step()``, all-reduce of the loss.
4. Counted: ``engine.model_state_bytes(optimizer)`` (parameters, gradients, AdamW state with its
   step counters); the explicit DP engine's gradient buckets; the activations autograd saves
   for backward, measured with ``torch.autograd.graph.saved_tensors_hooks`` as the bytes of
   distinct storages that are not parameters or buffers, per micro-batch (they run one after
   another, each keeping its own from its forward to its backward); the ledger's bytes per tag.

:func:`compare` puts the analytical numbers of :mod:`shardwise.plan.cost` next to them. Today
only data parallelism exists, so the estimator runs dp layouts; ZeRO, TP and PP come from the
formulas until their engines land (then ``parallelize`` builds them here unchanged).

Run it on its own (it needs its own process group, so tests use a subprocess)::

    python -m shardwise.tools.estimate --model llama3-8b --world-size 64 --seq-len 8192
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ShardwiseConfigError


def to_llama_config(spec, max_seq_len: int | None = None):
    """The :class:`~shardwise.models.LlamaConfig` of a dense Llama-style :class:`ModelSpec`
    (SwiGLU, RMSNorm, RoPE, no biases). Raises ShardwiseConfigError for other shapes and for
    mixtures of experts."""
    import dataclasses

    from ..plan.models import train_model_config

    if spec.mlp != "swiglu" or spec.norm != "rmsnorm" or spec.bias or spec.learned_positions:
        raise ShardwiseConfigError(f"model {spec.name}: the estimator builds shardwise's Llama "
                                   "(SwiGLU, RMSNorm, RoPE, no biases); choose a Llama-style "
                                   "model such as llama3-8b or tiny")
    if spec.is_moe:
        raise ShardwiseConfigError(
            f"model {spec.name} is a mixture of experts: the estimator runs dense Llama models "
            "only (an MoE forward reads its routing counts on the host, which fake tensors "
            "cannot answer); use `shardwise plan` for its analytical memory")
    # the config train builds for the spec (one conversion: plan.models.train_model_config)
    return dataclasses.replace(train_model_config(spec), max_seq_len=max_seq_len or spec.seq_len)


def estimate_memory(spec, world_size: int, *, seq_len: int | None = None, micro_batch: int = 1,
                    microbatches: int = 1, engine: str = "explicit", bucket_mb: float = 25.0,
                    dtype: str = "fp32") -> dict:
    """Bytes rank 0 holds and sends in one step of ``spec`` (a Llama-style
    :class:`~shardwise.plan.models.ModelSpec`) under data parallelism over ``world_size`` fake
    ranks, with ``microbatches`` micro-batches of ``micro_batch`` sequences of ``seq_len``
    tokens. Initialises (and destroys) the default process group: call it in a process that has
    none. Returns {"params", "grads", "optimizer", "model_state", "buckets", "activations",
    "ledger": {tag: bytes}, "num_params", "num_tensors"} (bytes)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .. import comm
    from ..config import TrainConfig
    from ..models import Llama
    from ..parallel.apply import parallelize
    from ..topology import Topology
    from ..train.optim import build_optimizer

    if world_size < 1:
        raise ShardwiseConfigError(f"--world-size {world_size} must be at least 1")
    if engine != "explicit":
        raise ShardwiseConfigError(f"--engine {engine}: the estimator runs the explicit engine "
                                   "only (DDP checks parameter data at construction, which fake "
                                   "tensors do not have)")
    if dist.is_initialized():
        raise ShardwiseConfigError("estimate_memory needs a process without a process group "
                                   "(run `python -m shardwise.tools.estimate`)")
    seq_len = seq_len or spec.seq_len
    cfg = to_llama_config(spec, max_seq_len=seq_len)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        topo = Topology(dp=world_size)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = Llama(cfg)
            wrapped = parallelize(model, topo, engine=engine, bucket_mb=bucket_mb)
            opt = build_optimizer(wrapped, TrainConfig(model="tiny"))
            fixed = {s.untyped_storage()._cdata
                     for s in [*model.parameters(), *model.buffers()]}
            batches = [{"input_ids": torch.zeros(micro_batch, seq_len, dtype=torch.long),
                        "labels": torch.ones(micro_batch, seq_len, dtype=torch.long)}
                       for _ in range(microbatches)]
            saved: dict[int, tuple] = {}

            def pack(t):
                st = t.untyped_storage()
                if st._cdata not in fixed and st._cdata not in saved:
                    saved[st._cdata] = (st, st.nbytes())  # held: its address is not reused
                return t

            topo.ledger.begin_step()
            count = torch.tensor([float(micro_batch * seq_len * microbatches)],
                                 dtype=torch.float64)
            for axis in wrapped.count_axes:  # train_step's sync point 1
                comm.all_reduce(count, topo, axis, tag="loss")
            denom = float(micro_batch * seq_len * microbatches * world_size)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = wrapped.forward_backward(batches, denom, dtype)  # sync point 2
            # micro-batches run one after another: each keeps its activations from its forward
            # to its backward, so the peak is one micro-batch's share
            peak_act = sum(n for _, n in saved.values()) / microbatches
            wrapped.finish_gradient_sync()  # sync point 3
            wrapped.clip_grad_norm_(1.0)  # sync point 4
            opt.step()
            for axis in wrapped.reduce_loss_axes:  # sync point 5
                comm.all_reduce(loss, topo, axis, tag="loss")
            state = wrapped.model_state_bytes(opt)
            buckets = sum(b.buffer.numel() * b.buffer.element_size()  # explicit DP's sync
                          for b in getattr(wrapped.grad_sync, "buckets", []))
            ledger: dict[str, float] = {}
            for r in topo.ledger.step_records():
                ledger[r.tag] = ledger.get(r.tag, 0.0) + r.wire_bytes
            n_params = sum(p.numel() for p in model.parameters())
            n_tensors = len(list(model.parameters()))
        return {"world_size": world_size, "params": state["params"], "grads": state["grads"],
                "optimizer": state["optimizer"], "model_state": state["total"],
                "buckets": buckets, "activations": peak_act, "ledger": ledger,
                "num_params": n_params, "num_tensors": n_tensors, "seq_len": seq_len,
                "micro_batch": micro_batch, "microbatches": microbatches, "dtype": dtype}
    finally:
        dist.destroy_process_group()


def analytical(spec, world_size: int, *, seq_len: int | None = None, micro_batch: int = 1,
               microbatches: int = 1, dtype: str = "fp32") -> dict:
    """What :mod:`shardwise.plan.cost` predicts for the same step (dp = ``world_size``, zero 0,
    eager kernels, shardwise's explicit DP engine with its gradient buckets). The activation
    count is exact in fp32; under bf16 autocast our eager model keeps fp32 residuals and norm
    statistics and bf16 copies of the matmul inputs, about twice what the a = 2 formula says
    (the estimator measures it)."""
    import dataclasses

    from ..plan.comm import dp_step_bytes
    from ..plan.layout import PRECISIONS, PlanLayout
    from ..plan.memory import (embedding_activation_bytes, head_activation_bytes,
                               layer_activation_bytes, model_state_bytes)

    spec = dataclasses.replace(spec, kernels="eager", seq_len=seq_len or spec.seq_len)
    prec = PRECISIONS["fp32" if dtype == "fp32" else "amp"]
    lay = PlanLayout(dp=world_size, precision=prec.name, micro_batch=micro_batch)
    psi = spec.num_params()
    st = model_state_bytes(psi, spec.num_tensors(), 0, world_size, prec)
    tokens = micro_batch * spec.seq_len
    act = (spec.n_layers * layer_activation_bytes(spec, tokens, ckpt="none", act_bytes=prec.act)
           + head_activation_bytes(spec, tokens, act_bytes=prec.act)
           + embedding_activation_bytes(spec, tokens))
    if prec.act == 4:  # fp32: the loss also saves its 0-d result  (4 bytes)
        act += 4
    return {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
            "model_state": st["params"] + st["grads"] + st["optimizer"],
            "buckets": prec.grad * psi,
            "activations": act, "ledger": dp_step_bytes(spec, lay, m=microbatches),
            "num_params": psi, "num_tensors": spec.num_tensors()}


def compare(spec, world_size: int, **kw) -> dict:
    """{"measured": :func:`estimate_memory`, "predicted": :func:`analytical`}."""
    return {"measured": estimate_memory(spec, world_size, **kw),
            "predicted": analytical(spec, world_size, **{k: v for k, v in kw.items()
                                                         if k in ("seq_len", "micro_batch",
                                                                  "microbatches", "dtype")})}


def main(argv: list[str] | None = None) -> int:
    from ..plan.models import get_model

    p = argparse.ArgumentParser(prog="python -m shardwise.tools.estimate",
                                description="bytes per rank of one DP step of the real model "
                                "under FakeTensorMode and a fake process group")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args(argv)
    try:
        spec = get_model(args.model)
        measured = estimate_memory(spec, args.world_size, seq_len=args.seq_len,
                                   micro_batch=args.micro_batch,
                                   microbatches=args.microbatches, dtype=args.dtype)
        predicted = analytical(spec, args.world_size, seq_len=args.seq_len,
                               micro_batch=args.micro_batch, microbatches=args.microbatches,
                               dtype=args.dtype)
    except ShardwiseConfigError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    json.dump({"model": spec.name, "measured": measured, "predicted": predicted}, sys.stdout,
              indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
