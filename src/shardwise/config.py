"""The run configuration: one flat dataclass, TOML files, command-line overrides, validation.

Precedence: dataclass defaults < ``--config FILE.toml`` < explicit flags. Every field is a flag
(``seq_len`` ↔ ``--seq-len``). :func:`validate` checks everything that can be checked without
the data and raises :class:`~shardwise.errors.ShardwiseConfigError` naming the constraint and the fix;
it runs in the launcher and again on every rank before any collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
import tomllib
import typing

from .errors import ShardwiseConfigError


@dataclasses.dataclass
class TrainConfig:
    # model
    model: str = "small"  # preset: tiny | small | base (Llama-style) | mlp | mlp-tiny
    n_layers: int = 0  # override the preset's layer count (0 = the preset's)
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_from_hf: str = ""  # a local HF folder (Llama, Mistral, Qwen2/3, GPT-2, Mixtral)
    # mixture of experts (--model moe-tiny | moe-small; models/moe.py): 0 = the preset's
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 0  # experts per token
    n_shared_experts: int = 0  # always-on experts (DeepSeekMoE)
    moe_every: int = 0  # block i is MoE when i % moe_every == 0 (the preset's: every block)
    capacity_factor: float = 0.0  # 0 = dropless; c > 0: at most ceil(c·k·s/E) copies per
    # expert per sequence (the rest dropped, counted in metrics.jsonl)
    aux_loss_coef: float = 0.01  # α of the load-balancing loss E·Σ f_i·P_i (per sequence)
    z_loss_coef: float = 0.001  # β of the router z-loss (ST-MoE)
    # layout (world size = dp × cp × tp × pp). The default layout, dp=2 × tp=2 with ZeRO-1,
    # applies only when no degree is chosen; choosing any of dp/cp/tp/pp sets the others to
    # 1 and zero to 0 unless they are chosen too (see :func:`from_args`)
    dp: int = 2
    tp: int = 2
    pp: int = 1
    cp: int = 1  # context parallelism: ranks that split each sequence (parallel/cp)
    cp_method: str = "ring"  # ring (K/V passed around the cp ring) | allgather (Llama 3)
    ep: int = 1  # expert parallelism: ranks of dp × cp that share out the experts (parallel/ep)
    # HSDP: dp = dp_replicate × dp_shard; ZeRO shards within dp_shard, replicas all-reduce the
    # shards (--dp-shard S alone: dp = dp_replicate × S; 0 = dp / dp_replicate)
    dp_replicate: int = 1
    dp_shard: int = 0
    zero: int = 1
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0  # pipeline microbatches per step (0 = global batch / (dp × micro-batch);
    # not given with --micro-batch not given either: derived, see derive_batching)
    virtual_stages: int = 0  # model chunks per pp rank (0 = 2 for interleaved-1f1b, else 1)
    layers_per_stage: str = ""  # explicit pipeline split, e.g. "3,3,2" ("" = balanced)
    engine: str = "explicit"  # explicit | torch
    collectives: str = "native"  # native | ring | tree | auto: how comm/ops.py runs each
    # collective (the backend's own, or shardwise.comm.algorithms over isend/irecv)
    bucket_mb: float = 25.0  # DP gradient bucket size, MB
    overlap: bool = True  # launch gradient collectives during backward
    prefetch: bool = True  # ZeRO-3: all-gather the next unit while this one computes
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each forward
    # data
    data: str = ""  # "" = the embedded default corpus (the stdlib's .py sources)
    pack: bool = False  # sft: several examples per row, block-diagonal attention (data/pack.py)
    task: str = "lm"  # lm (packed text) | sft (alpaca-style .jsonl, prompt tokens masked) |
    # dpo (prompt/chosen/rejected .jsonl beside a frozen reference: train/dpo.py)
    dpo_beta: float = 0.1  # --task dpo: β of the sigmoid DPO loss (Rafailov et al. 2023, eq. 7)
    tokenizer: str = "bpe"  # bpe | bytes | FILE.json
    vocab_size: int = 4096  # BPE vocabulary size when training one
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step, all dp ranks together
    micro_batch: int = 8  # sequences per forward/backward on one rank (not given: derived from
    # the layout, at most this default; see derive_batching)
    # optimisation
    steps: int = 200  # make train: 4 ranks on 2 CPU cores stay under ~3 min (300 did not)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad L2 norm; 0 = off
    seed: int = 0
    dtype: str = "fp32"  # fp32 | bf16 (autocast compute, fp32 master weights and grads)
    reduce_dtype: str = "fp32"  # fp32 | bf16: the dtype gradients are reduced in over dp
    ac: str = "none"  # activation checkpointing per block: none | selective | full
    compile: bool = False  # torch.compile each transformer block (models/compile.py)
    peak_tflops: float = 0.0  # MFU: peak dense TFLOP/s of one GPU / CPU core (0 = table/probe)
    device: str = "cpu"  # cpu | cuda
    # run
    out: str = ""  # "" = runs/<timestamp>
    log_every: int = 10
    eval_every: int = 50
    eval_sequences: int = 64
    save_every: int = 0  # 0 = only the final checkpoint
    keep: int = 0  # keep only the K newest complete checkpoints (0 = keep all)
    resume: str = ""  # "" = start fresh; auto = newest complete checkpoint in --out; or a PATH
    async_save: bool = False  # write checkpoints in the background (dcp.async_save)
    allow_data_change: bool = False  # --resume on data whose fingerprint differs (on purpose)
    sample_tokens: int = 200
    timeout: float = 300.0  # process-group timeout, seconds
    max_restarts: int = 0  # local launcher: restart every rank up to N times after a failure
    # compare collective fingerprints across ranks: off | step (at every step boundary, through
    # the store; measured cost in docs/troubleshooting.md) | every (before each collective)
    check_collectives: str = "step"
    # a rank waiting longer than this (seconds) for its peers, in a collective or at the check,
    # writes RUN/flight/rank{r}.json and ends the run naming every rank's position; 0 = half
    # of --timeout (needs --check-collectives step or every)
    hang_after: float = 0.0
    wandb: str = ""  # a Weights & Biases project: mirror metrics.jsonl there (offline by default)
    # the fields above that :func:`derive_batching` chose, not the user ("micro_batch",
    # "microbatches", comma-separated): a run folder's config.toml read back with --config
    # derives them again for its layout instead of taking them as chosen. Not a flag
    derived: str = ""

    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def microbatching(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank per step). With pp > 1 and
        ``--microbatches M`` the micro-batch is global / (dp × M); otherwise ``--micro-batch``
        decides and M = global / (dp × micro-batch)."""
        local = self.global_batch // self.dp
        if self.pp > 1 and self.microbatches:
            return max(1, local // self.microbatches), self.microbatches
        return self.micro_batch, max(1, local // self.micro_batch)

    def model_overrides(self) -> dict:
        """Preset fields this config overrides (``--n-layers``; with ``--init-from-hf`` the HF
        folder's architecture, read from its config.json — see :mod:`shardwise.interop.hf`)."""
        over = {}
        if self.init_from_hf:
            from .interop.hf import hf_model_overrides

            over = {k: v for k, v in hf_model_overrides(self.init_from_hf).items()
                    if k != "vocab_size"}
        over = {**over, **self.moe_overrides()}
        return {**over, "n_layers": self.n_layers} if self.n_layers else over

    def moe_overrides(self) -> dict:
        """The mixture-of-experts fields of an MoE preset this config sets ({} for a dense
        model): ``--n-experts``, ``--top-k``, ``--moe-every`` where given (> 0),
        ``--n-shared-experts``, ``--capacity-factor`` (0: dropless), the two coefficients."""
        from .models import MOE_PRESETS

        if self.model not in MOE_PRESETS:
            return {}
        over = {k: getattr(self, k) for k in ("n_experts", "top_k", "moe_every")
                if getattr(self, k) > 0}
        return {**over, "n_shared_experts": self.n_shared_experts,
                "capacity_factor": self.capacity_factor or None,
                "aux_loss_coef": self.aux_loss_coef, "z_loss_coef": self.z_loss_coef}

    def model_layers(self) -> int:
        from .models import preset_config

        return self.n_layers or preset_config(self.model, **self.model_overrides()).n_layers

    def stage_split(self) -> list[int] | None:
        """``--layers-per-stage "3,3,2"`` as a list (None when empty)."""
        if not self.layers_per_stage.strip():
            return None
        try:
            return [int(x) for x in self.layers_per_stage.split(",")]
        except ValueError:
            raise ShardwiseConfigError(f"--layers-per-stage {self.layers_per_stage!r}: write "
                                       "comma-separated layer counts, e.g. 3,3,2") from None

    def to_toml(self) -> str:
        """The effective config as TOML (``config.toml`` of a run)."""
        lines = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, str):
                s = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                s = repr(v)
            lines.append(f"{f.name} = {s}")
        return "\n".join(lines) + "\n"


CHOICES = {
    "zero": (0, 1, 2, 3),
    "schedule": ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"),
    "engine": ("explicit", "torch"),
    "dtype": ("fp32", "bf16"),
    "task": ("lm", "sft", "dpo"),
    "device": ("cpu", "cuda"),
    "reduce_dtype": ("fp32", "bf16"),
    "ac": ("none", "selective", "full"),
    "check_collectives": ("off", "step", "every"),
}


NOT_FLAGS = ("derived",)  # fields set by from_args, never by a flag
DERIVABLE = ("micro_batch", "microbatches")  # fields derive_batching fills when not given


def _field_type(f: dataclasses.Field):
    return typing.get_type_hints(TrainConfig)[f.name]


def add_config_flags(parser: argparse.ArgumentParser, fields: list[str] | None = None,
                     defaults: dict | None = None) -> None:
    """Add ``--config`` and one flag per field (all defaulting to "not given"), each with its
    line of :data:`~shardwise.flag_help.FLAG_HELP`, its choices, and the default in effect for
    this subcommand (``defaults`` over the dataclass's: e.g. trace's tiny model)."""
    from .flag_help import FLAG_HELP

    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file "
                        "(flags override it; a run's config.toml works)")
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        if (fields is not None and f.name not in fields) or f.name in NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(f)
        default = defaults.get(f.name, f.default)
        shown = (f"derived from the layout, at most {default}" if f.name == "micro_batch"
                 and f.name not in defaults else "derived" if f.name in DERIVABLE
                 and f.name not in defaults
                 else "on" if default is True else "off" if default is False
                 else repr(default) if default == "" else default)
        text = FLAG_HELP.get(f.name, "")
        choices = CHOICES.get(f.name)
        extra = f"; choices: {', '.join(map(str, choices))}" if choices else ""
        text = f"{text} (default: {shown}{extra})".replace("%", "%%")  # argparse formats it
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type=typ, default=argparse.SUPPRESS,
                                choices=choices, metavar=None if choices
                                else f.name.upper(), help=text)


