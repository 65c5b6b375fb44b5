"""The explicit pipeline engine: executes a :class:`~.schedules.Schedule` action by action.

Math
----
The step's loss is the token-weighted mean over the global batch, L = (1/T) Σ_t ℓ_t with T the
counted tokens of all microbatches of all dp ranks (the train step all-reduces T over dp before
the forward). The last stage back-propagates ``loss_sum(microbatch) / T`` for each microbatch,
so the gradients that accumulate in ``.grad`` over the m microbatches are exactly ∇L — no second
division by m ("double scaling"). ``forward_backward`` returns this rank's loss *sum* (zero on
all but the last stage); the train step all-reduces it over ``reduce_loss_axes = ("pp", "dp")``
so every rank logs the same global loss.

Execution of the actions (one pp rank; see :mod:`.schedules` for the vocabulary)
---------------------------------------------------------------------------------
* ``F``: run the chunk; the first stage reads ``input_ids`` (or ``inputs``), the others the
  received activation [b, s, d]; the last stage computes the loss sum of ``labels`` and keeps
  ``loss_sum / T`` as the output to back-propagate.
* ``B``: ``torch.autograd.backward(output, grad_output)``: accumulates weight gradients, leaves
  the input gradient in the received activation's ``.grad``.
* ``I`` / ``W`` (zero bubble): during ``F`` a forward hook records the output of every module
  that owns parameters (Linear, Embedding, RMSNorm). ``I`` calls ``torch.autograd.grad(output,
  [input, *those module outputs], grad_output, retain_graph=True)``: the input gradient plus the
  gradient at each parameterised module's output, without any weight-gradient matmul. ``W`` then
  calls ``torch.autograd.grad(module_output, module.parameters(), saved_grad)`` per module: only
  the one-op graph from that output to its own weights is traversed (for a Linear, the dW = dYᵀX
  matmul), so I + W cost what B costs (Qi et al. 2023 §2; Megatron's implementation defers the
  dW GEMM the same way).
* ``SEND_*``: ``isend`` through :func:`shardwise.comm.send` (booked: S bytes); the handles are
  waited at the end of the step. ``RECV_*``: ``irecv`` + wait (blocking) through
  :func:`shardwise.comm.recv`. Between a pair of ranks, messages are matched in order; the
  schedule's SEND and RECV orders agree per channel (checked by :func:`.simulate.simulate`).
  Activations travel on the topology's ``pp`` process group, gradients on its ``world`` group
  (every rank of the layout, so it contains the pp peers; booked as axis "pp"). The two kinds
  thus never share a FIFO between a pair of ranks — necessary for interleaving with pp = 2,
  where both kinds flow between the same two ranks in both directions, and for NCCL, where one
  communicator per pair would queue a send behind an unrelated receive. (We do not create a
  group of our own: group creation is collective over the whole world, and an engine is built
  only by the ranks of its layout.)

Collectives per optimizer step (rank r of p; v chunks; m microbatches; A = bytes of one
activation [b, s, d]; Ψ_r = bytes of this rank's parameters)
----------------------------------------------------------------------------------------------
* activations: ``m·A`` per chunk not holding the last stage: ``m·A·(v − [r = p−1])`` sent;
  gradients: ``m·A·(v − [r = 0])`` sent (see :func:`p2p_bytes_formula`), tags ``pp_fwd``,
  ``pp_bwd``;
* tied embedding (p > 1): the first and the last rank swap their gradient of the V×d table: each
  sends ``V·d·4`` bytes (tag ``tied``); the middle ranks send nothing;
* global gradient norm: one fp64 scalar all-reduced over pp, 2(p−1)/p·8 bytes (tag ``norm``);
* dp > 1: one all-reduce of this stage's gradients over dp, 2(n−1)/n·Ψ_r (tag ``grad``);
* token count (over dp) and loss sum (over pp then dp): fp64 scalars (tag ``loss``, issued by
  the train step).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ... import comm
from ...errors import ShardwiseConfigError
from ...models import count_items
from ..engine import Engine, autocast
from .schedules import build_schedule, check_schedule
from .split import StageModule, activation_shape, first_stage_input, loss_sum

KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


class _GradTraffic:
    """The topology with the pp axis's point-to-point traffic routed over its "world" process
    group (gradient traffic; see the module docstring). Duck-types what :mod:`shardwise.comm`
    needs: sizes and global ranks are the pp axis's, records go to the same ledger as axis
    "pp"."""

    def __init__(self, topo):
        self._topo = topo
        self.ledger = topo.ledger

    def size(self, axis):
        return self._topo.size(axis)

    def group(self, axis):
        return self._topo.group("world" if axis == "pp" else axis)

    def global_rank(self, axis, index):
        return self._topo.global_rank(axis, index)


def p2p_bytes_formula(pp_index: int, p: int, v: int, m: int, act_bytes: int) -> dict[str, int]:
    """Bytes this pp rank sends per step through point-to-point activations and gradients:
    ``{"pp_fwd": m·A·(v − [r = p−1]), "pp_bwd": m·A·(v − [r = 0])}`` for p > 1, A = bytes of one
    activation [b, s, d]. Every stage except the last sends its output once per microbatch, every
    stage except the first its input gradient (GPipe/1F1B/ZB-H1: v = 1; interleaving: each of the
    v chunks on a rank is a stage)."""
    if p == 1:
        return {"pp_fwd": 0, "pp_bwd": 0}
    return {"pp_fwd": m * act_bytes * (v - (pp_index == p - 1)),
            "pp_bwd": m * act_bytes * (v - (pp_index == 0))}


class PipelineParallel(Engine):
    """Pipeline parallelism over ``topo``'s "pp" axis with an explicit schedule.

    ``model``: the plain model (Llama or StackedMLP), built identically on every rank; this rank
    keeps only its stages (:class:`.split.StageModule`, available as ``.module``).
    ``schedule``: gpipe | 1f1b | interleaved-1f1b | zb-h1. ``virtual_stages``: chunks per rank
    (interleaving; default 2). ``layers_per_stage``: explicit split (one count per stage).
    ``microbatches``: the expected m, validated here (the actual m is the length of the list
    passed to :meth:`forward_backward`; a schedule is built, validated and cached per m).

    dp > 1 is supported (each stage's gradients are all-reduced over dp after the pipeline);
    tp > 1 is not. Raises :class:`ShardwiseConfigError` for invalid settings, before any
    collective."""

    count_axes = ("dp",)
    reduce_loss_axes = ("pp", "dp")

    def __init__(self, model: nn.Module, topo, *, schedule: str = "1f1b",
                 microbatches: int | None = None, virtual_stages: int | None = None,
                 layers_per_stage: list[int] | None = None):
        if topo.size("tp") > 1:
            raise ShardwiseConfigError("the pipeline engine does not compose with --tp > 1 yet: "
                                       "use --tp 1")
        self.p, self.pp_index = topo.size("pp"), topo.index("pp")
        self.v = check_schedule(schedule, self.p, microbatches or self.p, virtual_stages)
        stage = StageModule(model, self.pp_index, self.p, self.v, layers_per_stage)
        super().__init__(stage)
        self.topo, self.schedule_name = topo, schedule
        self.chunks = stage.chunks
        self.is_first, self.is_last = self.pp_index == 0, self.pp_index == self.p - 1
        self._schedules = {}
        self._split_backward = schedule == "zb-h1"
        self.timeline: list[tuple] = []  # last step: (kind, mb, chunk, peer, t_start, t_end) s
        self.peak_alive = 0  # last step: max (microbatch, chunk) pairs holding activations
        self._capture = None
        if self._split_backward:
            self._hook_param_modules()
        self._grad_traffic = _GradTraffic(topo)  # gradients: another FIFO (module docstring)
        with topo.ledger.phase("init"):
            if topo.size("dp") > 1:  # replicas of a stage start identical
                for p in stage.parameters():
                    comm.broadcast(p.data, topo, "dp", src=0, tag="init")
            if stage.tied and self.p > 1 and (self.is_first or self.is_last):
                if self.is_first:
                    comm.send(stage.tok_embeddings.weight.data, topo, "pp", self.p - 1,
                              tag="init")
                else:
                    comm.recv(stage.tied_output.data, topo, "pp", 0, tag="init")

    # -- schedule --------------------------------------------------------------------------
    def schedule(self, m: int):
        """The (cached) :class:`~.schedules.Schedule` for ``m`` microbatches."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.schedule_name, self.p, m, self.v)
        return self._schedules[m]

    # -- zero-bubble support -----------------------------------------------------------------
    def _hook_param_modules(self) -> None:
        owners = [m for m in self.module.modules() if list(m.parameters(recurse=False))]
        covered = {id(p) for m in owners for p in m.parameters(recurse=False)}
        if covered != {id(p) for p in self.module.parameters()}:
            raise ShardwiseConfigError("zb-h1 needs every parameter to belong to a module whose "
                                       "output carries its whole gradient")
        for m in owners:
            m.register_forward_hook(self._record_output)

    def _record_output(self, module, args, output):
        if self._capture is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._capture.append((list(module.parameters(recurse=False)), output))

    # -- one step -----------------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], denom: float,
                         dtype: str = "fp32") -> torch.Tensor:
        """Run this rank's actions of the schedule for ``len(microbatches)`` microbatches.

        ``microbatches``: the same list of dicts on every pp rank (``input_ids``/``labels`` or
        ``inputs``/``targets``, [b, s] each; the first stage reads the inputs, the last the
        labels). ``denom``: the global count of counted tokens. Returns this rank's loss sum,
        fp64 [1] (0 except on the last stage). Raises ShardwiseConfigError for an invalid m."""
        sched = self.schedule(len(microbatches))
        device = next(self.module.parameters()).device
        mbs = [{k: t.to(device, non_blocking=True) for k, t in mb.items()} for mb in microbatches]
        shape = activation_shape(mbs[0], self.module.config)
        act_dtype = next(self.module.parameters()).dtype
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        inputs, outputs, out_grads, in_grads, wgrad = {}, {}, {}, {}, {}
        captures = {}
        sends = []
        alive, self.peak_alive = set(), 0
        self.timeline = []
        topo, grad_topo = self.topo, self._grad_traffic
        for a in sched[self.pp_index]:
            key = (a.microbatch, a.chunk)
            chunk = self.chunks[a.chunk]
            t0 = time.time()
            if a.kind == "RECV_F":
                buf = torch.empty(shape, dtype=act_dtype, device=device)
                comm.recv(buf, topo, "pp", a.peer, tag="pp_fwd")
                inputs[key] = buf.requires_grad_()
            elif a.kind == "RECV_B":
                buf = torch.empty(shape, dtype=act_dtype, device=device)
                comm.recv(buf, grad_topo, "pp", a.peer, tag="pp_bwd")
                out_grads[key] = buf
            elif a.kind == "SEND_F":
                t = outputs[key].detach().to(act_dtype)
                sends.append((comm.send(t, topo, "pp", a.peer, tag="pp_fwd", async_op=True), t))
            elif a.kind == "SEND_B":
                t = in_grads.pop(key).to(act_dtype)
                sends.append((comm.send(t, grad_topo, "pp", a.peer, tag="pp_bwd",
                                        async_op=True), t))
            elif a.kind == "F":
                x = first_stage_input(mbs[a.microbatch]) if chunk.is_first else inputs[key]
                self._capture = [] if self._split_backward else None
                with autocast(dtype, device):
                    y = chunk(x)
                    if chunk.is_last:
                        s = loss_sum(y, mbs[a.microbatch])
                        loss += s.detach().double()
                        y = s / denom  # back-propagate the share of the global mean
                captures[key], self._capture = self._capture, None
                outputs[key] = y
                alive.add(key)
                self.peak_alive = max(self.peak_alive, len(alive))
            elif a.kind == "B":
                y = outputs.pop(key)
                g = None if chunk.is_last else out_grads.pop(key).to(y.dtype)
                torch.autograd.backward(y, g)
                if not chunk.is_first:
                    in_grads[key] = inputs.pop(key).grad
                alive.discard(key)
            elif a.kind == "I":
                y = outputs.pop(key)
                g = None if chunk.is_last else out_grads.pop(key).to(y.dtype)
                roots = [] if chunk.is_first else [inputs.pop(key)]
                cap = captures.pop(key)
                grads = torch.autograd.grad(y, roots + [out for _, out in cap], g,
                                            retain_graph=True, allow_unused=True)
                if not chunk.is_first:
                    in_grads[key] = grads[0]
                wgrad[key] = [(params, out, gout) for (params, out), gout
                              in zip(cap, grads[len(roots):]) if gout is not None]
            elif a.kind == "W":
                for params, out, gout in wgrad.pop(key):
                    for p, gp in zip(params, torch.autograd.grad(out, params, gout,
                                                                 retain_graph=True)):
                        if p.grad is None:
                            p.grad = gp
                        else:
                            p.grad.add_(gp)
                alive.discard(key)
            self.timeline.append((a.kind, a.microbatch, a.chunk,
                                  -1 if a.peer is None else a.peer, t0, time.time()))
        for handle, _ in sends:
            handle.wait()
        leftover = [d for d in (inputs, outputs, out_grads, in_grads, wgrad) if d]
        if leftover:  # a schedule bug; the simulator should have caught it
            raise RuntimeError(f"pipeline step left state behind: {leftover}")
        return loss

    # -- the formula the ledger is checked against -------------------------------------------
    def step_bytes_formula(self, micro_steps: int, sequences: int, seq_len: int = 1,
                           **_) -> dict[str, float]:
        """Bytes this rank sends in one optimizer step, by tag (see the module docstring):
        ``pp_fwd``/``pp_bwd`` (:func:`p2p_bytes_formula` with A = (sequences / micro_steps) ·
        seq_len · d_model · element bytes for a Llama, (sequences / micro_steps) · D · bytes for
        an MLP; activations travel in the parameter dtype), ``tied`` (V·d·bytes on the first and
        the last rank when embeddings are tied), ``norm`` (2(p−1)/p · 8), ``grad`` (dp > 1:
        2(n−1)/n · this stage's parameter bytes). The loss/count scalars are the caller's."""
        from ...comm.ledger import ring_bytes

        stage = self.module
        elem = next(stage.parameters()).element_size()
        rows = sequences // micro_steps
        tokens = rows * seq_len if stage.is_llama else rows
        act = tokens * stage.config.d_model * elem
        out = {k: float(v) for k, v in
               p2p_bytes_formula(self.pp_index, self.p, self.v, micro_steps, act).items()}
        tied = stage.tied and self.p > 1 and (self.is_first or self.is_last)
        out["tied"] = float(stage.config.vocab_size * stage.config.d_model * elem) if tied else 0.0
        out["norm"] = ring_bytes("all_reduce", 8, self.p)
        stage_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
        out["grad"] = ring_bytes("all_reduce", stage_bytes, self.topo.size("dp"))
        return out

    # -- evaluation ------------------------------------------------------------------------------
    def loss_sum_and_count(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum fp64 [1], counted items) of ``batch`` (the same dict on every pp rank), for
        evaluation: one forward through every stage in order (RECV_F, F, SEND_F per chunk; no
        pipelining across batches, no backward), the last stage's loss sum all-reduced over pp
        (tag "eval") so every rank returns it. Collective over pp: all ranks call it together."""
        device = next(self.module.parameters()).device
        mb = {k: t.to(device) for k, t in batch.items()}
        shape = activation_shape(mb, self.module.config)
        act_dtype = next(self.module.parameters()).dtype
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        sends = []
        with torch.no_grad():
            for c, chunk in enumerate(self.chunks):  # local chunks are in stage order
                s = chunk.index
                if chunk.is_first:
                    x = first_stage_input(mb)
                else:
                    x = torch.empty(shape, dtype=act_dtype, device=device)
                    comm.recv(x, self.topo, "pp", (s - 1) % self.p, tag="eval")
                y = chunk(x)
                if chunk.is_last:
                    loss += loss_sum(y, mb).double()
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

    # -- after backward --------------------------------------------------------------------------
    def finish_gradient_sync(self) -> None:
        """Sum the tied embedding's gradients between the first and the last rank, then (dp > 1)
        all-reduce this stage's gradients over dp (SUM: each loss was already divided by the
        global token count)."""
        stage = self.module
        if stage.tied and self.p > 1 and (self.is_first or self.is_last):
            w = stage.tok_embeddings.weight if self.is_first else stage.tied_output
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            buf = torch.empty_like(w.grad)
            peer = self.p - 1 if self.is_first else 0
            # first rank sends then receives, last rank receives then sends: safe even if
            # sends block until matched
            if self.is_first:
                comm.send(w.grad, self.topo, "pp", peer, tag="tied")
                comm.recv(buf, self.topo, "pp", peer, tag="tied")
            else:
                comm.recv(buf, self.topo, "pp", peer, tag="tied")
                comm.send(w.grad, self.topo, "pp", peer, tag="tied")
            w.grad.add_(buf)  # g_first + g_last on both ranks (addition commutes exactly)
        if self.topo.size("dp") > 1:
            params = [p for p in stage.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.all_reduce(flat, self.topo, "dp", tag="grad")
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm over all stages: each rank sums its gradients' squares (the tied copy
        on the last rank left out: the weight is counted once, on the first rank), one fp64
        all-reduce over pp, then clip every gradient by max_norm / (norm + 1e-6) if that is < 1
        (the rule of ``torch.nn.utils.clip_grad_norm_``). Returns the norm before clipping."""
        stage = self.module
        device = next(stage.parameters()).device
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for p in stage.parameters():
            if p.grad is not None and p is not stage.tied_output:
                sq += p.grad.detach().double().pow(2).sum()
        comm.all_reduce(sq, self.topo, "pp", tag="norm")
        norm = sq.sqrt()
        if max_norm and max_norm > 0:
            coef = max_norm / (float(norm) + 1e-6)
            if coef < 1.0:
                for p in stage.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm.float()

    def make_optimizer(self, param_groups: list[dict], **adamw) -> torch.optim.Optimizer:
        """AdamW over this stage's parameters. The last rank's copy of a tied embedding is an
        embedding (no weight decay), as in the plain model, although it sits in an nn.Linear."""
        tied = self.module.tied_output
        if tied is not None:
            groups = [dict(g, params=[p for p in g["params"] if p is not tied])
                      for g in param_groups]
            nd = next(g for g in groups if g.get("weight_decay", 0.0) == 0.0)
            nd["params"].append(tied)
            param_groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(param_groups, **adamw)

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters keyed by the plain model's names (the last rank's tied copy
        as ``tok_embeddings.weight``)."""
        return {self.module.fqn(n): p.detach() for n, p in self.module.named_parameters()}

    def named_full_gradients(self) -> dict[str, torch.Tensor]:
        return {self.module.fqn(n): p.grad for n, p in self.module.named_parameters()
                if p.grad is not None}

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool):
        yield


def gather_timeline(engine: PipelineParallel, topo) -> list:
    """Every pp rank's action timestamps of ``engine``'s last step, on every rank of the pp
    line, as :class:`.simulate.Event` s with times in seconds from the earliest start.

    Collective over "pp" (call it on every rank of the line): one all_reduce(max) of the row
    count and one all_gather of [rows, 6] fp64 (kind, microbatch, chunk, peer, start, end),
    booked in phase "trace". Timestamps are ``time.time()``: one host's clock is shared by its
    processes; across hosts they are only as aligned as the hosts' clocks."""
    from .simulate import Event

    kinds = KINDS + ("STEP",)
    rows = torch.tensor([[kinds.index(k), mb, c, peer, t0, t1]
                         for k, mb, c, peer, t0, t1 in engine.timeline],
                        dtype=torch.float64).reshape(-1, 6)
    device = next(engine.module.parameters()).device
    n = torch.tensor([float(len(rows))], dtype=torch.float64, device=device)
    p = topo.size("pp")
    with topo.ledger.phase("trace"):
        comm.all_reduce(n, topo, "pp", op="max", tag="trace")
        n = int(n.item())
        mine = torch.full((n, 6), -1.0, dtype=torch.float64)
        mine[: len(rows)] = rows
        mine = mine.to(device)
        everyone = torch.empty((p * n, 6), dtype=torch.float64, device=device)
        comm.all_gather(everyone, mine, topo, "pp", tag="trace")
    everyone = everyone.cpu()
    valid = everyone[:, 0] >= 0
    t_min = float(everyone[valid, 4].min()) if valid.any() else 0.0
    events = []
    for i, (k, mb, c, peer, t0, t1) in enumerate(everyone.tolist()):
        if k < 0:
            continue
        events.append(Event(rank=i // n, kind=kinds[int(k)], microbatch=int(mb), chunk=int(c),
                            start=t0 - t_min, end=t1 - t_min,
                            peer=None if peer < 0 else int(peer)))
    return events
