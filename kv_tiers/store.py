"""The contract of a tier: a bounded map from a block's chained prefix hash to its payload.

A store is called from worker threads (reads and writes at once) and from the event loop
(`__contains__`), so it keeps its own lock. It never raises for a fault of its medium nor of its
eviction policy: a block it cannot write is not stored (`put` answers False), a block it cannot
read or check is gone (`get` answers None), and the caller computes it again. Each fault is logged
by the store and counted in its `stats`. Which blocks go first to make room is its eviction
policy's choice (`order.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from cadenza.kv_tiers.order import EvictionOrder, TierOrder
from cadenza.kv_tiers.stats import TierStats

__all__ = ["TierStats", "TierStore"]


class TierStore(ABC):
    """Blocks by chained prefix hash, within `size_bytes`; `policy` (an `EvictionPolicy`) says
    which go first (see `order.py`)."""

    name: str = "tier"

    def __init__(self, size_bytes: int, policy: EvictionOrder) -> None:
        if size_bytes <= 0:
            raise ValueError(f"a {self.name} tier needs a positive size, not {size_bytes}")
        self.size_bytes = size_bytes
        self.stats = TierStats()
        self.order = TierOrder(policy, self.name, self.stats)

    @abstractmethod
    def __contains__(self, digest: bytes) -> bool:
        """Whether the tier's index has a block under `digest`, without I/O (it may still fail its
        checks on `get`). Cheap: the event loop asks it."""

    def has(self, digest: bytes) -> bool:
        """Whether the tier has the block, looking past the index on the medium where another
        process may have written it (the disk). May do I/O: call it from a worker thread."""
        return digest in self

    @abstractmethod
    def __len__(self) -> int:
        """Blocks stored."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the stored blocks take (files with their headers, for the disk)."""

    @abstractmethod
    def get(self, digest: bytes) -> bytes | None:
        """The payload stored under `digest`, or None (absent, unreadable or failing a check:
        then it is dropped). Counts a hit, its bytes and its time."""

    @abstractmethod
    def put(self, digest: bytes, payload: bytes, position: int) -> bool:
        """Store `payload` under `digest`, the block at `position` of its sequence (0 holds the
        first tokens), making room by dropping the blocks its policy offers; True if it is stored
        (or already was), False if not: too large, the policy offers no victim (every block pinned)
        or fails, or the medium refuses (counted, never raised)."""
