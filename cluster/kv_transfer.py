"""A replica's side of prefill/decode disaggregation: its blocks held, and its connector's half of
each transfer. The front-end (`pd_engine.py`) drives it with these messages over the replica's
router connection; each answers ("kv", request_id, kind, ...) or ("kv", request_id, "error", why):

    ("kv_lookup", id, hashes)          decode side: hold the leading run of `hashes` cached here;
                                       answers "have" with those hashes
    ("kv_prefill", id, tokens, hashes, salt)  prefill side: compute the prompt (one greedy token,
                                       thrown away; hashed with the request's cache_salt), then hold
                                       its cached blocks for `hashes`; answers
                                       "prefilled" with their block ids
    ("kv_reserve", id, count)          decode side: hold up to `count` empty blocks more; answers
                                       "reserved" with their ids
    ("kv_send", id, transfer)          prefill side: the connector's `send`, then let go of the
                                       blocks; answers "sent" with bytes and seconds
    ("kv_receive", id, transfer, hashes)  decode side: the connector's `receive`; the blocks then
                                       enter the prefix cache under `hashes`; answers "received"
    ("kv_abort", id, transfer_id)      decode side: the transfer's sender died; the connector's
                                       `abort` ends its receive now (no answer)
    ("kv_release", id)                 let go of whatever `id` holds (no answer)
    ("kv_audit", token)                answers "audit": blocks in use, requests holding, and
                                       whether the block accounting holds (no block leaked)

A request's blocks are held under a holder id of its own in the cache manager
(`KVCacheManager.hold_*`), so they are neither evicted nor reused while they are read or written;
blocks a transfer is writing are let go only once it has ended. The decode side lets go of the
received blocks once the request's first output shows it was admitted (its own reference keeps
them), or when it ends; everything a connection held goes when the connection closes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import anyio
import structlog

from cadenza.kv_connectors.base import BlockTransfer, KVConnector
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

Send = Callable[[tuple], Any]  # an async callable that sends a frame to the front-end


def holder_id(request_id: str) -> str:
    return f"kv-transfer:{request_id}"


class KVTransferAgent:
    def __init__(self, engine, connector: KVConnector) -> None:
        self.engine = engine
        self.core = engine.cache_core
        self.connector = connector
        self._holding: set[str] = set()  # requests that hold blocks here
        self._active: dict[str, int] = {}  # requests with a step under way: how many
        self._dropped: set[str] = set()  # released while a step was under way: let go after it
        self._prefills: dict[str, anyio.CancelScope] = {}

    async def handle(self, message: tuple, send: Send) -> None:
        """Carry out one kv_* message and answer it; a failure answers "error" (the replica serves on)."""
        request_id = message[1]
        if message[0] == "kv_release":
            self.release(request_id)
            return
        if message[0] == "kv_abort":
            self.connector.abort(message[2])
            return
        self._active[request_id] = self._active.get(request_id, 0) + 1
        try:
            reply = await self._dispatch(message)
        except Exception as exc:
            log.warning("KV transfer step failed", request_id=request_id, step=message[0], error=str(exc))
            reply = ("error", str(exc))
        finally:
            self._active[request_id] -= 1
            if not self._active[request_id]:
                del self._active[request_id]
                if request_id in self._dropped:  # nobody waits for what this step held
                    self._dropped.discard(request_id)
                    self._free(request_id)
            self._report()
        await send(("kv", request_id, *reply))

    async def _dispatch(self, message: tuple) -> tuple:
        match message:
            case ("kv_lookup", request_id, hashes):
                await self.engine.settle()
                have = self._hold(request_id).hold_cached(holder_id(request_id), hashes)
                return ("have", tuple(hashes[: len(have)]))
            case ("kv_prefill", request_id, token_ids, hashes, salt):
                await self._prefill(request_id, token_ids, salt)
                await self.engine.settle()  # its blocks are committed and released before we look
                return ("prefilled", self._hold(request_id).hold_cached(holder_id(request_id), hashes))
            case ("kv_reserve", request_id, count):
                await self.engine.settle()
                return ("reserved", self.core.hold_fresh(holder_id(request_id), count))
            case ("kv_send", request_id, transfer):
                try:
                    nbytes, seconds = await self._move(request_id, self.connector.send, transfer)
                finally:
                    self._free(request_id)  # sent or not: the prefill side needs them no more
                return ("sent", nbytes, seconds)
            case ("kv_receive", request_id, transfer, hashes):
                try:
                    nbytes, seconds = await self._move(request_id, self.connector.receive, transfer)
                except BaseException:
                    self._free(request_id)  # contents unknown: back to the free list, unhashed
                    raise
                self.core.cache_held(holder_id(request_id), hashes)
                return ("received", nbytes, seconds)
            case ("kv_audit", _):
                await self.engine.settle()
                try:
                    self.core.check_invariants()
                    problem = None
                except AssertionError as exc:
                    problem = str(exc) or "the block accounting does not add up"
                return ("audit", {"used": self.core.num_used, "free": self.core.num_free, "holding": len(self._holding),
                                  "cached": self.core.num_cached_blocks, "problem": problem})  # fmt: skip
            case _:
                raise ValueError(f"unknown KV transfer message {message!r}")

    async def _prefill(self, request_id: str, token_ids, salt: str | None = None) -> None:
        """Compute the prompt's keys and values here: a one-token greedy request whose blocks stay
        in the prefix cache when it ends (the token is thrown away: the decode side samples), under
        the request's cache `salt`, so they are found by its salted hashes."""
        params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt)
        with anyio.CancelScope() as scope:
            self._prefills[request_id] = scope
            try:
                async for out in self.engine.generate(list(token_ids), params, request_id=request_id):
                    if out.finish_reason == "error":
                        raise RuntimeError(f"the prefill failed ({out.error_code}): {out.error}")
            finally:
                self._prefills.pop(request_id, None)
        if scope.cancelled_caught:
            raise RuntimeError("the prefill was cancelled")

    async def _move(self, request_id: str, half: Callable[[BlockTransfer], int], transfer: BlockTransfer) -> tuple[int, float]:
        """One half of a transfer, in a worker thread. Never abandoned on cancel: the blocks it
        reads or writes stay held until the thread is done (within the connector's timeout)."""
        if not self.core.holds(holder_id(request_id)):
            raise RuntimeError(f"request {request_id} holds no blocks to move")
        started = time.perf_counter()
        nbytes = await anyio.to_thread.run_sync(half, transfer)
        return nbytes, time.perf_counter() - started

    def release(self, request_id: str) -> None:
        """Let go of what `request_id` holds: now, or once the step under way for it ends (a
        transfer's blocks are never let go mid-write); a prefill under way stops."""
        scope = self._prefills.get(request_id)
        if scope is not None:
            scope.cancel()
        if request_id in self._active:
            self._dropped.add(request_id)
        else:
            self._free(request_id)

    def release_all(self) -> None:
        """The front-end is gone: let go of everything held for it."""
        for request_id in list(self._holding | set(self._active)):
            self.release(request_id)

    def _hold(self, request_id: str):
        """The cache core, `request_id` noted as holding blocks (let go of on disconnect)."""
        self._holding.add(request_id)
        return self.core

    def _free(self, request_id: str) -> None:
        if request_id in self._holding:
            self._holding.discard(request_id)
            self.core.free(holder_id(request_id))
            self._report()

    def _report(self) -> None:
        """The engine's KV gauges, which the cache manager refreshes only on its own messages."""
        metrics = self.engine.metrics
        metrics.kv_blocks_used = self.core.num_used
        metrics.kv_blocks_cached = self.core.num_cached_blocks


