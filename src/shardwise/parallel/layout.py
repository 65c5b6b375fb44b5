"""The parallel layout, and the one validator every entry point calls.

A :class:`Layout` holds the degrees (dp × cp × tp × pp), the ZeRO stage, sequence parallelism,
the context-parallel method and the pipeline schedule. :meth:`Layout.check` is the one place a
layout is refused: it runs every cross-strategy rule and calls each strategy's own check
(:func:`~.zero.validate_zero`, :func:`~.tp.validate_tp`, :func:`~.cp.validate_cp`,
:func:`~.pp.split.validate_pp`), raising
:class:`~shardwise.errors.ShardwiseConfigError` with the constraint and the fix, on every rank,
before any collective. Its callers:

* ``config.validate`` (``shardwise train`` / ``trace``): with the model's config and the batch;
* :func:`~.apply.parallelize`: with the model and the topology;
* :func:`parse_layout` (``verify`` / ``bench --layouts``): the layout alone.

The planner's ``shardwise.plan.layout.PlanLayout`` subclasses :class:`Layout`, so verify, bench
and plan share the field names and the :meth:`Layout.name` format, and its ``check_layout``
calls :meth:`Layout.check_rules`, the part of :meth:`Layout.check` about the layout alone, so
the rules the planner shares with the engine are written once, here.
"""

from __future__ import annotations

import dataclasses

