"""Parallel strategies, each a transform over a plain model (see docs/architecture.md).

Read first, in this order (the core every strategy passes through):

1. :mod:`.apply` — :func:`~.apply.parallelize`, the one composition site: a plain model and a
   layout become one engine in the steps its docstring numbers (check, transforms, runner,
   loss, gradient sync, finishers);
2. :mod:`.engines` — :class:`~.engines.Explicit` and :class:`~.engines.Torch`: each engine's
   constructors for those steps, so ``parallelize`` holds no ``if engine``;
3. :mod:`.model` — :class:`~.model.ParallelModel`, the engine the pieces make up: what the train
   step, ``verify``, ``trace`` and checkpoints ask of it;
4. :mod:`.runner` — the :class:`~.runner.Runner` protocol and pp = 1's micro-batch loop,
   :class:`~.runner.NoPipelining` (a pipeline's runners are in :mod:`.pp`);
5. :mod:`.loss` — the loss protocol's defaults, :class:`~.loss.PlainLoss`, and
   :func:`~.loss.autocast`;
6. :mod:`.sync` — :class:`~.sync.Sync`, the gradient-sync protocol every dp and zero class
   implements (:class:`~.sync.NoSync`: nothing to reduce);
7. :mod:`.params` — where each parameter's elements live (:class:`~.params.Placement`) and the
   rules that read it: the gradient norm, the reduce dtype, this rank's bytes;
8. :mod:`.layout` — :class:`~.layout.Layout` and :meth:`~.layout.Layout.check`, the one place
   a layout is refused;
9. :mod:`.views` — full shape ⇄ what this rank holds (:func:`~.views.to_full`,
   :func:`~.views.to_local`), for parity checks and checkpoints;
10. :mod:`.materialize` — a model built on the meta device becomes this rank's shards
    (:class:`~.materialize.Values`: where the values come from, decided once);
11. :mod:`.numerics` — the slot for numerics transforms (a linear op per ``nn.Linear``, kept
    by the TP layers); the precision of every piece is one record,
    :class:`shardwise.precision.Precision`.

Then a strategy folder, :mod:`.dp`, :mod:`.zero`, :mod:`.tp`, :mod:`.pp`, :mod:`.cp`,
:mod:`.ep`: each ``__init__`` maps its ``learn/`` script's names to its classes ("From learn/").
:mod:`.muon`: the Muon optimizer over every layout.

From learn/ (``learn/fsdp_tp.py``: two axes composed; each axis's names in zero/ and tp/):

* ``rank = x·Y + y``, ``dist.new_group`` → :class:`shardwise.topology.Topology`: the ranks as
  one grid (pp, dp, cp, tp), tp innermost, one process group per axis
* ``tp_group``, ``dp_group`` → :meth:`shardwise.topology.Topology.group` ("tp", "dp")
* FSDP over X of each TP shard → :func:`~.apply.parallelize`: TP first, then the sync over dp
"""
