"""The cache manager: owns KV block ids, reference counts and the prefix cache.

Blocks a request fills completely are registered under a chained hash of their tokens (the hash of
the previous block and this block's tokens), so a later request with the same prefix reuses them
instead of recomputing. A cached block that no request references stays cached until the pool runs
short; the configured eviction policy decides which such block goes first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.messages import (
    AllocateStep,
    BlockGrant,
    BlockNeed,
    CacheMessage,
    Candidate,
    CommitTokens,
    FreeBlocks,
    Offload,
    StepAllocation,
    SyncCache,
    TierMessage,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics
from cadenza.policies.eviction import EvictionPolicy

log = structlog.get_logger(__name__)


def block_hash(parent: bytes | None, tokens: tuple[int, ...] | list[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def salt_root(salt: str | None) -> bytes | None:
    """Where a request's hash chain starts: nothing, or (a `cache_salt`) a digest of the salt, so
    that requests with different salts never find each other's blocks."""
    if salt is None:
        return None
    return hashlib.blake2b(b"cadenza cache salt\0" + salt.encode(), digest_size=16).digest()


def prompt_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained hash of each full block of `token_ids`, as the cache manager computes them for a
    request with `salt`."""
    hashes, parent = [], salt_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def reusable_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks an admission may reuse: it keeps one token
    to compute, as `KVCacheManager.admit` does (what a tier reads back, what a prefill replica sends)."""
    return prompt_hashes(token_ids, block_size, salt)[: max(0, len(token_ids) - 1) // block_size]


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are computed, in order
    hashes: list[bytes] = field(default_factory=list)  # of the leading full blocks
    root: bytes | None = None  # where its hash chain starts (`salt_root` of its cache_salt)
    reserved: int = 0  # tokens the blocks were taken for (computed, or being computed this step)


class KVCacheManager:
    """The synchronous core. `num_available` counts free blocks plus evictable cached ones."""

    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, _Table] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        # (hash, position) of the blocks `commit` cached since the last `take_newly_cached`, kept
        # only when tiers below the KV budget want them written behind (None: not kept).
        self.newly_cached: list[tuple[bytes, int]] | None = None
        self._evictions = [0] * num_blocks  # per block: times its cached contents were evicted for reuse

    # --- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self.policy)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_table(self, request_id: str) -> tuple[int, ...]:
        table = self._tables.get(request_id)
        return tuple(table.blocks) if table else ()

    def slot_usage(self) -> tuple[int, int]:
        """(slots in the blocks requests hold, slots their tokens fill once this step runs).

        The difference is the paged cache's internal waste: the unfilled tail of each request's
        last block. Shared prefix blocks count once per request on both sides (they are full).
        """
        allocated = reserved = 0
        for table in self._tables.values():
            slots = len(table.blocks) * self.block_size
            allocated += slots
            reserved += min(table.reserved, slots)
        return allocated, reserved

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        held = len(self._tables[request_id].blocks) if request_id in self._tables else 0
        return max(0, -(-num_tokens // self.block_size) - held)

    # --- the step -------------------------------------------------------------------------------

    def allocate_step(
        self, running: Sequence[BlockNeed], waiting: Sequence[Candidate], step_id: int = 0
    ) -> StepAllocation:
        """Keep the longest prefix of `running` (best-ranked first) that fits once every request
        ranked below it is released, release the rest, grow the kept tables; then, unless one was
        preempted (it would only preempt again next step), admit the longest prefix of `waiting`
        that fits, so admission stays first come, first refused."""
        kept = self._num_fitting(running)
        preempted = tuple(r.request_id for r in running[kept:])
        for request_id in reversed(preempted):  # the tail first, as it would be preempted one by one
            self.free(request_id)
        grants = []
        for need in running[:kept]:
            self._fit(need.request_id, need.num_tokens)
            grants.append(BlockGrant(need.request_id, self.block_table(need.request_id)))
        admitted: list[BlockGrant] = []
        if not preempted:
            for candidate in waiting:
                grant = self.admit(candidate.request_id, candidate.token_ids, candidate.num_new_tokens,
                                   candidate.max_cached_tokens, candidate.cache_salt)
                if grant is None:
                    break
                admitted.append(grant)
        return StepAllocation(step_id, tuple(grants), preempted, tuple(admitted))

    def _num_fitting(self, running: Sequence[BlockNeed]) -> int:
        """How many of `running` fit when every request ranked below them is released.

        Releasing a request makes available only the blocks no kept request shares, so the count
        follows the reference counts: a block comes back once every reference to it is released.
        """
        need = sum(self.blocks_needed(r.request_id, r.num_tokens) for r in running)
        room = self.num_available
        released: dict[int, int] = {}
        kept = len(running)
        while need > room and kept:
            kept -= 1
            request_id = running[kept].request_id
            need -= self.blocks_needed(request_id, running[kept].num_tokens)
            table = self._tables.get(request_id)
            for block in table.blocks if table else ():
                released[block] = released.get(block, 0) + 1
                if released[block] == self._ref[block]:
                    room += 1
        return kept

    def admit(
        self, request_id: str, tokens: tuple[int, ...], num_new_tokens: int, max_cached_tokens: int | None = None,
        salt: str | None = None,
    ) -> BlockGrant | None:
        """Reuse the longest cached prefix of `tokens` (at most `max_cached_tokens` of them: a
        request owed prompt logprobs computes those positions itself) among the blocks of requests
        with the same `salt` (their `cache_salt`), then cover `num_new_tokens` more; None if no room."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds blocks")
        # Keep at least one token to compute, and never write into a shared block.
        limit = (len(tokens) - 1) // self.block_size
        if max_cached_tokens is not None:
            limit = min(limit, max_cached_tokens // self.block_size)
        root = salt_root(salt)
        hits, hashes = self._match(tokens, root) if limit else ([], [])
        usable = min(len(hits), limit)
        hits, hashes = hits[:usable], hashes[:usable]
        cached_tokens = usable * self.block_size
        target = min(len(tokens), cached_tokens + num_new_tokens)
        evictable_hits = sum(1 for b in hits if self._ref[b] == 0)
        fresh = -(-target // self.block_size) - len(hits)
        if fresh + evictable_hits > self.num_available:
            return None
        table = _Table(tokens=list(tokens[:cached_tokens]), hashes=list(hashes), root=root)
        for block in hits:
            self._acquire(block)
            table.blocks.append(block)
        self._tables[request_id] = table
        self._grow(request_id, target)
        if max_cached_tokens is None or max_cached_tokens >= self.block_size:  # tokens looked up
            self.prefix_queries += len(tokens)
            self.prefix_hits += cached_tokens
        return BlockGrant(request_id, self.block_table(request_id), cached_tokens)

    def commit(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        """Record computed tokens; each block they complete enters the prefix cache."""
        table = self._tables.get(request_id)
        if table is None:
            return  # finished or aborted while its step ran
        table.tokens.extend(token_ids)
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        while len(table.hashes) < len(table.tokens) // size and len(table.hashes) < len(table.blocks):
            index = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else table.root
            digest = block_hash(parent, table.tokens[index * size : (index + 1) * size])
            table.hashes.append(digest)
            block = table.blocks[index]
            if digest not in self._cached and block not in self._hash_of:
                self._cached[digest] = block
                self._hash_of[block] = digest
                self.policy.on_cached(block, index)
                if self.newly_cached is not None:
                    self.newly_cached.append((digest, index))

    def take_newly_cached(self) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
        """The hashes `commit` cached since the last call (when `newly_cached` is kept), and each
        block's position in its sequence."""
        if not self.newly_cached:
            return (), ()
        taken, self.newly_cached = self.newly_cached, []
        hashes, positions = zip(*taken)
        return hashes, positions

    def cached_block(self, digest: bytes) -> int | None:
        """The block cached under `digest`, or None."""
        return self._cached.get(digest)

    def block_epoch(self, block: int) -> int:
        """How many times `block`'s cached contents have been evicted for reuse. A full cached
        block changes only so, so a copy taken while this stays the same is intact: the tier agent
        copies blocks without pinning them (a pin would take blocks from admission)."""
        return self._evictions[block]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        # Tail blocks first: they are the least likely to be shared by a later request.
        for block in reversed(table.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self.policy.on_release(block)
                else:
                    self._free.append(block)

    # --- blocks that move between replicas (prefill/decode disaggregation) ------------------------
    # A `holder` is a table like a request's, under an id of its own, released by `free(holder)`:
    # it keeps blocks from eviction while they are sent (prefill side) or received (decode side).
    # The replica's transfer agent (cluster/kv_transfer.py) calls these on the event loop's thread
    # after `engine.settle()`, so they run between this actor's messages, never inside one.

    def hold_cached(self, holder: str, hashes: Sequence[bytes]) -> tuple[int, ...]:
        """Hold the cached blocks of the leading run of `hashes` that this cache has (chained
        hashes, as `commit` computes them); returns their ids, in order: the prefix the caller
        need not send or receive again."""
        if holder in self._tables:
            raise ValueError(f"{holder} already holds blocks")
        table = _Table()
        for digest in hashes if self.enable_prefix_caching else ():
            block = self._cached.get(digest)
            if block is None:
                break
            self._acquire(block)
            table.blocks.append(block)
            table.hashes.append(digest)
        self._tables[holder] = table
        return tuple(table.blocks)

    def hold_fresh(self, holder: str, count: int) -> tuple[int, ...]:
        """Add up to `count` empty blocks to `holder` (fewer when fewer are available; cached
        blocks no one holds are evicted for them, as for a request); returns their ids."""
        table = self._tables[holder]
        taken = []
        for _ in range(max(0, min(count, self.num_available))):
            block = self._take_block()
            self._ref[block] = 1
            table.blocks.append(block)
            taken.append(block)
        return tuple(taken)

    def cache_held(self, holder: str, hashes: Sequence[bytes]) -> None:
        """`holder`'s blocks after its hashed ones now hold the keys and values the chained
        `hashes` name (received from another replica): they enter the prefix cache, in order, so a
        request with that prompt finds them as a prefix hit. A hash some other block entered
        meanwhile keeps that block; this one then goes back to the free list with the holder."""
        table = self._tables[holder]
        if len(table.hashes) + len(hashes) > len(table.blocks):
            raise ValueError(f"{holder}: {len(hashes)} hashes for {len(table.blocks) - len(table.hashes)} unhashed blocks")
        for digest in hashes:
            index = len(table.hashes)
            table.hashes.append(digest)
            block = table.blocks[index]
            if self.enable_prefix_caching and digest not in self._cached and block not in self._hash_of:
                self._cached[digest] = block
                self._hash_of[block] = digest
                self.policy.on_cached(block, index)

    def holds(self, holder: str) -> bool:
        return holder in self._tables

    # --- internals ------------------------------------------------------------------------------

    def _match(self, tokens: tuple[int, ...], root: bytes | None = None) -> tuple[list[int], list[bytes]]:
        if not self.enable_prefix_caching:
            return [], []
        hits, hashes, parent = [], [], root
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            digest = block_hash(parent, tokens[start : start + size])
            block = self._cached.get(digest)
            if block is None:
                break
            hits.append(block)
            hashes.append(digest)
            parent = digest
        return hits, hashes

    def _acquire(self, block: int) -> None:
        # Every reuse counts (LFU's frequency), not only a revival from the evictable set.
        self.policy.on_acquire(block)
        self._ref[block] += 1

    def _grow(self, request_id: str, num_tokens: int) -> None:
        table = self._tables.setdefault(request_id, _Table())
        table.reserved = max(table.reserved, num_tokens)
        for _ in range(self.blocks_needed(request_id, num_tokens)):
            block = self._take_block()
            self._ref[block] = 1
            table.blocks.append(block)

    def _fit(self, request_id: str, num_tokens: int) -> None:
        """Cover exactly `num_tokens`: grow, or give back tail blocks left empty once a request's
        rejected guesses are rolled back (speculative decoding reserves slots it may not keep)."""
        table = self._tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table.blocks) <= keep:
            self._grow(request_id, num_tokens)
            return
        if num_tokens < len(table.tokens):
            raise ValueError(
                f"request {request_id}: cannot shrink its blocks to {num_tokens} tokens, {len(table.tokens)} are computed"
            )
        # Tail blocks hold no computed token, so none is hashed or shared: straight back to the free list.
        for block in reversed(table.blocks[keep:]):
            self._ref[block] -= 1
            if self._ref[block] or block in self._hash_of:
                raise RuntimeError(f"request {request_id}: tail block {block} is shared or cached")
            self._free.append(block)
        del table.blocks[keep:]
        table.reserved = num_tokens

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block = self.policy.pop_victim()
        del self._cached[self._hash_of.pop(block)]
        self._evictions[block] += 1
        return block

    def check_invariants(self) -> None:
        """Every block is exactly one of: free, evictable, or referenced; nothing leaked."""
        referenced = {b for t in self._tables.values() for b in t.blocks}
        counts: dict[int, int] = {}
        for t in self._tables.values():
            for b in t.blocks:
                counts[b] = counts.get(b, 0) + 1
        assert all(self._ref[b] == counts.get(b, 0) for b in range(self.num_blocks)), "reference counts drifted"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & referenced, "a referenced block is on the free list"
        evictable = {b for b in self._hash_of if self._ref[b] == 0}
        assert len(evictable) == len(self.policy), "the eviction policy lost track of a block"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "a block leaked"


class CacheManagerActor(Actor[CacheMessage]):
    name = "cache_manager"

    def __init__(
        self,
        inbox,
        core: KVCacheManager,
        metrics: EngineMetrics,
        tiers: MemoryObjectSendStream[TierMessage] | None = None,
    ) -> None:
        super().__init__(inbox)
        self.core = core
        self.metrics = metrics
        self.tiers = tiers  # the tier agent's inbox: newly cached blocks are written behind
        if tiers is not None:
            core.newly_cached = []

    async def handle(self, message: CacheMessage) -> None:
        match message:
            case AllocateStep(step_id=step_id, running=running, waiting=waiting, reply=reply):
                async with reply:  # closed even if allocating raises, so the asker never hangs
                    allocation = self.core.allocate_step(running, waiting, step_id)
                    self._report()
                    await reply.send(allocation)
            case CommitTokens(step_id=step_id, entries=entries):
                for request_id, token_ids in entries:
                    self.core.commit(request_id, token_ids)
                self._offload(step_id)
            case FreeBlocks(request_id=request_id):
                self.core.free(request_id)
                self._report()
            case SyncCache(reply=reply):
                async with reply:
                    await reply.send(None)
            case _:
                raise UnexpectedMessageError(self.name, message)

    def requests_concerned(self, message: CacheMessage) -> tuple[str, ...]:
        return ()  # the block pool is shared: a failure here is never one request's alone

    def _offload(self, step_id: int) -> None:
        """Hand the blocks just cached to the tier agent, never waiting: a full inbox drops them."""
        hashes, positions = self.core.take_newly_cached()
        if self.tiers is None or not hashes:
            return
        try:
            self.tiers.send_nowait(Offload(step_id, hashes, positions))
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.metrics.kv_tier_writes_dropped += len(hashes)

    def _report(self) -> None:
        core = self.core
        self.metrics.kv_blocks_total = core.num_blocks
        self.metrics.kv_capacity_tokens = core.num_blocks * core.block_size
        self.metrics.kv_blocks_used = core.num_used
        self.metrics.kv_blocks_cached = core.num_cached_blocks
        self.metrics.prefix_hit_rate = core.prefix_hit_rate
        self.metrics.prefix_cached_tokens = core.prefix_hits
        self.metrics.prefix_queried_tokens = core.prefix_queries
        allocated, filled = core.slot_usage()
        if allocated and allocated >= self.metrics.kv_slots_allocated_peak:
            self.metrics.kv_slots_allocated_peak = allocated
            self.metrics.kv_slots_filled_at_peak = filled
