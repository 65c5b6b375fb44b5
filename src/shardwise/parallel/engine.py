"""The interface every parallel wrapper implements, and the rules every layout shares, once.

The training step (``train/step.py``) talks to a model only through this interface:

===========================  ================================================================
``module``                   the plain model (its submodules may be sharded/parallel versions)
``forward_backward``         run the step's micro-batches forward and backward; returns this
                             rank's loss sum (fp64, [1]); gradient sync may start inside. One
                             loop here; pipeline engines run their schedule instead
``finish_gradient_sync``     wait for / issue the remaining gradient collectives
``clip_grad_norm_``          the *global* gradient L2 norm over every axis, clipping in place
                             (one rule: :func:`.params.grad_norm_`)
``make_optimizer``           the optimizer (ZeRO returns a sharded one)
``reduce_loss_axes``         axes over which the loss sum is all-reduced for the log line
``count_axes``               axes over which the step's token count is all-reduced (both: the
                             topology's data axis, dp or dp × cp, plus pp for a pipeline)
``named_full_parameters``    {FQN of the plain model: full-shape tensor} for the parameters this
                             rank's stage holds, gathered over dp/tp shards (for parity checks)
``named_full_gradients``     the same for gradients (after ``finish_gradient_sync``)
``model_state_bytes``        bytes this rank holds: parameters, gradients, optimizer state
``loss_sum_and_count``       evaluation: (loss sum, counted items) of one batch, no backward
``full_model``               context: the plain model with full weights and full logits, for
                             sampling (collective where the weights are sharded; None when this
                             rank holds only a pipeline stage); every rank enters it together
``full_optimizer_state``     {FQN: {"step", "exp_avg", "exp_avg_sq"}} in full parameter shape,
                             gathered like ``named_full_parameters`` (checkpoints: layout-free)
``load_full_optimizer_state``  the inverse: slice full-shape state into this rank's shards
``bytes_formula``            {tag: bytes} one rank sends per step by the strategy's formula
``memory_formula``           model-state bytes by the papers' formula (None: no closed form)
===========================  ================================================================

A strategy changes the shared rules only through small hooks: ``loss_sum`` / ``booking`` /
``backward_context`` / ``begin_forward_backward`` (the micro-batch loop), ``held_grads`` /
``norm_axes`` (what the norm counts and over which axes it sums), and ``named_params`` /
``dp_parameters`` / ``dp_gradients`` / ``dp_optimizer_state`` / ``dp_load_optimizer_state`` (the
dp part of a full-shape view; the tp part is :func:`.views.to_full` / :func:`.views.to_local`,
which read each parameter's placement: "dp first, then tp", once).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..models import loss_sum_and_count
from .params import (Held, grad_norm_, held_of, grads_or_zeros, local, local_state_bytes,
                     sum_coalesced_, tp_sharded)
from .views import to_full, to_local


def autocast(dtype: str, device: torch.device):
    """bf16 mixed precision: matmuls in bf16, master weights/grads/optimizer state stay fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Sync:
    """The gradient-sync protocol with its defaults: a replicated ``module`` on ``topo`` whose
    gradients need no reduction. Every gradient sync is a plain object (:class:`~.dp.
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

    def held_grads(self) -> Held:
        """The gradient pieces this rank holds, each with whether it counts here
        (:func:`.params.held_of` the module's parameters; ZeRO: its slices); the norm's axes
        are derived from them (:meth:`.params.Held.norm_axes`), never declared per engine."""
        return held_of(self.module.parameters(), getattr(self, "topo", None))

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over ``param_groups`` (parameters of ``self.module``) with ``adamw`` kwargs
        (lr, betas, eps). Sharded strategies override this to shard the optimizer state."""
        return torch.optim.AdamW(param_groups, **adamw)

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank
        (:func:`.params.local_state_bytes`: each tensor once, DTensors by their local shards)."""
        return local_state_bytes(self.module.parameters(), optimizer)

    def bytes_formula(self, micro_steps: int = 1, sequences: int = 0, seq_len: int = 0,
                      dtype: str = "fp32") -> dict[str, float]:
        """{ledger tag: bytes} this rank sends in one step by the strategy's formula (``loss``
        and ``total`` are added by :func:`shardwise.formulas.step_bytes_formula`). Nothing
        here. ``sequences``: this rank's sequences per step (all micro-batches), ``seq_len``
        tokens each; ``dtype``: the autocast dtype."""
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
        return {n: p.grad for n, p in self.named_params() if p.grad is not None}

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


class Engine(nn.Module, Sync):
    """Base class: a replicated model whose micro-batches run one after another on this rank
    (inside :attr:`step_context`, :class:`Sync`'s)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def _step_context(self, batch: dict):
        if self.step_context is None:
            return contextlib.nullcontext()
        return self.step_context(batch["input_ids"].shape[1])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def count_axes(self) -> tuple[str, ...]:
        """Axes the step's token count is summed over: the data axis, "dp" or "dp_cp" (each cp
        rank counts the tokens of its own chunks)."""
        topo = getattr(self, "topo", None)
        return (topo.data_axis if topo is not None else "dp",)

    @property
    def reduce_loss_axes(self) -> tuple[str, ...]:
        """Axes the step's loss sum is summed over for the log line: as :attr:`count_axes`."""
        return self.count_axes

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """The one micro-batch loop: forward + backward each micro-batch; the loss
        back-propagated is its token-loss sum (:meth:`loss_sum`) divided by ``denom`` (the global
        token count), so gradients sum to ∇ of the global mean. Gradient sync is enabled on the
        last micro-step only (nanoGPT's ``require_backward_grad_sync``). Engines change what
        runs inside through the hooks :meth:`loss_sum`, :meth:`booking`, :meth:`backward_context`
        and :meth:`begin_forward_backward`; pipeline engines replace the loop by their schedule.
        Returns the loss sum, fp64 [1]."""
        device = next(self.module.parameters()).device
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        self.begin_forward_backward()
        with self._step_context(microbatches[0]), self.booking():
            for i, mb in enumerate(microbatches):
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                with self.sync_gradients(i == len(microbatches) - 1):
                    with autocast(dtype, device):
                        s = self.loss_sum(mb)
                    with self.backward_context():
                        (s / denom).backward()
                loss_sum += local(s.detach()).double()
        return loss_sum

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The token-loss sum of one micro-batch, with grad (fp32 scalar; TP engines: the
        vocab-parallel loss, complete on every tp rank)."""
        return loss_sum_and_count(self, batch)[0]

    def booking(self, **options):
        """Context around a step's micro-batches (PyTorch engines: book DTensor's collectives;
        ``options`` come from the dp part's :meth:`booking_options` inside dp × tp)."""
        return contextlib.nullcontext()

    def backward_context(self):
        """Context each backward runs in (DTensor TP: ``loss_parallel``)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient L2 norm, every element of the model counted once, clipping to
        ``max_norm`` if > 0 (:func:`.params.grad_norm_` over :meth:`held_grads` and
        :meth:`norm_axes`). Returns the norm before clipping, fp32 []."""
        return grad_norm_(self.held_grads(), getattr(self, "topo", None), None, max_norm)

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, counted items) of ``batch`` — for evaluation (call under no_grad): the
        language-model loss, without a mixture of experts' aux losses."""
        with self._step_context(batch):
            return loss_sum_and_count(self, batch, aux=False)

    def _full_named(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        params = dict(self.named_params())
        names = list(local)
        return dict(zip(names, to_full([(local[n], params[n]) for n in names],
                                       getattr(self, "topo", None), self._views_cache())))

    def _views_cache(self) -> dict:
        """Element positions of DTensor layouts for :func:`.views.to_full`, kept per engine."""
        if "_full_cache" not in self.__dict__:
            self.__dict__["_full_cache"] = {}
        return self.__dict__["_full_cache"]

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """{FQN of the plain model: full-shape parameter} for the parameters this rank holds:
        :meth:`dp_parameters` (whole over dp), then :func:`.views.to_full` over tp. Collective
        wherever the parameters are sharded (every rank of those axes calls it)."""
        return self._full_named(self.dp_parameters())

    def named_full_gradients(self) -> dict[str, torch.Tensor]:
        """The same for gradients (after ``finish_gradient_sync``)."""
        return self._full_named(self.dp_gradients())

    def full_optimizer_state(self, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{FQN of the plain model: {state key: tensor}} for the parameters this rank holds:
        AdamW's ``exp_avg``/``exp_avg_sq`` in the parameter's *full* shape (dp part by
        :meth:`dp_optimizer_state`, tp part by :func:`.views.to_full`, as the parameters) and
        its ``step``. Parameters with no state yet are absent. Collective wherever
        :meth:`named_full_parameters` is."""
        local = self.dp_optimizer_state(optimizer)
        params = dict(self.named_params())
        out, where, pairs = {}, [], []
        for n, st in local.items():
            entry = out[n] = {}
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    where.append((entry, k))
                    pairs.append((v, params[n]))
                else:
                    entry[k] = v.detach().clone() if torch.is_tensor(v) else v
        full = to_full(pairs, getattr(self, "topo", None), self._views_cache())
        for (entry, k), t in zip(where, full):  # one gather for all
            entry[k] = t
        return out

    def load_full_optimizer_state(self, optimizer, state: dict[str, dict]) -> None:
        """Set ``optimizer``'s state from :meth:`full_optimizer_state`'s form (possibly saved
        under another layout): each tensor is cut to this rank's tp shard
        (:func:`.views.to_local`), then to its dp slice (:meth:`dp_load_optimizer_state`). No
        collective. Raises ``KeyError`` naming the FQNs this rank's parameters need but
        ``state`` lacks, ``ValueError`` for a tensor whose shape is not its parameter's."""
        named = self.named_params()
        missing = [n for n, _ in named if n not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. "
                           f"{missing[:3]}")
        topo = getattr(self, "topo", None)
        local = {n: {k: (to_local(v, p, topo) if torch.is_tensor(v) and k != "step"
                         else v.detach().clone() if torch.is_tensor(v) else v)
                     for k, v in state[n].items()} for n, p in named}
        self.dp_load_optimizer_state(optimizer, local)


class NoSync(Sync):
    """The gradient sync of a layout whose data axis has one rank (tp only): nothing to
    reduce (:class:`Sync`'s defaults)."""


class Local(Engine):
    """The single-process reference "engine": the plain model, no communication. Its norm is
    ``torch.nn.utils.clip_grad_norm_`` itself, independent of :func:`.params.grad_norm_`."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if max_norm and max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])
