"""The prefix cache's tiers below the KV budget (docs/kv-tiers.md), on a real directory.

The stores alone (host, disk: bounds, restart, each fault), then an engine over a tiny random
model: a prefix evicted from the KV budget comes back from disk with the same greedy tokens, a
restarted engine serves it at once, every fault (truncated, flipped, foreign, unreadable, a full
disk, a kill -9 mid-write) recomputes without failing a request, and no KV block leaks.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from cadenza.kv_tiers import DiskTier, HostTier, model_identity
from cadenza.kv_tiers.disk import HEADER, SUFFIX, TMP_PREFIX
from cadenza.policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy

IDENTITY = model_identity("weights", dtype="float32", block_size=8, kv_dtype="float32")
OTHER = model_identity("weights", dtype="bfloat16", block_size=8, kv_dtype="bfloat16")


def digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int, size: int = 1000) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


# --- the stores ----------------------------------------------------------------------------------


def test_disk_tier_round_trip_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())
    assert tier.put(digest(1), payload(1), 1) and tier.put(digest(2), payload(2), 2)
    assert tier.get(digest(1)) == payload(1) and tier.get(digest(3)) is None
    assert tier.stats.hits == 1 and tier.stats.bytes_read == 1000 and tier.stats.bytes_written == 2000
    again = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())  # a restart: the scan finds both at once
    assert len(again) == 2 and digest(2) in again and again.get(digest(2)) == payload(2)
    assert not any(p.name.startswith(TMP_PREFIX) for p in tier.directory.iterdir())


def test_disk_tier_keeps_within_its_size_least_recently_used_first(tmp_path):
    file_bytes = HEADER.size + 1000
    tier = DiskTier(tmp_path, 3 * file_bytes, IDENTITY, LRUPolicy())
    for i in range(3):
        tier.put(digest(i), payload(i), i)
    tier.get(digest(0))  # 1 is now the least recently used
    tier.put(digest(3), payload(3), 3)
    assert digest(1) not in tier and {digest(0), digest(2), digest(3)} <= set(tier._index)
    assert len(list(tier.directory.glob(f"*{SUFFIX}"))) == 3 and tier.nbytes == 3 * file_bytes
    assert tier.stats.evicted == 1
    smaller = DiskTier(tmp_path, 2 * file_bytes, IDENTITY, LRUPolicy())  # restarted with less room: trimmed at once
    assert len(smaller) == 2 and len(list(smaller.directory.glob(f"*{SUFFIX}"))) == 2


def test_disk_tier_is_per_model_identity(tmp_path):
    DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy()).put(digest(1), payload(1), 1)
    assert digest(1) not in DiskTier(tmp_path, 1 << 20, OTHER, LRUPolicy())


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 500] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    """Another model's file for the same hash, put where this model's would be."""
    other = DiskTier(path.parent.parent, 1 << 20, OTHER, LRUPolicy())
    other.put(bytes.fromhex(path.name.removesuffix(SUFFIX)), payload(9), 0)
    os.replace(other.file_of(bytes.fromhex(path.name.removesuffix(SUFFIX))), path)


def _unreadable(path: Path) -> None:
    path.unlink()
    path.mkdir()  # opening it fails with an OSError, as root too (a chmod would not stop root)


FAULTS = {"truncated": _truncate, "flipped": _flip, "foreign": _foreign, "unreadable": _unreadable}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_disk_tier_drops_a_file_that_fails_a_check(tmp_path, fault):
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())
    tier.put(digest(1), payload(1), 1)
    FAULTS[fault](tier.file_of(digest(1)))
    with capture_logs() as logs:
        assert tier.get(digest(1)) is None
    assert digest(1) not in tier and tier.nbytes == 0
    if fault == "unreadable":
        assert tier.stats.read_errors == 1
    else:
        assert tier.stats.corrupt == 1 and not tier.file_of(digest(1)).exists()  # deleted
    (warning,) = logs
    assert warning["log_level"] == "warning" and warning["file"] == str(tier.file_of(digest(1)))  # names the file
    assert warning.get("reason") or warning.get("error")  # and why
    assert tier.put(digest(1), payload(1), 1) or fault == "unreadable"  # written again once recomputed


def test_a_full_disk_pauses_writes_and_reads_go_on(tmp_path, monkeypatch):
    now = [0.0]
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy(), pause_seconds=30, clock=lambda: now[0])
    tier.put(digest(1), payload(1), 1)

    def full(self, tmp, header, data):
        with open(tmp, "wb") as f:
            f.write(header[:5])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", full)
    assert not tier.put(digest(2), payload(2), 2)
    assert tier.stats.write_errors == 1 and tier.writes_paused and digest(2) not in tier
    assert not any(p.name.startswith(TMP_PREFIX) for p in tier.directory.iterdir())  # no torn file left
    assert not tier.put(digest(3), payload(3), 3) and tier.stats.writes_skipped == 1  # paused: not even tried
    assert tier.get(digest(1)) == payload(1)  # reads go on
    monkeypatch.undo()
    now[0] = 31.0
    assert tier.put(digest(2), payload(2), 2) and tier.get(digest(2)) == payload(2)
    assert tier.nbytes == 2 * (HEADER.size + 1000)


def test_stale_temporary_files_are_removed_at_start_up(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())
    stale, fresh = tier.directory / f"{TMP_PREFIX}old", tier.directory / f"{TMP_PREFIX}new"
    stale.write_bytes(b"torn")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())
    assert not stale.exists() and fresh.exists()  # a live writer's file is left alone


def test_host_tier_keeps_within_its_size():
    tier = HostTier(2500, LRUPolicy())
    for i in range(3):
        assert tier.put(digest(i), payload(i), i)
    assert digest(0) not in tier and tier.get(digest(2)) == payload(2) and tier.nbytes == 2000
    assert not tier.put(digest(9), payload(9, 3000), 9) and tier.stats.writes_skipped == 1


# --- eviction policies per tier --------------------------------------------------------------------


class KeepFirst(LRUPolicy):
    """LRU, but a block at position 0 is never offered: kept, as a pinning policy keeps it."""

    name = "keep_first_test"

    def __init__(self) -> None:
        super().__init__()
        self.kept: set[int] = set()

    def on_cached(self, block_id: int, position: int = 0) -> None:
        if position == 0:
            self.kept.add(block_id)

    def on_release(self, block_id: int) -> None:
        if block_id not in self.kept:
            super().on_release(block_id)

    def forget(self, block_id: int) -> None:
        self.kept.discard(block_id)


class Raising(LRUPolicy):
    """LRU whose `method` raises."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self.method = method

    def _maybe_raise(self, method: str) -> None:
        if method == self.method:
            raise RuntimeError(f"{method} broke")

    def on_cached(self, block_id: int, position: int = 0) -> None:
        self._maybe_raise("on_cached")

    def on_acquire(self, block_id: int) -> None:
        self._maybe_raise("on_acquire")
        super().on_acquire(block_id)

    def pop_victim(self) -> int:
        self._maybe_raise("pop_victim")
        return super().pop_victim()

    def on_evict(self, block_id: int) -> None:
        self._maybe_raise("on_evict")
        super().on_evict(block_id)


