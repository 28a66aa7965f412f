"""`TierOrder`: which block a tier drops first, decided by an eviction-policy plugin.

The policy is an `EvictionPolicy` (policies/eviction.py; runtime/tiers.py builds one per tier from
`cache.host_eviction_policy` and `cache.disk_eviction_policy`). That contract orders int block ids
through their life in a cache; a tier addresses blocks by digest, so this class gives each digest
an id of the tier's own and plays the contract's calls:

- a block written (`add`): `on_cached(id, position)`, then `on_release(id)`: nothing holds a block
  in a tier, so it is evictable at once;
- a block read back (`touch`): `on_acquire(id)`, then `on_release(id)`: one reuse;
- room wanted (`victim`): `pop_victim()` while `len(policy)`; a block the policy never offers stays
  (that is how a policy pins one), so a tier whose every block is pinned has no victim;
- a block gone otherwise (`remove`: a failed check, a file another process removed): `on_evict(id)`.

A policy that raises never fails a request nor the tier agent: the fault is logged (a warning the
first time for each method, then counted in `TierStats.policy_errors`), and the tier falls back: a
block the policy could not take, or room it could not name, is not written (`put` answers False).
Not thread-safe: the tier calls it under its own lock.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import structlog

from cadenza.kv_tiers.stats import TierStats

log = structlog.get_logger(__name__)


class EvictionOrder(Protocol):
    """What a tier calls of an `EvictionPolicy` (whose module this floor may not import)."""

    def on_cached(self, block_id: int, position: int) -> None: ...

    def on_release(self, block_id: int) -> None: ...

    def on_acquire(self, block_id: int) -> None: ...

    def on_evict(self, block_id: int) -> None: ...

    def pop_victim(self) -> int: ...

    def __len__(self) -> int: ...


class TierOrder:
    """A tier's blocks, by digest, in the order its policy evicts them."""

    def __init__(self, policy: EvictionOrder, tier: str, stats: TierStats) -> None:
        self.policy = policy
        self.tier = tier
        self.stats = stats
        self._ids: dict[bytes, int] = {}
        self._digests: dict[int, bytes] = {}
        self._next_id = itertools.count()
        self._warned: set[str] = set()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, digest: bytes, position: int) -> bool:
        """A block entered the tier at `position` of its sequence; False if the policy failed on it
        (then it is not ordered, and the tier must not keep it)."""
        if digest in self._ids:
            return True
        block_id = next(self._next_id)
        try:
            self.policy.on_cached(block_id, position)
            self.policy.on_release(block_id)
        except Exception as exc:
            self._fault("on_cached/on_release", exc)
            self._call("on_evict", block_id)
            return False
        self._ids[digest] = block_id
        self._digests[block_id] = digest
        return True

    def touch(self, digest: bytes) -> None:
        """The block was read back: a reuse (recency, frequency)."""
        block_id = self._ids.get(digest)
        if block_id is not None and self._call("on_acquire", block_id):
            self._call("on_release", block_id)

    def remove(self, digest: bytes) -> None:
        """The block left the tier other than as a victim."""
        block_id = self._ids.pop(digest, None)
        if block_id is not None:
            del self._digests[block_id]
            self._call("on_evict", block_id)

    def victim(self) -> bytes | None:
        """The next block to drop (no longer ordered once returned), or None: the policy offers
        none (every block kept) or failed (logged)."""
        try:
            if len(self.policy) <= 0:
                return None
            block_id = self.policy.pop_victim()
        except Exception as exc:
            self._fault("pop_victim", exc)
            return None
        digest = self._digests.pop(block_id, None) if isinstance(block_id, int) else None
        if digest is None:
            self._fault("pop_victim", LookupError(f"returned {block_id!r}, not a block of this tier"))
            return None
        del self._ids[digest]
        return digest

    def _call(self, method: str, block_id: int) -> bool:
        try:
            getattr(self.policy, method)(block_id)
        except Exception as exc:
            self._fault(method, exc)
            return False
        return True

    def _fault(self, method: str, exc: Exception) -> None:
        self.stats.policy_errors += 1
        if method not in self._warned:
            self._warned.add(method)
            log.warning("KV tier eviction policy failed; the tier skips what it cannot order", tier=self.tier,
                        policy=getattr(self.policy, "name", type(self.policy).__name__), method=method,
                        error=repr(exc))  # fmt: skip
