"""The contract of a tier: a bounded map from a block's chained prefix hash to its payload.

A store is called from worker threads (reads and writes at once) and from the event loop
(`__contains__`), so it keeps its own lock. It never raises for a fault of its medium: a block it
cannot write is not stored (`put` answers False), a block it cannot read or check is gone (`get`
answers None), and the caller computes it again. Each fault is logged by the store and counted in
its `stats`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class TierStats:
    """One tier's counters: written by the store, read by anyone (plain numbers)."""

    hits: int = 0  # blocks read back
    bytes_read: int = 0
    read_seconds: float = 0.0  # time spent reading the blocks that hit
    blocks_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0  # writes the medium refused (a full disk, say)
    writes_skipped: int = 0  # writes not tried: paused after an error, or a block larger than the tier
    corrupt: int = 0  # blocks that failed a check on read (truncated, flipped, another model's)
    read_errors: int = 0  # blocks that could not be read at all
    evicted: int = 0  # blocks dropped to stay within the size bound


class TierStore(ABC):
    """Blocks by chained prefix hash, within `size_bytes`; least recently used go first."""

    name: str = "tier"

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"a {self.name} tier needs a positive size, not {size_bytes}")
        self.size_bytes = size_bytes
        self.stats = TierStats()

    @abstractmethod
    def __contains__(self, digest: bytes) -> bool:
        """Whether the tier has a block under `digest` (it may still fail its checks on `get`)."""

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
    def put(self, digest: bytes, payload: bytes) -> bool:
        """Store `payload` under `digest`, making room by dropping the least recently used blocks;
        True if it is stored (or already was), False if not (never raises for the medium)."""
