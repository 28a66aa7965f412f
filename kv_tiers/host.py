"""`HostTier`: blocks in host memory, a bounded map in its eviction policy's order (for GPU
deployments, where host memory is far larger than the GPU's KV budget; on a CPU it would only copy
the KV budget's own memory)."""

from __future__ import annotations

import threading
import time

from cadenza.kv_tiers.order import EvictionOrder
from cadenza.kv_tiers.store import TierStore


class HostTier(TierStore):
    name = "host"

    def __init__(self, size_bytes: int, policy: EvictionOrder) -> None:
        super().__init__(size_bytes, policy)
        self._blocks: dict[bytes, bytes] = {}
        self._nbytes = 0
        self._lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def get(self, digest: bytes) -> bytes | None:
        started = time.perf_counter()
        with self._lock:
            payload = self._blocks.get(digest)
            if payload is None:
                return None
            self.order.touch(digest)
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.read_seconds += time.perf_counter() - started
        return payload

    def put(self, digest: bytes, payload: bytes, position: int) -> bool:
        if len(payload) > self.size_bytes:
            self.stats.writes_skipped += 1
            return False
        with self._lock:
            if digest in self._blocks:
                self.order.touch(digest)
                return True
            while self._nbytes + len(payload) > self.size_bytes:
                victim = self.order.victim()
                if victim is None:  # every block kept (pinned), or the policy failed: not written
                    self.stats.writes_skipped += 1
                    return False
                self._nbytes -= len(self._blocks.pop(victim))
                self.stats.evicted += 1
            if not self.order.add(digest, position):
                self.stats.writes_skipped += 1
                return False
            self._blocks[digest] = bytes(payload)
            self._nbytes += len(payload)
            self.stats.blocks_written += 1
            self.stats.bytes_written += len(payload)
        return True