def make_tier(kind: str, path: Path, blocks: int, policy, **kw):
    """A tier with room for `blocks` blocks of `payload`'s 1000 bytes."""
    if kind == "host":
        return HostTier(blocks * 1000, policy)
    return DiskTier(path, blocks * (HEADER.size + 1000), IDENTITY, policy, **kw)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_tier_drops_blocks_in_its_policys_order(tmp_path, kind):
    dropped = {}
    for policy in (LRUPolicy(), FIFOPolicy(), LFUPolicy()):
        tier = make_tier(kind, tmp_path / policy.name, 3, policy)
        for i in range(3):
            tier.put(digest(i), payload(i), i)
        assert tier.get(digest(0)) == payload(0)  # a reuse: recent (lru), frequent (lfu); fifo ignores it
        assert tier.put(digest(3), payload(3), 3) and len(tier) == 3 and tier.stats.evicted == 1
        (dropped[policy.name],) = [i for i in range(3) if digest(i) not in tier]
    assert dropped == {"lru": 1, "fifo": 0, "lfu": 1}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_block_the_policy_never_offers_stays_and_a_full_tier_skips_writes(tmp_path, kind):
    tier = make_tier(kind, tmp_path, 2, KeepFirst())
    assert tier.put(digest(0), payload(0), 0) and tier.put(digest(1), payload(1), 1)
    assert tier.put(digest(2), payload(2), 1) and digest(1) not in tier  # 1 goes; 0 (position 0) stays
    assert tier.put(digest(3), payload(3), 0) and digest(2) not in tier  # 2 goes: both left are kept
    assert not tier.put(digest(4), payload(4), 5) and tier.stats.writes_skipped == 1  # refused, no loop
    assert {d for d in map(digest, range(5)) if d in tier} == {digest(0), digest(3)}
    assert tier.get(digest(0)) == payload(0) and tier.stats.evicted == 2
    if kind == "disk":  # the positions come back from the files' headers: still kept after a restart
        again = make_tier(kind, tmp_path, 2, KeepFirst())
        assert len(again) == 2 and not again.put(digest(5), payload(5), 5) and digest(0) in again


