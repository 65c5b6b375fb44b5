"""The explicit pipeline runner: executes one pp rank's actions of a :class:`~.schedules.Schedule`.

The step's loss is the token-weighted mean over the global batch, L = (1/T) Σ_t ℓ_t, T the
counted tokens of all microbatches of all dp ranks: the last stage back-propagates
``loss_sum(microbatch) / T`` for each microbatch, so the gradients accumulated over the m
microbatches are ∇L, with no second division by m ("double scaling").

A mixture of experts: every stage's MoE layers, not only the last stage's, have auxiliary losses
(load balance, router z-loss; token sums). The runner puts them in *attach mode* for the step
(:func:`~shardwise.models.moe.set_aux_grad_scale` with 1/T; Megatron-Core's
``MoEAuxLossAutoScaler``): each layer's output carries its aux loss's gradient 1/T, so the
backward of any stage reaches its routers with no loss of its own, and each forward's aux value
(detached) joins this rank's loss sum, which the engine reduces over pp and the data axis.

What moves over pp: per SEND_F/RECV_F one activation (tag ``pp_fwd``), per SEND_B/RECV_B its
gradient (``pp_bwd``), on two channels (:mod:`.comms` has the bytes). Two consecutive stages on
one rank (the V placement of zbv/dualpipev: stages p−1 and p on rank p−1) hand the activation
and its gradient over in memory, with no action and no message. The actions, zero bubble's
I/W (Qi et al. 2023 §2) and why they cannot deadlock: docs/pipeline-parallel.md §4.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ... import comm
from ...errors import ShardwiseConfigError
from ...models import count_items, positions_kw
from ...models.moe import moe_layers, set_aux_grad_scale
from ...precision import FP32, Precision
from ..loss import autocast
from ..params import Held, fold_grad_, local, norm_bytes
from .comms import GradTraffic, p2p_bytes_formula
from .schedules import build_schedule, placement_of, rank_of
from .split import activation_shape, first_stage_input

KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules with I/W actions

# autograd nodes of the collectives that end a TP region (parallel/tp/comms.py): zb-h1's W pass
# starts below them (see ZeroBubbleCapture.record)
_TP_EXIT_NODES = ("ReduceScatterToSPBackward", "ReduceFromTPBackward")


class ZeroBubbleCapture:
    """zb-h1's split backward: during ``F`` a forward hook records the output of every module
    that owns parameters; ``I`` differentiates with respect to those outputs, ``W`` from each
    output to its own weights (for a Linear, dW = dYᵀX), so I + W cost what B costs. Raises
    :class:`ShardwiseConfigError` if a parameter belongs to no such module."""

    def __init__(self, module: torch.nn.Module):
        owners = [m for m in module.modules() if list(m.parameters(recurse=False))]
        covered = {id(p) for m in owners for p in m.parameters(recurse=False)}
        if covered != {id(p) for p in module.parameters()}:
            raise ShardwiseConfigError("a zero-bubble schedule (zb-h1, zbv, dualpipev) needs "
                                       "every parameter to belong to a module whose output "
                                       "carries its whole gradient")
        self.active: list | None = None
        for m in owners:
            m.register_forward_hook(self.record)

    def record(self, module, args, output):
        """Record where W will start for ``module``'s weights: its output or, when the output
        leaves a TP region through a collective, the edge *into* that collective (a
        ``GradientEdge``), so the collective's backward runs once, in I."""
        if self.active is None or not isinstance(output, torch.Tensor) \
                or not output.requires_grad:
            return
        target = output
        fn = output.grad_fn
        if fn is not None and type(fn).__name__ in _TP_EXIT_NODES:
            from torch.autograd.graph import GradientEdge

            node, nr = fn.next_functions[0]
            if node is not None:
                target = GradientEdge(node, nr)
        self.active.append((list(module.parameters(recurse=False)), target))


