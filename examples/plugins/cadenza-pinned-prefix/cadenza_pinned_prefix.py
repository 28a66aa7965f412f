"""cadenza-pinned-prefix: an eviction policy that keeps the shared system prompt's KV blocks cached.

Every request of a chat deployment usually starts with the same system prompt, so its first blocks
are the most valuable ones in the prefix cache; plain LRU evicts them as soon as a burst of other
requests has gone by. This policy splits evictable blocks in two tiers:

- *pinned*: blocks at positions `< pinned_blocks` of their sequence (the cache manager tells
  `on_cached` each block's position). They are evicted only when no other evictable block is left,
  the least reused first (the shared system prompt is reused by every request, a one-off prompt's
  first blocks once), then the least recently released;
- *unpinned*: every other block, evicted least recently released first (LRU).

In the KV budget pinned blocks are never held back from a request that needs the room: "evicted
last" rather than "never evicted", so a cache full of pinned blocks cannot leave requests
unschedulable. In a tier below it (`cache.host_eviction_policy` or `cache.disk_eviction_policy`:
pinned_prefix), the tiers listed in `kept_in` never evict pinned blocks: they are left out of the
evictable blocks (the contract lets a tier keep what its policy never offers), so a system prompt
survives any amount of other traffic and every restart, and a tier full of pinned blocks skips new
writes (its `writes_skipped` counts them) instead of dropping one.

Deployment: `cache: {eviction_policy: pinned_prefix, disk_eviction_policy: pinned_prefix}` and
`plugin_options: {pinned_prefix: {pinned_blocks: 4, kept_in: [disk]}}`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.eviction import KeyedEvictionPolicy

__version__ = "0.1.0"


class PinnedPrefixOptions(BaseModel):
    """The deployment's `plugin_options.pinned_prefix`."""

    model_config = ConfigDict(extra="forbid")

    pinned_blocks: int = Field(4, ge=0, description="Leading blocks of every sequence that are evicted last.")
    kept_in: list[Literal["host", "disk"]] = Field(
        default_factory=list, max_length=2,
        description="Tiers below the KV budget that never evict pinned blocks (where this policy orders them: "
        "cache.host_eviction_policy, cache.disk_eviction_policy); a tier full of them skips new writes. "
        "Elsewhere, the KV budget included, pinned blocks are evicted last.",
    )


class PinnedPrefixPolicy(KeyedEvictionPolicy):
    """LRU for most blocks; a sequence's first `pinned_blocks` blocks go last, least reused first,
    or (in a tier of `kept_in`) never."""

    name = "pinned_prefix"
    options_model = PinnedPrefixOptions

    def __init__(self, options: PinnedPrefixOptions | None = None) -> None:
        super().__init__(options)
        self._pinned: set[int] = set()
        self._uses: dict[int, int] = {}  # pinned blocks only: how many requests used them

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    @property
    def keeps_pinned(self) -> bool:
        """Whether pinned blocks are never offered: in a tier `kept_in` names (`tier` is set by cadenza)."""
        return self.tier is not None and self.tier in self.options.kept_in

    def on_cached(self, block_id: int, position: int) -> None:
        if position < self.options.pinned_blocks:
            self._pinned.add(block_id)
            self._uses[block_id] = 1

    def on_release(self, block_id: int) -> None:
        if block_id in self._pinned and self.keeps_pinned:
            return  # never evictable here: not in the order, not counted by __len__
        super().on_release(block_id)

    def on_acquire(self, block_id: int) -> None:
        super().on_acquire(block_id)
        if block_id in self._pinned:
            self._uses[block_id] += 1

    def key(self, block_id: int) -> tuple:
        # Unpinned (0) before pinned (1); pinned ones least reused first; ties: released first.
        pinned = block_id in self._pinned
        return (int(pinned), self._uses[block_id] if pinned else 0)

    def forget(self, block_id: int) -> None:
        self._pinned.discard(block_id)
        self._uses.pop(block_id, None)


@hookimpl
def register_eviction_policies(register) -> None:
    register(PinnedPrefixPolicy.name, PinnedPrefixPolicy)
