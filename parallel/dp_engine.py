"""`DataParallelEngine`: `AsyncEngine`'s interface over data-parallel replicas.

`generate` tokenizes the prompt (only to route it: the replica tokenizes again, exactly as it
would alone), asks the `Router` for a replica, sends the request over that replica's connection
(`ReplicaClient`) and relays its outputs. A replica whose connection drops, or that reports itself
unhealthy, ends its open requests with `engine_failed` and makes the engine unhealthy.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import structlog

from cadenza.engine import SERVER_SHUTDOWN, EngineClosedError
from cadenza.metrics import EngineMetrics
from cadenza.parallel.errors import ReplicaFailedError
from cadenza.parallel.replica_server import error_output
from cadenza.parallel.replicas import FrontendRuntime, ReplicaProcess
from cadenza.parallel.router import Router
from cadenza.parallel.wire import FrameStream
from cadenza.prompts import tokenize_prompt
from cadenza.sampling_params import SamplingParams
from cadenza.streams import GenerationOutput

log = structlog.get_logger(__name__)

METRICS_SECONDS = 1.0


class ReplicaClient:
    """The server's connection to one replica: sends requests, routes outputs to their streams."""

    def __init__(self, replica: ReplicaProcess, frames: FrameStream) -> None:
        self.replica = replica
        self.frames = frames
        self.closing = False
        self.on_metrics = lambda: None
        self.streams: dict[str, anyio.abc.ObjectSendStream[GenerationOutput]] = {}
        self.snapshot: dict[str, float] = {}
        self.failure: str | None = None

    @classmethod
    async def connect(cls, replica: ReplicaProcess) -> "ReplicaClient":
        return cls(replica, FrameStream(await anyio.connect_tcp(replica.host, replica.port)))

    async def send(self, message: tuple) -> None:
        await self.frames.send(message)

    async def read(self) -> None:
        """Deliver outputs until the connection ends; then every open request ends with an error."""
        try:
            while True:
                message = await self.frames.receive()
                match message:
                    case ("out", batch):
                        for request_id, out in batch:
                            stream = self.streams.get(request_id)
                            if stream is None:
                                continue
                            try:
                                stream.send_nowait(out)
                            except anyio.WouldBlock:  # its reader fell too far behind: cut it off
                                self.end(request_id, "slow_reader", "the client is not reading the stream")
                                await self.send(("abort", request_id))
                            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                                self.streams.pop(request_id, None)
                    case ("metrics", snapshot, healthy):
                        self.snapshot = snapshot
                        self.on_metrics()
                        if not healthy:
                            self.fail(f"data-parallel replica {self.replica.index} is unhealthy")
                    case _:
                        raise ReplicaFailedError(f"unknown message from replica {self.replica.index}: {message!r}")
        except Exception as exc:
            if not self.closing:
                self.fail(f"lost data-parallel replica {self.replica.index}: {exc!r}")

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("Replica failed", replica=self.replica.index, reason=reason)
        for request_id in list(self.streams):
            self.end(request_id, "engine_failed", reason)

    def end(self, request_id: str, code: str, message: str, finish_reason: str = "error") -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            last = error_output(request_id, code, message)
            if finish_reason != "error":
                last = GenerationOutput(request_id, "", (), None, finish_reason, 0, 0, 0)
            try:
                stream.send_nowait(last)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            stream.close()


class DataParallelEngine:
    """`AsyncEngine`'s interface over replicas, each request sent where the router says."""

    def __init__(self, runtime: FrontendRuntime, clients: list[ReplicaClient], max_pending_tokens: int) -> None:
        self.runtime = runtime
        self.clients = clients
        self.router = Router(len(clients), runtime.block_size, runtime.config.parallel.router, capacity_blocks=runtime.num_blocks)
        self.metrics = EngineMetrics()
        self.max_pending_tokens = max_pending_tokens
        self._open: dict[str, int] = {}  # request id -> replica
        self._accepting = False
        self._changed = anyio.Event()

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, runtime: FrontendRuntime, *, shutdown_grace: float = 5.0, max_pending_tokens: int = 1 << 16
    ) -> AsyncIterator["DataParallelEngine"]:
        clients = [await ReplicaClient.connect(r) for r in runtime.replicas]
        engine = cls(runtime, clients, max_pending_tokens)
        async with anyio.create_task_group() as tg:
            for client in clients:
                client.on_metrics = engine._aggregate
                tg.start_soon(client.read)
            tg.start_soon(engine._poll_replicas)
            engine._accepting = True
            log.info("Started data-parallel engine", replicas=len(clients), router=engine.router.policy)
            try:
                yield engine
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.shutdown(shutdown_grace)
                    for client in clients:
                        client.closing = True
                        await client.frames.aclose()  # the replica cancels whatever still ran for us
                tg.cancel_scope.cancel()

    async def _poll_replicas(self) -> None:
        """Per-replica metrics and liveness, every METRICS_SECONDS: a dead replica fails the engine."""
        while True:
            for index, client in enumerate(self.clients):
                reason = client.failure or (self.runtime.failure() if not self.runtime.closed else None)
                if reason is None and client.replica.exit_status() is None:
                    try:
                        await client.send(("metrics",))
                    except Exception as exc:
                        client.fail(f"lost data-parallel replica {index}: {exc!r}")
                if client.failure is not None and self.router.stats[index].alive:
                    self.router.mark_dead(index)
                    self._accepting = False
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
            {"replica": i, "alive": s.alive, "in_flight": s.in_flight, "routed": s.routed,
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
                                  ("prefix_cached_tokens", "prefix_cached_tokens"), ("prefix_hit_rate", "prefix_hit_rate")):  # fmt: skip
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
        return next((c.failure for c in self.clients if c.failure), None)

    @property
    def num_active_requests(self) -> int:
        return len(self._open)

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[GenerationOutput]:
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
        index = self.router.route(ids)
        client = self.clients[index]
        # Bounded in outputs (each a merge of what the replica had ready), the engine's bound in tokens.
        send, receive = anyio.create_memory_object_stream[GenerationOutput](self.max_pending_tokens)
        client.streams[request_id] = send
        self._open[request_id] = index
        self.metrics.requests_started += 1
        finished = False
        try:
            await client.send(("generate", request_id, prompt, params, priority))
            async with receive:
                async for output in receive:
                    finished = output.finished
                    yield output
                    if finished:
                        return
            # The stream was closed with its last output undelivered (its buffer was full).
            finished = True
            yield error_output(request_id, "engine_failed", client.failure or "the replica's stream ended early")
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
            self.clients[index].end(request_id, "abort", "aborted", finish_reason="abort")
            await self.clients[index].send(("abort", request_id))

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
