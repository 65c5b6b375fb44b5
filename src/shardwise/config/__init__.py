"""The run configuration: one flat dataclass, TOML files, command-line overrides, validation.

Precedence: dataclass defaults < ``--config FILE.toml`` < explicit flags. Every field is a flag
(``seq_len`` ↔ ``--seq-len``). :func:`validate` checks everything that can be checked without
the data and raises :class:`~shardwise.errors.ShardwiseConfigError` naming the constraint and the fix;
it runs in the launcher and again on every rank before any collective.

One module per job: :mod:`.fields` (:class:`TrainConfig`, :data:`CHOICES`), :mod:`.flags`
(flags and TOML), :mod:`.notes` (derived batching and its note), :mod:`.checks` (:func:`validate`).
"""

from .fields import CHOICES, DERIVABLE, NOT_FLAGS, TrainConfig
from .flags import add_config_flags, apply_toml, from_args
from .notes import batching_note, derive_batching
from .checks import FP32_MAX, MIN_TIMEOUT_S, check_out_writable, check_timeout, validate

__all__ = ["CHOICES", "DERIVABLE", "FP32_MAX", "MIN_TIMEOUT_S", "NOT_FLAGS", "TrainConfig",
           "add_config_flags", "apply_toml", "batching_note", "check_out_writable", "check_timeout",
           "derive_batching", "from_args", "validate"]