@pytest.mark.parametrize("method", ["on_cached", "on_acquire", "pop_victim", "on_evict"])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_policy_that_raises_is_logged_and_the_tier_skips_the_write(tmp_path, kind, method):
    tier = make_tier(kind, tmp_path, 2, Raising(method))
    with capture_logs() as logs:
        written = [tier.put(digest(i), payload(i), i) for i in range(4)]
        reads = [tier.get(digest(i)) for i in range(4)]
        if kind == "disk":  # a block gone from under the tier: `on_evict`
            tier.file_of(digest(3)).unlink(missing_ok=True)
            assert tier.get(digest(3)) is None
    stored = {i for i in range(4) if digest(i) in tier}
    assert all(reads[i] == payload(i) for i in stored)  # what the tier holds, it still serves
    expected = {"on_cached": ([False] * 4, set()), "pop_victim": ([True, True, False, False], {0, 1})}
    if method in expected:
        assert (written, stored) == expected[method]
        assert tier.stats.writes_skipped == written.count(False)
    else:
        assert written == [True] * 4
    if kind == "disk":
        assert {bytes.fromhex(p.name.removesuffix(SUFFIX)) for p in tier.directory.glob(f"*{SUFFIX}")} == set(map(digest, stored))
    warnings = [e for e in logs if e["event"].startswith("KV tier eviction policy failed")]
    if tier.stats.policy_errors:
        assert len(warnings) == 1 and warnings[0]["method"].startswith(method) and tier.stats.policy_errors >= 1
    else:
        assert method == "on_evict" and kind == "host"  # the host tier never drops a block but as a victim


def test_a_file_keeps_its_blocks_position_and_the_first_format_is_recomputed(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())
    tier.put(digest(1), payload(1), 7)
    path = tier.file_of(digest(1))
    assert HEADER.unpack_from(path.read_bytes())[2] == 7  # magic, version, position, ...
    data = bytearray(path.read_bytes())
    data[8:16] = (1).to_bytes(2, "little") + bytes(6)  # format 1: version 1, padding where the position is
    path.write_bytes(bytes(data))
    again = DiskTier(tmp_path, 1 << 20, IDENTITY, LRUPolicy())  # logs "Removed KV block files of an older format"
    assert digest(1) not in again and not path.exists() and again.stats.corrupt == 0
    assert again.put(digest(1), payload(1), 7) and again.get(digest(1)) == payload(1)  # recomputed, written anew


# --- replicas sharing one directory ----------------------------------------------------------------


