"""TP on the stacked MLP (the scaling book's model): W_in column-parallel, W_out row-parallel.

Each block ``x + W_out · gelu(W_in · x)`` on x [b, D] (replicated over tp) keeps F/n hidden
units per rank: ``w_in`` [F/n, D] (+ bias [F/n]) and ``w_out`` [D, F/n] (bias [D], replicated,
added once after the sum). One Megatron f/g pair per block: f enters the region (identity
forward, all-reduce of ∂x backward), g leaves it (all-reduce of the partial output forward).
No SP (an MLP batch [b, D] has no sequence dimension), no vocabulary. The loss needs no
collective: every tp rank holds the whole prediction. The same split through DTensor
(``ColwiseParallel`` / ``RowwiseParallel``) is :func:`parallelize_mlp_dtensor`.

Bytes per rank and step, n = tp, L blocks, N rows on this rank, r = 2(n−1)/n:
``tp_fwd`` = L·r·4·N·D (each g), ``tp_bwd`` = (L−1)·r·4·N·D (each f but the first block's:
the data needs no gradient), ``grad_norm`` = r·8. Sources: Shoeybi et al. 2019 (Megatron-LM)
§3; JAX scaling book ch. 5 ("Tensor parallelism"); docs/tensor-parallel.md §0.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ... import comm
from ...errors import ShardwiseConfigError
from ...models.mlp import MLPBlock, StackedMLP
from ..loss import PlainLoss
from ..params import tp_sharded
from .comms import AXIS
from .layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from .options import TPOptions

NO_SP = TPOptions(sp=False)  # the MLP's options: its batch [b, D] has no sequence to split


def is_mlp(model) -> bool:
    """Whether ``model`` is the stacked MLP (or its config, :class:`~shardwise.models.mlp.
    MLPConfig`: it has ``d_ff`` but no attention heads)."""
    cfg = getattr(model, "config", model)
    return hasattr(cfg, "d_ff") and not hasattr(cfg, "n_heads")


def validate_mlp_tp(cfg, tp: int, options: TPOptions, pp: int = 1) -> None:
    """Raise :class:`ShardwiseConfigError` unless ``tp`` divides the MLP's ``d_ff`` (F is split
    evenly), ``options.sp`` is off (no sequence dimension) and ``pp`` = 1 (stages of the MLP are
    not tensor-parallel). Runs no collective."""
    if options.sp:
        raise ShardwiseConfigError(
            f"--tp {tp} --sp: the stacked MLP's activations [b, D] have no sequence dimension "
            "for SP to split: drop --sp (or use a Llama-style model)")
    if pp > 1:
        raise ShardwiseConfigError(
            f"--tp {tp} --pp {pp}: pipeline stages of the stacked MLP are not tensor-parallel: "
            "use --pp 1 with --tp, or a Llama-style model (--model tiny)")
    valid = [k for k in range(1, min(cfg.d_ff, 64) + 1) if cfg.d_ff % k == 0]
    if cfg.d_ff % tp:
        raise ShardwiseConfigError(
            f"--tp {tp} does not divide the MLP's d_ff={cfg.d_ff} (TP splits the hidden units "
            f"evenly over the tp ranks): choose --tp from {{{', '.join(map(str, valid))}}}")


class TensorParallelMLPBlock(MLPBlock):
    """x [b, D] → x + W_out(gelu(W_in x)) [b, D] with this rank's F/n hidden units: enter the
    region (f), ``w_in`` column-parallel → [b, F/n], GELU (element-wise, local), ``w_out``
    row-parallel → all-reduce (g) → [b, D] + b_out. Keeps the plain block's ``ac_mode``; still
    an ``MLPBlock``, so ZeRO-3 makes it a unit as before the conversion."""

    def __init__(self, plain: MLPBlock, topo):
        nn.Module.__init__(self)  # not MLPBlock's: the layers come from ``plain``
        self.topo = topo
        self.w_in = ColumnParallelLinear(plain.w_in, topo)
        self.w_out = RowParallelLinear(plain.w_out, topo, NO_SP)
        self.ac_mode, self.recompute_context = plain.ac_mode, plain.recompute_context

    def forward(self, x):
        return self.run(self._body, x)

    def _body(self, x):
        h = enter_tp_region(x, self.topo, NO_SP)  # f: [b, D], replicated
        return x + self.w_out(F.gelu(self.w_in(h)))  # [b, F/n] → g → [b, D]


def apply_tp_mlp(model: StackedMLP, topo) -> None:
    """Convert ``model`` in place: broadcast every parameter from tp index 0 (phase and tag
    ``"init"``), then replace each block by :class:`TensorParallelMLPBlock`. RuntimeError when a
    shard has the wrong shape or mark (a bug, not bad input)."""
    cfg, n = model.config, topo.size(AXIS)
    validate_mlp_tp(cfg, n, NO_SP)
    with topo.ledger.phase("init"):
        comm.broadcast_coalesced([p.data for p in model.parameters()], topo, AXIS, tag="init")
    for i, block in enumerate(model.layers):
        if type(block) is not MLPBlock:
            raise ShardwiseConfigError(f"TP plan: expected an MLPBlock at layers.{i}, found "
                                       f"{type(block).__name__}")
        model.layers[i] = TensorParallelMLPBlock(block, topo)
    params = dict(model.named_parameters())
    expect = {f"layers.{i}.{k}": s for i in range(cfg.n_layers) for k, s in
              (("w_in.weight", (cfg.d_ff // n, cfg.d_model)), ("w_in.bias", (cfg.d_ff // n,)),
               ("w_out.weight", (cfg.d_model, cfg.d_ff // n)))}
    bad = [f"{k} {tuple(params[k].shape)} (expected {s}, a tp shard)" for k, s in expect.items()
           if tuple(params[k].shape) != s or not tp_sharded(params[k])]
    if bad:
        raise RuntimeError("tensor-parallel conversion of the MLP incomplete: " + "; ".join(bad))


def mlp_tp_bytes(cfg, rows: int, tp: int, param_bytes: int = 4) -> dict[str, float]:
    """{"tp_fwd", "tp_bwd", "grad_norm": bytes} one rank sends per step for ``rows`` samples
    (all micro-batches) through the MLP's L blocks over ``tp`` ranks (module docstring).
    ``param_bytes``: the stored parameter's bytes — ``--param-dtype bf16`` (2): each g sums
    W_out's bf16 partial outputs, while ∂x of each f stays 4 B (the residual stream is the
    fp32 data plus bf16 outputs: fp32 by type promotion)."""
    r = 2 * (tp - 1) / tp
    act = r * 4 * rows * cfg.d_model
    return {"tp_fwd": cfg.n_layers * act * param_bytes / 4, "tp_bwd": (cfg.n_layers - 1) * act,
            "grad_norm": r * 8}


def dtensor_mlp_plan(model: StackedMLP) -> dict:
    """The ``parallelize_module`` plan of the MLP: ``w_in`` ``ColwiseParallel`` (its input
    enters as Replicate: all-reduce of ∂x backward), ``w_out`` ``RowwiseParallel`` (all-reduce
    of the output forward, Replicate bias)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {k: v for i in range(len(model.layers))
            for k, v in ((f"layers.{i}.w_in", ColwiseParallel()),
                         (f"layers.{i}.w_out", RowwiseParallel()))}


def parallelize_mlp_dtensor(model: StackedMLP, topo) -> None:
    """Apply :func:`dtensor_mlp_plan` to ``model`` in place on ``topo.mesh["tp"]`` (after the
    same checks as :func:`apply_tp_mlp`); every Linear weight must come out a DTensor
    (RuntimeError otherwise)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ..params import is_dtensor

    validate_mlp_tp(model.config, topo.size(AXIS), NO_SP)
    parallelize_module(model, topo.mesh[AXIS], dtensor_mlp_plan(model))
    plain = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not is_dtensor(m.weight)]
    if plain:
        raise RuntimeError(f"DTensor TP conversion incomplete: {', '.join(plain)} not sharded")


class MLPLoss(PlainLoss):
    """The MLP's loss function under TP: :class:`~..loss.PlainLoss` (the prediction is whole on
    every tp rank); with ``book``, DTensor's collectives are booked in the ledger during the
    step (the torch engine)."""

    def __init__(self, module, topo, book: bool = False):
        super().__init__(module)
        self.topo, self.book = topo, book

    def booking(self, **options):
        from ...comm.torch_booking import BookFunctionalCollectives

        return BookFunctionalCollectives(self.topo, **options) if self.book \
            else super().booking()
