"""`TierStats`: one tier's counters, plain numbers (`EngineMetrics.kv_tiers` shows them)."""

from __future__ import annotations

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
    writes_skipped: int = 0  # writes not tried: paused, a block larger than the tier, no victim (all pinned)
    corrupt: int = 0  # blocks that failed a check on read (truncated, flipped, another model's)
    read_errors: int = 0  # blocks that could not be read at all
    evicted: int = 0  # blocks dropped to stay within the size bound
    policy_errors: int = 0  # calls to the tier's eviction policy that raised (contained, logged)
