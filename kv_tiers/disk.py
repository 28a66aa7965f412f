"""`DiskTier`: one file a block, in a directory per model identity, bounded by size.

A file is a header then the payload (`kv_connectors/blocks.py`'s bytes for one block). The header:
magic, format version, the model identity, the block's chained hash, the payload's length and its
blake2b checksum. Every read checks all of them, so a truncated file, a flipped byte or another
model's block is never handed back: it is logged (a warning naming the file and why), deleted, and
the block is computed again.

Writes go to a temporary name, are fsync'd, then `os.replace`d into place: a crash mid-write leaves
at worst a temporary file (removed at the next start-up once it is old), never a torn block under a
real name. A write the medium refuses (ENOSPC, any OSError) pauses writes for `pause_seconds`;
reads go on. The index (hash -> file size, least recently used first) lives in memory and is built
by scanning the directory at start-up, ordered by modification time (a hit touches its file), so a
restarted server finds its blocks at once; headers are checked on read, not at the scan.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import structlog

from cadenza.kv_tiers.store import TierStore

log = structlog.get_logger(__name__)

MAGIC = b"CDZKVBLK"
VERSION = 1
# magic, version, (padding), model identity, block hash (zero-padded), payload length, payload checksum
HEADER = struct.Struct("<8sH6x32s32sQ32s")
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
PAUSE_SECONDS = 30.0
STALE_TMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier(TierStore):
    name = "disk"

    def __init__(
        self,
        path: str | Path,
        size_bytes: int,
        identity: bytes,
        *,
        fsync: bool = True,
        pause_seconds: float = PAUSE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(size_bytes)
        if len(identity) != 32:
            raise ValueError(f"a model identity is 32 bytes (model_identity), not {len(identity)}")
        self.identity = identity
        self.directory = Path(path) / identity.hex()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.pause_seconds = pause_seconds
        self.clock = clock
        self._paused_until = float("-inf")
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._nbytes = 0
        self._lock = threading.Lock()
        self._scan()

    # --- queries -------------------------------------------------------------------------------

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def writes_paused(self) -> bool:
        return self.clock() < self._paused_until

    def file_of(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}{SUFFIX}"

    # --- reads ---------------------------------------------------------------------------------

    def get(self, digest: bytes) -> bytes | None:
        if digest not in self._index:
            return None
        path = self.file_of(digest)
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # removed behind our back (by hand, or another process): a miss
            self._forget(digest)
            return None
        except OSError as exc:
            log.warning("Cannot read a KV block file; computing the block instead", file=str(path), error=str(exc))
            self.stats.read_errors += 1
            self._forget(digest)
            return None
        reason = self._check(digest, data)
        if reason is not None:
            self._reject(digest, path, reason)
            return None
        payload = data[HEADER.size :]
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.read_seconds += time.perf_counter() - started
        try:
            os.utime(path)  # recently used, also for the order a restart rebuilds
        except OSError:
            pass
        return payload

    def _check(self, digest: bytes, data: bytes) -> str | None:
        """Why `data` is not a valid file for `digest`, or None."""
        if len(data) < HEADER.size:
            return f"truncated: {len(data)} bytes, shorter than the header"
        magic, version, identity, stored_hash, length, stored_sum = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a KV block file (bad magic)"
        if version != VERSION:
            return f"format version {version}, this build reads {VERSION}"
        if identity != self.identity:
            return "written by another model (identity mismatch)"
        if stored_hash != digest.ljust(32, b"\0"):
            return "holds another block (hash mismatch)"
        if len(data) - HEADER.size != length:
            return f"truncated: {len(data) - HEADER.size} of {length} payload bytes"
        if checksum(memoryview(data)[HEADER.size :]) != stored_sum:
            return "checksum mismatch"
        return None

    def _reject(self, digest: bytes, path: Path, reason: str) -> None:
        log.warning("Ignoring a KV block file; computing the block instead", file=str(path), reason=reason)
        self.stats.corrupt += 1
        self._forget(digest)
        try:
            path.unlink()
        except OSError:
            pass

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._nbytes -= size

    # --- writes --------------------------------------------------------------------------------

    def put(self, digest: bytes, payload: bytes) -> bool:
        if len(digest) > 32:
            raise ValueError(f"a block hash of {len(digest)} bytes; at most 32")
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
                return True
        size = HEADER.size + len(payload)
        if size > self.size_bytes or self.writes_paused:
            self.stats.writes_skipped += 1
            return False
        self._make_room(size)
        path = self.file_of(digest)
        tmp = self.directory / f"{TMP_PREFIX}{digest.hex()}-{os.getpid()}-{threading.get_ident()}"
        header = HEADER.pack(MAGIC, VERSION, self.identity, digest.ljust(32, b"\0"), len(payload), checksum(payload))
        try:
            self._write_file(tmp, header, payload)
            os.replace(tmp, path)
        except OSError as exc:
            with self._lock:
                self._nbytes -= size  # the room `_make_room` reserved
            self.stats.write_errors += 1
            self._paused_until = self.clock() + self.pause_seconds
            log.warning("KV disk tier write failed; writes paused, serving goes on", file=str(path), error=str(exc),
                        pause_seconds=self.pause_seconds)  # fmt: skip
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        with self._lock:
            self._index[digest] = size
        self.stats.blocks_written += 1
        self.stats.bytes_written += len(payload)
        return True

    def _write_file(self, tmp: Path, header: bytes, payload: bytes) -> None:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _make_room(self, size: int) -> None:
        """Drop least recently used files until `size` more bytes fit; reserves them."""
        dropped = []
        with self._lock:
            while self._index and self._nbytes + size > self.size_bytes:
                digest, old = self._index.popitem(last=False)
                self._nbytes -= old
                dropped.append(digest)
            self._nbytes += size
        for digest in dropped:
            self.stats.evicted += 1
            try:
                self.file_of(digest).unlink()
            except OSError:
                pass

    # --- start-up ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the directory's block files, oldest first; remove stale temporary files; trim to size."""
        found = []
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith(TMP_PREFIX):
                if now - stat.st_mtime > STALE_TMP_SECONDS:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
                continue
            stem = entry.name.removesuffix(SUFFIX)
            if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                digest = bytes.fromhex(stem)
            except ValueError:
                continue
            found.append((stat.st_mtime, digest, stat.st_size))
        for _, digest, size in sorted(found):
            self._index[digest] = size
            self._nbytes += size
        self._make_room(0)
        log.info("KV disk tier ready", directory=str(self.directory), blocks=len(self._index), bytes=self._nbytes,
                 size_bytes=self.size_bytes)  # fmt: skip
