"""The tier agent: the prefix cache's tiers below the KV budget (host memory, disk), kept beside it.

Write-behind: each block the cache manager caches (`Offload`, sent without waiting, with the
block's position in its sequence for the tiers' eviction policies) is queued here,
at most `max_pending_writes` blocks (more are dropped and counted). The write loop takes a batch,
drops those every tier has by now (another replica sharing the disk tier may have written them: asked
past the index, in a worker thread), notes each block's id and epoch, gathers their bytes in a worker
thread, then keeps only the copies
of blocks still cached under their hash with the same epoch (`KVCacheManager.block_epoch`: a block
evicted and reused meanwhile may have been overwritten mid-copy), and writes each to every tier that
lacks it, in a worker thread. A block already in every tier is not written again. The blocks are
not pinned while copied: a pin takes blocks from admission, and with nothing running the scheduler
would fail a request that did not fit beside the pins (seen in tests/test_kv_tiers.py).

Read-back: a new request with more than one block of prompt (and a preempted one, for its prompt and
output so far) waits outside the scheduler's queue
(its gate) while this agent looks its prompt's chained hashes up: past the run cached in memory, the
leading run found in a tier (looked up in a worker thread: the disk tier may look past its index
for files another replica wrote) is read into fresh blocks (a worker thread reads and scatters them),
which enter the prefix cache; then `TierReadDone` opens the gate, and the request's admission finds
the blocks as prefix hits. So its TTFT counts the read, never a recompute. A read takes at most half
the blocks available, so running requests keep room to grow. A block that is missing, unreadable or
fails a check ends the run there: the rest is computed. Nothing here fails a request.

The cache manager's core is called on the event loop's thread between its actor's messages (each
call is synchronous), as cluster/kv_transfer.py does; only copies and file work run in threads.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import anyio
import structlog
import torch
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.cache_manager import KVCacheManager, reusable_hashes
from cadenza.actors.messages import (
    Offload,
    ReadBack,
    SchedulerMessage,
    TierMessage,
    TierReadDone,
    UnexpectedMessageError,
)
from cadenza.kv_connectors.blocks import block_nbytes, gather_blocks, scatter_blocks
from cadenza.kv_tiers.store import TierStore
from cadenza.metrics import EngineMetrics

log = structlog.get_logger(__name__)

MAX_PENDING_WRITES = 4096  # blocks queued for write-behind; more are dropped
WRITE_BATCH = 64  # blocks pinned and gathered at once


class TierAgent(Actor[TierMessage]):
    name = "kv_tiers"

    def __init__(
        self,
        inbox,
        core: KVCacheManager,
        tensors: Sequence[torch.Tensor],
        tiers: Sequence[TierStore],
        *,
        scheduler: MemoryObjectSendStream[SchedulerMessage],
        metrics: EngineMetrics,
        max_pending_writes: int = MAX_PENDING_WRITES,
    ) -> None:
        super().__init__(inbox)
        if not tiers:
            raise ValueError("a tier agent needs at least one tier")
        self.core = core
        self.tensors = list(tensors)
        self.block_bytes = block_nbytes(self.tensors)
        self.tiers = list(tiers)  # fastest first: reads try them in order
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_pending_writes = max_pending_writes
        self._writes: deque[tuple[bytes, int]] = deque()  # (hash, position)
        self._queued: set[bytes] = set()
        self._write_ready: anyio.Event | None = None  # made on the event loop, in `run`
        self._tg: TaskGroup | None = None
        for tier in self.tiers:
            metrics.kv_tiers[tier.name] = tier.stats

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self._write_ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._write_loop)
            try:
                await super().run(task_status=task_status)
            finally:
                tg.cancel_scope.cancel()  # the inbox closed or the engine stops: queued writes are dropped

    async def handle(self, message: TierMessage) -> None:
        match message:
            case ReadBack(request_id=request_id, prompt_token_ids=token_ids, cache_salt=salt):
                self._tg.start_soon(self._read_back, request_id, token_ids, salt)
            case Offload(hashes=hashes, positions=positions):
                self._queue_writes(hashes, positions)
            case _:
                raise UnexpectedMessageError(self.name, message)

    def requests_concerned(self, message: TierMessage) -> tuple[str, ...]:
        return ()

    # --- read-back -----------------------------------------------------------------------------

    async def _read_back(self, request_id: str, token_ids: tuple[int, ...], salt: str | None) -> None:
        """Read what the tiers have of the prompt's prefix into the cache, then open its gate."""
        num_blocks = 0
        try:
            num_blocks = await self._read_prefix(request_id, token_ids, salt)
        except Exception as exc:  # a tier's fault never fails the request: it computes instead
            log.warning("KV tier read failed; computing the prefix", request_id=request_id, error=repr(exc))
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.scheduler.send(TierReadDone(request_id, num_blocks))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the engine is stopping: nobody waits for the gate

    async def _read_prefix(self, request_id: str, token_ids: tuple[int, ...], salt: str | None) -> int:
        hashes = reusable_hashes(token_ids, self.core.block_size, salt)
        if not hashes or not self.core.enable_prefix_caching:
            return 0
        holder = f"kv-tier-read:{request_id}"
        # Hold the prefix cached in memory too: it must not be evicted while the rest is read.
        in_memory = len(self.core.hold_cached(holder, hashes))
        try:
            wanted = await anyio.to_thread.run_sync(self._leading_run, hashes[in_memory:])
            wanted = wanted[: self.core.num_available // 2]
            if not wanted:
                return 0
            blocks = self.core.hold_fresh(holder, len(wanted))
            started = time.perf_counter()
            found = await anyio.to_thread.run_sync(self._read_blocks, wanted[: len(blocks)], in_memory, blocks)
            self.core.cache_held(holder, wanted[:found])
            self.metrics.kv_tier_blocks_read += found
            log.debug("Read back from KV tiers", request_id=request_id, in_memory=in_memory, blocks=found,
                      wanted=len(wanted), seconds=round(time.perf_counter() - started, 4))  # fmt: skip
            return found
        finally:
            self.core.free(holder)  # read blocks stay cached, unread ones go back to the free list

    def _leading_run(self, hashes: list[bytes]) -> list[bytes]:
        """In a worker thread: the leading run of `hashes` some tier has."""
        run = []
        for digest in hashes:
            if not any(tier.has(digest) for tier in self.tiers):
                break
            run.append(digest)
        return run

    def _read_blocks(self, hashes: list[bytes], first: int, blocks: tuple[int, ...]) -> int:
        """In a worker thread: read the leading run of `hashes` (the first at position `first` of
        its sequence) into `blocks`; how many were read."""
        payloads = []
        for position, digest in enumerate(hashes, first):
            payload = self._read_one(digest, position)
            if payload is None:
                break
            payloads.append(payload)
        # One block a call: a payload of several blocks lays them out tensor by tensor, not block by block.
        for block, payload in zip(blocks, payloads):
            scatter_blocks(self.tensors, [block], torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return len(payloads)

    def _read_one(self, digest: bytes, position: int) -> bytes | None:
        """A block's payload from the first tier that has a valid one (copied up to the faster
        tiers that lack it), or None."""
        for i, tier in enumerate(self.tiers):
            payload = tier.get(digest)
            if payload is None:
                continue
            if len(payload) != self.block_bytes:  # the identity should make this impossible
                log.warning("A KV tier block has the wrong size; computing it", tier=tier.name, bytes=len(payload),
                            expected=self.block_bytes)  # fmt: skip
                tier.stats.corrupt += 1
                continue
            for faster in self.tiers[:i]:
                faster.put(digest, payload, position)
            return payload
        return None

    # --- write-behind --------------------------------------------------------------------------

    def _queue_writes(self, hashes: tuple[bytes, ...], positions: tuple[int, ...]) -> None:
        for digest, position in zip(hashes, positions):
            if digest in self._queued or all(digest in tier for tier in self.tiers):
                continue
            if len(self._writes) >= self.max_pending_writes:
                self.metrics.kv_tier_writes_dropped += 1
                continue
            self._writes.append((digest, position))
            self._queued.add(digest)
        if self._writes and self._write_ready is not None:
            self._write_ready.set()

    async def _write_loop(self) -> None:
        while True:
            await self._write_ready.wait()
            self._write_ready = anyio.Event()
            while self._writes:
                batch = [self._writes.popleft() for _ in range(min(WRITE_BATCH, len(self._writes)))]
                try:
                    await self._write_batch(batch)
                except Exception as exc:
                    log.warning("KV tier write-behind failed; blocks not written", blocks=len(batch), error=repr(exc))
                finally:
                    self._queued.difference_update(d for d, _ in batch)

    async def _write_batch(self, batch: list[tuple[bytes, int]]) -> None:
        # Another replica on the same disk tier may have written some of them since they were
        # queued: asked first, past the index (a stat a block), so that only what a tier lacks is copied.
        batch = await anyio.to_thread.run_sync(self._lacking, batch)
        core = self.core
        live = [(d, n, b, core.block_epoch(b)) for d, n in batch if (b := core.cached_block(d)) is not None]
        if not live:  # evicted before their turn: gone
            return
        payloads = await anyio.to_thread.run_sync(self._gather, tuple(b for _, _, b, _ in live))
        intact = [(d, n, p) for (d, n, b, e), p in zip(live, payloads)
                  if core.cached_block(d) == b and core.block_epoch(b) == e]  # fmt: skip
        self.metrics.kv_tier_writes_dropped += len(live) - len(intact)
        if intact:
            await anyio.to_thread.run_sync(self._write_blocks, intact)

    def _lacking(self, batch: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """In a worker thread: the blocks of `batch` that some tier lacks, looking past each
        tier's index (the disk tier adopts a file another replica wrote)."""
        return [(d, n) for d, n in batch if not all(tier.has(d) for tier in self.tiers)]

    def _gather(self, blocks: tuple[int, ...]) -> list[bytes]:
        """In a worker thread: each block's payload (one a call, as `_read_blocks` scatters them)."""
        return [gather_blocks(self.tensors, [block]).cpu().numpy().tobytes() for block in blocks]

    def _write_blocks(self, blocks: list[tuple[bytes, int, bytes]]) -> None:
        """In a worker thread: each block's bytes (hash, position, payload) to every tier that
        lacks them (a tier that cannot take one, full of pinned blocks say, skips it)."""
        for digest, position, payload in blocks:
            for tier in self.tiers:
                if digest not in tier:
                    tier.put(digest, payload, position)