def from_args(args: argparse.Namespace, **defaults) -> TrainConfig:
    """Build a config: dataclass defaults, then ``defaults``, then ``--config``, then flags;
    then the micro-batch and pipeline microbatches the user did not give (by flag or in the
    TOML file; ``defaults`` are not the user's) are derived from the layout
    (:func:`derive_batching`). A pure function of the arguments: every rank, parsing the same
    command line, gets the same config before any collective."""
    cfg = dataclasses.replace(TrainConfig(), **defaults)
    path = getattr(args, "config", None)
    if path:
        base = cfg
        cfg = apply_toml(cfg, path)
        # values a saved run derived are derived again (for this run's layout), not reused
        cfg = dataclasses.replace(cfg, **{k: getattr(base, k) for k in _toml_derived(path)})
    names = {f.name for f in dataclasses.fields(TrainConfig)} - set(NOT_FLAGS)
    given = {k: v for k, v in vars(args).items() if k in names}
    by_user = set(given) | _toml_keys(path)
    chosen = by_user | set(defaults)
    if "dp_shard" in given and "dp" not in chosen:  # HSDP: dp = dp_replicate × dp_shard
        given["dp"] = given["dp_shard"] * given.get("dp_replicate", cfg.dp_replicate)
        chosen = chosen | {"dp"}
    if chosen & {"dp", "cp", "tp", "pp"}:  # a layout was chosen: the default one does not apply
        for k in ("dp", "cp", "tp", "pp"):  # e.g. --tp 2 alone is tp=2 × dp=1, not × dp=2
            if k not in chosen:
                given[k] = 1
        if "zero" not in chosen:
            given["zero"] = 0
    for k in ("n_experts", "top_k", "moe_every"):  # 0 in the config means "the preset's"
        if given.get(k) == 0:
            raise ShardwiseConfigError(
                f"--{k.replace('_', '-')} 0 must be at least 1: give a positive count, or omit "
                "the flag for the MoE preset's own value")
    cfg = dataclasses.replace(cfg, **given)
    if cfg.init_from_hf and "model" not in by_user and os.path.isdir(cfg.init_from_hf):
        from .interop.hf import hf_model_kind  # the folder decides: dense Llama or Mixtral

        try:
            kind = hf_model_kind(cfg.init_from_hf)
        except ShardwiseConfigError:  # validate() reports it, with the other checks
            kind = "llama"
        if kind == "moe":
            cfg = dataclasses.replace(cfg, model="moe-small")
    if cfg.init_from_hf and os.path.isdir(cfg.init_from_hf):
        # the folder's router coefficients (Mixtral's router_aux_loss_coef / router_z_loss_coef)
        # unless a flag or the TOML file gives them: an export → import round trip keeps them
        coefs = _hf_router_coefs(cfg.init_from_hf)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in coefs.items() if k not in by_user})
    # a capacity factor given as a flag must be > 0 (NaN and infinity: validate's finite check;
    # a saved config.toml's 0.0 is the default, dropless)
    if "capacity_factor" in given and math.isfinite(cfg.capacity_factor) \
            and not cfg.capacity_factor > 0:
        raise ShardwiseConfigError(
            f"--capacity-factor {cfg.capacity_factor} must be > 0 (each expert takes at most "
            "ceil(c·k·s/E) token copies of a sequence): give e.g. 1.25, or omit it for dropless "
            "routing")
    if not chosen & {"dp", "cp", "tp", "pp"} and cfg.tp > 1:
        from .models import MLP_PRESETS

        if cfg.model in MLP_PRESETS:  # TP splits attention heads: the MLP's default is dp only
            cfg = dataclasses.replace(cfg, tp=1)
    cfg = _follow_world(cfg, chosen)
    return derive_batching(cfg, set(DERIVABLE) - by_user)


