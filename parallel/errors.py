"""The errors scale-out raises, each naming what does not fit or which rank failed."""

from __future__ import annotations


class ParallelError(RuntimeError):
    """Base of scale-out errors."""


class ShardingError(ParallelError, ValueError):
    """The model cannot be split this way (say, more ranks than attention heads)."""


class RankFailedError(ParallelError):
    """A rank died or a collective operation failed or timed out; the group is unusable."""


class ReplicaFailedError(ParallelError):
    """A data-parallel replica process died or stopped answering."""
