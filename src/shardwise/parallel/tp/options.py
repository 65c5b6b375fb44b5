"""The options of tensor parallelism: one record, one argument to every function of :mod:`.tp`.

A layout builds it once (:attr:`shardwise.parallel.layout.Layout.tp_options`) and the
transform, its layers, the loss and the byte formulas read what they need from it, so an option
TP gains later is a field here, not a new parameter of every function of ``tp/``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TPOptions:
    """How tensor parallelism runs, beyond its degree (the size of the topology's tp axis).

    * ``sp`` — sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
      Recomputation in Large Transformer Models", arXiv 2205.05198, §4.2.2): between the TP
      regions the activations are sharded over the tp ranks along the sequence ([b, s/n, d]
      instead of replicated [b, s, d]); each region is entered by an all-gather and left by a
      reduce-scatter instead of Megatron's f (identity, all-reduce backward) and g (all-reduce),
      and the tp-replicated parameters' gradients (the norms) are summed over tp once per step
      (``sp_grad``). Needs tp > 1 and tp dividing the sequence length.

    A later option joins here as a field with a default that keeps today's behaviour: async TP
    (torchtitan's ``enable_async_tensor_parallel``, Megatron's ``--tp-comm-overlap``: the
    all-gather / reduce-scatter of a region overlapped with its matmuls) would be one more
    ``bool``, read where the regions are entered and left, not a new parameter of every
    function of ``tp/``."""

    sp: bool = False