def _hf_router_coefs(folder: str) -> dict:
    """``aux_loss_coef`` and ``z_loss_coef`` of a Mixtral folder as imported
    (:func:`~.interop.hf.hf_to_llama_config`: absent keys take transformers' default α = 0.001
    and β = 0); {} for a dense folder or one that does not load (validate reports that)."""
    from .interop.hf import hf_to_llama_config, read_hf_config

    try:
        m = hf_to_llama_config(read_hf_config(folder))
    except ShardwiseConfigError:
        return {}
    return {k: getattr(m, k) for k in ("aux_loss_coef", "z_loss_coef") if hasattr(m, k)}


def _follow_world(cfg: TrainConfig, chosen: set[str]) -> TrainConfig:
    """Under torchrun (``WORLD_SIZE`` = W set by the launcher) with no degree chosen, the default
    layout follows W as it follows the flags: tp = 2 (the default's) when W is even and ≥ 4
    (and the model has heads to split), dp = W / tp; else dp = W, tp = 1. A W equal to the
    default's world changes nothing (our own launcher always starts exactly that world)."""
    world = os.environ.get("WORLD_SIZE", "")
    if chosen & {"dp", "cp", "tp", "pp"} or not world.isdigit() or int(world) < 1 \
            or int(world) == cfg.world_size():
        return cfg
    w = int(world)
    tp = 2 if cfg.tp == 2 and w % 2 == 0 and w >= 4 else 1
    return dataclasses.replace(cfg, dp=w // tp, tp=tp, dp_replicate=1, dp_shard=0)


def derive_batching(cfg: TrainConfig, auto: set[str]) -> TrainConfig:
    """Fill in the micro-batch (and, with pp > 1, the microbatches) named in ``auto`` — the
    ones the user did not give — from the layout, and record them in ``cfg.derived``.

    ``micro_batch`` in ``auto`` (and no explicit ``--microbatches``): the largest b ≤
    ``cfg.micro_batch`` (the default in effect, 8) that divides the local batch
    global batch / dp and, with pp > 1, leaves at least pp microbatches per step (for
    interleaved-1f1b, m that splits into m // pp equal rounds). With pp > 1 and
    ``microbatches`` in ``auto`` too, m = local / b is recorded: the smallest m ≥ pp that divides
    the local batch with micro-batches of at most the default (the fewest microbatches: least
    per-step overhead, the bubble (p − 1)/(m + p − 1) of GPipe/1F1B, Narayanan et al. 2021 §2.2,
    is the price). Where the default fits it is kept, so runs that worked before are unchanged.
    An explicit value is never changed: one that does not fit gets :func:`validate`'s error.

    Raises :class:`ShardwiseConfigError` when no value fits (global batch not a multiple of dp,
    or fewer sequences per pipeline than pp), naming the constraint and the fix. Values below 1
    are left for :func:`validate` to report."""
    cfg = dataclasses.replace(cfg, derived="")
    gb, dp, pp, cap = cfg.global_batch, cfg.dp, cfg.pp, cfg.micro_batch
    if "micro_batch" not in auto or min(gb, dp, pp, cap) < 1 or cfg.microbatches < 0 \
            or (pp > 1 and cfg.microbatches):  # explicit m: the micro-batch follows from it
        return cfg
    if gb % dp:
        lo = max(dp, gb // dp * dp)
        divisors = [d for d in range(1, gb + 1) if gb % d == 0]
        raise ShardwiseConfigError(
            f"--global-batch {gb} does not split over --dp {dp} (each dp rank takes global "
            f"batch / dp whole sequences), so no micro-batch fits: choose --global-batch a "
            f"multiple of {dp} (e.g. {lo} or {lo + dp}) or --dp from {divisors}")
    local = gb // dp
    fits = [b for b in range(min(cap, local), 0, -1) if local % b == 0
            and (pp == 1 or _pipeline_fits(cfg.schedule, pp, local // b))]
    if not fits:
        need = dp * pp
        raise ShardwiseConfigError(
            f"--pp {pp} needs at least {pp} microbatches per step, but global batch / dp = "
            f"{gb} / {dp} = {local} sequences per pipeline"
            + ("" if local >= pp else f" (fewer than {pp})") + ": choose --global-batch a "
            f"multiple of dp × pp = {need} (e.g. {max(need, gb // need * need)}) or a smaller "
            "--pp or --dp")
    b = fits[0]
    derived = ["micro_batch"]
    if pp > 1 and "microbatches" in auto:
        derived.append("microbatches")
        cfg = dataclasses.replace(cfg, microbatches=local // b)
    return dataclasses.replace(cfg, micro_batch=b, derived=",".join(derived))


def _pipeline_fits(schedule: str, pp: int, m: int) -> bool:
    """m microbatches fill a pp-stage pipeline: m ≥ pp, and for interleaved-1f1b m splits into
    m // pp equal rounds (:func:`~.parallel.pp.schedules.rounds_of`)."""
    if m < pp:
        return False
    return schedule != "interleaved-1f1b" or m % (m // pp) == 0


def batching_note(cfg: TrainConfig) -> str:
    """The start-up line's words on derived values ("" when the user chose them), e.g.
    ``micro-batch 4 (derived: global batch 16 / dp 4; pass --micro-batch to choose)``."""
    derived = set(filter(None, cfg.derived.split(",")))
    if "micro_batch" not in derived:
        return ""
    local = cfg.global_batch // cfg.dp
    if "microbatches" in derived:
        return (f"micro-batch {cfg.micro_batch}, {cfg.microbatches} microbatches (derived: "
                f"global batch {cfg.global_batch} / dp {cfg.dp} = {local} sequences per "
                f"pipeline, at least pp {cfg.pp} microbatches; pass --micro-batch or "
                "--microbatches to choose)")
    return (f"micro-batch {cfg.micro_batch} (derived: global batch {cfg.global_batch} / dp "
            f"{cfg.dp}; pass --micro-batch to choose)")


def _toml_derived(path: str | None) -> set[str]:
    """The fields a ``--config`` file says were derived (its ``derived = "..."``)."""
    if not path or not os.path.isfile(path):
        return set()
    try:
        with open(path, "rb") as f:
            value = tomllib.load(f).get("derived", "")
    except tomllib.TOMLDecodeError:
        return set()
    return {k for k in str(value).split(",") if k in DERIVABLE}


def _toml_keys(path: str | None) -> set[str]:
    """Field names a ``--config`` file sets, less those it says were derived (empty without
    one; errors are apply_toml's)."""
    if not path or not os.path.isfile(path):
        return set()
    try:
        with open(path, "rb") as f:
            return {k.replace("-", "_") for k in tomllib.load(f)} - _toml_derived(path)
    except tomllib.TOMLDecodeError:
        return set()


def apply_toml(cfg: TrainConfig, path: str) -> TrainConfig:
    """Override ``cfg`` with the keys of TOML file ``path`` (dashes or underscores)."""
    if not os.path.isfile(path):
        raise ShardwiseConfigError(f"--config {path}: no such file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ShardwiseConfigError(f"--config {path}: not valid TOML ({e})") from None
    hints = typing.get_type_hints(TrainConfig)
    updates = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ShardwiseConfigError(f"--config {path}: unknown key {key!r}; valid keys: "
                                       f"{', '.join(sorted(hints))}")
        want = hints[name]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ShardwiseConfigError(f"--config {path}: {key} = {value!r} should be a "
                                       f"{want.__name__}")
        updates[name] = value
    return dataclasses.replace(cfg, **updates)


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Check ``cfg`` (and, if given, that the launched ``world_size`` matches the layout).

    Raises :class:`ShardwiseConfigError` naming the constraint and the fix.
    """
    from .models import MLP_PRESETS, is_llama_name, max_seq_len_of, model_names
    from .topology import validate_degrees

    _validate_finite(cfg)
    for name in filter(None, cfg.derived.split(",")):
        if name not in DERIVABLE:
            raise ShardwiseConfigError(f"derived = {cfg.derived!r}: only {', '.join(DERIVABLE)} "
                                       "are derived; remove the others from the config file")
    if cfg.n_layers < 0:
        raise ShardwiseConfigError(f"--n-layers {cfg.n_layers} must be ≥ 1 (or 0 for the preset)")
    for name, value in (("dp", cfg.dp), ("cp", cfg.cp), ("tp", cfg.tp), ("pp", cfg.pp),
                        ("ep", cfg.ep), ("dp-replicate", cfg.dp_replicate),
                        ("steps", cfg.steps),
                        ("seq-len", cfg.seq_len), ("global-batch", cfg.global_batch),
                        ("micro-batch", cfg.micro_batch)):
        if value < 1:
            raise ShardwiseConfigError(f"--{name} {value} must be at least 1")
    if cfg.dp_shard < 0 or (cfg.dp_shard and cfg.dp_shard * cfg.dp_replicate != cfg.dp):
        raise ShardwiseConfigError(
            f"--dp-shard {cfg.dp_shard} × --dp-replicate {cfg.dp_replicate} must equal --dp "
            f"{cfg.dp} (HSDP: dp = dp_replicate × dp_shard): give two of the three, e.g. "
            f"--dp-replicate {cfg.dp_replicate} --dp-shard {max(1, cfg.dp // cfg.dp_replicate)}")
    if world_size is not None:
        validate_degrees(cfg.pp, cfg.dp, cfg.tp, world_size, cfg.cp)
    if not is_llama_name(cfg.model) and cfg.model not in MLP_PRESETS:
        raise ShardwiseConfigError(f"--model {cfg.model!r} is not a preset: choose from "
                                   f"{model_names()}")
    _validate_moe(cfg)
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ShardwiseConfigError(f"--{key.replace('_', '-')} {getattr(cfg, key)!r}: "
                                       f"choose from {allowed}")
    from .comm.algorithms import check_collectives

    check_collectives(cfg.collectives)
    _validate_task_and_init(cfg)
    if cfg.task == "dpo":
        _validate_dpo(cfg)
    if cfg.pack:
        from .data.pack import check_pack

        check_pack(cfg.task, cfg.cp, cfg.engine)
    _validate_ranges(cfg)
    _validate_layout(cfg)
    per_step = cfg.dp * cfg.micro_batch
    if cfg.pp > 1 and cfg.microbatches:
        per_step = cfg.dp * cfg.microbatches
        if cfg.global_batch % per_step:
            lo = max(per_step, cfg.global_batch // per_step * per_step)
            raise ShardwiseConfigError(
                f"--global-batch {cfg.global_batch} is not divisible by dp × microbatches = "
                f"{cfg.dp} × {cfg.microbatches} = {per_step}: choose a multiple of {per_step} "
                f"(e.g. {lo} or {lo + per_step}) or change --microbatches")
    elif cfg.global_batch % per_step:
        lo = max(per_step, cfg.global_batch // per_step * per_step)
        raise ShardwiseConfigError(
            f"--global-batch {cfg.global_batch} is not divisible by dp × micro-batch = "
            f"{cfg.dp} × {cfg.micro_batch} = {per_step}: choose a multiple of {per_step} "
            f"(e.g. {lo} or {lo + per_step}) or change --micro-batch")
    if is_llama_name(cfg.model) and cfg.seq_len > max_seq_len_of(cfg.model) \
            and not cfg.init_from_hf:  # (the HF model's own limit is checked above)
        raise ShardwiseConfigError(
            f"--seq-len {cfg.seq_len} exceeds the {cfg.model} model's max_seq_len "
            f"{max_seq_len_of(cfg.model)}: choose --seq-len ≤ "
            f"{max_seq_len_of(cfg.model)} or a larger --model")
    if cfg.data and not os.path.exists(cfg.data):
        raise ShardwiseConfigError(f"--data {cfg.data}: no such file or folder; give a .txt, "
                                   ".jsonl or .parquet file or a folder of them, or omit --data "
                                   "for the embedded default corpus")
    _validate_checkpointing(cfg)
    if cfg.out and os.path.exists(os.path.join(cfg.out, "metrics.jsonl")) and not cfg.resume:
        raise ShardwiseConfigError(
            f"--out {cfg.out} already holds a run (metrics.jsonl): choose a new --out (a config "
            "file from an earlier run keeps its out = ...; override it with --out), pass "
            "--resume auto to continue that run, or remove "
            "the folder")
    if cfg.lr <= 0:
        raise ShardwiseConfigError(f"--lr {cfg.lr} must be > 0")
    if cfg.ac == "selective" and cfg.pp > 1 and cfg.schedule == "zb-h1":
        raise ShardwiseConfigError(
            "--ac selective with --schedule zb-h1: zero-bubble splits each backward in two "
            "(input, then weight gradients), and PyTorch's selective checkpoint can be "
            "back-propagated through only once: use --ac full (recomputes per pass) or another "
            "--schedule")
    if cfg.compile:  # layouts whose blocks cannot be one graph (models/compile.py)
        from .models import MOE_PRESETS
        from .models.compile import check_compile

        check_compile(tp=cfg.tp, cp=cfg.cp, ep=cfg.ep, moe=cfg.model in MOE_PRESETS,
                      pp=cfg.pp, schedule=cfg.schedule)
    if cfg.peak_tflops < 0:
        raise ShardwiseConfigError(f"--peak-tflops {cfg.peak_tflops} must be ≥ 0 (0 = the "
                                   "device's table value, or a measured CPU peak)")
    check_timeout(cfg.timeout)
    if cfg.hang_after < 0:  # --hang-after
        raise ShardwiseConfigError(f"--hang-after {cfg.hang_after} must be ≥ 0 seconds (0 = "
                                   f"half of --timeout, {cfg.timeout / 2:g} s)")


# The smallest --timeout accepted, seconds: a floor, not a recommendation (the default is 300).
# Far below it a run cannot even start (--timeout 0.001 failed connecting to the rendezvous
# store: "client socket has timed out after 1ms"), and near it ordinary scheduling (a rank on a
# busy CPU descheduled, a peer slower by a step) already looks like a hung peer.
MIN_TIMEOUT_S = 1.0


def check_timeout(seconds: float, flag: str = "--timeout") -> None:
    """Raise :class:`ShardwiseConfigError` unless the process-group timeout ``seconds`` is a
    finite number ≥ :data:`MIN_TIMEOUT_S` (``train``, ``trace`` through :func:`validate`;
    ``verify`` and ``bench`` call it for their own ``--timeout``). Runs before any collective."""
    if not math.isfinite(seconds):
        raise ShardwiseConfigError(f"{flag} {seconds} must be a finite number of seconds: give "
                                   "e.g. 300 (the default)")
    if seconds <= 0:
        raise ShardwiseConfigError(f"{flag} {seconds} must be > 0 seconds")
    if seconds < MIN_TIMEOUT_S:
        raise ShardwiseConfigError(
            f"{flag} {seconds} s is too short to be meaningful: the start-up rendezvous and "
            "every collective must finish within it (a rank waits that long for its slowest "
            f"peer): choose {flag} ≥ {MIN_TIMEOUT_S:g} s (default 300)")


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: AdamW casts lr to it


def _validate_finite(cfg: TrainConfig) -> None:
    """Every float field (``--lr``, ``--timeout``, ``--bucket-mb``, …) must be finite. NaN
    passes every range check below (each comparison with NaN is false) and infinity passes the
    lower bounds; both then fail late — AdamW's ValueError on rank 0 after the process group
    exists, a ``timedelta`` overflow — or silently (NaN weights). Checked for every float field
    of :class:`TrainConfig`, so a new one is covered too."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if hints[f.name] is float and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            raise ShardwiseConfigError(
                f"--{f.name.replace('_', '-')} {value} must be a finite number within fp32's "
                f"range (±{FP32_MAX:.3g}; not NaN or infinity): give a finite value, e.g. the "
                f"default {f.default!r}")


def _validate_moe(cfg: TrainConfig) -> None:
    """The mixture-of-experts flags: only with an MoE preset, each ≥ 0, and a model config
    they can build (top_k ≤ n_experts, …: :class:`~.models.moe.MoEConfig`'s rules, as
    :class:`ShardwiseConfigError`). ``--ep`` itself is the layout's (:func:`_validate_layout`)."""
    from .models import MOE_PRESETS, preset_config

    flags = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in
             ("n_experts", "top_k", "n_shared_experts", "moe_every", "capacity_factor")
             if getattr(cfg, k)]
    if cfg.model not in MOE_PRESETS:
        if flags:
            raise ShardwiseConfigError(
                f"{', '.join(flags)}: mixture-of-experts settings need an MoE model: choose "
                f"--model {' or '.join(sorted(MOE_PRESETS))}, or drop them")
        return
    for k in ("n_experts", "top_k", "n_shared_experts", "moe_every", "aux_loss_coef",
              "z_loss_coef", "capacity_factor"):
        if getattr(cfg, k) < 0:
            raise ShardwiseConfigError(f"--{k.replace('_', '-')} {getattr(cfg, k)} must be ≥ 0")
    try:
        preset_config(cfg.model, cfg.vocab_size, **cfg.model_overrides())
    except ValueError as e:
        raise ShardwiseConfigError(f"--model {cfg.model}: {e}") from None


def _validate_layout(cfg: TrainConfig) -> None:
    """The layout through the one validator, :meth:`~.parallel.layout.Layout.check`, with the
    model's config (read only when tp, sp, pp or cp needs it) and the batch (before any
    collective)."""
    from .models import MOE_PRESETS, PRESETS, preset_config
    from .parallel.layout import Layout

    needs_model = cfg.tp > 1 or cfg.sp or cfg.pp > 1 or cfg.cp > 1 or cfg.ep > 1 \
        or cfg.model in MOE_PRESETS
    over = cfg.model_overrides()
    if cfg.model in PRESETS or cfg.model in MOE_PRESETS:  # a Llama: its dropout matters to cp
        over = {"dropout": cfg.dropout, **over}
    Layout.from_config(cfg).check(
        preset_config(cfg.model, cfg.vocab_size, **over) if needs_model
        else None, engine=cfg.engine, reduce_dtype=cfg.reduce_dtype, seq_len=cfg.seq_len,
        device=cfg.device,
        global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
        layers_per_stage=cfg.stage_split() if cfg.pp > 1 else None)


def _validate_ranges(cfg: TrainConfig) -> None:
    """Numbers that would otherwise fail late (a ZeroDivisionError at step 1, AdamW's ValueError
    after the process group exists) or silently do the wrong thing (a negative clip norm flips
    the gradients; min-lr-ratio > 1 makes the "decay" grow the LR)."""
    for name, value, low in (("log-every", cfg.log_every, 1), ("eval-every", cfg.eval_every, 1),
                             ("eval-sequences", cfg.eval_sequences, 1),
                             ("warmup-steps", cfg.warmup_steps, 0),
                             ("microbatches", cfg.microbatches, 0),
                             ("virtual-stages", cfg.virtual_stages, 0),
                             ("sample-tokens", cfg.sample_tokens, 0)):
        if value < low:
            raise ShardwiseConfigError(f"--{name} {value} must be ≥ {low}")
    if cfg.grad_clip < 0:
        raise ShardwiseConfigError(f"--grad-clip {cfg.grad_clip} must be ≥ 0 (a max gradient "
                                   "norm; 0 = no clipping)")
    if not 0 <= cfg.dropout < 1:
        raise ShardwiseConfigError(f"--dropout {cfg.dropout} must be in [0, 1) (a drop "
                                   "probability; 0 = off)")
    if cfg.bucket_mb <= 0:
        raise ShardwiseConfigError(f"--bucket-mb {cfg.bucket_mb} must be > 0 MiB (e.g. 25; a "
                                   "tiny value means one all-reduce per parameter)")
    if cfg.weight_decay < 0:
        raise ShardwiseConfigError(f"--weight-decay {cfg.weight_decay} must be ≥ 0 (e.g. 0.1)")
    for name, value in (("beta1", cfg.beta1), ("beta2", cfg.beta2)):
        if not 0 <= value < 1:
            raise ShardwiseConfigError(f"--{name} {value} must be in [0, 1) (AdamW's moment "
                                       "decay, e.g. 0.9 and 0.95)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ShardwiseConfigError(f"--min-lr-ratio {cfg.min_lr_ratio} must be in [0, 1] (the "
                                   "final LR as a fraction of --lr)")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ShardwiseConfigError("--device cuda, but this torch sees no CUDA device "
                                       f"(torch {torch.__version__}): use --device cpu, or "
                                       "install a CUDA build of torch on a GPU machine")


def _validate_task_and_init(cfg: TrainConfig) -> None:
    """``--task sft`` needs a Llama model and a ``.jsonl`` file; ``--init-from-hf DIR`` needs a
    loadable Llama folder (config.json read here; weights when the model is built) whose
    context fits ``--seq-len``. Reads files only: runs before any collective."""
    from .models import MLP_PRESETS

    from .interop.hub import data_recipe, looks_like_hub_name

    if cfg.data and looks_like_hub_name(cfg.data):
        raise ShardwiseConfigError(f"--data {cfg.data}: no such file; " + data_recipe(cfg.data))
    if cfg.task == "sft":
        if cfg.model in MLP_PRESETS:
            raise ShardwiseConfigError(f"--task sft trains a language model; --model {cfg.model} "
                                       "is the MLP: choose --model tiny, small or base")
        if not cfg.data:
            raise ShardwiseConfigError("--task sft needs --data FILE.jsonl with one "
                                       '{"instruction", "input", "output"} or {"messages": [...]}'
                                       " record per line (see examples/sft_sample.jsonl, "
                                       "examples/chat_sample.jsonl)")
        if not cfg.data.endswith(".jsonl"):
            raise ShardwiseConfigError(f"--task sft --data {cfg.data}: expected a .jsonl file of "
                                       '{"instruction", "input", "output"} or {"messages": '
                                       '[...]} records (see examples/sft_sample.jsonl, '
                                       "examples/chat_sample.jsonl)")
    if cfg.init_from_hf:
        if cfg.model in MLP_PRESETS:
            raise ShardwiseConfigError(f"--init-from-hf loads a Llama; --model {cfg.model} is the "
                                       "MLP: drop --model (the HF config.json decides the shape)")
        from .interop.hf import check_weight_files

        from .interop.hf import hf_to_llama_config, read_hf_config

        over = cfg.model_overrides()  # raises on a missing/unsupported folder
        # no weights, a truncated file, or tensors that do not fit config.json
        check_weight_files(cfg.init_from_hf, hf_to_llama_config(read_hf_config(cfg.init_from_hf)))
        if cfg.seq_len > over["max_seq_len"]:
            raise ShardwiseConfigError(
                f"--seq-len {cfg.seq_len} exceeds the HF model's max_position_embeddings "
                f"{over['max_seq_len']}: choose --seq-len ≤ {over['max_seq_len']}")
        window = over.get("sliding_window") or 0
        if window and cfg.seq_len > window:
            raise ShardwiseConfigError(
                f"--seq-len {cfg.seq_len} exceeds the HF model's sliding_window {window}: "
                "shardwise's attention is full causal attention, equal to the windowed one only "
                f"while a sequence fits the window: choose --seq-len ≤ {window}")


def _validate_dpo(cfg: TrainConfig) -> None:
    """``--task dpo``: a dense Llama, a ``.jsonl`` file, β > 0, a layout DPO runs in, and batches
    of whole pairs: chosen and rejected sit in adjacent rows of one micro-batch on one rank
    (train/dpo.py), so the global batch, each dp rank's share and each micro-batch must be
    even numbers of rows. Before any collective."""
    from .models import MLP_PRESETS, MOE_PRESETS

    if cfg.model in MLP_PRESETS or cfg.model in MOE_PRESETS:
        raise ShardwiseConfigError(f"--task dpo trains a dense language model; --model {cfg.model}"
                                   " is not one: choose --model tiny, small or base")
    if not cfg.data or not cfg.data.endswith(".jsonl"):
        raise ShardwiseConfigError(f"--task dpo needs --data FILE.jsonl with one "
                                   '{"prompt", "chosen", "rejected"} record per line, got '
                                   f"{cfg.data or 'none'}")
    if not cfg.dpo_beta > 0:
        raise ShardwiseConfigError(f"--dpo-beta {cfg.dpo_beta} must be > 0 (the KL weight β; "
                                   "TRL's default is 0.1)")
    if cfg.cp > 1:
        raise ShardwiseConfigError("--task dpo with --cp > 1: a row's log-prob would be split "
                                   "over the cp ranks; use dp, tp, pp or ZeRO")
    if cfg.engine == "torch" and (cfg.tp > 1 or cfg.pp > 1):
        raise ShardwiseConfigError("--task dpo with --engine torch runs dp and ZeRO layouts "
                                   "only (DTensor's loss_parallel and torch.pipelining give no "
                                   "per-row log-probs): use --engine explicit for tp or pp")
    micro, m = cfg.microbatching()
    local = cfg.global_batch // cfg.dp
    pairs = "each (chosen, rejected) pair sits in adjacent rows of one micro-batch on one rank"
    if cfg.global_batch % 2 or local % 2 or cfg.global_batch % cfg.dp:
        raise ShardwiseConfigError(
            f"--task dpo: --global-batch {cfg.global_batch} over --dp {cfg.dp} gives "
            f"{cfg.global_batch / cfg.dp:g} rows per rank, which would split a pair ({pairs}): "
            f"choose --global-batch a multiple of 2 × dp = {2 * cfg.dp}")
    if micro % 2:
        raise ShardwiseConfigError(
            f"--task dpo: a micro-batch of {micro} rows would split a pair ({pairs}): choose an "
            "even --micro-batch" + (" (or --microbatches dividing global batch / (2·dp))"
                                    if cfg.pp > 1 else ""))


def _validate_checkpointing(cfg: TrainConfig) -> None:
    """``--save-every``, ``--keep``, ``--resume`` and ``--out`` (writable), before anything starts.
    The checkpoint itself is checked on every rank before any collective
    (:func:`shardwise.train.checkpoint.find_resume_checkpoint`)."""
    if cfg.save_every < 0:
        raise ShardwiseConfigError(f"--save-every {cfg.save_every} must be ≥ 0 (0 = only the "
                                   "final checkpoint)")
    if cfg.keep < 0:
        raise ShardwiseConfigError(f"--keep {cfg.keep} must be ≥ 0 (0 = keep every checkpoint)")
    if cfg.resume == "auto" and not cfg.out:
        raise ShardwiseConfigError("--resume auto looks for checkpoints in --out, but no --out "
                                   "was given: pass --out DIR (the same folder on every restart)")
    if cfg.resume and cfg.resume != "auto" and not os.path.exists(cfg.resume):
        raise ShardwiseConfigError(f"--resume {cfg.resume}: no such folder: give a "
                                   "checkpoints/step_N folder, a run folder, or auto")
    if cfg.max_restarts < 0:
        raise ShardwiseConfigError(f"--max-restarts {cfg.max_restarts} must be ≥ 0 (0 = a "
                                   "failed rank stops the run)")
    if cfg.max_restarts and cfg.resume != "auto":
        raise ShardwiseConfigError(
            f"--max-restarts {cfg.max_restarts} restarts every rank from the newest checkpoint "
            "in --out: add --resume auto (with --out DIR, the same folder on every attempt, and "
            "--save-every K, so that there is a checkpoint to go back to)")
    if cfg.out:
        check_out_writable(cfg.out)


def check_out_writable(out: str) -> None:
    """Raise :class:`ShardwiseConfigError` unless ``out`` is (or can be created as) a writable
    folder, before anything starts: creates it (as the run would) and writes and removes a probe
    file in it."""
    p = Path(out).absolute()
    if p.exists() and not p.is_dir():
        raise ShardwiseConfigError(f"--out {out}: exists and is not a folder: choose a folder "
                                   "path for the run's outputs")
    anc = p
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ShardwiseConfigError(f"--out {out}: cannot be created because {anc} is a file, not "
                                   "a folder: choose another --out")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ShardwiseConfigError(f"--out {out}: {anc} is not writable by this user: choose a "
                                   "writable --out (or fix the folder's permissions)")
    # permissions do not tell everything (root, read-only or special file systems): try it
    probe = p / f".shardwise-write-test-{os.getpid()}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ShardwiseConfigError(f"--out {out}: cannot write there ({e.strerror or e}): choose "
                                   "a writable --out") from None
