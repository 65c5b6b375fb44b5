"""One precision record, :class:`Precision`: the dtype of each piece of training state and
traffic, built once from the config, held by the engine and taken by every gradient sync,
runner and byte formula of ``parallel/`` (today they read ``compute``, the autocast and
activation bytes, and ``reduce_dtype``, the dp reduction; the memory formulas still assume
fp32 storage and AdamW state), and the planner's precisions (:data:`PRESETS`).

Why each field is separate (mixed-precision training, Micikevicius et al. 2018; ZeRO §3.1;
Megatron-LM's distributed optimizer; PyTorch FSDP2's ``MixedPrecisionPolicy``):
docs/precision-memory-mfu.md, "One record".
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import ShardwiseConfigError

# the dtype gradients are reduced in over dp: the one table (Layout.check and the syncs read it)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # bytes per element of a dtype name


def reduce_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype gradients are reduced in over dp: "fp32" (exact sums of fp32 gradients)
    or "bf16" (each rank rounds its local gradient to bf16, the sum is formed in bf16 and cast
    back to fp32: half the bytes for 8 mantissa bits instead of 24 — PyTorch FSDP's
    ``MixedPrecision(reduce_dtype=torch.bfloat16)``, Megatron-LM's ``--grad-reduce-in-bf16``).
    Raises :class:`ShardwiseConfigError` otherwise."""
    if name not in REDUCE_DTYPES:
        # the one place this rule is written (Layout.check and the engines call it)
        raise ShardwiseConfigError(f"--reduce-dtype {name!r}: choose fp32 or bf16 (the "
                                   "dtype gradients are reduced in over dp)")
    return REDUCE_DTYPES[name]


