"""The explicit pipeline engine: this rank's stages, the step through
:class:`.runner.ScheduleRunner`, and what follows backward (tied swap, SP sum, dp reduction,
norm).

TP (+SP) inside each stage (:func:`..tp.apply_tp`), the schedule across stages, DP
(:class:`..dp.GradSync`) / ZeRO-1 (:mod:`..zero.flat`) over dp after the last microbatch.
Every rank talks only to the pp neighbours with its own (dp, tp) index. ``forward_backward``
returns this rank's loss *sum* (the last stage's token losses, plus every stage's MoE aux
losses: :mod:`.runner`), which the train step all-reduces over ``reduce_loss_axes``: pp and the
data axis (dp, or dp × cp).

A mixture of experts with expert parallelism (ep > 1; :func:`..ep.parallelize_experts` ran on
the plain model before the split, so each stage holds its layers' E/ep experts): the stage's
token all-to-alls run inside its F and B over "ep" (the ep ranks share the pp index, so they run
the same actions in the same order); expert shards are summed over "edp", the rest over the data
axis (:class:`..dp.GradSync`); the norm sums over "ep" too. ZeRO-1 keeps two flat buffers,
the dense parameters over the data axis and the expert shards over "edp" (then the norm's one
scalar over the data axis counts every slice once).

Bytes this rank sends per optimizer step, by tag (:meth:`PipelineParallel.bytes_formula`; the
derivation: docs/composition.md, "Pipelines composed"), rank r of p, v chunks, m microbatches,
A = bytes of one activation as sent ([b, s, d]; SP [b, s/tp, d]), Ψ_r = bytes of this rank's
parameters (its tp shards) in the reduce dtype, P_r their elements padded to a multiple of n = dp:

* ``pp_fwd`` m·A·(v − [r = p−1]), ``pp_bwd`` m·A·(v − [r = 0]) (:mod:`.comms`);
* ``tp_fwd``/``tp_bwd``/``ce`` (tp > 1): :func:`..tp.tp_activation_bytes` for this rank's blocks,
  embedding and head; ``sp_grad`` (SP): 2(t−1)/t of the norm weights' bytes, t = tp;
* ``tied`` (p > 1, first and last rank): the [V_pad/tp, d] table shard's gradient, once;
* ``grad`` (dp > 1): 2(n−1)/n·Ψ_r, or with ZeRO-1 (n−1)/n·P_r elements in the reduce dtype
  and ``param`` (n−1)/n·P_r in the parameters' dtype; with ep > 1 the expert shards' part
  2(n_e−1)/n_e·Ψ_r,experts over n_e = dp·cp/ep ranks ("edp");
* ``grad_norm``: one fp64 scalar all-reduced over tp, dp (ZeRO-1 only), ep (ep > 1) and pp;
* ``ep_counts``/``ep_dispatch``/``ep_combine`` (ep > 1): :func:`..ep.ep_bytes_formula` of the
  stage's MoE layers, added by :func:`shardwise.formulas.step_bytes_formula`.

Sources: Megatron-LM §3 and Narayanan et al. 2021 §2.3 (PP × TP), Korthikanti et al. 2022 §4.2.2
(SP), ZeRO paper §7.2.1, JAX scaling book ch. 5 (collective costs).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ... import comm
from ...comm import ring_bytes
from ...models import count_items, moe_layers, positions_kw
from ...models.dpo import token_loss_sum
from ..dp.data_parallel import GradSync
from ..engine import Engine
from ..layout import Layout
from ..params import (Held, broadcast_replicas, held_of, local as _local,
                      norm_bytes, reduce_groups, tp_sharded)
from ..tp import apply_tp, tp_activation_bytes, vocab_parallel_cross_entropy
from ..tp.dtensor import f_summed_bytes
from ..zero.flat import (FlatShards, gather_named, gather_optimizer_state, load_optimizer_state,
                         sharded_optimizer)
from .comms import copy_stages_from_first, p2p_bytes_formula, swap_tied_grads
from .runner import ScheduleRunner
from .schedules import build_schedule, check_schedule
from .split import StageModule, activation_shape, first_stage_input, loss_sum


class PipelineParallel(Engine):
    """Pipeline parallelism over ``topo``'s "pp" axis with an explicit schedule, composed with
    TP (+SP) inside each stage and DP / ZeRO-1 over "dp".

    ``model``: the plain model (Llama or StackedMLP), built identically on every rank; this rank
    keeps only its stages (:class:`.split.StageModule`, ``.module``), converted for TP when
    tp > 1 (Llama only). ``schedule``: gpipe | 1f1b | interleaved-1f1b | zb-h1.
    ``virtual_stages``: chunks per rank (interleaving; default 2). ``layers_per_stage``: explicit
    split (one count per stage). ``microbatches``: the expected m, validated here (the actual m
    is the length of the list given to :meth:`forward_backward`). ``sp``: sequence parallelism
    inside the stages. ``zero``: 0 (the stage's gradients all-reduced over dp) or 1 (one
    :class:`..zero.flat.FlatShards` of the stage). ``reduce_dtype``: "fp32" | "bf16", the dp
    gradient reduction's dtype; ``bucket_mb``: its bucket size. ``seed``: the TP dropout RNG.

    Raises :class:`ShardwiseConfigError` for invalid settings, before any collective."""

    def __init__(self, model: nn.Module, topo, *, schedule: str = "1f1b",
                 microbatches: int | None = None, virtual_stages: int | None = None,
                 layers_per_stage: list[int] | None = None, sp: bool = False, zero: int = 0,
                 seed: int = 0, reduce_dtype: str = "fp32", bucket_mb: float = 25.0):
        self.tp, self.sp, self.zero = topo.size("tp"), bool(sp), int(zero)
        Layout(dp=topo.size("dp"), tp=self.tp, pp=topo.size("pp"), zero=self.zero, sp=self.sp,
               schedule=schedule, cp=topo.size("cp"), ep=topo.size("ep")).check(
            model=model, engine=self._engine_name, reduce_dtype=reduce_dtype,
            composition="pp")
        self.p, self.pp_index = topo.size("pp"), topo.index("pp")
        self.v = check_schedule(schedule, self.p, microbatches or self.p, virtual_stages)
        stage = StageModule(model, self.pp_index, self.p, self.v, layers_per_stage)
        super().__init__(stage)
        self.topo, self.schedule_name = topo, schedule
        copy_stages_from_first(model, topo, self.v, layers_per_stage)  # before TP shards them
        self.reduce_dtype = reduce_dtype
        self.chunks = stage.chunks
        self.is_first, self.is_last = self.pp_index == 0, self.pp_index == self.p - 1
        self._schedules = {}
        self.timeline: list[tuple] = []  # last step: (kind, mb, chunk, peer, t_start, t_end) s
        self.peak_alive = 0  # last step: max (microbatch, chunk) pairs holding activations
        self.rng = self._convert_tp(stage, seed) if self.tp > 1 else None
        self.runner = ScheduleRunner(self.chunks, topo, stage,
                                     split_backward=schedule == "zb-h1")
        with topo.ledger.phase("init"):
            if topo.size(topo.data_axis) > 1:  # replicas of a stage start identical
                broadcast_replicas(list(stage.parameters()), topo)  # expert shards over edp
            if stage.tied and self.p > 1 and (self.is_first or self.is_last):
                if self.is_first:
                    comm.send(_local(stage.tok_embeddings.weight.data), topo, "pp", self.p - 1,
                              tag="init")
                else:
                    comm.recv(_local(stage.tied_output.data), topo, "pp", 0, tag="init")
        self.zero1 = self._build_zero1() if self.zero == 1 else None
        # dp > 1 without ZeRO-1 shards: DP's own gradient sync (:class:`..dp.GradSync`: expert
        # shards over "edp", the rest over the data axis), launched after the schedule's last
        # backward (overlap=False: zb-h1's W pass writes .grad by hand, where post-accumulate
        # hooks do not fire)
        self.dp_sync = (GradSync(self._params(), topo, bucket_mb=bucket_mb, overlap=False,
                                 reduce_dtype=reduce_dtype)
                        if topo.size(topo.data_axis) > 1 and self.zero1 is None else None)

    _engine_name = "explicit"

    @property
    def reduce_loss_axes(self) -> tuple[str, ...]:
        """pp (only the last stage holds a loss) and the data axis."""
        return ("pp",) + self.count_axes

    def _convert_tp(self, stage, seed):
        """Megatron TP inside the stage: the whole model's transform, as torchtitan does."""
        return apply_tp(stage, self.topo, self.sp, seed=seed)

    def _build_zero1(self) -> list:
        """ZeRO-1 over dp: the stage's trainable parameters as one flat buffer sharded over the
        data axis; with expert parallelism the expert shards as a second one over "edp" (the
        ranks holding the same experts; :mod:`..zero.zero`)."""
        named = [(n, p) for n, p in self.named_params() if p.requires_grad]
        red = torch.bfloat16 if self.reduce_dtype == "bf16" else None
        return [FlatShards(g.items, self.topo, keep_full_grad=True, reduce_dtype=red,
                           **({} if g.axis == self.topo.data_axis
                              else {"name": "experts", "axis": g.axis}))
                for g in reduce_groups(named, self.topo)]

    def _params(self) -> list[nn.Parameter]:
        """This stage's trainable parameters, each once, in module order."""
        return [p for p in dict.fromkeys(self.module.parameters()) if p.requires_grad]

    def held_grads(self) -> Held:
        """The pieces for the global norm (:func:`..params.held_of`), the tied copy not counted
        (the first stage counts it); ZeRO-1: the pieces of this rank's slices, sliced over each
        flat buffer's axis. The axes (tp, the data axis for slices, else ep, then pp) are
        derived: :meth:`..params.Held.norm_axes`."""
        tied = [self.module.tied_output] if self.module.tied_output is not None else []
        if self.zero1 is None:
            return held_of(self._params(), self.topo, skip=tied)
        return Held([h for f in self.zero1 for h in f.held_grads(skip=tied)], self._sliced())

    def _sliced(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.axis for f in self.zero1 or ()))

    def schedule(self, m: int):
        """The (cached) :class:`~.schedules.Schedule` for ``m`` microbatches."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.schedule_name, self.p, m, self.v)
        return self._schedules[m]

    def _act_shape(self, mb: dict) -> tuple[int, ...]:
        """The tensor between stages: [b, s, d], with SP [b, s/tp, d]; MLP [b, D]."""
        return activation_shape(mb, self.module.config, self.tp if self.sp else 1)

    def _loss_sum(self, y: torch.Tensor, mb: dict) -> torch.Tensor:
        """Token-loss sum (fp32) of logits [b, s, V], or with tp > 1 [b, s, V_pad/tp]."""
        if self.tp > 1:
            head = self.module.output
            return token_loss_sum(vocab_parallel_cross_entropy(  # DPO too (models/dpo.py)
                y, mb["labels"], head.vocab_start, head.vocab_size, self.topo), mb)
        return loss_sum(y, mb)

    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """Run this rank's actions of the schedule for ``len(microbatches)`` microbatches.

        ``microbatches``: the same list of dicts on every pp rank (``input_ids``/``labels`` or
        ``inputs``/``targets``, [b, s] each); their row counts b may differ. ``denom``: the
        global count of counted tokens. Returns this rank's loss sum, fp64 [1]: the last
        stage's token losses and this rank's MoE aux loss sums (0 on a stage with neither).
        Raises ShardwiseConfigError for an invalid m."""
        sched = self.schedule(len(microbatches))
        device = next(self.module.parameters()).device
        mbs = [{k: t.to(device, non_blocking=True) for k, t in mb.items()} for mb in microbatches]
        loss = self.runner.run(sched[self.pp_index], mbs, denom, dtype,
                               act_shape=self._act_shape, loss_sum=self._loss_sum)
        self.timeline, self.peak_alive = self.runner.timeline, self.runner.peak_alive
        return loss

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                      dtype: str = "fp32") -> dict[str, float]:
        """Bytes this rank sends in one optimizer step, by ledger tag: the module docstring's
        terms. ``micro_steps`` = m (the bytes do not depend on it), ``sequences`` this
        pipeline's sequences per step (Σ of the microbatches' rows, equal or not), ``seq_len``
        tokens each, ``dtype`` the autocast dtype. The loss/count scalars are added by
        :func:`shardwise.formulas.step_bytes_formula`."""
        stage = self.module
        params = self._params()
        elem = _local(params[0]).element_size()
        n = self.tp
        d = stage.config.d_model
        # Σ_b A_b over the m microbatches = the bytes of all the step's rows (equal or not):
        # p2p_bytes_formula's m·A with m = 1 and A = that sum
        if stage.is_llama:
            acts = sequences * (seq_len // (n if self.sp else 1)) * d * elem
        else:
            acts = sequences * d * elem
        out = {k: float(v) for k, v in
               p2p_bytes_formula(self.pp_index, self.p, self.v, 1, acts).items()}
        tied = stage.tied and self.p > 1 and (self.is_first or self.is_last)
        w = (stage.tok_embeddings.weight if self.is_first else stage.tied_output) if tied else None
        out["tied"] = float(_local(w).numel() * elem) if tied else 0.0
        out["grad_norm"] = norm_bytes(Held([], self._sliced()).norm_axes(self.topo), self.topo)
        red = 2 if self.reduce_dtype == "bf16" else elem
        if self.zero1 is not None:  # each flat buffer over its own axis
            out["grad"] = sum(ring_bytes("reduce_scatter", f.padded * red, f.n)
                              for f in self.zero1)
            out["param"] = sum(ring_bytes("all_gather", f.padded * elem, f.n)
                               for f in self.zero1)
        elif self.dp_sync is not None:  # dense over the data axis, expert shards over edp
            out["grad"] = self.dp_sync.bytes_formula()
        else:
            out["grad"] = 0.0
        if n > 1:  # an MoE block's feed-forward stays whole per tp rank: one f/g pair less
            moe = sum(len(moe_layers(c)) for c in self.chunks)
            out |= tp_activation_bytes(sequences * seq_len, d, n, self.sp,
                                       blocks=sum(len(c.layers) for c in self.chunks),
                                       has_embedding=stage.holds_embedding,
                                       has_head=stage.holds_head, dtype=dtype, moe_blocks=moe)
            f_summed = f_summed_bytes(stage, n)  # the families' q/k norms, positions
            out["tp_bwd"] += micro_steps * f_summed
            if self.sp:
                rep = sum(_local(p).numel() * elem for p in params if not tp_sharded(p))
                out["sp_grad"] = ring_bytes("all_reduce", rep, n) - f_summed
        return out

    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum fp64 [1], counted items) of ``batch`` (the same dict on every pp rank), for
        evaluation: one forward through the stages in order (RECV_F, F, SEND_F per chunk), the
        last stage's loss sum all-reduced over pp (tag "eval"). Collective over pp (and tp)."""
        device = next(self.module.parameters()).device
        mb = {k: t.to(device) for k, t in batch.items()}
        shape = self._act_shape(mb)
        act_dtype = next(self.module.parameters()).dtype
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        sends = []
        with torch.no_grad():
            for chunk in self.chunks:  # local chunks are in stage order
                s = chunk.index
                if chunk.is_first:
                    x = first_stage_input(mb)
                else:
                    x = torch.empty(shape, dtype=act_dtype, device=device)
                    comm.recv(x, self.topo, "pp", (s - 1) % self.p, tag="eval")
                y = chunk(x, **positions_kw(mb))
                if chunk.is_last:
                    loss += self._loss_sum(y, mb).double()
                else:
                    y = y.to(act_dtype).contiguous()
                    sends.append((comm.send(y, self.topo, "pp", (s + 1) % self.p, tag="eval",
                                            async_op=True), y))
        for handle, _ in sends:
            handle.wait()
        comm.all_reduce(loss, self.topo, "pp", tag="eval")
        return loss, torch.tensor(count_items(mb))

    @contextlib.contextmanager
    def full_model(self):
        """None: this rank holds only its pipeline stages (no sampling from a pipeline)."""
        yield None

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """The tied swap (:func:`.comms.swap_tied_grads`), with SP the norm weights' partial
        gradients summed over tp, then (dp > 1) the stage's gradients SUMmed over dp (each loss
        is already divided by the global token count): all-reduce, or ZeRO-1 reduce-scatter."""
        stage = self.module
        if stage.tied and self.p > 1 and (self.is_first or self.is_last):
            swap_tied_grads(stage.tok_embeddings.weight if self.is_first else stage.tied_output,
                            self.topo, self.is_first, self.p)
        if self.tp > 1 and self.sp:
            self.sum_replicated_grads()
        if self.zero1 is not None:
            for f in self.zero1:
                f.reduce_scatter()
        elif self.dp_sync is not None:
            self.dp_sync.finish()

    def _tied_without_decay(self, param_groups: list[dict]) -> list[dict]:
        """The groups with the last rank's tied copy in the no-decay group (it is an embedding)."""
        tied = self.module.tied_output
        if tied is None:
            return param_groups
        groups = [dict(g, params=[p for p in g["params"] if p is not tied]) for g in param_groups]
        next(g for g in groups if g.get("weight_decay", 0.0) == 0.0)["params"].append(tied)
        return [g for g in groups if g["params"]]

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over this stage's parameters (ZeRO-1: over this rank's dp slice of them)."""
        param_groups = self._tied_without_decay(param_groups)
        if self.zero1 is not None:
            return sharded_optimizer(self.zero1, param_groups, torch.optim.AdamW, **adamw)
        return torch.optim.AdamW(param_groups, **adamw)

    def named_params(self):
        """(plain-model FQN, parameter) for this stage, each parameter once."""
        return [(self.module.fqn(n), p) for n, p in self.module.named_parameters()]

    def dp_gradients(self) -> dict[str, torch.Tensor]:
        """This stage's summed gradients in tp-local shape (ZeRO-1: gathered over dp)."""
        if self.zero1 is None:
            return super().dp_gradients()
        return gather_named(self.zero1, [f.shard_grad for f in self.zero1])

    def dp_optimizer_state(self, optimizer) -> dict[str, dict]:
        """ZeRO-1: the slices' state gathered over dp."""
        if self.zero1 is None:
            return super().dp_optimizer_state(optimizer)
        return gather_optimizer_state(self.zero1, optimizer)

    def dp_load_optimizer_state(self, optimizer, local: dict[str, dict]) -> None:
        """ZeRO-1: each tp-local state tensor cut to this rank's dp slice (no collective)."""
        if self.zero1 is None:
            return super().dp_load_optimizer_state(optimizer, local)
        load_optimizer_state(self.zero1, optimizer, local)

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        yield
