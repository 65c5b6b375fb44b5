"""The run configuration: one flat dataclass, TOML files, command-line overrides, validation.

Precedence: dataclass defaults < ``--config FILE.toml`` < explicit flags. Every field is a flag
(``seq_len`` ↔ ``--seq-len``). :func:`validate` checks everything that can be checked without
the data and raises :class:`~shardwise.errors.ShardwiseConfigError` naming the constraint and the fix;
it runs in the launcher and again on every rank before any collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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
    # layout (world size = dp × tp × pp)
    dp: int = 2
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0  # pipeline microbatches per step (0 = global batch / (dp × micro-batch))
    virtual_stages: int = 0  # model chunks per pp rank (0 = 2 for interleaved-1f1b, else 1)
    layers_per_stage: str = ""  # explicit pipeline split, e.g. "3,3,2" ("" = balanced)
    engine: str = "explicit"  # explicit | torch
    bucket_mb: float = 25.0  # DP gradient bucket size, MB
    overlap: bool = True  # launch gradient collectives during backward
    prefetch: bool = True  # ZeRO-3: all-gather the next unit while this one computes
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each forward
    # data
    data: str = ""  # "" = the embedded default corpus (the stdlib's .py sources)
    tokenizer: str = "bpe"  # bpe | bytes | FILE.json
    vocab_size: int = 4096  # BPE vocabulary size when training one
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step, all dp ranks together
    micro_batch: int = 8  # sequences per forward/backward on one rank
    # optimisation
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad L2 norm; 0 = off
    seed: int = 0
    dtype: str = "fp32"  # fp32 | bf16 (autocast compute, fp32 master weights and grads)
    device: str = "cpu"  # cpu | cuda
    # run
    out: str = ""  # "" = runs/<timestamp>
    log_every: int = 10
    eval_every: int = 50
    eval_sequences: int = 64
    save_every: int = 0  # 0 = only the final checkpoint
    sample_tokens: int = 200
    timeout: float = 300.0  # process-group timeout, seconds

    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def microbatching(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank per step). With pp > 1 and
        ``--microbatches M`` the micro-batch is global / (dp × M); otherwise ``--micro-batch``
        decides and M = global / (dp × micro-batch)."""
        local = self.global_batch // self.dp
        if self.pp > 1 and self.microbatches:
            return max(1, local // self.microbatches), self.microbatches
        return self.micro_batch, max(1, local // self.micro_batch)

    def model_overrides(self) -> dict:
        """Preset fields this config overrides (``--n-layers``)."""
        return {"n_layers": self.n_layers} if self.n_layers else {}

    def model_layers(self) -> int:
        from .models import preset_config

        return self.n_layers or preset_config(self.model).n_layers

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
}


def _field_type(f: dataclasses.Field):
    return typing.get_type_hints(TrainConfig)[f.name]


def add_config_flags(parser: argparse.ArgumentParser, fields: list[str] | None = None) -> None:
    """Add ``--config`` and one flag per field (all defaulting to "not given")."""
    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file")
    for f in dataclasses.fields(TrainConfig):
        if fields is not None and f.name not in fields:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(f)
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"(default: {f.default})")
        else:
            parser.add_argument(flag, type=typ, default=argparse.SUPPRESS,
                                choices=CHOICES.get(f.name), metavar=None if f.name in CHOICES
                                else f.name.upper(), help=f"(default: {f.default!r})")


