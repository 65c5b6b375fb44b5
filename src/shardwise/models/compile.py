"""``--compile``: ``torch.compile`` each transformer block, not the whole model.

One compiled region per block (torchtitan's ``apply_compile``): identical blocks share one
compiled graph (dynamo inlines ``nn.Module``s and passes their parameters as graph inputs, so
block i reuses block 0's code; ``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` is 1
for the dense Llama), compile time does not grow with depth, and everything between blocks — the
embedding, the loss, the pipeline runtime, the gradient sync — stays eager Python.

What is compiled is the block's ``forward`` *method*, set on the instance
(``block.forward = torch.compile(block.forward)``), not ``nn.Module.__call__``. So:

* module hooks stay eager and fire exactly as before: ZeRO-3's pre-forward all-gather and
  post-forward free (and the identity autograd node it wraps the block's output in, whose
  backward re-gathers the block before its backward), FSDP2's ``fully_shard`` hooks, DDP's;
* parameter hooks stay eager: the compiled backward (AOT autograd) returns the parameters'
  gradients to the autograd engine, whose ``AccumulateGrad`` nodes run outside the compiled
  graph, so DP's post-accumulate-grad hooks (bucket all-reduces launched during backward)
  fire per parameter as in eager mode;
* parameter names and ``state_dict`` keys are unchanged (no ``_orig_mod.`` prefix, the
  nanoGPT pitfall), so checkpoints of compiled and eager runs are interchangeable;
* activation checkpointing (:mod:`.ac`) is inside the compiled region: dynamo turns
  ``torch.utils.checkpoint`` into a higher-order op and the partitioner recomputes in the
  compiled backward (``selective`` keeps its policy; :func:`.ac.checkpoint_block`).

Refused (:func:`check_compile`, on every rank before any collective), because the block's
forward then issues collectives or data-dependent control flow that a full-graph compile of the
block cannot hold: tensor parallelism (Megatron f/g collectives inside attention and MLP;
DTensor), context parallelism (ring / all-gather attention inside the core), expert
parallelism and MoE models (all-to-all dispatch, routing counts read on the host). These run
eager — without ``--compile``. See docs/compile.md.
"""

from __future__ import annotations

from torch import nn

from ..errors import ShardwiseConfigError
from .ac import CheckpointedBlock


def check_compile(*, tp: int = 1, cp: int = 1, ep: int = 1, moe: bool = False,
                  pp: int = 1, schedule: str = "1f1b") -> None:
    """Raise :class:`ShardwiseConfigError` naming the constraint and the fix when ``--compile``
    cannot compile the blocks of this layout (module docstring): tp, cp or ep > 1, an MoE
    model, or a zero-bubble pipeline schedule (zb-h1, zbv, dualpipev: it runs each block's backward as two autograd
    passes, input then weight gradients, and a compiled block's backward is one graph that
    computes both). Runs on every rank before any collective (:func:`shardwise.config.validate`)."""
    why = []
    if tp > 1:
        why.append(f"--tp {tp} (tensor-parallel collectives inside each block)")
    if cp > 1:
        why.append(f"--cp {cp} (context-parallel attention communicates inside each block)")
    if ep > 1 or moe:
        why.append("a mixture-of-experts model (token routing: all-to-all and host-side "
                   "counts inside each block)")
    if pp > 1 and schedule in ("zb-h1", "zbv", "dualpipev"):
        why.append(f"--schedule {schedule} (its split backward needs two autograd passes per "
                   f"block)")
    if why:
        raise ShardwiseConfigError(
            "--compile compiles each transformer block as one graph, which cannot hold "
            + "; ".join(why) + ": drop --compile for this layout (it runs eager), or compile a "
            "layout with tp = cp = ep = 1 and a dense model (dp, ZeRO 1-3, HSDP, pp with "
            "gpipe/1f1b/interleaved-1f1b; docs/compile.md)")


def compile_blocks(model: nn.Module, *, fullgraph: bool = True, **compile_kwargs) -> int:
    """Compile the ``forward`` of every block of ``model`` (each submodule with the
    :class:`~.ac.CheckpointedBlock` mixin) with ``torch.compile(…, fullgraph=fullgraph,
    **compile_kwargs)``, in place; call it after ``parallelize`` on the engine's module (the
    strategies keep the block objects). Returns how many blocks were compiled (0: nothing to
    compile, e.g. a model without blocks). Idempotent: an already compiled block is skipped.
    Compilation itself happens at each block's first call (and again when its input shapes,
    dtype or grad mode change)."""
    import torch

    n = 0
    for m in model.modules():
        if isinstance(m, CheckpointedBlock) and not getattr(m, "_shardwise_compiled", False):
            m.forward = torch.compile(m.forward, fullgraph=fullgraph, **compile_kwargs)
            m._shardwise_compiled = True
            n += 1
    return n
