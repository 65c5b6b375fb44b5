"""Cut a plain model into pipeline stages, and validate a pipeline configuration.

The plain model (``models.llama.Llama`` or ``models.mlp.StackedMLP``), ``embedding → L blocks →
norm → head``, is cut into ``S = p·v`` stages of consecutive blocks (:func:`split_layers`);
where stage ``s`` lives is the schedule's placement (:func:`.schedules.stage_of`): rank
``s % p`` as chunk ``s // p`` ("loop"), or, for zbv and dualpipev, rank r holds stages r and
2p−1−r ("v": rank 0 the first and the last stage). Stage 0 also holds the
embedding, stage ``S−1`` the final norm, the head and the loss. Every rank builds the whole
plain model and keeps only its stages (:class:`StageModule`, under the plain model's names); a
tied embedding (Press & Wolf 2017) gets its own copy on the last stage.

Split rules, names and tied embeddings: docs/pipeline-parallel.md §1.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import ShardwiseConfigError
from ...models.llama import DocumentMask, embed, rope_tables
from ..numerics import set_linear_fn
from .schedules import check_schedule, stages_of


def _n_layers(model_or_n_layers) -> int:
    if isinstance(model_or_n_layers, int):
        return model_or_n_layers
    cfg = getattr(model_or_n_layers, "config", model_or_n_layers)
    return int(cfg.n_layers)


def split_layers(n_layers: int, n_stages: int,
                 layers_per_stage: list[int] | None = None) -> list[range]:
    """Block indices of every stage: a list of ``n_stages`` ranges covering ``0..n_layers−1``.

    Balanced (``layers_per_stage`` None): ``n_layers // n_stages`` blocks each, the first
    ``n_layers % n_stages`` stages one more (the last stage also pays for the head and the
    loss). Explicit: one count per stage, summing to ``n_layers``; only the first and the last
    may be 0. Raises :class:`ShardwiseConfigError` when ``n_layers < n_stages`` (balanced) or the
    list has the wrong length or sum, a negative entry, or an empty middle stage."""
    if layers_per_stage is None:
        if n_layers < n_stages:
            raise ShardwiseConfigError(
                f"the model has {n_layers} layers, too few for {n_stages} pipeline stages "
                f"(pp × virtual stages) with at least one layer each: choose pp × virtual "
                f"stages ≤ {n_layers}, a model with ≥ {n_stages} layers (--n-layers {n_stages}), "
                f"or an explicit layers-per-stage list")
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != n_stages:
            raise ShardwiseConfigError(
                f"layers-per-stage {counts} has {len(counts)} entries but the pipeline has "
                f"{n_stages} stages (pp × virtual stages): give one count per stage")
        if sum(counts) != n_layers or any(not isinstance(c, int) or c < 0 for c in counts):
            raise ShardwiseConfigError(
                f"layers-per-stage {counts} must be non-negative integers summing to the "
                f"model's {n_layers} layers (they sum to {sum(counts)})")
        empty_middle = [s for s in range(1, n_stages - 1) if counts[s] == 0]
        if empty_middle:
            raise ShardwiseConfigError(
                f"layers-per-stage {counts}: stages {empty_middle} have no layer; only the "
                f"first and the last stage (embedding, head) may be empty")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def validate_pp(model_or_n_layers, pp: int, schedule: str, microbatches: int,
                batch: int | None = None, virtual_stages: int | None = None,
                layers_per_stage: list[int] | None = None) -> int:
    """Check a pipeline configuration before anything runs; return the effective v.

    ``model_or_n_layers``: a model, a model config (``.n_layers``) or the layer count.
    ``batch``: sequences one pipeline processes per optimizer step (global batch / dp). Raises
    :class:`ShardwiseConfigError` for what :func:`.schedules.check_schedule` and
    :func:`split_layers` refuse, and for a batch that ``microbatches`` does not divide."""
    v = check_schedule(schedule, pp, microbatches, virtual_stages)
    if batch is not None and (batch < microbatches or batch % microbatches):
        divisors = [k for k in range(pp, batch + 1) if batch % k == 0]
        raise ShardwiseConfigError(
            f"--microbatches {microbatches} does not divide the {batch} sequences each pipeline "
            f"processes per step (global batch / dp): choose microbatches from {divisors} or "
            f"change --global-batch")
    split_layers(_n_layers(model_or_n_layers), pp * v, layers_per_stage)
    return v


def describe_placement(n_layers: int, pp: int, schedule: str, v: int | None = None,
                       layers_per_stage: list[int] | None = None) -> list[str]:
    """One line per pp rank: its stages (global index, in chunk order) and their blocks, where
    the embedding and the head live, e.g. under zbv at pp=2 over 4 layers
    ``pp rank 0: stage 0 = block 0 (+ embedding), stage 3 = block 3 (+ head)``. The placement is
    the schedule's (:func:`.schedules.placement_of`), the split :func:`split_layers`'. Raises
    :class:`ShardwiseConfigError` as :func:`.schedules.check_schedule` and :func:`split_layers`
    do."""
    from .schedules import placement_of

    v = check_schedule(schedule, pp, max(pp, 2 * pp), v)
    n_stages = pp * v
    ranges = split_layers(n_layers, n_stages, layers_per_stage)
    lines = []
    for r in range(pp):
        parts = []
        for s in stages_of(r, pp, v, placement_of(schedule)):
            blocks = ranges[s]
            what = ("no block" if not len(blocks) else f"block {blocks.start}" if len(blocks) == 1
                    else f"blocks {blocks.start}–{blocks.stop - 1}")
            extra = (" (+ embedding)" if s == 0 else "") + (" (+ head)" if s == n_stages - 1
                                                            else "")
            parts.append(f"stage {s} = {what}{extra}")
        lines.append(f"pp rank {r}: " + ", ".join(parts))
    return lines


def validate_pp_moe(cfg, *, engine: str = "explicit") -> None:
    """Check a pipeline over a mixture-of-experts model (``cfg`` None or a dense model: nothing
    to check) before anything runs; raise :class:`ShardwiseConfigError` naming the rule and the
    fix: ``--engine torch`` with an MoE model: ``torch.distributed.pipelining`` back-propagates the
      last stage's loss alone, so the aux losses (load balance, z-loss) of the other stages'
      routers — and the aux values in the logged loss — would be lost without an error; the
      explicit engine attaches them (:mod:`.runner`)."""
    moe = cfg is not None and getattr(cfg, "n_experts", None) is not None
    if moe and engine != "explicit":
        raise ShardwiseConfigError(
            f"--engine {engine} --pp with a mixture-of-experts model: torch.distributed."
            "pipelining back-propagates only the last stage's loss, so the auxiliary losses of "
            "the routers on the other stages would be silently dropped; use --engine explicit "
            "(it attaches each layer's aux-loss gradient to its output)")


def stage_parameter_names(plain: nn.Module, pp_index: int, pp: int, v: int = 1,
                          layers_per_stage: list[int] | None = None,
                          placement: str = "loop") -> list[str]:
    """The plain model's parameter names (``named_parameters()`` order) that pp rank
    ``pp_index`` holds under ``placement`` ("loop" | "v"): what :class:`StageModule` keeps,
    except the last stage's own copy of a tied embedding."""
    n_stages = pp * v
    ranges = split_layers(len(plain.layers), n_stages, layers_per_stage)
    mine = stages_of(pp_index, pp, v, placement)
    blocks = {str(i) for s in mine for i in ranges[s]}
    first, last = 0 in mine, n_stages - 1 in mine
    names = []
    for name, _ in plain.named_parameters():
        top, _, rest = name.partition(".")
        if top == "layers":
            keep = rest.split(".", 1)[0] in blocks
        else:  # tok_embeddings (pos_embeddings) on the first stage; norm, output on the last
            keep = first if top in ("tok_embeddings", "pos_embeddings") else last
        if keep:
            names.append(name)
    return names