def reduce_bytes(name: str) -> int:
    """Bytes per gradient element on the wire when reduced in ``name`` (fp32 4, bf16 2): the b_r
    of every dp, ZeRO, FSDP2 and pipeline formula."""
    return torch.finfo(reduce_torch_dtype(name)).bits // 8


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtype (a name: "fp32", "bf16", …) of each piece of state and traffic:

    ``compute``: the matmuls (bf16: autocast); ``param_dtype``: the parameters as stored;
    ``master_dtype``: the optimizer's master copy beside low-precision storage (None: the
    parameters are the master weights); ``grad_dtype``: the accumulated gradients;
    ``reduce_dtype``: the gradient reduction over dp; ``optim_dtype``: the optimizer state
    (Adam m, v); ``gather_dtype``: the parameter all-gather of ZeRO-3 / FSDP (None: the storage
    dtype). ``name``: the planner's label.

    shardwise trains today with fp32 storage, master, gradients and state, ``compute`` fp32 or
    bf16 autocast and ``reduce_dtype`` fp32 or bf16 (:meth:`of`); the planner also ranks bf16
    storage with fp32 master weights (:data:`PRESETS`). The byte properties below are the
    planner's per-parameter counts (ZeRO §3.1's 2 + 2 + 12, Megatron-LM's 2 + 4 + 12)."""

    compute: str = "fp32"
    param_dtype: str = "fp32"
    master_dtype: str | None = None
    grad_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    optim_dtype: str = "fp32"
    gather_dtype: str | None = None
    name: str = "fp32"

    @classmethod
    def of(cls, compute: str = "fp32", reduce: str = "fp32") -> "Precision":
        """shardwise's training precision: fp32 state, ``compute`` ("fp32" | "bf16" autocast),
        gradients reduced in ``reduce``."""
        return cls(compute=compute, reduce_dtype=reduce,
                   name="fp32" if compute == "fp32" else "amp")

    @classmethod
    def from_config(cls, cfg) -> "Precision":
        """From a run's config: ``--dtype``, ``--reduce-dtype``, ``--param-dtype`` and
        ``--master-dtype`` (:meth:`stored`)."""
        return cls.stored(getattr(cfg, "param_dtype", "fp32"),
                          getattr(cfg, "master_dtype", "fp32"), compute=cfg.dtype,
                          reduce=getattr(cfg, "reduce_dtype", "fp32"))

    @classmethod
    def stored(cls, param: str = "fp32", master: str = "fp32", *, compute: str = "fp32",
               reduce: str = "fp32") -> "Precision":
        """The record of a storage recipe: ``param`` "fp32" is :meth:`of`; ``param`` "bf16" with
        ``master`` "fp32" is Megatron-LM's (bf16 parameters; fp32 gradients, master weights and
        Adam state: 2 + 4 + 4 + 8 = 18 B/parameter), with ``master`` "none" the guide's FSDP2
        recipe (the model built in bf16: parameters, gradients and Adam state bf16, no master
        copy, 2 + 2 + 4 = 8 B/parameter; reduced in ``reduce``). bf16 storage computes in bf16."""
        if param == "fp32":
            return cls.of(compute, reduce)
        if master == "fp32":
            return cls(compute="bf16", param_dtype=param, master_dtype="fp32",
                       reduce_dtype=reduce, name=param)
        return cls(compute="bf16", param_dtype=param, grad_dtype=param, reduce_dtype=reduce,
                   optim_dtype=param, name=f"{param}-pure")

    def with_compute(self, compute: str) -> "Precision":
        """The same record with another compute dtype."""
        return self if compute == self.compute else dataclasses.replace(self, compute=compute)

    # -- torch dtypes and element sizes -------------------------------------------------------
    @property
    def reduce_torch(self) -> torch.dtype:
        """The torch dtype of the gradient reduction (:func:`reduce_torch_dtype`: raises
        :class:`ShardwiseConfigError` for an unknown one)."""
        return reduce_torch_dtype(self.reduce_dtype)

    @property
    def main_grad_torch(self) -> torch.dtype | None:
        """fp32 where gradients accumulate in another dtype than the parameters are stored in
        (Megatron's fp32 main gradients of bf16 parameters: ``parallel/storage.py``), else
        None (the parameters' own dtype)."""
        return torch.float32 if self.grad_dtype != self.param_dtype else None

    # -- the planner's bytes per parameter (plan/) ---------------------------------------------
    @property
    def param(self) -> int:
        """Bytes per stored parameter."""
        return ELEMENT_BYTES[self.param_dtype]

    @property
    def grad(self) -> int:
        """Bytes per accumulated gradient element."""
        return ELEMENT_BYTES[self.grad_dtype]

    @property
    def optim(self) -> int:
        """Optimizer-state bytes per parameter: Adam's m and v, plus the master copy."""
        master = ELEMENT_BYTES[self.master_dtype] if self.master_dtype else 0
        return 2 * ELEMENT_BYTES[self.optim_dtype] + master

    @property
    def grad_comm(self) -> int:
        """Bytes per gradient element on the wire (the reduce dtype)."""
        return ELEMENT_BYTES[self.reduce_dtype]

    @property
    def act(self) -> int:
        """Bytes per activation element (the compute dtype)."""
        return ELEMENT_BYTES[self.compute]

    @property
    def adam_bytes(self) -> int:
        """Bytes read + written per parameter by the AdamW step: the parameter (read and
        written; with a master copy, the master read and written and the parameter written), the
        gradient read, m and v read and written."""
        p = ELEMENT_BYTES[self.param_dtype]
        weights = p + 2 * ELEMENT_BYTES[self.master_dtype] if self.master_dtype else 2 * p
        return weights + self.grad + 4 * ELEMENT_BYTES[self.optim_dtype]

    @property
    def wgrad_bytes(self) -> int:
        """Bytes read + written per parameter and micro-batch to add a new weight gradient into
        the accumulated one as a separate element-wise kernel: a gradient in the storage dtype
        written and read, the accumulated one read and written (fp32 throughout: 4 × 4)."""
        return 2 * ELEMENT_BYTES[self.param_dtype] + 2 * self.grad


FP32 = Precision()

PRESETS = {
    # bf16 weights, fp32 main gradients (Megatron-LM's accumulation buffer, reduced in fp32 as
    # Llama 3 §3.3.2 does), fp32 master weights + Adam m, v: 2 + 4 + 12 = 18 bytes/parameter
    # (Megatron-LM distributed-optimizer table; ZeRO §3.1 counts 2 + 2 + 12 with fp16 gradients)
    "bf16": Precision(compute="bf16", param_dtype="bf16", master_dtype="fp32", name="bf16"),
    # shardwise's --dtype bf16: fp32 weights, gradients and Adam state, bf16 autocast compute
    "amp": Precision.of("bf16"),
    # everything fp32 (the CPU tests): 4 + 4 + 8 = 16 bytes/parameter
    "fp32": Precision.of("fp32"),
}
