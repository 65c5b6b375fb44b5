"""The numerics slot of :func:`~.apply.parallelize`: transforms that change how each
``nn.Linear`` computes (a weight fake-quantizer, later FP8 with an FP8 all-gather), applied to
the plain model *before* tensor parallelism. A mixture of experts' stacked expert matmuls are
no ``nn.Linear``: this slot does not reach them.

Why before TP: our TP layers (:mod:`.tp.layers`) replace each ``nn.Linear`` by a module that
calls the linear op itself, so a swap of ``nn.Linear`` classes made afterwards (torchao's
``convert_to_float8_training``) would never reach them. Instead a numerics transform gives each
``nn.Linear`` its ``linear_fn`` (:func:`set_linear_fn`: same signature as ``F.linear``), and
every layer that takes a plain ``nn.Linear`` over — column/row parallel, the vocab-parallel
head, the MLP's — keeps it (:func:`linear_fn_of`). DTensor TP keeps the ``nn.Linear`` itself, so
its forward already calls it; DP, ZeRO, FSDP2 and pipeline stages keep the modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

LinearFn = Callable  # (x [..., in], weight [out, in], bias [out] | None) → [..., out]


def linear_fn_of(linear: nn.Module) -> LinearFn:
    """The linear op ``linear`` computes with: its numerics transform's, else ``F.linear``."""
    return getattr(linear, "linear_fn", F.linear)


def _forward(module: nn.Linear, x):
    return module.linear_fn(x, module.weight, module.bias)


def set_linear_fn(linear: nn.Linear, fn: LinearFn) -> None:
    """Make ``linear`` (an ``nn.Linear``, its class unchanged, so TP plans still match it)
    compute with ``fn`` in its own forward and in the TP layer that takes it over."""
    linear.linear_fn = fn
    linear.forward = _forward.__get__(linear)  # an instance's forward: the class stays


def each_linear(model: nn.Module, make_fn: Callable[[str, nn.Linear], LinearFn]) -> None:
    """A numerics transform over every ``nn.Linear`` of ``model``: ``make_fn(name, linear)``
    gives the op of the linear layer named ``name`` (:func:`set_linear_fn`)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            set_linear_fn(m, make_fn(name, m))
