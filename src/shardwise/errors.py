"""Errors shardwise raises on bad input.

Every check that can fail on user input raises :class:`ShardwiseConfigError` with a message that
names the constraint that was broken and how to fix it, e.g.
``"--global-batch 10 is not divisible by dp × micro-batch = 2 × 4 = 8: choose a multiple of 8"``.
Checks run on every rank before any collective, so a bad input never leaves a rank waiting.
"""


class ShardwiseConfigError(ValueError):
    """Bad configuration or input data. The message names the constraint and the fix."""


class CollectiveTimeout(ShardwiseConfigError):
    """A collective of :mod:`shardwise.comm` did not complete within the process group's
    timeout. The message names the collective (op, axis, tag, dtype, shape, group size, the
    timeout); the usual cause is a collective called from a subset of the ranks (e.g. a
    checkpoint save on rank 0 only) or collectives called in different orders on different
    ranks. Raised chained to torch.distributed's own error (``__cause__``)."""


class CollectiveMismatch(ShardwiseConfigError):
    """The ranks of a group issued different collectives (``--check-collectives step|every``,
    :mod:`shardwise.comm.fingerprint`): one rank called a collective its peers did not, or with
    another op, shape, dtype, tag or reduce op. Raised on every rank with one message naming the
    first diverging sequence number and what each rank issued there, e.g. ``rank 1 called
    all_reduce(dp, extra, float32[4]) where rank 0 issued no collective (reached the check
    before step 4), at collective #7 on dp (ranks 0,1) in step 3: …`` and the fix."""


class CollectiveHang(CollectiveTimeout):
    """A rank waited longer than ``--hang-after`` seconds for its peers (in a collective of
    :mod:`shardwise.comm` or at the collective check). The message gives every rank's position
    (which collective or check it waits in; which ranks reported nothing: stuck in compute, or
    dead) and where the flight records are (``RUN/flight/rank{r}.json``)."""


class ShardwiseFileError(ShardwiseConfigError):
    """A file the user named (``--config``, ``--model``, ``--cluster``, ``--data``) or a run wrote
    is missing or not valid JSON, JSON lines or TOML (:mod:`shardwise.readers`). The message
    names the flag or the file's role, the path, what is wrong (with the parser's line and
    column) and, where one is given, the fix."""
