"""Eviction policies for cached KV blocks, and the built-in `lru`, `lfu` and `fifo`.

The cache manager keeps full blocks in a prefix cache after their requests finish. A block whose
reference count is zero is *evictable*; when the pool runs out of free blocks, the cache manager asks
the policy for a victim. The policy only orders block ids; it never touches KV memory. The tiers
below the KV budget (kv_tiers/: host memory, disk) are ordered by policies of the same contract,
one instance per tier (`cache.host_eviction_policy`, `cache.disk_eviction_policy`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import BaseModel

from cadenza.plugins.hookspecs import hookimpl


class EvictionPolicy(ABC):
    """Orders evictable cached blocks.

    Call order per block: `on_cached` once when the block enters the prefix cache; `on_release` each
    time it becomes evictable (no request holds it); `on_acquire` on every prefix hit, whether the
    block was evictable (it no longer is) or already held by other requests; and
    `on_evict`/`pop_victim` when it leaves the cache.
    `pop_victim` is only called when `len(policy) > 0` and returns an evictable block id.
    A policy with an `options_model` is built with `options=` from the config's
    `plugin_options[name]`; others are built with no arguments.

    In a tier below the KV budget (`tier` is "host" or "disk"; kv_tiers/order.py) the ids are the
    tier's own, no request holds a block: a write is `on_cached` then `on_release`, a read back
    `on_acquire` then `on_release`, a block dropped after a failed check or removed by another
    process `on_evict`. There a block the policy never offers (left out of `__len__`) is kept:
    a tier whose every block is kept refuses new ones. A policy's exception there is logged and
    the tier falls back (the write is skipped); it never fails a request.
    """

    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None] = None
    # Which cache this instance orders: None, the KV budget; "host" or "disk", that tier. Set by
    # cadenza after `__init__`, before the first call.
    tier: str | None = None

    def __init__(self, options: BaseModel | None = None) -> None:
        if options is None and self.options_model is not None:
            options = self.options_model()
        self.options = options

    @abstractmethod
    def on_cached(self, block_id: int, position: int) -> None:
        """The block entered the prefix cache; `position` is its index in its sequence (0 holds
        the first `block_size` tokens), the same for every sequence that shares it."""

    @abstractmethod
    def on_release(self, block_id: int) -> None:
        """No request holds the block any more: it is evictable from now on."""

    @abstractmethod
    def on_acquire(self, block_id: int) -> None:
        """A request reuses the block (a prefix hit): it is not evictable while held."""

    @abstractmethod
    def on_evict(self, block_id: int) -> None:
        """The block left the cache for another reason (e.g. it was overwritten)."""

    @abstractmethod
    def pop_victim(self) -> int:
        """Remove and return the evictable block to evict next."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""


class KeyedEvictionPolicy(EvictionPolicy):
    """A base for policies that evict in ascending order of a per-block key (ties: first released).

    Subclasses implement `on_cached` and `key(block_id)`, a tuple computed when the block is
    released (so it may use counts gathered in `on_acquire`), and may override `forget(block_id)`
    to drop their own per-block state when the block leaves the cache. The heap, the lazy removal
    of re-acquired blocks and `pop_victim` / `__len__` are done here.
    """

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._evictable: dict[int, tuple] = {}
        self._heap: list[tuple] = []
        self._counter = itertools.count()

    @abstractmethod
    def key(self, block_id: int) -> tuple:
        """The block's eviction key, smallest evicted first; asked once per release."""

    def on_release(self, block_id: int) -> None:
        entry = (*self.key(block_id), next(self._counter), block_id)
        self._evictable[block_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._evictable) + 64:
            # Stale entries (blocks re-acquired since) would otherwise pile up on every prefix hit
            # until an eviction happened to pop them; rebuild from the live ones, order unchanged.
            self._heap = list(self._evictable.values())
            heapq.heapify(self._heap)

    def on_acquire(self, block_id: int) -> None:
        self._evictable.pop(block_id, None)  # the heap entry goes stale and is skipped later

    def pop_victim(self) -> int:
        while self._heap:
            entry = heapq.heappop(self._heap)
            block_id = entry[-1]
            if self._evictable.get(block_id) == entry:
                del self._evictable[block_id]
                self.forget(block_id)
                return block_id
        raise LookupError("no evictable block")

    def on_evict(self, block_id: int) -> None:
        self._evictable.pop(block_id, None)
        self.forget(block_id)

    def forget(self, block_id: int) -> None:
        """Drop per-block bookkeeping once the block leaves the cache."""

    def __len__(self) -> int:
        return len(self._evictable)


class LRUPolicy(KeyedEvictionPolicy):
    """Least recently used: the block released longest ago goes first."""

    name = "lru"

    def on_cached(self, block_id: int, position: int = 0) -> None:
        pass

    def key(self, block_id: int) -> tuple:
        return ()


class FIFOPolicy(KeyedEvictionPolicy):
    """First in, first out: the block cached earliest goes first, however often it was reused."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._cached_at: dict[int, int] = {}
        self._clock = itertools.count()

    def on_cached(self, block_id: int, position: int = 0) -> None:
        self._cached_at[block_id] = next(self._clock)

    def key(self, block_id: int) -> tuple:
        return (self._cached_at.get(block_id, -1),)

    def forget(self, block_id: int) -> None:
        self._cached_at.pop(block_id, None)


class LFUPolicy(KeyedEvictionPolicy):
    """Least frequently used: the block reused fewest times goes first (ties: least recent)."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[int, int] = {}

    def on_cached(self, block_id: int, position: int = 0) -> None:
        self._uses[block_id] = 1

    def on_acquire(self, block_id: int) -> None:
        super().on_acquire(block_id)
        self._uses[block_id] = self._uses.get(block_id, 0) + 1

    def key(self, block_id: int) -> tuple:
        return (self._uses.get(block_id, 0),)

    def forget(self, block_id: int) -> None:
        self._uses.pop(block_id, None)


@hookimpl
def register_eviction_policies(register) -> None:
    for policy in (LRUPolicy, LFUPolicy, FIFOPolicy):
        register(policy.name, policy)
