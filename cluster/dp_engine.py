"""`DataParallelEngine`: `AsyncEngine`'s interface over data-parallel replicas.

`generate` tokenizes the prompt (only to route it: the replica tokenizes again, exactly as it
would alone), asks the `Router` for a replica, sends the request over that replica's connection
(`ReplicaClient`, `replica_client.py`) and relays its outputs. A replica whose connection drops, or that reports itself
unhealthy, ends its open requests with `engine_failed` (`REPLICA_FAILED`) and the router sends it
nothing more. Then either its handle `restarts` (a Ray actor with restarts left): the others serve
meanwhile, and once the restarted replica reports ready the engine connects to it and routes there
again; or it does not (a local replica): the engine turns unhealthy.

It reads the runtime it serves (`ReplicaFrontEnd`, `replicas.py`) only through `ReplicaSet`'s
attributes, so this module imports no launcher.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

import anyio
import structlog

from cadenza.cluster.replica_client import REPLICA_FAILED, ReplicaClient
from cadenza.cluster.replica_server import error_output
from cadenza.cluster.router import Router
from cadenza.engine.async_engine import SERVER_SHUTDOWN, EngineClosedError
from cadenza.engine.streams import GenerationOutput
from cadenza.metrics import EngineMetrics
from cadenza.models.prompts import tokenize_prompt
from cadenza.parallel.errors import ReplicaFailedError
from cadenza.parallel.lifecycle import ManagedProcess
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

METRICS_SECONDS = 1.0
RESTART_SECONDS = 300.0  # longest wait for a restarted replica to report ready
DEATH_SECONDS = 10.0  # longest wait for a replica's handle to see the death its dropped connection showed


class ReplicaSet(Protocol):
    """What the engine reads of the runtime it serves (`replicas.ReplicaFrontEnd`)."""

    config: Any
    loaded: Any  # .arch, .tokenizer
    replicas: Sequence[ManagedProcess]  # each with its `address` once ready
    num_blocks: int
    closed: bool

    @property
    def tokenizer(self) -> Any: ...

    @property
    def block_size(self) -> int: ...


class DataParallelEngine:
    """`AsyncEngine`'s interface over replicas, each request sent where the router says."""

    def __init__(self, runtime: ReplicaSet, clients: list[ReplicaClient], max_pending_tokens: int) -> None:
        self.runtime = runtime
        self.clients = clients
        self.router = Router(len(clients), runtime.block_size, runtime.config.parallel.router, capacity_blocks=runtime.num_blocks)
        self.metrics = EngineMetrics()
        self.max_pending_tokens = max_pending_tokens
        self._open: dict[str, int] = {}  # request id -> replica
        self._accepting = False
        self._changed = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None
        self.restarted = [0] * len(clients)  # per replica: how often it came back

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, runtime: ReplicaSet, *, shutdown_grace: float = 5.0, max_pending_tokens: int = 1 << 16
    ) -> AsyncIterator["DataParallelEngine"]:
        clients = [await ReplicaClient.connect(i, r) for i, r in enumerate(runtime.replicas)]
        engine = cls(runtime, clients, max_pending_tokens)
        async with anyio.create_task_group() as tg:
            engine._tasks = tg
            for client in clients:
                engine._watch(client)
            tg.start_soon(engine._poll_replicas)
            engine._accepting = True
            log.info("Started data-parallel engine", replicas=len(clients), router=engine.router.policy)
            try:
                yield engine
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.shutdown(shutdown_grace)
                    for client in engine.clients:
                        client.closing = True
                        await client.frames.aclose()  # the replica cancels whatever still ran for us
                tg.cancel_scope.cancel()

    def _watch(self, client: ReplicaClient) -> None:
        client.on_metrics = self._aggregate
        client.on_failure = self._replica_failed
        self._tasks.start_soon(client.read)

    def _replica_failed(self, client: ReplicaClient) -> None:
        """Route nothing more there; wait for it to come back where its handle restarts it."""
        self.router.mark_dead(client.index)
        if client.handle.restarts and not client.closing and not self.runtime.closed:
            client.recovering = True
            self._tasks.start_soon(self._recover, client)
        else:
            self._accepting = False

    async def _recover(self, failed: ReplicaClient) -> None:
        index, handle = failed.index, failed.handle
        deadline = anyio.current_time() + RESTART_SECONDS
        try:
            if failed.unhealthy:  # it runs, but cannot serve: restart it
                await anyio.to_thread.run_sync(handle.kill, abandon_on_cancel=True)
            with anyio.move_on_after(DEATH_SECONDS):  # a dropped connection is its death: let the handle see it
                while handle.is_alive():
                    await anyio.sleep(0.1)
            while True:  # the next incarnation's address, until one answers
                left = max(1.0, deadline - anyio.current_time())
                address = await anyio.to_thread.run_sync(handle.wait_ready, left, abandon_on_cancel=True)
                try:
                    client = await ReplicaClient.connect(index, handle, address)
                    break
                except OSError:
                    if anyio.current_time() > deadline:
                        raise
                    await anyio.sleep(0.5)
        except Exception as exc:
            failed.recovering = False
            failed.failure = f"{failed.failure}; it did not come back: {exc}"
            log.error("Replica did not come back", replica=index, error=str(exc))
            self._accepting = False
            return
        with anyio.move_on_after(1, shield=True):
            await failed.frames.aclose()
        self.clients[index] = client
        self._watch(client)
        self.router.revive(index)
        self.restarted[index] += 1
        log.info("Replica restarted and serving again", replica=index, port=address.port, restarts=self.restarted[index])

    async def _poll_replicas(self) -> None:
        """Per-replica metrics and liveness, every METRICS_SECONDS: a dead replica fails its client."""
        while True:
            for client in list(self.clients):
                if client.failure is not None:
                    continue
                if not client.handle.is_alive():
                    client.fail(client.handle.failure() or f"data-parallel replica {client.index} is not running")
                    continue
                try:
                    await client.send(("metrics",))
                except Exception as exc:
                    client.fail(f"lost data-parallel replica {client.index}: {exc!r}")
            await anyio.sleep(METRICS_SECONDS)

    def _aggregate(self) -> None:
        totals: dict[str, float] = {}
        for client in self.clients:
            for key, value in client.snapshot.items():
                if isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
        for key, value in totals.items():
            if hasattr(self.metrics, key) and not isinstance(getattr(type(self.metrics), key, None), property):
                current = getattr(self.metrics, key)
                if isinstance(current, (int, float)) and key != "prefix_hit_rate":
                    setattr(self.metrics, key, type(current)(value))
        if self.metrics.prompt_tokens:
            self.metrics.prefix_hit_rate = self.metrics.prefix_cached_tokens / self.metrics.prompt_tokens

    def replica_metrics(self) -> list[dict[str, Any]]:
        """Per replica: the router's counts and the replica's own engine metrics."""
        return [
            {"replica": i, "alive": s.alive, "in_flight": s.in_flight, "routed": s.routed, "restarts": self.restarted[i],
             "predicted_prefix_blocks": s.matched_blocks, "prompt_blocks": s.prompt_blocks, **c.snapshot}
            for i, (s, c) in enumerate(zip(self.router.stats, self.clients))
        ]  # fmt: skip

    def register_metrics(self, registry) -> None:
        """Per-replica Prometheus gauges (`cadenza_replica_*{replica="i"}`) in `registry`."""
        from prometheus_client.core import GaugeMetricFamily

        engine = self

        class _Collector:
            def collect(self):
                rows = engine.replica_metrics()
                for name, key in (("in_flight", "in_flight"), ("routed", "routed"), ("generation_tokens", "generation_tokens"),
                                  ("prefix_cached_tokens", "prefix_cached_tokens"), ("prefix_hit_rate", "prefix_hit_rate"),
                                  ("restarts", "restarts")):  # fmt: skip
                    family = GaugeMetricFamily(f"cadenza_replica_{name}", f"Per data-parallel replica: {name}", labels=["replica"])
                    for row in rows:
                        family.add_metric([str(row["replica"])], float(row.get(key, 0) or 0))
                    yield family

        registry.register(_Collector())

    # --- AsyncEngine's interface -----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        """A replica that failed for good, or every replica down at once; one coming back while
        another serves is not a failure of the engine."""
        failures = [c for c in self.clients if c.failure]
        for client in failures:
            if not client.recovering:
                return client.failure
        if failures and len(failures) == len(self.clients):
            return f"every data-parallel replica is restarting; {failures[0].failure}"
        return None

    @property
    def num_active_requests(self) -> int:
        return len(self._open)

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[GenerationOutput]:
        params, request_id, ids = self._accept(prompt, params, request_id)
        async for output in self._relay(self.router.route(ids, salt=params.cache_salt), request_id, prompt, params, priority):
            yield output

    def _accept(self, prompt: Any, params: SamplingParams | None, request_id: str | None) -> tuple[SamplingParams, str, list[int]]:
        """Check a new request; returns its params, its id and its prompt's token ids (to route it:
        the replica tokenizes again, exactly as it would alone)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n={params.n}: generate streams one completion per request")
        if not self._accepting or not self.healthy:
            raise EngineClosedError(self.unhealthy_reason or "the engine is not accepting requests")
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        if request_id in self._open:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            ids = tokenize_prompt(prompt, self.runtime.tokenizer, self.runtime.loaded.arch.vocab_size)[1]
        except ValueError:
            ids = []  # the replica's ingress reports the bad prompt, as it would alone
        return params, request_id, ids

    async def _relay(
        self, index: int, request_id: str, prompt: Any, params: SamplingParams, priority: int,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[GenerationOutput]:  # fmt: skip
        """Send the request to replica `index` (routed there) and relay its outputs. `prepare`
        runs first, the request already open (so shutdown and `end_requests` reach it): a
        `ReplicaFailedError` from it ends the request with `REPLICA_FAILED` without sending it."""
        client = self.clients[index]
        # Bounded in outputs (each a merge of what the replica had ready), the engine's bound in tokens.
        send, receive = anyio.create_memory_object_stream[GenerationOutput](self.max_pending_tokens)
        client.streams[request_id] = send
        self._open[request_id] = index
        self.metrics.requests_started += 1
        finished = False
        try:
            if prepare is not None:
                try:
                    await prepare()
                except ReplicaFailedError as exc:  # a replica the request needed first failed
                    client.end(request_id, REPLICA_FAILED, str(exc))
            if request_id in client.streams:  # not ended meanwhile
                try:
                    await client.send(("generate", request_id, prompt, params, priority))
                except Exception as exc:  # its connection broke: it ends like the replica's other requests
                    client.fail(f"lost data-parallel replica {index}: {exc!r}")
            async with receive:
                async for output in receive:
                    finished = output.finished
                    yield output
                    if finished:
                        return
            # The stream was closed with its last output undelivered (its buffer was full).
            finished = True
            yield error_output(request_id, REPLICA_FAILED, client.failure or "the replica's stream ended early")
        finally:
            client.streams.pop(request_id, None)
            if not finished and client.failure is None:
                with anyio.CancelScope(shield=True):
                    try:
                        await client.send(("abort", request_id))
                    except Exception:
                        pass
            self._open.pop(request_id, None)
            self.router.finished(index)
            self.metrics.requests_ended += 1
            self._changed.set()

    async def abort(self, request_id: str) -> None:
        index = self._open.get(request_id)
        if index is not None:
            client = self.clients[index]
            client.end(request_id, "abort", "aborted", finish_reason="abort")
            if client.failure is None:
                await client.send(("abort", request_id))

    async def wait_for_requests(self, timeout: float) -> int:
        self._accepting = False
        with anyio.move_on_after(timeout):
            while self._open:
                self._changed = anyio.Event()
                await self._changed.wait()
        return len(self._open)

    async def end_requests(self, code: str, message: str) -> int:
        ended = list(self._open.items())
        for request_id, index in ended:
            self.clients[index].end(request_id, code, message)
        return len(ended)

    async def shutdown(self, grace: float) -> None:
        await self.wait_for_requests(grace)
        ended = await self.end_requests(SERVER_SHUTDOWN, "the server is shutting down")
        if ended:
            log.info("Ended requests still running", requests=ended, error_code=SERVER_SHUTDOWN)

    async def settle(self) -> None:
        """Nothing to wait for here: each replica's cache settles on its own."""