def test_two_disk_tiers_share_one_directory(tmp_path):
    """Two processes' tiers (data-parallel replicas) on one directory: each finds the other's
    blocks past its own index, a file the other removed is a plain miss, and re-scans keep the
    directory as a whole within the bound."""
    now = [0.0]
    a, b = (make_tier("disk", tmp_path, 4, LRUPolicy(), rescan_seconds=10, clock=lambda: now[0]) for _ in range(2))
    assert a.put(digest(1), payload(1), 0)
    assert digest(1) not in b and b.has(digest(1)) and digest(1) in b  # one open of its file: adopted
    assert a.put(digest(2), payload(2), 1) and b.get(digest(2)) == payload(2)  # read straight past its index
    assert b.put(digest(2), payload(2), 1) and b.stats.blocks_written == 0  # there already: not written again
    assert not b.has(digest(9)) and b.get(digest(9)) is None  # nobody wrote it: a miss
    a.file_of(digest(1)).unlink()  # the other replica evicted it
    with capture_logs() as logs:
        assert b.get(digest(1)) is None and digest(1) not in b
    assert not logs and b.stats.corrupt == b.stats.read_errors == 0  # a miss, not a fault
    for i in range(10, 14):  # a fills the directory by its own count (it still counts digest 1)
        assert a.put(digest(i), payload(i), 2)
    now[0] = 11.0  # due for a re-scan
    for i in range(20, 23):
        assert b.put(digest(i), payload(i), 2)
    on_disk = {bytes.fromhex(p.name.removesuffix(SUFFIX)) for p in a.directory.glob(f"*{SUFFIX}")}
    assert len(on_disk) <= 4 and set(b._index) == on_disk  # b saw a's files and trimmed the whole
    a.scan()  # a forgets the files b removed, adopts b's
    assert set(a._index) == on_disk and a.nbytes == b.nbytes == len(on_disk) * (HEADER.size + 1000)
    assert all(a.get(d) is not None for d in on_disk) and a.stats.corrupt == 0


def test_each_tiers_eviction_policy_is_a_registered_name():
    from cadenza.config import load_config
    from cadenza.config.flags import BY_FLAG
    from cadenza.plugins.errors import UnknownNameError
    from cadenza.runtime.plugins import resolve_plugins

    plugins = resolve_plugins(load_config(None, overrides={"cache.disk_eviction_policy": "fifo"}, env={}))
    assert {t: cls.name for t, cls in plugins.tier_eviction_policies.items()} == {"host": "lru", "disk": "fifo"}
    with pytest.raises(UnknownNameError, match="eviction policy 'mru'.*fifo, lfu, lru"):
        resolve_plugins(load_config(None, overrides={"cache.host_eviction_policy": "mru"}, env={}))
    assert BY_FLAG["--kv-disk-eviction-policy"].path == "cache.disk_eviction_policy"


def test_model_identity_names_the_weights_and_the_cache_layout(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * (3 << 20))
    base = dict(dtype="float32", block_size=8, kv_dtype="float32")
    first = model_identity(tmp_path, **base)
    assert first == model_identity(tmp_path, **base)
    for change in ({"dtype": "bfloat16"}, {"block_size": 16}, {"kv_dtype": "int8"}, {"tensor_parallel_size": 2}):
        assert model_identity(tmp_path, **{**base, **change}) != first
    weights.write_bytes(b"x" * (3 << 20) + b"y")  # the last MiB and the size change
    assert model_identity(tmp_path, **base) != first


# --- the tier agent ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_write_behind_is_bounded_and_skips_blocks_every_tier_has():
    import anyio
    import torch

    from cadenza.actors.cache_manager import KVCacheManager
    from cadenza.actors.messages import Offload
    from cadenza.actors.tier_agent import TierAgent
    from cadenza.metrics import EngineMetrics

    metrics, tier = EngineMetrics(), HostTier(1 << 20, LRUPolicy())
    send, _receive = anyio.create_memory_object_stream(4)
    agent = TierAgent(None, KVCacheManager(8, 4, LRUPolicy()), [torch.zeros(2, 8, 16)], [tier], scheduler=send,
                      metrics=metrics, max_pending_writes=2)  # fmt: skip
    await agent.handle(Offload(1, (digest(1), digest(2), digest(3), digest(1)), (0, 1, 2, 0)))
    assert list(agent._writes) == [(digest(1), 0), (digest(2), 1)] and metrics.kv_tier_writes_dropped == 1
    tier.put(digest(4), payload(4), 4)
    await agent.handle(Offload(2, (digest(4),), (4,)))  # in every tier already: not queued, not dropped
    assert len(agent._writes) == 2 and metrics.kv_tier_writes_dropped == 1
    assert metrics.kv_tiers == {"host": tier.stats}


