"""`DisaggregatedEngine`: data-parallel replicas split into prefill and decode replicas.

Per request (`parallel.disaggregation`, docs/scale-out.md): the router picks a decode replica by
its cached prefix, among the decode replicas. The prompt's full blocks, except a last block that
ends the prompt (the decode side computes at least the last position itself, and samples the
first token there with the request's own sampling state), are the blocks a transfer may bring:

1. the decode replica holds the leading run of those blocks it already caches and answers their
   hashes; when it has them all, nothing else happens (step 5);
2. the router picks a prefill replica, which computes the prompt (its own prefix cache helps)
   and holds its blocks;
3. the decode replica reserves room for the blocks it lacks;
4. both halves of one `BlockTransfer` run at once, the prefill replica's connector sending only
   the blocks after those the decode replica has; the received blocks enter its prefix cache;
5. the request goes to the decode replica as to any replica; its admission finds the prompt's
   blocks cached and computes only the tail past them (1 to block_size tokens), then streams.

A replica that dies during 1-4 ends the request with `REPLICA_FAILED` (and, being local, the
engine turns unhealthy, as any dead replica does); a step that fails on a live replica (a prefill
refused, a transfer that timed out) falls back to the decode replica computing the whole prompt.
Either way both sides let go of what they held (a receive whose sender died is aborted, so its
blocks go back at once, whatever the connector waits for). Transfers between one pair of replicas run one
at a time, so a connector never sees two of a pair's transfers interleave. A pair whose transfer
failed with both replicas alive is not used again (a gloo group whose wait timed out has closed
that connection for good): its decode replica then computes its prompts itself, or takes them
from another prefill replica.

Requests that disaggregation does not help run on one replica like any data-parallel request:
prompts of no transferable block and requests for prompt logprobs on a decode replica,
embeddings on a prefill replica.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

import anyio
import structlog

from cadenza.actors.cache_manager import reusable_hashes
from cadenza.cluster.dp_engine import DataParallelEngine
from cadenza.cluster.replica_client import KVStepError, ReplicaClient
from cadenza.engine.streams import GenerationOutput
from cadenza.kv_connectors.base import BlockTransfer
from cadenza.parallel.errors import ReplicaFailedError
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


@dataclass
class TransferStats:
    """What disaggregation moved, for /metrics and the bench (counts since start)."""

    requests: int = 0  # requests that took the disaggregated path
    transfers: int = 0  # transfers that completed
    blocks_sent: int = 0
    blocks_skipped: int = 0  # prompt blocks the decode replica already had: not sent
    bytes_sent: int = 0
    seconds: float = 0.0  # transfers' wall time, both halves done
    prefill_seconds: float = 0.0  # prefill replicas computing prompts, as the front-end waited
    tokens_sent: int = 0  # prompt tokens in the blocks sent
    in_flight: int = 0  # transfers under way now
    failed: int = 0  # requests ended because a replica they needed died during 1-4
    fallbacks: int = 0  # steps that failed on live replicas: the decode replica computed the prompt
    broken_pairs: int = 0  # (prefill, decode) pairs no longer used after a transfer failed between them


class DisaggregatedEngine(DataParallelEngine):
    """`DataParallelEngine` whose requests are prefilled on one replica and decoded on another."""

    def __init__(self, runtime, clients: list[ReplicaClient], max_pending_tokens: int) -> None:
        super().__init__(runtime, clients, max_pending_tokens)
        self.roles = runtime.roles
        self.transfers = TransferStats()
        self._transfer_ids = itertools.count(1)
        self._pairs: dict[tuple[int, int], anyio.Lock] = {}
        self._broken: set[tuple[int, int]] = set()  # pairs a transfer failed between, both alive

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[GenerationOutput]:
        params, request_id, ids = self._accept(prompt, params, request_id)
        if params.pooling is not None:  # prefill only: a prefill replica's work, whole
            index, prepare = self.router.route(ids, among=self.roles.prefill, salt=params.cache_salt), None
        else:
            index = self.router.route(ids, among=self.roles.decode, salt=params.cache_salt)
            # Full blocks only, and never one that ends the prompt: the decode side computes the rest.
            hashes = reusable_hashes(ids, self.router.block_size, params.cache_salt)
            prepare = None
            if hashes and params.prompt_logprobs is None:  # logprobs of every prompt position: computed where sampled

                async def prepare() -> None:
                    await self._bring_blocks(request_id, ids, hashes, index, params.cache_salt)

        async for output in self._relay(index, request_id, prompt, params, priority, prepare):
            yield output

    async def _bring_blocks(self, request_id: str, ids: list[int], hashes: list[bytes], decode: int,
                            salt: str | None = None) -> None:
        """Steps 1-4 of the module docstring. Raises `ReplicaFailedError` when a replica died;
        anything else leaves the decode replica to compute the prompt itself."""
        self.transfers.requests += 1
        target, prefill, sent_on = self.clients[decode], None, False
        try:
            (have,) = await target.call(("kv_lookup", request_id, hashes))
            sources = [p for p in self.roles.prefill if (p, decode) not in self._broken]
            if len(have) < len(hashes) and sources:
                prefill = self.router.route(ids, among=sources, salt=salt)
                try:
                    await self._prefill_and_send(request_id, ids, hashes, have, prefill, decode, salt)
                finally:
                    self.router.finished(prefill)
            self.transfers.blocks_skipped += len(have)
            sent_on = True
        except ReplicaFailedError as exc:
            self.transfers.failed += 1
            log.error("Disaggregated request lost a replica", request_id=request_id, error=str(exc))
            raise
        except (KVStepError, RuntimeError) as exc:  # the replicas serve on: the decode side computes the prompt
            self.transfers.fallbacks += 1
            sent_on = True
            log.warning("KV transfer failed; the decode replica computes the prompt", request_id=request_id, error=str(exc))
        finally:
            # Nothing stays held for it: the prefill side lets go now; the decode side once the
            # request runs there (serve_router), or now when it will not be sent there.
            for index in (prefill, None if sent_on else decode):
                if index is not None:
                    await _tell(self.clients[index], ("kv_release", request_id))

    async def _prefill_and_send(self, request_id: str, ids: list[int], hashes: list[bytes], have: tuple[bytes, ...],
                                prefill: int, decode: int, salt: str | None = None) -> None:  # fmt: skip
        """Steps 2-4: the prompt computed on `prefill`, the blocks `decode` lacks sent there."""
        source, target = self.clients[prefill], self.clients[decode]
        started = time.perf_counter()
        (held,) = await source.call(("kv_prefill", request_id, ids, hashes, salt))
        self.transfers.prefill_seconds += time.perf_counter() - started
        missing = max(0, len(held) - len(have))  # blocks the prefill side evicted meanwhile are computed by the decode side
        (room,) = await target.call(("kv_reserve", request_id, missing))
        count = min(len(room), missing)
        if count:
            transfer = BlockTransfer(next(self._transfer_ids), prefill, decode,
                                     tuple(held[len(have) : len(have) + count]), tuple(room[:count]))  # fmt: skip
            await self._transfer(request_id, source, target, transfer, hashes[len(have) : len(have) + count])

    async def _transfer(self, request_id: str, source: ReplicaClient, target: ReplicaClient, transfer: BlockTransfer,
                        hashes: list[bytes]) -> None:  # fmt: skip
        """Both halves at once, one transfer at a time per pair; a dead replica's half raises
        `ReplicaFailedError` (preferred to the other half's error, which it caused)."""
        outcomes: dict[str, Any] = {}

        async def half(name: str, client: ReplicaClient, message: tuple, tg) -> None:
            try:
                outcomes[name] = await client.call(message)
            except Exception as exc:
                outcomes[name] = exc
                if isinstance(exc, ReplicaFailedError):
                    tg.cancel_scope.cancel()  # no use waiting for the other half: the request is lost
                    if name == "send":  # a receive waiting on a dead sender ends now, not at its timeout
                        await _tell(target, ("kv_abort", request_id, transfer.transfer_id))

        lock = self._pairs.setdefault((transfer.source, transfer.destination), anyio.Lock())
        async with lock:
            started = time.perf_counter()
            self.transfers.in_flight += 1
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(half, "send", source, ("kv_send", request_id, transfer), tg)
                    tg.start_soon(half, "receive", target, ("kv_receive", request_id, transfer, hashes), tg)
            finally:
                self.transfers.in_flight -= 1
            seconds = time.perf_counter() - started
        errors = [o for o in outcomes.values() if isinstance(o, Exception)]
        lost = next((e for e in errors if isinstance(e, ReplicaFailedError)), None)
        if lost is not None:
            raise lost
        if errors:  # both alive, yet the transfer failed: this pair's connection is not to be trusted again
            self._broken.add((transfer.source, transfer.destination))
            self.transfers.broken_pairs = len(self._broken)
            log.error("KV transfers between these replicas stop; the decode replica computes prompts itself",
                      source=transfer.source, destination=transfer.destination, error=str(errors[0]))  # fmt: skip
            raise errors[0]
        nbytes = outcomes["receive"][0]
        stats = self.transfers
        stats.transfers += 1
        stats.blocks_sent += transfer.num_blocks
        stats.tokens_sent += transfer.num_blocks * self.router.block_size
        stats.bytes_sent += nbytes
        stats.seconds += seconds
        log.debug("KV blocks transferred", request_id=request_id, blocks=transfer.num_blocks, bytes=nbytes,
                  ms=round(seconds * 1000, 2), source=transfer.source, destination=transfer.destination)  # fmt: skip

    async def audit(self, index: int) -> dict:
        """Replica `index`'s block accounting: blocks in use, requests holding blocks for a
        transfer, and `problem` (None when every block is free, evictable or referenced once)."""
        (report,) = await self.clients[index].call(("kv_audit", f"audit-{next(self._transfer_ids)}"))
        return report

    def replica_metrics(self) -> list[dict[str, Any]]:
        return [{**row, "role": self.roles.role(row["replica"])} for row in super().replica_metrics()]

    def register_metrics(self, registry) -> None:
        """The replicas' gauges, and `cadenza_kv_transfer_*`: what disaggregation moved."""
        super().register_metrics(registry)
        from prometheus_client.core import GaugeMetricFamily

        engine = self

        class _Collector:
            def collect(self):
                for key, value in asdict(engine.transfers).items():
                    family = GaugeMetricFamily(f"cadenza_kv_transfer_{key}", f"Prefill/decode disaggregation: {key}")
                    family.add_metric([], float(value))
                    yield family

        registry.register(_Collector())


async def _tell(client: ReplicaClient, message: tuple) -> None:
    """Send `message` (one that has no answer) to a live replica, even from a cancelled scope;
    a broken connection needs none: the replica lets go of everything its connection held."""
    with anyio.CancelScope(shield=True):
        if client.failure is None:
            try:
                await client.send(message)
            except Exception:
                pass
