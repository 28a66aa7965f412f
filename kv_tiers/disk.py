"""`DiskTier`: one file a block, in a directory per model identity, bounded by size.

A file is a header then the payload (`kv_connectors/blocks.py`'s bytes for one block). The header:
magic, format version, the block's position in its sequence (for the eviction policy, after a
restart too), the model identity, the block's chained hash, the payload's length and its blake2b
checksum. Every read checks all of them, so a truncated file, a flipped byte or another model's
block is never handed back: it is logged (a warning naming the file and why), deleted, and the
block is computed again. Files of format 1 (no position) are removed at the scan and recomputed.

Writes go to a temporary name, are fsync'd, then `os.replace`d into place: a crash mid-write leaves
at worst a temporary file (removed at the next start-up once it is old), never a torn block under a
real name. A write the medium refuses (ENOSPC, any OSError) pauses writes for `pause_seconds`;
reads go on. Room is made by dropping the blocks the tier's eviction policy offers (`order.py`);
when it offers none (every block pinned), the write is skipped.

The index (hash -> file size) lives in memory, built by scanning the directory at start-up in
modification-time order (a hit touches its file), so a restarted server finds its blocks at once.
Several processes (data-parallel replicas) may share the directory: a hash missing from the index
is looked up on disk (one open: the file is named by the hash) and adopted once its header checks;
a file another process removed is a miss, never an error; and every `rescan_seconds` a write
re-scans the directory first, adopting the others' files and forgetting removed ones, then trims
to `size_bytes`, so the directory as a whole stays near its bound.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import structlog

from cadenza.kv_tiers.order import EvictionOrder
from cadenza.kv_tiers.store import TierStore

log = structlog.get_logger(__name__)

MAGIC = b"CDZKVBLK"
VERSION = 2  # 1 had no position (its two bytes of padding and the position's four were zero)
# magic, version, (padding), position, model identity, block hash (zero-padded), payload length, payload checksum
HEADER = struct.Struct("<8sH2xI32s32sQ32s")
MAX_POSITION = 2**32 - 1
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
PAUSE_SECONDS = 30.0
RESCAN_SECONDS = 60.0  # how often a writer re-reads a directory other processes may share
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
        policy: EvictionOrder,
        *,
        fsync: bool = True,
        pause_seconds: float = PAUSE_SECONDS,
        rescan_seconds: float = RESCAN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(size_bytes, policy)
        if len(identity) != 32:
            raise ValueError(f"a model identity is 32 bytes (model_identity), not {len(identity)}")
        self.identity = identity
        self.directory = Path(path) / identity.hex()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.pause_seconds = pause_seconds
        self.rescan_seconds = rescan_seconds
        self.clock = clock
        self._paused_until = float("-inf")
        self._index: dict[bytes, int] = {}  # hash -> file bytes; the order is the policy's (`self.order`)
        self._nbytes = 0
        self._lock = threading.Lock()
        self._next_scan = clock() + rescan_seconds
        self.scan()
        log.info("KV disk tier ready", directory=str(self.directory), blocks=len(self._index), bytes=self._nbytes,
                 size_bytes=self.size_bytes)  # fmt: skip

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

    def has(self, digest: bytes) -> bool:
        return digest in self._index or self._adopt(digest)

    # --- reads ---------------------------------------------------------------------------------

    def get(self, digest: bytes) -> bytes | None:
        if digest not in self._index and not self._adopt(digest):
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
                self.order.touch(digest)
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.read_seconds += time.perf_counter() - started
        try:
            os.utime(path)  # recently used, also for the order a restart rebuilds
        except OSError:
            pass
        return payload

    def _check_header(self, digest: bytes, head: bytes, file_size: int) -> tuple[int, str | None]:
        """(the block's position, None), or (-1, why `head` does not start a valid file for
        `digest` of `file_size` bytes)."""
        if len(head) < HEADER.size:
            return -1, f"truncated: {len(head)} bytes, shorter than the header"
        magic, version, position, identity, stored_hash, length, _ = HEADER.unpack_from(head)
        if magic != MAGIC:
            return -1, "not a KV block file (bad magic)"
        if version != VERSION:
            return -1, f"format version {version}, this build reads {VERSION}"
        if identity != self.identity:
            return -1, "written by another model (identity mismatch)"
        if stored_hash != digest.ljust(32, b"\0"):
            return -1, "holds another block (hash mismatch)"
        if file_size - HEADER.size != length:
            return -1, f"truncated: {file_size - HEADER.size} of {length} payload bytes"
        return position, None

    def _check(self, digest: bytes, data: bytes) -> str | None:
        """Why `data` is not a valid file for `digest`, or None."""
        _, reason = self._check_header(digest, data[: HEADER.size], len(data))
        if reason is None and checksum(memoryview(data)[HEADER.size :]) != data[HEADER.size - 32 : HEADER.size]:
            return "checksum mismatch"
        return reason

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
                self.order.remove(digest)

    def _adopt(self, digest: bytes, *, header: tuple[bytes, int] | None = None) -> bool:
        """Index the file under `digest` that another process wrote (one open, for its header),
        if its header checks and the policy takes it; False when there is none (a miss)."""
        path = self.file_of(digest)
        if header is None:
            try:
                with open(path, "rb") as f:
                    header = f.read(HEADER.size), os.fstat(f.fileno()).st_size
            except OSError:  # none (or it vanished, or it is unreadable: a get will say so): a miss
                return False
        position, reason = self._check_header(digest, *header)
        if reason is not None:
            self._reject(digest, path, reason)
            return False
        with self._lock:
            if digest in self._index:
                return True
            if not self.order.add(digest, position):
                return False
            self._index[digest] = header[1]
            self._nbytes += header[1]
        self._remove(self._make_room(0)[0])  # adopted beyond the bound: the policy's victims go
        return True

    # --- writes --------------------------------------------------------------------------------

    def put(self, digest: bytes, payload: bytes, position: int) -> bool:
        if len(digest) > 32:
            raise ValueError(f"a block hash of {len(digest)} bytes; at most 32")
        with self._lock:
            if digest in self._index:
                self.order.touch(digest)
                return True
        size = HEADER.size + len(payload)
        if size > self.size_bytes or self.writes_paused:
            self.stats.writes_skipped += 1
            return False
        if self.clock() >= self._next_scan:
            self._next_scan = self.clock() + self.rescan_seconds
            self.scan()
        if self._adopt(digest):  # another process wrote it meanwhile
            return True
        dropped, fits = self._make_room(size)
        self._remove(dropped)
        if not fits:  # the policy offers no victim (every block pinned) or failed: not written
            self.stats.writes_skipped += 1
            return False
        path = self.file_of(digest)
        tmp = self.directory / f"{TMP_PREFIX}{digest.hex()}-{os.getpid()}-{threading.get_ident()}"
        header = HEADER.pack(MAGIC, VERSION, min(max(position, 0), MAX_POSITION), self.identity,
                             digest.ljust(32, b"\0"), len(payload), checksum(payload))  # fmt: skip
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
            if digest in self._index:  # a reader adopted the file meanwhile: counted already
                self._nbytes -= size
                ordered = True
            elif self.order.add(digest, position):
                self._index[digest] = size
                ordered = True
            else:
                self._nbytes -= size
                ordered = False
        if not ordered:  # the policy failed on it: a block it cannot order is not kept
            try:
                path.unlink()
            except OSError:
                pass
            self.stats.writes_skipped += 1
            return False
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

    def _make_room(self, size: int) -> tuple[list[bytes], bool]:
        """Take the policy's victims out of the index until `size` more bytes fit, and reserve
        them: (the victims, whose files the caller removes; whether it fits, reserved only then)."""
        dropped = []
        with self._lock:
            while self._nbytes + size > self.size_bytes:
                victim = self.order.victim()
                if victim is None:
                    return dropped, False
                self._nbytes -= self._index.pop(victim)
                dropped.append(victim)
            self._nbytes += size
        return dropped, True

    def _remove(self, dropped: list[bytes]) -> None:
        for digest in dropped:
            self.stats.evicted += 1
            try:
                self.file_of(digest).unlink()
            except OSError:
                pass  # gone already: another process evicted it too

    # --- the directory -------------------------------------------------------------------------

    def scan(self) -> None:
        """Read the directory: adopt block files not indexed (oldest first), forget indexed ones
        that are gone (another process removed them), remove stale temporary files and files of
        an older format, then trim to size. At start-up, and every `rescan_seconds` of writes."""
        with self._lock:
            known = set(self._index)  # indexed before the listing: a file written since is not "gone"
        found, on_disk, old_format = [], set(), 0
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
            on_disk.add(digest)
            if digest not in known:
                found.append((stat.st_mtime, digest, entry.path))
        for digest in known - on_disk:
            self._forget(digest)
        for _, digest, path in sorted(found):
            try:
                with open(path, "rb") as f:
                    header = f.read(HEADER.size), os.fstat(f.fileno()).st_size
            except OSError:
                continue  # vanished since the listing, or unreadable: not indexed
            if len(header[0]) >= 10 and header[0][:8] == MAGIC and header[0][8:10] != VERSION.to_bytes(2, "little"):
                old_format += 1
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
            self._adopt(digest, header=header)
        if old_format:
            log.info("Removed KV block files of an older format; their blocks are computed again",
                     directory=str(self.directory), files=old_format)  # fmt: skip
        self._remove(self._make_room(0)[0])