@pytest.mark.anyio
async def test_a_block_another_replica_wrote_meanwhile_is_not_copied(tmp_path):
    """Write-behind asks the tiers past their index before it copies a batch: a block the other
    replica on the same disk directory wrote after it was queued here is adopted, not copied."""
    import anyio
    import torch

    from cadenza.actors.cache_manager import KVCacheManager
    from cadenza.actors.messages import Offload
    from cadenza.actors.tier_agent import TierAgent
    from cadenza.metrics import EngineMetrics

    mine, theirs = (make_tier("disk", tmp_path, 8, LRUPolicy()) for _ in range(2))
    send, _receive = anyio.create_memory_object_stream(4)
    core = KVCacheManager(8, 4, LRUPolicy())
    agent = TierAgent(None, core, [torch.zeros(2, 8, 16)], [mine], scheduler=send, metrics=EngineMetrics())
    await agent.handle(Offload(1, (digest(5), digest(6)), (0, 1)))
    assert list(agent._writes) == [(digest(5), 0), (digest(6), 1)]
    assert theirs.put(digest(5), payload(5), 0)  # the other replica, after the queueing
    copied = []
    agent._gather = lambda blocks: copied.extend(blocks) or [payload(6) for _ in blocks]
    agent.core.cached_block = lambda d: {digest(5): 3, digest(6): 4}[d]  # both still cached here
    await agent._write_batch(list(agent._writes))
    assert copied == [4]  # digest 6 alone: digest 5 was found on disk
    assert digest(5) in mine and digest(6) in mine and mine.stats.blocks_written == 1  # 6 alone written


# --- the scheduler's gate ------------------------------------------------------------------------


def test_a_request_reading_its_prefix_waits_outside_the_queue_and_others_flow():
    from cadenza.actors.request_state import Request
    from cadenza.actors.scheduler_core import QueueFullError, SchedulerCore
    from cadenza.config import SchedulerConfig
    from cadenza.sampling_params import SamplingParams

    core = SchedulerCore(SchedulerConfig(max_waiting=2), block_size=4, eos_token_ids=(2,), max_model_len=256)

    def request(rid: str) -> Request:
        return Request(rid, tuple(range(10, 30)), SamplingParams(max_tokens=2), 2, 0.0)

    core.add(request("gated"), gated=True)
    assert core.schedule() is None  # nothing to plan while its read is under way
    core.add(request("other"))
    plan = core.schedule()
    assert [r.request_id for r, _ in plan.candidates] == ["other"]  # the others flow
    with pytest.raises(QueueFullError):  # a gated request counts against max_waiting
        core.add(request("third"))
    assert core.open_gate("gated") and not core.open_gate("gated") and core.waiting[-1].request_id == "gated"
    core.abort("other")
    core.add(request("aborted"), gated=True)
    assert core.abort("aborted") is not None and not core.reading and not core.open_gate("aborted")


# --- an engine over the tiers ----------------------------------------------------------------------

BLOCK = 8
PROMPT = [(7 * i + 3) % 90 + 5 for i in range(8 * BLOCK + 1)]  # 8 full blocks and a token: 8 reusable


def greedy(n: int = 4):
    from cadenza import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make_llm(model, disk=None, num_blocks=40, **extra):
    from cadenza import LLM

    overrides = {"cache.disk_path": str(disk)} if disk is not None else {}
    return LLM(model, dtype="float32", block_size=BLOCK, num_blocks=num_blocks, **overrides, **extra)


def others(n: int, length: int = 8 * BLOCK) -> list[dict]:
    """Prompts that share no block with PROMPT (nor each other), to push it out of the KV budget."""
    return [{"prompt_token_ids": [(k * 31 + 13 * i) % 90 + 5 + 100 for i in range(length)]} for k in range(n)]