from ..errors import ShardwiseConfigError
from ..precision import FP32, Precision
from ..topology import check_dp_replicate
from .storage import check_storage


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: degrees, ZeRO stage, sequence parallelism, pipeline schedule,
    context parallelism (``cp`` ranks split each sequence; ``cp_method`` "ring" or
    "allgather", :mod:`.cp`), expert parallelism (``ep`` ranks of the data axis share out
    an MoE model's experts, :mod:`.ep`; not a degree of the world: EP ⊆ dp × cp) and HSDP
    (``dp_replicate`` R: dp = R × dp_shard, ZeRO within each shard group of dp / R ranks, the
    shards all-reduced across the R replicas; also inside dp). ``microbatches`` = 0: decided by
    the batch (global batch / (dp × micro-batch)); ``virtual_stages`` = 0: the schedule's
    default (2 for interleaved-1f1b, else 1)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 0
    cp: int = 1
    cp_method: str = "ring"
    ep: int = 1
    dp_replicate: int = 1

    @property
    def dp_shard(self) -> int:
        """HSDP's shard group size S = dp / dp_replicate (dp without HSDP)."""
        return self.dp // self.dp_replicate if self.dp_replicate else self.dp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank, v: 1 when pp = 1; else ``virtual_stages``, or the
        schedule's default when 0 (2 for interleaved-1f1b, zbv and dualpipev, else 1, as
        :func:`~.pp.schedules.check_schedule` resolves it)."""
        if self.pp == 1:
            return 1
        from .pp.schedules import default_chunks

        return self.virtual_stages or default_chunks(self.schedule)

    @property
    def tp_options(self):
        """This layout's :class:`~.tp.options.TPOptions` (``sp``): the one argument the TP
        transform, its layers, loss and byte formulas take."""
        from .tp.options import TPOptions

        return TPOptions(sp=self.sp)

    def name(self) -> str:
        """Compact, e.g. ``"dp=2,zero=3"``, ``"tp=2,sp"``, ``"pp=4,1f1b,m=8"``,
        ``"pp=4,interleaved-1f1b,v=4"`` (v only when given and > 1), ``"dp=2,cp=2"``,
        ``"cp=4,allgather"``, ``"dp=4,ep=2"``. :func:`parse_layout` reads it back."""
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "cp", "tp", "pp")
                 if getattr(self, k) > 1]
        parts = parts or ["dp=1"]
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1 and self.cp_method != "ring":
            parts.append(self.cp_method)
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule)
            if self.virtual_stages > 1:
                parts.append(f"v={self.virtual_stages}")
            if self.microbatches:
                parts.append(f"m={self.microbatches}")
        return ",".join(parts)

    @classmethod
    def from_config(cls, cfg) -> "Layout":
        return cls(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, zero=cfg.zero, sp=cfg.sp,
                   schedule=cfg.schedule, microbatches=cfg.microbatches,
                   virtual_stages=getattr(cfg, "virtual_stages", 0), cp=getattr(cfg, "cp", 1),
                   cp_method=getattr(cfg, "cp_method", "ring"), ep=getattr(cfg, "ep", 1),
                   dp_replicate=getattr(cfg, "dp_replicate", 1))

    def check(self, model_cfg=None, topo=None, *, model=None, engine: str = "explicit",
              precision: Precision = FP32, seq_len: int | None = None,
              global_batch: int | None = None, micro_batch: int | None = None,
              layers_per_stage: list[int] | None = None,
              composition: str | None = None, device: str | None = None,
              offload: str = "none") -> None:
        """Raise :class:`ShardwiseConfigError` (no collective) unless this layout can run.

        ``model_cfg``: the model's config (``LlamaConfig`` / ``MLPConfig``) when no module exists
        yet, or ``model``: the plain module (its ``.config`` is read); with neither, the
        model-dependent checks are skipped (the layout syntax of verify and bench).
        ``topo``: the :class:`~shardwise.topology.Topology` the layout will run on (its degrees
        must equal the layout's). ``engine``: "explicit" | "torch". ``precision``: the run's
        :class:`~shardwise.precision.Precision` (its dp gradient reduction dtype is checked).
        ``seq_len``: tokens per sequence (SP splits it).
        ``global_batch`` (sequences per step, all replicas) and ``micro_batch`` (sequences per
        micro-batch), given together with a model: the pipeline's microbatches and split are
        checked (``layers_per_stage``: an explicit split). ``composition``: "pp" when a
        pipeline engine calls, built directly (its ZeRO-2/3 rule whatever pp is). ``device``: the
        device type the layout will run on (default: the topology's; CP's torch engine needs
        CUDA).

        Checked in this order:

        1. the layout alone: :meth:`check_rules` (the rules the planner shares: positive
           degrees, ep | dp × cp, the HSDP split, sp needs tp, the ZeRO stage over dp × cp ≥ 2,
           the cp method and not the torch engine's cp on CPU, a known schedule whose virtual
           stages fit it), then what the engines do not wire: HSDP with cp or ep
           (:meth:`_check_hsdp_wiring`); the torch engine's cp with tp, pp or ZeRO (its cp is
           dp × cp only, DDP inside torch's ``context_parallel``); a pipeline's ZeRO-2/3 and
           HSDP where not wired (:func:`_check_zero_pipeline`, docs/composition.md §5).
        2. the topology's degrees;
        3. the reduce dtype: fp32 or bf16 (:func:`~shardwise.precision.reduce_torch_dtype`);
        4. the model: cp > 1 needs a Llama-style model without dropout and ``seq_len``
           divisible by 2·cp (:func:`~.cp.validate_cp`); tp > 1 needs a Llama-style model whose
           heads, kv heads, d_ff (and, with SP, ``seq_len``/cp) tp divides, or the stacked
           MLP with tp | d_ff, no SP and pp = 1 (:func:`~.tp.validate_tp`); pp > 1 needs at least pp
           microbatches that divide the batch and a layer split that fits
           (:func:`~.pp.split.validate_pp`); an MoE model in a pipeline needs the explicit
           engine (:func:`~.pp.split.validate_pp_moe`)."""
        from .cp import validate_cp
        from .ep import validate_ep
        from .tp import validate_tp

        known = model is not None or model_cfg is not None
        cfg = getattr(model, "config", None) if model is not None else model_cfg
        if device is None and getattr(topo, "device", None) is not None:
            device = topo.device.type
        # 1. the layout alone: the rules the planner shares, then what the engines do not wire
        self.check_rules(engine=engine, device=device, model_cfg=cfg, seq_len=seq_len)
        self._check_hsdp_wiring()
        _check_torch_cp(self, engine)
        pipeline = self.pp > 1 or composition == "pp"
        _check_zero_pipeline(self, pipeline, engine)
        check_storage(self, precision, offload, engine)  # .storage
        # 2. the topology
        if topo is not None:
            _check_topology(self, topo)
        # 3. the reduce dtype
        precision.reduce_torch
        # 4. the model
        if not known:
            return
        validate_ep(cfg, self.ep, self.dp, self.cp, engine=engine, sp=self.sp, tp=self.tp,
                    pp=self.pp)
        if pipeline:  # a mixture of experts in a pipeline: the explicit engine
            from .pp.split import validate_pp_moe

            validate_pp_moe(cfg, engine=engine)
        if self.cp > 1:
            validate_cp(cfg, self.cp, self.cp_method, seq_len=seq_len, engine=engine,
                        device=device)
        local_seq = seq_len // self.cp if seq_len is not None else None
        if self.tp > 1:
            validate_tp(cfg, self.tp, self.tp_options, local_seq, pp=self.pp)
        if self.pp > 1 and global_batch is not None and micro_batch is not None:
            _check_pipeline_batch(self, cfg, global_batch, micro_batch, layers_per_stage)

    def check_rules(self, *, engine: str = "explicit", device: str | None = None,
                    model_cfg=None, seq_len: int | None = None) -> None:
        """Raise :class:`ShardwiseConfigError` unless this layout is well formed: the rules of
        the layout alone that the engine (:meth:`check`) and the planner
        (``shardwise.plan.layout.check_layout``) share, written once here. In this order:

        1. dp, cp, tp, pp and ``dp_replicate`` are positive integers; ``microbatches`` and
           ``virtual_stages`` are integers ≥ 0 (0: decided by the batch / the schedule);
        2. ep ≥ 1 divides dp × cp (EP ⊆ dp × cp; :func:`~.ep.validate_ep` without a model,
           which also refuses ep > 1 on the torch engine);
        3. HSDP: ``dp_replicate`` divides dp, needs ZeRO ≥ 1, leaves a shard group of
           dp_shard·cp ≥ 2 ranks, and holds the expert group inside it (:meth:`_check_hsdp`);
        4. ``sp`` needs tp > 1 (TP's rule, :func:`~.tp.validate_tp`);
        5. a ZeRO stage in {0..3}, and ZeRO ≥ 1 needs a data axis dp × cp ≥ 2
           (:func:`~.zero.validate_zero`);
        6. cp ≥ 1 and a known cp method (:func:`~.cp.validate_cp` without a model; with
           ``engine`` "torch" and ``device`` "cpu" it also refuses cp > 1);
        7. a known pipeline schedule (:data:`~.pp.schedules.SCHEDULES`), and with pp > 1 more
           than one virtual stage only for interleaved-1f1b (the message of
           :func:`~.pp.schedules.check_schedule`).

        ``model_cfg`` and ``seq_len`` (optional) only name the tp values that would fit in the
        message of rule 4. Engine-only refusals (what the engines do not wire: ZeRO-3 with a
        split-backward pipeline schedule, HSDP with cp or ep, the torch engine's cp with tp, pp
        or ZeRO, its ZeRO-2/3 and HSDP with pp) stay in
        :meth:`check`; the planner models those layouts as Megatron-Core and torchtitan run
        them."""
        from .cp import validate_cp
        from .ep import validate_ep
        from .pp.schedules import SCHEDULES
        from .tp import validate_tp
        from .zero import validate_zero

        for flag, v in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp),
                        ("dp-replicate", self.dp_replicate)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShardwiseConfigError(f"--{flag} {v!r} must be a positive integer")
        for flag, v in (("microbatches", self.microbatches),
                        ("virtual-stages", self.virtual_stages)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ShardwiseConfigError(f"--{flag} {v!r} must be a positive integer "
                                           "(or 0: decided for you)")
        validate_ep(None, self.ep, self.dp, self.cp, engine=engine)
        self._check_hsdp()
        if self.sp and self.tp == 1:
            validate_tp(model_cfg, self.tp, self.tp_options, seq_len)
        validate_zero(self.zero, self.dp * self.cp, engine=engine)
        validate_cp(None, self.cp, self.cp_method, engine=engine, device=device)
        if self.schedule not in SCHEDULES:
            raise ShardwiseConfigError(f"--schedule {self.schedule!r} is unknown: choose one of "
                                       f"{', '.join(SCHEDULES)}")
        if self.pp > 1 and self.schedule in ("gpipe", "1f1b", "zb-h1") and self.chunks != 1:
            raise ShardwiseConfigError(
                f"--schedule {self.schedule} runs one model chunk per rank, got {self.chunks} "
                "virtual stages: use --schedule interleaved-1f1b or 1")

    def _check_hsdp(self) -> None:
        """HSDP (dp_replicate R > 1), the layout's rules: R divides dp (dp = R × S), under ZeRO
        1-3 (ZeRO-0 shards nothing: every rank already holds everything and all-reduces over
        all of dp), with a shard group of S·cp ≥ 2 ranks that holds the expert group (ep divides
        S·cp, as torchtitan carves ep out of ``dp_shard_cp``)."""
        r, dp = self.dp_replicate, self.dp
        if r == 1:
            return
        check_dp_replicate(r, dp)
        if not self.zero:
            raise ShardwiseConfigError(
                f"--dp-replicate {r} with --zero 0: HSDP shards the model state within "
                "dp_shard and replicates it across dp_replicate; without ZeRO every rank holds "
                "the whole state and the gradient all-reduce already spans all of dp (plain "
                "DP): add --zero 1, 2 or 3, or drop --dp-replicate")
        shard = self.dp_shard * self.cp
        if shard < 2:
            raise ShardwiseConfigError(
                f"--dp-replicate {r} with dp = {dp} leaves dp_shard = {self.dp_shard}, a shard "
                f"group of dp_shard·cp = {self.dp_shard}·{self.cp} = 1 rank: nothing to shard "
                "within a replica; choose a smaller --dp-replicate (the shard group needs ≥ 2 "
                "ranks) or drop it")
        if self.ep > 1 and shard % self.ep:
            ok = [e for e in range(1, shard + 1) if shard % e == 0]
            raise ShardwiseConfigError(
                f"--ep {self.ep} with --dp-replicate {r}: the expert group must lie inside a "
                f"shard group of dp_shard·cp = {self.dp_shard}·{self.cp} = {shard} ranks: "
                f"choose --ep from {ok}, or another --dp-replicate")

    def _check_hsdp_wiring(self) -> None:
        """HSDP in the engines: with tp and pp (:func:`_check_zero_pipeline`), not cp or ep."""
        r = self.dp_replicate
        other = [f for f, on in ((f"--cp {self.cp}", self.cp > 1), (f"--ep {self.ep}",
                                                                    self.ep > 1)) if on]
        if r > 1 and other:
            raise ShardwiseConfigError(
                f"--dp-replicate {r} with {' '.join(other)}: HSDP composes with tp and pp here; "
                "with cp or ep it is not wired: drop --dp-replicate (ZeRO over the whole data "
                "axis) or the other flag")


# -- the rules of Layout.check beyond check_rules, one function each ---------------------------
def _check_torch_cp(layout: Layout, engine: str) -> None:
    """The torch engine's cp is dp × cp only (DDP inside torch's ``context_parallel``): with tp,
    pp or ZeRO it is not wired."""
    if layout.cp > 1:
        rest = " ".join(flag for flag, on in ((f"--tp {layout.tp}", layout.tp > 1),
                                              (f"--pp {layout.pp}", layout.pp > 1),
                                              (f"--zero {layout.zero}", layout.zero > 0)) if on)
        if engine == "torch" and rest:
            raise ShardwiseConfigError(
                f"--engine torch --cp {layout.cp} runs dp × cp with DDP inside torch's "
                f"context_parallel; {rest} is not wired with it: use --engine explicit "
                "for cp with tp, pp or ZeRO")


def _check_zero_pipeline(layout: Layout, pipeline: bool, engine: str) -> None:
    """ZeRO-2/3 and HSDP in a pipeline (``pipeline``), the one rule (docs/composition.md §5):
    the explicit engine runs them (:mod:`.zero.stage_zero`) but for ZeRO-3 with a
    split-backward schedule (the W pass writes ``.grad`` outside the hooks that free a unit
    its I pass re-gathered) and ZeRO-2/3 with ep; the torch engine's stages have no FSDP2."""
    if not pipeline or not (layout.zero >= 2 or layout.dp_replicate > 1):
        return
    from .pp.runner import SPLIT_BACKWARD

    if engine == "torch":
        what = f"--zero {layout.zero}" + f" --dp-replicate {layout.dp_replicate}" * (
            layout.dp_replicate > 1)
        raise ShardwiseConfigError(
            f"layout {layout.name()}: --engine torch runs {what} (FSDP2) without a pipeline "
            "only: its pipeline stages are not wrapped by fully_shard here; use --engine "
            "explicit (ZeRO-2/3 and HSDP inside each stage), or --zero 1 with --pp")
    if layout.zero == 3 and layout.schedule in SPLIT_BACKWARD:
        raise ShardwiseConfigError(
            f"layout {layout.name()}: ZeRO-3 with the split-backward schedule "
            f"{layout.schedule}: its W pass would run on units its I pass re-gathered, outside "
            "the hooks that free them: use --schedule 1f1b or interleaved-1f1b, or --zero 2")
    if layout.zero >= 2 and layout.ep > 1:
        raise ShardwiseConfigError(f"layout {layout.name()}: ZeRO-{layout.zero} with --ep "
                                   f"{layout.ep} in a pipeline is not wired: use --zero 1")


def _check_topology(layout: Layout, topo) -> None:
    """``topo``'s degrees (pp, dp, cp, tp, and its ep and dp_replicate) are the layout's."""
    sizes = tuple(topo.size(a) for a in ("pp", "dp", "cp", "tp"))
    ep, rep = getattr(topo, "ep", 1), getattr(topo, "dp_replicate", 1)
    if sizes != (layout.pp, layout.dp, layout.cp, layout.tp) or (ep, rep) != (
            layout.ep, layout.dp_replicate):
        cp = f", cp={layout.cp}" if layout.cp > 1 else ""
        cp += f", ep={layout.ep}" if layout.ep > 1 else ""
        cp += f", dp_replicate={layout.dp_replicate}" if layout.dp_replicate > 1 else ""
        raise ShardwiseConfigError(
            f"layout {layout.name()} does not match the topology {topo.describe()}: "
            f"build Topology(pp={layout.pp}, dp={layout.dp}, tp={layout.tp}{cp}) for it")


def _check_pipeline_batch(layout: Layout, cfg, global_batch: int, micro_batch: int,
                          layers_per_stage: list[int] | None) -> None:
    """pp > 1 with the batch known: at least pp microbatches per step (``--microbatches``, or
    global batch / (dp × micro-batch)) and a split that fits (:func:`~.pp.split.validate_pp`)."""
    from .pp.split import validate_pp

    local = global_batch // layout.dp
    m = layout.microbatches or max(1, local // micro_batch)
    if not layout.microbatches and m < layout.pp:
        raise ShardwiseConfigError(
            f"--pp {layout.pp} needs at least {layout.pp} microbatches per step, but global "
            f"batch / (dp × micro-batch) = {global_batch} / ({layout.dp} × {micro_batch}) "
            f"= {m}: pass --microbatches M (M ≥ {layout.pp}, dividing {local}) or a "
            "smaller --micro-batch")
    validate_pp(cfg, layout.pp, layout.schedule, m, batch=local,
                virtual_stages=layout.virtual_stages or None,
                layers_per_stage=layers_per_stage)


def parse_layout(text: str) -> Layout:
    """``"dp=2"``, ``"dp=2,zero=3"``, ``"tp=2,sp"``, ``"pp=4,schedule=1f1b,m=8"``, ``"dp=2,cp=2"``,
    ``"cp=2,allgather"``, ``"dp=4,ep=2"``, ``"dp=4,dp_replicate=2,zero=3"`` → Layout, checked by
    :meth:`Layout.check` (the layout alone). Raises ShardwiseConfigError naming the syntax."""
    from .cp import CP_METHODS
    from .pp.schedules import SCHEDULES

    kw: dict = {}
    for part in text.split(","):
        key, _, value = (x.strip() for x in part.partition("="))
        if key == "sp" and not value:
            kw["sp"] = True
        elif key in SCHEDULES and not value:
            kw["schedule"] = key
        elif key in CP_METHODS and not value:
            kw["cp_method"] = key
        elif key == "schedule" and value in SCHEDULES:
            kw["schedule"] = value
        elif key in ("dp", "cp", "tp", "pp", "ep", "zero", "m", "microbatches", "v",
                     "dp_replicate") and value.isdigit():
            kw[{"m": "microbatches", "v": "virtual_stages"}.get(key, key)] = int(value)
        else:
            raise ShardwiseConfigError(
                f"--layouts {text!r}: write each layout as comma-separated parts: dp=N, cp=N, "
                f"tp=N, pp=N, ep=N, dp_replicate=R, zero=Z, sp, a schedule "
                f"({', '.join(SCHEDULES)}), m=M, a cp method "
                f"({', '.join(CP_METHODS)}) (e.g. dp=2,zero=3, pp=2,1f1b,m=4 or dp=2,cp=2)")
    layout = Layout(**kw)
    layout.check()
    return layout


def check_supported(layout: Layout) -> None:
    """Raise :class:`ShardwiseConfigError` (before any collective) for a layout no engine runs:
    :meth:`Layout.check` without a model (the layout's own rules and the reduce dtype)."""
    layout.check()
