"""The learner's track: one short standalone script per strategy on the stacked MLP.

``collectives`` (a ring all-reduce from send/recv), ``dp``, ``fsdp``, ``tp``, ``fsdp_tp``, ``pp``
(GPipe and 1F1B). Each imports only torch and :mod:`._common` (never ``shardwise.parallel`` or
``shardwise.comm``), writes every collective as a ``torch.distributed`` call with the scaling
book's sharding notation and its textbook bytes, and is tested equal to one process and to the
framework's ledger (tests/test_learn.py). Run: ``shardwise learn dp --nproc 2`` or
``torchrun --nproc-per-node 2 -m shardwise.learn.dp``. Reading path: README.md, "Learn".
"""