def wait_for(condition, timeout: float = 30.0) -> None:
    """Write-behind runs off the step's path: wait (bounded) for what it promises."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the tier agent"
        time.sleep(0.02)


def agent_tiers(llm) -> list:
    return next(a for a in llm.engine.actors if a.name == "kv_tiers").tiers


def disk_of(llm) -> DiskTier:
    return next(t for t in llm.engine.actors if t.name == "kv_tiers").tiers[-1]


def settle_writes(llm) -> None:
    agent = next(a for a in llm.engine.actors if a.name == "kv_tiers")
    wait_for(lambda: not agent._writes and not agent._queued)


def audit(llm) -> None:
    """No block leaked: once every request has ended and the writes are done, nothing is held."""
    settle_writes(llm)
    core = llm.engine.cache_core
    core.check_invariants()
    assert core.num_used == 0 and not core._tables


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama3")


@pytest.fixture(scope="module")
def reference(model):
    """PROMPT's greedy tokens without any tier."""
    with make_llm(model) as llm:
        return llm.generate({"prompt_token_ids": PROMPT}, greedy())[0].outputs[0].token_ids


def finished_once(outputs) -> None:
    assert all(len(o.outputs) == 1 and o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("tiers", ["disk", "host", "host+disk"])
def test_an_evicted_prefix_comes_back_from_a_tier(model, reference, tmp_path, tiers):
    extra = {"kv_host_size": "64MiB"} if "host" in tiers else {}
    with make_llm(model, tmp_path if "disk" in tiers else None, **extra) as llm:
        first = llm.generate({"prompt_token_ids": PROMPT}, greedy())[0]
        assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == reference
        settle_writes(llm)
        fastest = agent_tiers(llm)[0]
        assert all(len(t) >= 8 for t in agent_tiers(llm))  # every full block written behind
        finished_once(llm.generate(others(6), greedy(1)))  # 48 blocks through a 40-block budget
        again = llm.generate({"prompt_token_ids": PROMPT}, greedy())[0]
        assert again.num_cached_tokens == 8 * BLOCK  # all 8 reusable blocks: some from the tier
        assert llm.engine.metrics.kv_tier_blocks_read > 0 and fastest.stats.hits > 0  # the fastest tier first
        assert again.outputs[0].token_ids == reference
        assert llm.engine.metrics.snapshot()[f"kv_tier_{fastest.name}_hits"] == fastest.stats.hits
        settle_writes(llm)
        assert all(t.stats.blocks_written == len(t) for t in agent_tiers(llm))  # no block written twice
        audit(llm)


def test_a_restarted_engine_serves_the_prefix_from_disk_at_once(model, reference, tmp_path):
    with make_llm(model, tmp_path) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, greedy())
        settle_writes(llm)
        files = list(disk_of(llm).directory.glob(f"*{SUFFIX}"))
    # Each file holds its block's position in the sequence (for the tier's policy, after a restart too).
    assert sorted(HEADER.unpack_from(f.read_bytes())[2] for f in files) == list(range(8))
    with make_llm(model, tmp_path) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, greedy())[0]
        assert out.num_cached_tokens == 8 * BLOCK and llm.engine.metrics.kv_tier_blocks_read == 8
        assert out.outputs[0].token_ids == reference
        audit(llm)


def test_another_cache_layout_never_reads_the_blocks(model, tmp_path):
    from cadenza import LLM

    with make_llm(model, tmp_path) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, greedy())
        settle_writes(llm)
    with LLM(model, dtype="float32", block_size=2 * BLOCK, num_blocks=20, kv_disk_path=str(tmp_path)) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, greedy())[0]
        assert out.num_cached_tokens == 0 and llm.engine.metrics.kv_tier_blocks_read == 0
        assert len(list(tmp_path.iterdir())) == 2  # a directory per identity
        audit(llm)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_block_file_is_recomputed(model, reference, tmp_path, fault):
    with make_llm(model, tmp_path) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, greedy())
        settle_writes(llm)
        tier = disk_of(llm)
    from cadenza.actors.cache_manager import reusable_hashes

    hashes = reusable_hashes(PROMPT, BLOCK, None)
    with make_llm(model, tmp_path) as llm:
        FAULTS[fault](tier.file_of(hashes[3]))  # the fourth block goes bad after the restart's scan
        out = llm.generate({"prompt_token_ids": PROMPT}, greedy())[0]
        assert out.num_cached_tokens == 3 * BLOCK  # the run stops at the bad block: the rest is computed
        assert out.outputs[0].token_ids == reference
        stats = disk_of(llm).stats
        assert (stats.read_errors if fault == "unreadable" else stats.corrupt) == 1
        settle_writes(llm)
        if fault != "unreadable":  # recomputed, and written again
            assert hashes[3] in disk_of(llm)
        audit(llm)


