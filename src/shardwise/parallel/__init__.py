"""Parallel strategies, each a transform over a plain model (see docs/architecture.md).

Read first, in this order (the core every strategy passes through):

1. :mod:`.apply` — :func:`~.apply.parallelize`, the one composition site: a plain model and a
   layout become one engine, in the steps its docstring numbers (transforms, sync, finishers);
2. :mod:`.model` — :class:`~.model.ParallelModel`, the one engine those pieces make up, and
   what the train step, ``verify``, ``trace`` and checkpoints ask of it;
3. :mod:`.sync` — :class:`~.sync.Sync`, the gradient-sync protocol (:class:`~.sync.NoSync`:
   nothing to reduce) that every dp and zero class implements;
4. :mod:`.params` — where each parameter's elements live (:class:`~.params.Placement`) and the
   rules that read it: the gradient norm, the reduce dtypes, this rank's bytes;
5. :mod:`.layout` — :class:`~.layout.Layout` and :meth:`~.layout.Layout.check`, the one place
   a layout is refused;
6. :mod:`.views` — full shape ⇄ what this rank holds (:func:`~.views.to_full`,
   :func:`~.views.to_local`), for parity checks and checkpoints;
7. :mod:`.materialize` — a model built on the meta device becomes this rank's shards.

Then a strategy folder, :mod:`.dp`, :mod:`.zero`, :mod:`.tp`, :mod:`.pp`, :mod:`.cp`,
:mod:`.ep`: each ``__init__`` maps its ``learn/`` script's names to its classes ("From learn/").
:mod:`.muon`: the Muon optimizer over every layout.

From learn/ (``learn/fsdp_tp.py``: two axes composed; each axis's names in zero/ and tp/):

* ``rank = x·Y + y``, ``dist.new_group`` → :class:`shardwise.topology.Topology`: the ranks as
  one grid (pp, dp, cp, tp), tp innermost, one process group per axis
* ``tp_group``, ``dp_group`` → :meth:`shardwise.topology.Topology.group` ("tp", "dp")
* FSDP over X of each TP shard → :func:`~.apply.parallelize`: TP first, then the sync over dp
"""