def from_args(args: argparse.Namespace, **defaults) -> TrainConfig:
    """Build a config: dataclass defaults, then ``defaults``, then ``--config``, then flags."""
    cfg = dataclasses.replace(TrainConfig(), **defaults)
    if getattr(args, "config", None):
        cfg = apply_toml(cfg, args.config)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if "dp" not in given and ("tp" in given or "pp" in given):
        given["dp"] = 1  # --tp/--pp alone: the default dp=2 would silently double the world
    return dataclasses.replace(cfg, **given)


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
    from .models import MLP_PRESETS, PRESETS, model_names
    from .topology import validate_degrees

    if cfg.n_layers < 0:
        raise ShardwiseConfigError(f"--n-layers {cfg.n_layers} must be ≥ 1 (or 0 for the preset)")
    for name, value in (("dp", cfg.dp), ("tp", cfg.tp), ("pp", cfg.pp), ("steps", cfg.steps),
                        ("seq-len", cfg.seq_len), ("global-batch", cfg.global_batch),
                        ("micro-batch", cfg.micro_batch)):
        if value < 1:
            raise ShardwiseConfigError(f"--{name} {value} must be at least 1")
    if world_size is not None:
        validate_degrees(cfg.pp, cfg.dp, cfg.tp, world_size)
    if cfg.model not in PRESETS and cfg.model not in MLP_PRESETS:
        raise ShardwiseConfigError(f"--model {cfg.model!r} is not a preset: choose from "
                                   f"{model_names()}")
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ShardwiseConfigError(f"--{key} {getattr(cfg, key)!r}: choose from {allowed}")
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
    if cfg.model in PRESETS and cfg.seq_len > PRESETS[cfg.model]["max_seq_len"]:
        raise ShardwiseConfigError(
            f"--seq-len {cfg.seq_len} exceeds the {cfg.model} model's max_seq_len "
            f"{PRESETS[cfg.model]['max_seq_len']}: choose --seq-len ≤ "
            f"{PRESETS[cfg.model]['max_seq_len']} or a larger --model")
    if cfg.data and not os.path.exists(cfg.data):
        raise ShardwiseConfigError(f"--data {cfg.data}: no such file or folder; give a .txt, "
                                   ".jsonl or .parquet file or a folder of them, or omit --data "
                                   "for the embedded default corpus")
    if cfg.out and os.path.exists(os.path.join(cfg.out, "metrics.jsonl")):
        raise ShardwiseConfigError(
            f"--out {cfg.out} already holds a run (metrics.jsonl): choose a new --out (a config "
            "file from an earlier run keeps its out = ...; override it with --out), or remove "
            "the folder")
    if cfg.lr <= 0:
        raise ShardwiseConfigError(f"--lr {cfg.lr} must be > 0")
    if cfg.timeout <= 0:
        raise ShardwiseConfigError(f"--timeout {cfg.timeout} must be > 0 seconds")


def _validate_layout(cfg: TrainConfig) -> None:
    """The composition check, then each strategy's own checks (all before any collective)."""
    from .models import MLP_PRESETS, preset_config
    from .parallel.apply import Layout, check_supported

    layout = Layout.from_config(cfg)
    check_supported(layout)
    if cfg.zero:
        from .parallel.zero import validate_zero

        validate_zero(cfg.zero, cfg.dp, engine=cfg.engine)
    if cfg.tp > 1 or cfg.sp:
        from .parallel.tensor import validate_tp

        if cfg.model in MLP_PRESETS:
            raise ShardwiseConfigError(f"--tp {cfg.tp}: tensor parallelism splits the Llama-style "
                                       f"models; --model {cfg.model} is the MLP: choose --model "
                                       f"tiny, small or base")
        validate_tp(preset_config(cfg.model, cfg.vocab_size, **cfg.model_overrides()), cfg.tp,
                    cfg.sp, cfg.seq_len)
    if cfg.pp > 1:
        from .parallel.pipeline import validate_pp

        _, m = cfg.microbatching()
        if not cfg.microbatches and m < cfg.pp:
            local = cfg.global_batch // cfg.dp
            raise ShardwiseConfigError(
                f"--pp {cfg.pp} needs at least {cfg.pp} microbatches per step, but global batch / "
                f"(dp × micro-batch) = {cfg.global_batch} / ({cfg.dp} × {cfg.micro_batch}) = {m}: "
                f"pass --microbatches M (M ≥ {cfg.pp}, dividing {local}) or a smaller --micro-batch")
        validate_pp(cfg.model_layers(), cfg.pp, cfg.schedule, m, batch=cfg.global_batch // cfg.dp,
                    virtual_stages=cfg.virtual_stages or None,
                    layers_per_stage=cfg.stage_split())

