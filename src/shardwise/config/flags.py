"""The configuration from the command line and TOML: :func:`add_config_flags` (one flag per
field), :func:`from_args` (dataclass defaults < ``--config FILE.toml`` < explicit flags) and
:func:`apply_toml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import typing

from ..errors import ShardwiseConfigError, ShardwiseFileError
from ..readers import read_toml
from .fields import CHOICES, DERIVABLE, LOCAL_WORLD, NOT_FLAGS, TrainConfig
from .notes import derive_batching


@functools.cache
def _hints() -> dict:
    """TrainConfig's resolved annotations, once (each ``get_type_hints`` call evaluates every
    field's annotation: called per field, it cost ~0.3 s of each command's start)."""
    return typing.get_type_hints(TrainConfig)


def _field_type(f: dataclasses.Field):
    return _hints()[f.name]


def add_config_flags(parser: argparse.ArgumentParser, fields: list[str] | None = None,
                     defaults: dict | None = None) -> None:
    """Add ``--config`` and one flag per field (all defaulting to "not given"), each with its
    line of :data:`~shardwise.config.flag_help.FLAG_HELP`, its choices, and the default in effect for
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
        shown = ("the world size: see the default layout above" if f.name == "dp"
                 and f.name not in defaults
                 else f"derived from the layout, at most {default}" if f.name == "micro_batch"
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
    for k in ("n_experts", "top_k", "moe_every"):  # 0 in the config means "the preset's"
        if given.get(k) == 0:
            raise ShardwiseConfigError(
                f"--{k.replace('_', '-')} 0 must be at least 1: give a positive count, or omit "
                "the flag for the MoE preset's own value")
    cfg = dataclasses.replace(cfg, **given)
    if cfg.init_from_hf and "model" not in by_user and os.path.isdir(cfg.init_from_hf):
        from ..interop.hf import hf_model_kind  # the folder decides: dense Llama or Mixtral

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
    if not chosen & {"dp", "cp", "tp", "pp"}:  # no degree chosen: DEFAULT_LAYOUT_RULE
        cfg = dataclasses.replace(cfg, dp=default_world())
    return derive_batching(cfg, set(DERIVABLE) - by_user)


def _hf_router_coefs(folder: str) -> dict:
    """``aux_loss_coef`` and ``z_loss_coef`` of a Mixtral folder as imported
    (:func:`~.interop.hf.hf_to_llama_config`: absent keys take transformers' default α = 0.001
    and β = 0); {} for a dense folder or one that does not load (validate reports that)."""
    from ..interop.hf import hf_to_llama_config, read_hf_config

    try:
        m = hf_to_llama_config(read_hf_config(folder))
    except ShardwiseConfigError:
        return {}
    return {k: getattr(m, k) for k in ("aux_loss_coef", "z_loss_coef") if hasattr(m, k)}


def default_world() -> int:
    """The world a run with no degree chosen spreads dp over (:data:`DEFAULT_LAYOUT_RULE`):
    torchrun's ``WORLD_SIZE`` (our own launcher's workers see the world it started), else the
    :data:`LOCAL_WORLD` ranks ``shardwise train`` spawns alone. Unchosen degrees are 1 and
    ``--zero`` 0 by the dataclass defaults, so ``--tp 2`` alone is tp=2 × dp=1 and ``--zero 3``
    alone is ZeRO-3 over the whole world."""
    world = os.environ.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() and int(world) >= 1 else LOCAL_WORLD


def _toml_derived(path: str | None) -> set[str]:
    """The fields a ``--config`` file says were derived (its ``derived = "..."``)."""
    if not path:
        return set()
    try:
        value = read_toml(path, "--config").get("derived", "")
    except ShardwiseFileError:  # apply_toml reports it
        return set()
    return {k for k in str(value).split(",") if k in DERIVABLE}


def _toml_keys(path: str | None) -> set[str]:
    """Field names a ``--config`` file sets, less those it says were derived (empty without
    one; errors are apply_toml's)."""
    if not path:
        return set()
    try:
        return {k.replace("-", "_") for k in read_toml(path, "--config")} - _toml_derived(path)
    except ShardwiseFileError:
        return set()


def apply_toml(cfg: TrainConfig, path: str) -> TrainConfig:
    """Override ``cfg`` with the keys of TOML file ``path`` (dashes or underscores)."""
    data = read_toml(path, "--config")
    hints = _hints()
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