# --- meeting the other replicas ------------------------------------------------------------------

JOIN_SECONDS = 300.0  # replicas load their models at their own pace before they join
STORE_PREFIX = "cadenza-kv/"


def peer_flag(rank: int, world_size: int, host: str, port: int) -> str:
    """The `--kv-peer` value a replica starts with: its connector rank, the world, the store."""
    return f"{rank}/{world_size}@{host}:{port}"


def host_store(host: str = "127.0.0.1"):
    """The key-value store the replicas' connectors meet in, served by the front-end's process
    (so it outlives any replica) on a free port; returns (store, port)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=JOIN_SECONDS))
    return store, store.port


def join_connector(connector_cls, plugins, runtime, flag: str, *, timeout: float, backend: str) -> KVConnector:
    """Build this replica's connector over its KV cache and join the others (blocks until every
    replica has joined, up to `JOIN_SECONDS`)."""
    from datetime import timedelta

    import torch.distributed as dist

    from cadenza.kv_connectors.base import ConnectorPeers
    from cadenza.parallel.groups import is_loopback

    ranks, _, address = flag.partition("@")
    rank, world_size = (int(x) for x in ranks.split("/"))
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=JOIN_SECONDS))
    connector = plugins.build(connector_cls, runtime.runner.kv_caches, block_size=runtime.block_size,
                              device=runtime.loaded.device)  # fmt: skip
    peers = ConnectorPeers(rank, world_size, dist.PrefixStore(STORE_PREFIX, store), timeout, JOIN_SECONDS, backend,
                           loopback=is_loopback(host))  # fmt: skip
    connector.join(peers)  # the peers' store (and its connection) lives on in what the connector built
    return connector