def test_a_full_disk_keeps_serving(model, reference, tmp_path, monkeypatch):
    def full(self, tmp, header, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", full)
    with make_llm(model, tmp_path) as llm:
        outs = llm.generate([{"prompt_token_ids": PROMPT}, *others(3)], greedy())
        finished_once(outs)
        assert outs[0].outputs[0].token_ids == reference
        settle_writes(llm)
        assert disk_of(llm).stats.write_errors == 1 and disk_of(llm).writes_paused and len(disk_of(llm)) == 0
        finished_once(llm.generate(others(3), greedy()))  # serving goes on, writes stay paused
        audit(llm)


KILLED_WRITER = """
import sys
from cadenza import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", block_size=8, num_blocks=64, **{"cache.disk_path": sys.argv[2]})
print("ready", flush=True)
k = 0
while True:  # many distinct prompts: the disk tier writes without end until the kill
    prompts = [{"prompt_token_ids": [(k * 7 + j * 13 + i) % 200 + 5 for i in range(64)]} for j in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    k += 1
"""


def test_a_kill_during_writes_leaves_only_valid_blocks(model, reference, tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(KILLED_WRITER))
    disk = tmp_path / "tiers"
    proc = subprocess.Popen([sys.executable, str(script), str(model), str(disk)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=Path(__file__).parent, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        wait_for(lambda: sum(1 for _ in disk.rglob(f"*{SUFFIX}")) >= 60, timeout=120)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with make_llm(model, disk, num_blocks=64) as llm:
        tier = disk_of(llm)
        assert len(tier) >= 60
        for digest_ in list(tier._index):  # every block read back validates
            assert tier.get(digest_) is not None
        assert tier.stats.corrupt == 0 and tier.stats.read_errors == 0
        outs = llm.generate([{"prompt_token_ids": PROMPT}, *others(2)], greedy())
        finished_once(outs)
        assert outs[0].outputs[0].token_ids == reference
        audit(llm)


def test_tier_metrics_reach_prometheus(model, tmp_path):
    from prometheus_client import generate_latest

    from cadenza.api.metrics import ServerMetrics

    with make_llm(model, tmp_path) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, greedy())
        settle_writes(llm)
        text = generate_latest(ServerMetrics(llm.engine.metrics).registry).decode()
    assert 'cadenza_kv_tier_written_bytes_total{tier="disk"}' in text
    assert 'cadenza_kv_tier_hits_total{tier="disk"} 0.0' in text


def test_a_cache_salt_is_kept_apart_on_disk_too(model, reference, tmp_path):
    """Blocks written behind under one tenant's cache_salt are read back for that salt only: after
    a restart another salt (or none) computes its prompt, as it would in memory."""
    def salted(salt):
        return greedy().model_copy(update={"cache_salt": salt})

    with make_llm(model, tmp_path) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, salted("tenant-a"))
        settle_writes(llm)
    with make_llm(model, tmp_path) as llm:
        for salt in ("tenant-b", None):
            out = llm.generate({"prompt_token_ids": PROMPT}, salted(salt))[0]
            assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference, salt
        assert llm.engine.metrics.kv_tier_blocks_read == 0
        out = llm.generate({"prompt_token_ids": PROMPT}, salted("tenant-a"))[0]
        assert out.num_cached_tokens == 8 * BLOCK and llm.engine.metrics.kv_tier_blocks_read == 8
        assert out.outputs[0].token_ids == reference
        audit(llm)


def test_preempted_requests_over_a_tier_finish_once_with_their_tokens(model, tmp_path):
    """Under a budget too small for the batch, preempted requests wait for a read of what the tier
    holds of them instead of queuing to recompute: each still finishes once, with the tokens an
    unconstrained engine gives, and no block is left held."""
    prompts = others(4, length=6 * BLOCK)
    with make_llm(model, num_blocks=200) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))]
    with make_llm(model, tmp_path, num_blocks=20) as llm:
        outputs = llm.generate(prompts, greedy(24))
        assert llm.engine.metrics.num_preemptions > 0
        finished_once(outputs)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert not llm.engine.scheduler_core.reading
        audit(llm)