class Chunk(nn.Module):
    """One pipeline stage: ``[embedding] → blocks → [norm → head]``.

    Input: token ids [b, s] (first stage of a Llama), inputs [b, D] (first stage of an MLP), or
    the hidden state [b, s, d] / [b, D] from the previous stage. Output: the hidden state, or the
    logits [b, s, V] / predictions [b, D] on the last stage. Converted for TP
    (:func:`..tp.apply_tp`): the hidden state is [b, s, d] replicated over tp, or with SP this tp
    rank's sequence shard [b, s/tp, d]; the last stage returns local logits [b, s, V_pad/tp]."""

    def __init__(self, index: int, n_stages: int, layers: list[nn.Module], is_llama: bool,
                 tok_embeddings=None, norm=None, output=None, rope=None, pos_embeddings=None):
        super().__init__()
        self.index, self.n_stages, self.is_llama = index, n_stages, is_llama
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.tok_embeddings = tok_embeddings
        self.pos_embeddings = pos_embeddings  # learned positions (GPT-2), first stage only
        self.layers = nn.ModuleList(layers)
        self.norm, self.output = norm, output
        # sequence parallelism inside the stage (tp > 1 with SP): the hidden state between
        # stages is this tp rank's sequence shard [b, s/sp_degree, d]; RoPE needs the full s
        self.sp_degree = 1
        if rope is not None:
            self.register_buffer("rope_cos", rope[0], persistent=False)
            self.register_buffer("rope_sin", rope[1], persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: token positions [b, s] (context parallelism's chunks, or a packed
        row's), default 0..s-1; ``documents``: a packed row's example ids [b, s] (the
        document mask), default None (plain causal)."""
        s = x.shape[1] * (1 if self.tok_embeddings is not None else self.sp_degree)
        if self.tok_embeddings is not None:  # [b, s] → [b, s, d] (SP: [b, s/tp, d])
            x = embed(self.tok_embeddings, self.pos_embeddings, x, positions)
        if self.is_llama:
            cos, sin = rope_tables(self.rope_cos, self.rope_sin, s, positions)
            mask = None if documents is None else DocumentMask(documents)
            for layer in self.layers:
                x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask)  # [b, s, d]
        else:
            for layer in self.layers:
                x = layer(x)  # [b, D]
        if self.output is not None:
            x = self.output(self.norm(x) if self.norm is not None else x)  # [b, s, V]
        return x


class StageModule(nn.Module):
    """This rank's share of the plain model, under the plain model's parameter names
    (``tok_embeddings``, ``layers.{i}`` with the *global* block index, ``norm``, ``output``).

    ``chunks``: one :class:`Chunk` per local chunk, in order, over the same submodules (not
    registered as children, to keep names unique); ``placement`` "loop" | "v"
    (:func:`.schedules.stage_of`). With p > 1 a tied embedding lives on two ranks, unless the
    V placement puts the first and the last stage on rank 0: the last stage's rank holds its
    own copy (:attr:`tied_output`), whose gradient the engine sums with the first rank's after
    every backward."""

    def __init__(self, plain: nn.Module, pp_index: int, pp: int, v: int = 1,
                 layers_per_stage: list[int] | None = None, placement: str = "loop"):
        super().__init__()
        self.config = plain.config
        self.is_llama = hasattr(plain, "tok_embeddings")
        self.placement = placement
        n_stages = pp * v
        ranges = split_layers(len(plain.layers), n_stages, layers_per_stage)
        mine = stages_of(pp_index, pp, v, placement)  # global stage indices, local chunk order
        self.stage_indices = mine
        self.layers = nn.ModuleDict()
        for s in mine:
            for i in ranges[s]:
                self.layers[str(i)] = plain.layers[i]
        self.tied = bool(self.is_llama and plain.output.weight is plain.tok_embeddings.weight)
        self._tied_copy = False
        first, last = 0 in mine, n_stages - 1 in mine
        if self.is_llama and first:
            self.tok_embeddings = plain.tok_embeddings
            if getattr(plain, "pos_embeddings", None) is not None:
                self.pos_embeddings = plain.pos_embeddings
        if self.is_llama and last:
            self.norm = plain.norm
            if self.tied and not first:
                # own copy of the tied weight; gradients are summed with the first rank's
                self.output = nn.Linear(plain.output.in_features, plain.output.out_features,
                                        bias=False, device=plain.output.weight.device,
                                        dtype=plain.output.weight.dtype)
                if hasattr(plain.output, "linear_fn"):  # a numerics transform's op, kept
                    set_linear_fn(self.output, plain.output.linear_fn)
                self._tied_shape = (plain.output.in_features, plain.output.out_features)
                self._tied_dtype = plain.output.weight.dtype
                if not plain.output.weight.is_meta:  # meta: values later (replay_tied_draw)
                    with torch.no_grad():
                        self.output.weight.copy_(plain.tok_embeddings.weight)
                self._tied_copy = True
            else:
                self.output = plain.output
        rope = (plain.rope_cos, plain.rope_sin) if self.is_llama else None
        chunks = []
        for s in mine:
            chunks.append(Chunk(
                s, n_stages, [plain.layers[i] for i in ranges[s]], self.is_llama,
                tok_embeddings=getattr(self, "tok_embeddings", None) if s == 0 else None,
                pos_embeddings=getattr(self, "pos_embeddings", None) if s == 0 else None,
                norm=getattr(self, "norm", None) if s == n_stages - 1 else None,
                output=getattr(self, "output", None) if s == n_stages - 1 else None,
                rope=rope))
        self.__dict__["chunks"] = chunks  # plain attribute: not a registered child
        self.holds_embedding, self.holds_head = first, last

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage has no standalone forward: its chunks run inside "
                           "the schedule (engine.forward_backward / engine.loss_sum_and_count)")

    def replay_tied_draw(self) -> None:
        """Built from a meta model: take the draw from the global RNG that building the tied
        copy's ``nn.Linear`` on a real device takes (its Kaiming init, then overwritten), so
        the RNG continues as after a whole build. Call it right after the init's own draws."""
        if self._tied_copy:
            nn.Linear(*self._tied_shape, bias=False, dtype=self._tied_dtype)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute what the plain model computed rather than initialised, on the parameters'
        device, after a build on the meta device (:mod:`..materialize`): each chunk's RoPE
        tables, each MoE layer's statistics."""
        device = next(self.parameters()).device
        if self.is_llama:
            from ...models.llama import rope_cache

            cfg = self.config
            cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta,
                                  cfg.rope_scaling)
            for c in self.chunks:
                c.rope_cos, c.rope_sin = cos.to(device), sin.to(device)
        for m in self.modules():
            if callable(getattr(m, "reset_stats", None)):
                m.reset_stats()

    @property
    def tied_output(self) -> nn.Parameter | None:
        """The last rank's own copy of a tied embedding (``output.weight``), else None."""
        return self.output.weight if self._tied_copy else None

    def fqn(self, name: str) -> str:
        """The plain model's name of this module's parameter ``name`` (the tied copy on the last
        rank is the plain model's ``tok_embeddings.weight``)."""
        return "tok_embeddings.weight" if self.tied_output is not None and \
            name == "output.weight" else name


def first_stage_input(mb: dict) -> torch.Tensor:
    """The first stage's input of a microbatch dict: ``input_ids`` [b, s] or ``inputs`` [b, D]."""
    return mb["input_ids"] if "input_ids" in mb else mb["inputs"]


def activation_shape(mb: dict, config, seq_shards: int = 1) -> tuple[int, ...]:
    """Shape of the tensor passed between stages for microbatch ``mb``: [b, s, d_model] for a
    Llama, with ``seq_shards`` = tp under SP [b, s/tp, d_model]; [b, D] for an MLP. Read from
    ``input_ids``/``inputs`` or ``labels``/``targets``. Raises ``KeyError`` if ``mb`` has none."""
    if "input_ids" in mb or "labels" in mb:
        b, s = (mb["input_ids"] if "input_ids" in mb else mb["labels"]).shape
        return (b, s // seq_shards, config.d_model)
    if "inputs" in mb or "targets" in mb:
        return tuple((mb["inputs"] if "inputs" in mb else mb["targets"]).shape)
    raise KeyError(f"a microbatch needs input_ids/labels or inputs/targets, got {sorted(mb)}")