class ScheduleRunner:
    """The runner of an explicit pipeline: this rank's ``stage`` (:class:`.split.StageModule`,
    converted for TP by then, its chunks placed as the schedule's placement says) on ``topo``'s
    "pp" axis, ``schedule`` (gpipe | 1f1b | interleaved-1f1b | zb-h1 | zbv | dualpipev) with
    ``v`` chunks per rank; ``loss_sum(y, mb)``: the last stage's token-loss sum of its output
    ``y`` (plain, or tp's vocab-parallel loss); ``seq_shards``: tp under SP (the activations
    between stages are [b, s/tp, d]), else 1. zb-h1, zbv and dualpipev split backward into I/W
    over ``stage`` (:class:`ZeroBubbleCapture`). :meth:`forward_backward` replaces the
    micro-batch loop of :class:`~shardwise.parallel.model.ParallelModel`, :meth:`evaluate` its evaluation. After a
    step, ``timeline`` holds (kind, microbatch, chunk, peer, t_start, t_end) per action
    (seconds, ``time.time()``) and ``peak_alive`` the most (microbatch, chunk) pairs that held
    activations at once."""

    loss_axes = ("pp",)  # only the last stage holds a loss: the log line sums it over pp

    def __init__(self, stage: torch.nn.Module, topo, *, schedule: str, v: int, loss_sum,
                 seq_shards: int = 1):
        self.module, self.chunks, self.topo = stage, stage.chunks, topo
        self.schedule_name, self.v, self.loss_sum = schedule, v, loss_sum
        self.seq_shards = seq_shards
        self.p, self.pp_index = topo.size("pp"), topo.index("pp")
        self.placement = placement_of(schedule)
        # this rank holds the first / the last stage (both: rank 0 under the V placement)
        self.is_first, self.is_last = stage.holds_embedding, stage.holds_head
        self._schedules = {}
        self.grad_topo = GradTraffic(topo)  # gradients: the other channel (.comms)
        self.zb = ZeroBubbleCapture(stage) if schedule in SPLIT_BACKWARD else None
        self.moe = [moe_layers(c) for c in self.chunks]  # each chunk's MoE layers (maybe none)
        self.timeline: list[tuple] = []
        self.peak_alive = 0

    def schedule(self, m: int):
        """The (cached) :class:`~.schedules.Schedule` for ``m`` microbatches (validated:
        :class:`ShardwiseConfigError` for an invalid m)."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.schedule_name, self.p, m, self.v)
        return self._schedules[m]

    def act_shape(self, mb: dict) -> tuple[int, ...]:
        """The tensor between stages: [b, s, d], with SP [b, s/tp, d]; MLP [b, D]."""
        return activation_shape(mb, self.module.config, self.seq_shards)

    def forward_backward(self, microbatches: list[dict], denom: float,
                         precision: Precision = FP32) -> torch.Tensor:
        """Run this rank's actions of the schedule for ``len(microbatches)`` microbatches.

        ``microbatches``: the same list of dicts on every pp rank (``input_ids``/``labels`` or
        ``inputs``/``targets``, [b, s] each); their row counts b may differ. ``denom``: the
        global count of counted tokens. Returns this rank's loss sum, fp64 [1] (:meth:`run`)."""
        sched = self.schedule(len(microbatches))
        device = next(self.module.parameters()).device
        mbs = [{k: t.to(device, non_blocking=True) for k, t in mb.items()} for mb in microbatches]
        return self.run(sched[self.pp_index], mbs, denom, precision, act_shape=self.act_shape,
                        loss_sum=self.loss_sum)

    def evaluate(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum fp64 [1], counted items) of ``batch`` (the same dict on every pp rank), for
        evaluation: one forward through the stages in order (RECV_F, F, SEND_F per chunk), the
        last stage's loss sum all-reduced over pp (tag "eval"). Collective over pp (and tp)."""
        device = next(self.module.parameters()).device
        mb = {k: t.to(device) for k, t in batch.items()}
        shape = self.act_shape(mb)
        act_dtype = next(self.module.parameters()).dtype
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        sends, here = [], {}  # here: outputs for the next stage on this rank (the V's turn)
        with torch.no_grad():
            for chunk in self.chunks:  # local chunks are in stage order
                s = chunk.index
                if chunk.is_first:
                    x = first_stage_input(mb)
                elif s - 1 in here:
                    x = here.pop(s - 1)
                else:
                    x = torch.empty(shape, dtype=act_dtype, device=device)
                    comm.recv(x, self.topo, "pp", self._rank_of(s - 1), tag="eval")
                y = chunk(x, **positions_kw(mb))
                if chunk.is_last:
                    loss += self.loss_sum(y, mb).double()
                elif self._rank_of(s + 1) == self.pp_index:
                    here[s] = y.to(act_dtype)
                else:
                    y = y.to(act_dtype).contiguous()
                    sends.append((comm.send(y, self.topo, "pp", self._rank_of(s + 1),
                                            tag="eval", async_op=True), y))
        for handle, _ in sends:
            handle.wait()
        comm.all_reduce(loss, self.topo, "pp", tag="eval")
        return loss, torch.tensor(count_items(mb))

    def _rank_of(self, stage: int) -> int:
        return rank_of(stage, self.p, self.placement)

    def _local_neighbours(self, chunk) -> tuple[int | None, int | None]:
        """Local chunk indices of ``chunk``'s previous and next stage when they live on this
        rank too (the V placement's stages p−1 and p), else None."""
        s, mine = chunk.index, [c.index for c in self.chunks]
        prev = mine.index(s - 1) if s - 1 in mine else None
        nxt = mine.index(s + 1) if s + 1 in mine else None
        return prev, nxt

    def bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                      precision: Precision = FP32) -> dict[str, float]:
        """``pp_fwd``/``pp_bwd`` bytes this rank sends in one step (:func:`.comms.
        p2p_bytes_formula`): ``sequences`` this pipeline's sequences per step (Σ of the
        microbatches' rows, equal or not), ``seq_len`` tokens each; the bytes do not depend on
        ``micro_steps`` = m nor on the compute dtype (activations travel in the parameters'
        dtype)."""
        stage = self.module
        elem = local(next(p for p in stage.parameters() if p.requires_grad)).element_size()
        d = stage.config.d_model
        # Σ_b A_b over the m microbatches = the bytes of all the step's rows (equal or not):
        # p2p_bytes_formula's m·A with m = 1 and A = that sum
        acts = sequences * ((seq_len // self.seq_shards) if stage.is_llama else 1) * d * elem
        return {k: float(v) for k, v in
                p2p_bytes_formula(self.pp_index, self.p, self.v, 1, acts,
                                  self.placement).items()}

    def step_bytes(self, composed, micro_steps: int, sequences: int, seq_len: int,
                   precision: Precision = FP32) -> dict[str, float]:
        """A pipeline stage's bytes by tag in one step, of ``composed`` (the
        :class:`~shardwise.parallel.model.ParallelModel` this runner is part of): the runner's
        ``pp_fwd``/``pp_bwd``, each finisher's term (``tied``), the norm's fp64 scalar over the
        derived axes (tp, the sync's sliced axes, ep, pp: :meth:`..params.Held.norm_axes`), the
        sync's ``grad`` (and ZeRO's ``param``, HSDP's ``grad_replicate``), tp's terms for the stage's blocks
        (``tp_fwd``/``tp_bwd``/``ce``, ``sp_grad``). Derivation: docs/composition.md,
        "Pipelines composed"."""
        args = (micro_steps, sequences, seq_len, precision)
        sync = composed.grad_sync
        out = dict(self.bytes_formula(*args))
        for finish in composed.finishers:
            if hasattr(finish, "bytes_formula"):
                out.update(finish.bytes_formula())
        out["grad_norm"] = norm_bytes(Held([], sync.sliced).norm_axes(self.topo), self.topo)
        d = dict(sync.bytes_formula(*args))
        d.pop("grad_norm", None)  # counted above, over every derived axis at once
        out["grad"] = 0.0
        out.update(d)
        if composed.traffic is not None:
            out.update(composed.traffic.bytes_formula(*args))
        return out

    def memory_formula(self, sync) -> None:
        """No closed form for a pipeline stage's model state here."""
        return None

    @contextlib.contextmanager
    def full_model(self, composed):
        """None: this rank holds only its stage (no sampling from a pipeline)."""
        yield None

    sampling_model = full_model  # None too

    def run(self, actions, microbatches: list[dict], denom: float, precision: Precision, *,
            act_shape, loss_sum) -> torch.Tensor:
        """Execute ``actions`` (this rank's row of the schedule) for ``microbatches`` (the same
        list on every pp rank, on this rank's device). ``act_shape(mb)``: the shape of the
        tensor between stages for ``mb`` (each receive is sized from its own microbatch, so
        unequal rows send no shape); ``loss_sum(y, mb)``: the last stage's token-loss sum.
        ``denom``: the global count of counted tokens. Returns this rank's loss sum, fp64 [1]:
        the last stage's token losses plus, with MoE layers, every forward's aux loss sums
        (0 on a stage with neither). RuntimeError if the schedule leaves state behind. Sends
        are ``isend``, waited at the end of the step; receives block. MoE layers are in attach
        mode (aux gradient 1/``denom``) during the step and back in plain mode after it."""
        step = _Step(self, microbatches, denom, precision, act_shape, loss_sum)
        self.timeline, self.peak_alive = [], 0
        set_aux_grad_scale(self.module, 1.0 / denom)  # each MoE layer's aux gradient: 1/T
        for a in actions:
            key = (a.microbatch, a.chunk)
            chunk = self.chunks[a.chunk]
            t0 = time.time()
            if a.kind in ("RECV_F", "RECV_B"):
                step.recv(a, key)
            elif a.kind in ("SEND_F", "SEND_B"):
                step.send(a, key)
            elif a.kind == "F":
                step.forward(a, key, chunk)
            elif a.kind == "B":
                step.backward(a, key, chunk)
            elif a.kind == "I":
                step.input_grad(a, key, chunk)
            elif a.kind == "W":
                step.weight_grad(key)
            self.timeline.append((a.kind, a.microbatch, a.chunk,
                                  -1 if a.peer is None else a.peer, t0, time.time()))
        return step.finish()


class _Step:
    """One step of :meth:`ScheduleRunner.run` on this rank, action by action. What the actions
    hand each other, by ``(microbatch, chunk)``: ``inputs`` (activations received, or handed
    over by this rank's previous stage; requiring grad), ``outputs`` (each F's, until its
    backward), ``out_grads`` (gradients w.r.t. those outputs, received or handed over),
    ``in_grads`` (w.r.t. the inputs, until sent or handed over), ``wgrad`` (what each I leaves
    to its W), ``captures`` (what each F's zero-bubble hooks recorded); with ``sends`` (the
    isends in flight and their tensors), ``alive`` (the pairs holding activations) and
    ``loss``, this rank's loss sum, fp64 [1]. Arguments as :meth:`ScheduleRunner.run`'s."""

    def __init__(self, runner: ScheduleRunner, microbatches: list[dict], denom: float,
                 precision: Precision, act_shape, loss_sum):
        self.runner, self.mbs, self.denom, self.precision = runner, microbatches, denom, precision
        self.loss_sum = loss_sum
        self.shapes = [act_shape(mb) for mb in microbatches]
        first = next(runner.module.parameters())
        self.device, self.act_dtype = first.device, first.dtype
        self.loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.inputs, self.outputs, self.out_grads, self.in_grads = {}, {}, {}, {}
        self.wgrad, self.captures = {}, {}
        self.sends, self.alive = [], set()
        self.neighbours = [runner._local_neighbours(c) for c in runner.chunks]

    def recv(self, a, key) -> None:
        """RECV_F: an activation (tag ``pp_fwd``); RECV_B: its gradient (``pp_bwd``, on the
        gradients' channel). Blocks."""
        buf = torch.empty(self.shapes[a.microbatch], dtype=self.act_dtype, device=self.device)
        if a.kind == "RECV_F":
            comm.recv(buf, self.runner.topo, "pp", a.peer, tag="pp_fwd")
            self.inputs[key] = buf.requires_grad_()
        else:
            comm.recv(buf, self.runner.grad_topo, "pp", a.peer, tag="pp_bwd")
            self.out_grads[key] = buf

    def send(self, a, key) -> None:
        """SEND_F: the output activation; SEND_B: the input gradient (an ``isend``, waited for
        in :meth:`finish`)."""
        if a.kind == "SEND_F":
            t = self.outputs[key].detach().to(self.act_dtype).contiguous()
            handle = comm.send(t, self.runner.topo, "pp", a.peer, tag="pp_fwd", async_op=True)
        else:
            t = self.in_grads.pop(key).to(self.act_dtype).contiguous()
            handle = comm.send(t, self.runner.grad_topo, "pp", a.peer, tag="pp_bwd",
                               async_op=True)
        self.sends.append((handle, t))

    def forward(self, a, key, chunk) -> None:
        """F: ``chunk`` on its input; adds its MoE aux sums (and on the last stage its token
        losses) to the loss sum; the last stage keeps loss sum / ``denom`` to back-propagate."""
        runner, mb = self.runner, self.mbs[a.microbatch]
        x = first_stage_input(mb) if chunk.is_first else self.inputs[key]
        if runner.zb is not None:
            runner.zb.active = []
        with autocast(self.precision, self.device):
            y = chunk(x, **positions_kw(mb))
            for m in runner.moe[a.chunk]:  # this forward's aux sums, for the log line
                self.loss += m.aux.detach().double()
            if chunk.is_last:
                s = self.loss_sum(y, mb)
                self.loss += s.detach().double()
                y = s / self.denom  # back-propagate the share of the global mean
        if runner.zb is not None:
            self.captures[key], runner.zb.active = runner.zb.active, None
        self.outputs[key] = y
        nxt = self.neighbours[a.chunk][1]
        if nxt is not None:  # the next stage is ours: its input, with no message
            self.inputs[(a.microbatch, nxt)] = y.detach().to(self.act_dtype).requires_grad_()
        self.alive.add(key)
        runner.peak_alive = max(runner.peak_alive, len(self.alive))

    def backward(self, a, key, chunk) -> None:
        """B: the full backward, input and weight gradients."""
        y = self.outputs.pop(key)
        g = None if chunk.is_last else self.out_grads.pop(key).to(y.dtype)
        torch.autograd.backward(y, g)
        if not chunk.is_first:
            self.in_grads[key] = self.inputs.pop(key).grad
        self.captures.pop(key, None)  # recorded by F for an I that this B replaces
        self.alive.discard(key)
        self._hand_back(a, key)

    def input_grad(self, a, key, chunk) -> None:
        """I: the input gradient, and each captured output's gradient, kept for its W."""
        y = self.outputs.pop(key)
        g = None if chunk.is_last else self.out_grads.pop(key).to(y.dtype)
        roots = [] if chunk.is_first else [self.inputs.pop(key)]
        cap = self.captures.pop(key)
        grads = torch.autograd.grad(y, roots + [out for _, out in cap], g,
                                    retain_graph=True, allow_unused=True)
        if not chunk.is_first:
            self.in_grads[key] = grads[0]
        self.wgrad[key] = [(ps, out, gout) for (ps, out), gout
                           in zip(cap, grads[len(roots):]) if gout is not None]
        self._hand_back(a, key)

    def weight_grad(self, key) -> None:
        """W: from each captured output to its own weights, accumulated into ``.grad``."""
        for ps, out, gout in self.wgrad.pop(key):
            for p, gp in zip(ps, torch.autograd.grad(out, ps, gout, retain_graph=True)):
                if p.grad is None:
                    p.grad = gp
                else:
                    p.grad.add_(gp)
                fold_grad_(p)  # bf16 storage: into the fp32 main gradient (no hook fires here)
        self.alive.discard(key)

    def _hand_back(self, a, key) -> None:
        """After B or I: when the previous stage is this rank's, its output gradient is this
        input gradient, with no message."""
        prev = self.neighbours[a.chunk][0]
        if prev is not None:
            self.out_grads[(a.microbatch, prev)] = self.in_grads.pop(key)

    def finish(self) -> torch.Tensor:
        """Wait for the sends, put the MoE layers back in plain mode, check that the schedule
        left nothing behind (RuntimeError), return the loss sum."""
        for handle, _ in self.sends:
            handle.wait()
        set_aux_grad_scale(self.runner.module, None)
        leftover = [d for d in (self.inputs, self.outputs, self.out_grads, self.in_grads,
                                self.wgrad) if d]
        if leftover:  # a schedule bug; the simulator should have caught it
            raise RuntimeError(f"pipeline step left state behind: {leftover}")
        return self.loss
