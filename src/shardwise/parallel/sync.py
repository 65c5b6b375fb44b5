"""The gradient-sync protocol: :class:`Sync`, with its defaults, and :class:`NoSync`.

A gradient sync is a plain object (not a module, not an engine) that :class:`~.model.
ParallelModel` asks for the micro-step sync, the finish of the reduction, the optimizer, the
norm's held gradients and the dp part of the full-shape views ("dp first, then tp": the tp part
is :func:`.views.to_full` / :func:`.views.to_local`, which read each parameter's placement). Its
members are listed in docs/architecture.md, "One engine".
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from ..precision import FP32, Precision
from .muon import Muon, Orthogonalizer
from .params import (Held, grad_of, held_of, grads_or_zeros, local_state_bytes,
                     sum_coalesced_, tp_sharded)


class Sync(Protocol):
    """The gradient-sync protocol (a ``typing.Protocol``) with its defaults, which a sync that
    subclasses it explicitly inherits: a replicated ``module`` on ``topo`` whose gradients need
    no reduction. Every gradient sync is a plain object (:class:`~.dp.
    DataParallel`, :class:`~.dp.DDPSync`, :mod:`.zero`'s); :class:`~.model.ParallelModel` asks it
    for the micro-step sync, the finish, the optimizer, the norm's held gradients and the dp
    part of the full-shape views. Used as is when dp × cp = 1 (:class:`NoSync`).
    ``step_context``: None, or local sequence length → the context every step's micro-batches
    and every evaluation run in (torch's ``context_parallel``: :func:`.cp.torch_cp.step_context`)."""

    step_context = None

    sliced: tuple[str, ...] = ()  # axes over which the held gradients are slices (ZeRO)

    def __init__(self, module: nn.Module, topo):
        self.module, self.topo = module, topo

    @property
    def forward_module(self) -> nn.Module:
        """What the loss function runs forward: the module (DDP: its wrapper, whose forward
        prepares the bucketed all-reduce of the backward)."""
        return self.module

    def booking(self):
        """Context around a step's micro-batches, the sync's own (HSDP through FSDP2: book its
        c10d all-reduce over the replicas)."""
        return contextlib.nullcontext()

    def sync_gradients(self, enabled: bool):
        """Context: inside ``sync_gradients(False)`` backward only accumulates locally."""
        return contextlib.nullcontext()

    def begin_forward_backward(self) -> None:
        """Called before a step's first forward (ZeRO-3: every unit starts sharded)."""

    def booking_options(self) -> dict:
        """Options for the loss function's booking (FSDP2 over DTensor: which c10d calls to
        book as dp traffic)."""
        return {}

    def finish_gradient_sync(self) -> None:
        """Wait for / issue the remaining gradient collectives."""

    def fill(self, weights) -> None:
        """The values of a sync built over a meta model's parameters: each rank's part from
        ``weights`` ((name, full tensor)): the plain copy (:func:`.materialize.fill_module`:
        our tp/ep shards, or DTensor TP's and FSDP2's local shards). ZeRO's flat buffers
        override it (:meth:`.zero.ZeroSync.fill`). Raises ``ValueError`` for a missing name."""
        from .materialize import fill_module

        fill_module(self.module, weights, self.topo, fqn=getattr(self.module, "fqn", None))

    def sum_replicated_grads(self) -> None:
        """The SP finisher's sum (:class:`~.tp.SPSum`): SUM over tp the gradients this rank
        holds of the tp-replicated parameters (the norm weights, whose gradient on one tp rank
        covers only its s/tp positions) — one flat all-reduce, tag ``sp_grad``. Here: the whole
        gradients of the module's replicated parameters; ZeRO sums its slice only; FSDP2 over
        DTensor TP already reduced its ``Partial`` gradients in backward."""
        rep = [p for p in dict.fromkeys(self.module.parameters()) if not tp_sharded(p)]
        sum_coalesced_(grads_or_zeros(rep), self.topo, "tp", tag="sp_grad")

    def sp_grad_bytes(self, whole: float) -> float:
        """Bytes of :meth:`sum_replicated_grads` given ``whole``, TP's formula for the whole
        replicated gradients (:func:`~.tp.tp_step_bytes_formula`'s ``sp_grad``)."""
        return whole

    def after_evaluation(self) -> None:
        """Called after an evaluation forward (FSDP2: reshard what stayed gathered)."""

    @contextlib.contextmanager
    def full_model(self):
        yield self.module

    @contextlib.contextmanager
    def full_model_for(self, composed):
        """The full-weights, full-logits model of ``composed`` for sampling: this sync's full
        weights (ZeRO-3: gathered) and the loss function's gathered logits."""
        with self.full_model(), composed.loss_fn.gathered_logits() as model:
            yield model

    def sampling_model_for(self, composed):
        """The model to sample from, with full logits: :meth:`full_model_for`'s (ZeRO-3
        overrides it: its own sharded forward, unit by unit)."""
        return self.full_model_for(composed)

    def held_grads(self) -> Held:
        """The gradient pieces this rank holds, each with whether it counts here
        (:func:`.params.held_of` the module's parameters; ZeRO: its slices); the norm's axes
        are derived from them (:meth:`.params.Held.norm_axes`), never declared per engine."""
        return held_of(self.module.parameters(), getattr(self, "topo", None))

    def make_optimizer(self, param_groups: list[dict], optimizer_class=torch.optim.AdamW,
                       **adamw) -> torch.optim.Optimizer:
        """``optimizer_class`` (AdamW, or :class:`.muon.Muon`) over ``param_groups``
        (parameters of ``self.module``) with ``adamw`` kwargs (lr, betas, eps). Muon's
        orthogonaliser gathers tp-sharded matrices over tp (:class:`.muon.Orthogonalizer`);
        whole matrices (DP, CP, PP, EP) need nothing. Sharded strategies override this to shard
        the optimizer state."""
        opt = optimizer_class(param_groups, **adamw)
        if isinstance(opt, Muon):
            opt.orthogonalize = Orthogonalizer(self.topo)
            self._muon = (opt.orthogonalize, [p for g in param_groups if g.get("muon")
                                              for p in g["params"]])
        return opt

    _muon = None  # (the Muon optimizer's orthogonaliser, its matrices) once make_optimizer ran

    def muon_bytes(self) -> float:
        """Bytes this rank sends per step under tag ``muon`` by the formula
        (:meth:`.muon.Orthogonalizer.bytes_formula`): 0 unless :meth:`make_optimizer` built
        Muon."""
        return self._muon[0].bytes_formula(self._muon[1]) if self._muon else 0.0

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank
        (:func:`.params.local_state_bytes`: each tensor once, DTensors by their local shards)."""
        return local_state_bytes(self.module.parameters(), optimizer)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      precision: Precision = FP32) -> dict[str, float]:
        """{ledger tag: bytes} this rank sends in one step by the strategy's formula (``loss``
        and ``total`` are added by :func:`shardwise.formulas.step_bytes_formula`). Nothing
        here. ``sequences``: this rank's sequences per step (all micro-batches), ``seq_len``
        tokens each; ``precision``: the run's record (its compute dtype: the autocast's)."""
        return {}

    def memory_formula(self) -> dict[str, float] | None:
        """Model-state bytes by the papers' formula for this rank (None: no closed form)."""
        return None

    # -- full shape: the dp part (this sync), then the tp part (:func:`.views.to_full`) --------
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """(FQN of the plain model, parameter) for every parameter this rank holds, each once
        (a pipeline stage maps its own names to the plain model's: its ``fqn``)."""
        fqn = getattr(self.module, "fqn", None)  # a tied parameter under its first name
        return [(fqn(n) if fqn else n, p) for n, p in self.module.named_parameters()]

    def dp_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN: parameter in this rank's tp-local shape}: whole over dp (ZeRO-3 gathers its
        shards over dp here; FSDP2's DTensors stay DTensors)."""
        return {n: p.detach() for n, p in self.named_params()}

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        """{FQN: summed gradient in this rank's tp-local shape} (ZeRO: its slices gathered over
        dp)."""
        return {n: grad_of(p) for n, p in self.named_params() if grad_of(p) is not None}

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        """{FQN: {state key: value}} with tensors in this rank's tp-local parameter shape (ZeRO:
        its slices gathered over dp). Parameters without state (never stepped) are absent."""
        names = {id(p): n for n, p in self.named_params()}
        return {names[id(p)]: dict(optimizer.state[p]) for g in optimizer.param_groups
                for p in g["params"] if optimizer.state.get(p)}

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        """The inverse of :meth:`dp_optimizer_state`: ``local`` in tp-local shape (ZeRO: cut to
        this rank's slices). No collective."""
        for n, p in self.named_params():
            optimizer.state[p] = local[n]

    def dp_pieces(self, optimizer=None) -> list:
        """What this rank holds, no collective and no copy (a shard-by-shard checkpoint's
        source): a :class:`.boxes.Piece` per parameter and per tensor of its optimizer state
        (``optimizer`` None: the parameters only), in the tp-local shape. Here the whole
        tensors (DTensors stay DTensors: FSDP2 shards and DTensor TP carry their boxes); ZeRO:
        its flat slices (:func:`.zero.flat.flat_pieces`)."""
        from .boxes import Piece

        out = [Piece("model", n, p.detach()) for n, p in self.named_params()]
        if optimizer is not None:
            out += [Piece(k, n, v) for n, st in self.dp_optimizer_state(optimizer).items()
                    for k, v in st.items() if torch.is_tensor(v)]
        return out


class NoSync(Sync):
    """The gradient sync of a layout whose data axis has one rank (tp only): nothing to
    reduce (:class:`Sync`'s defaults)."""
