"""`AsyncEngine`: five actors wired by typed, bounded channels, behind `generate` and `abort`.

    async with AsyncEngine.serve(runtime) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

Life of a request: ingress (validate, template, tokenize) -> scheduler (admit, plan steps) <->
cache manager (blocks, prefix cache) -> runner (model + samplers) -> scheduler -> detokenizer
(text, stop strings, finish) -> the caller's `RequestStream`.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import structlog

from cadenza.actors.base import Actor, channel
from cadenza.actors.cache_manager import CacheManagerActor, KVCacheManager
from cadenza.actors.detokenizer import DetokenizerActor, IncrementalDetokenizer
from cadenza.actors.ingress import IngressActor, PromptValidator
from cadenza.actors.messages import (
    AbortRequest,
    CacheMessage,
    DetokenizerMessage,
    IngressMessage,
    RunnerMessage,
    SchedulerMessage,
    SubmitRequest,
    SyncCache,
    TierMessage,
)
from cadenza.actors.runner import RunnerActor
from cadenza.actors.scheduler import SchedulerActor
from cadenza.actors.scheduler_core import SchedulerCore
from cadenza.actors.tier_agent import TierAgent
from cadenza.engine.streams import GenerationOutput, RequestStream
from cadenza.kernels.cpu import loader as cpu_kernels
from cadenza.kv_connectors.blocks import cache_tensors
from cadenza.metrics import EngineMetrics
from cadenza.outputs import TextDelta
from cadenza.pooling_params import PoolingParams
from cadenza.runtime.build import Runtime
from cadenza.runtime.tiers import build_tiers
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.setup import built_methods
from cadenza.threads.binding import bind_compute_team, release_compute_team
from cadenza.threads.governor import thread_governor

log = structlog.get_logger(__name__)

INBOX_CAPACITY = 4096


# The error code of requests still running when the engine (or the server) shuts down.
SERVER_SHUTDOWN = "server_shutdown"


class EngineClosedError(RuntimeError):
    """The engine is shutting down or unhealthy and takes no new requests."""


class AsyncEngine:
    def __init__(self, runtime: Runtime, *, max_pending_tokens: int = 1 << 16) -> None:
        self.runtime = runtime
        self.max_pending_tokens = max_pending_tokens  # per stream, before a slow reader is cut off
        self.metrics = EngineMetrics()
        self._streams: dict[str, RequestStream] = {}
        self._streams_closed: anyio.Event | None = None  # set when a stream leaves or ends, while shutdown waits
        self._accepting = False
        self._unhealthy_reason: str | None = None
        self._ids = itertools.count()
        self._build()

    # --- wiring ---------------------------------------------------------------------------------

    def _build(self) -> None:
        rt, cfg = self.runtime, self.runtime.config
        ingress_tx, ingress_rx = channel(IngressMessage, INBOX_CAPACITY)
        scheduler_tx, scheduler_rx = channel(SchedulerMessage, INBOX_CAPACITY)
        cache_tx, cache_rx = channel(CacheMessage, INBOX_CAPACITY)
        runner_tx, runner_rx = channel(RunnerMessage, 4)
        detok_tx, detok_rx = channel(DetokenizerMessage, INBOX_CAPACITY)
        self._ingress, self._scheduler_inbox, self._cache_inbox = ingress_tx, scheduler_tx, cache_tx.clone()
        self.cache_core = KVCacheManager(
            rt.num_blocks, rt.block_size, rt.make_eviction_policy(), cfg.cache.enable_prefix_caching
        )
        tiers = build_tiers(rt)
        self.scheduler_core = SchedulerCore(
            cfg.scheduler,
            block_size=rt.block_size,
            eos_token_ids=rt.tokenizer.eos_token_ids,
            max_model_len=rt.max_model_len,
            speculative=cfg.speculative,
            device_type=rt.loaded.device.type,
            gate_reads=bool(tiers),
        )
        tier_tx, tier_rx = channel(TierMessage, INBOX_CAPACITY) if tiers else (None, None)
        validator = PromptValidator(
            rt.tokenizer,
            vocab_size=rt.loaded.arch.vocab_size,
            max_model_len=rt.max_model_len,
            max_prompt_tokens=cfg.server.max_prompt_tokens,
            capacity_tokens=rt.num_blocks * rt.block_size,
            extra_params=rt.extra_params,
            speculative_methods=built_methods(rt.runner),
        )
        bind_compute_team(rt.team_plan, functools.partial(cpu_kernels.configure, cfg.model.cpu_kernels))
        self.actors: list[Actor] = [
            IngressActor(
                ingress_rx,
                validator,
                scheduler=scheduler_tx.clone(),
                detokenizer=detok_tx.clone(),
                metrics=self.metrics,
                is_cancelled=lambda rid: rid not in self._streams or self._streams[rid].cancelled,
            ),
            SchedulerActor(
                scheduler_rx,
                self.scheduler_core,
                cache=cache_tx,
                runner=runner_tx,
                detokenizer=detok_tx.clone(),
                metrics=self.metrics,
                tiers=tier_tx.clone() if tier_tx else None,
            ),
            CacheManagerActor(cache_rx, self.cache_core, self.metrics, tier_tx.clone() if tier_tx else None),
            RunnerActor(runner_rx, rt.runner, scheduler_tx.clone(), self.metrics, governor=thread_governor(rt)),
            DetokenizerActor(detok_rx, IncrementalDetokenizer(rt.tokenizer), self._deliver, scheduler_tx.clone(), self.metrics),
        ]
        if tiers:
            self.actors.append(TierAgent(tier_rx, self.cache_core, cache_tensors(rt.runner.kv_caches), tiers,
                                         scheduler=scheduler_tx.clone(), metrics=self.metrics))  # fmt: skip
            tier_tx.close()
        detok_tx.close()  # only the clones held by actors stay open

    def _deliver(self, delta: TextDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is not None and stream.put(delta):
            # The reader fell too far behind: its stream has ended, so stop generating for it.
            try:
                self._scheduler_inbox.send_nowait(AbortRequest(delta.request_id, "abort"))
            except anyio.WouldBlock:
                log.warning("Could not abort a slow reader's request", request_id=delta.request_id)

    # --- lifecycle ------------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, runtime: Runtime, *, shutdown_grace: float = 5.0, max_pending_tokens: int = 1 << 16
    ) -> AsyncIterator["AsyncEngine"]:
        """Start the actors, yield the running engine; on exit, `shutdown(shutdown_grace)` and stop."""
        engine = cls(runtime, max_pending_tokens=max_pending_tokens)
        async with anyio.create_task_group() as tg:
            for actor in engine.actors:
                await tg.start(engine._supervise, actor)
            if runtime.parallel is not None:
                tg.start_soon(engine._watch_runtime)
            engine._accepting = True
            log.info("Started engine", actors=[a.name for a in engine.actors], kv_blocks=runtime.num_blocks)
            try:
                yield engine
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.shutdown(shutdown_grace)
                tg.cancel_scope.cancel()
        release_compute_team()  # pins would outlive the engine: in the team, and in what its thread starts next
        log.info("Engine stopped")

    async def _supervise(self, actor: Actor, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await actor.run(task_status=task_status)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._mark_unhealthy(f"actor {actor.name} failed: {exc!r}")

    async def _watch_runtime(self) -> None:
        """A tensor-parallel rank that dies fails the engine (health, requests) even while idle."""
        while (reason := self.runtime.failure()) is None:
            await anyio.sleep(0.25)
        self._mark_unhealthy(reason)

    def _mark_unhealthy(self, reason: str) -> None:
        if self._unhealthy_reason is not None:
            reason = self._unhealthy_reason  # the first failure is the cause; later ones follow from it
        self._unhealthy_reason = reason
        self._accepting = False
        log.error("Engine unhealthy", reason=reason)
        self._end_streams("engine_failed", reason)

    async def shutdown(self, grace: float) -> None:
        """Stop accepting; let running requests finish within `grace` seconds; end the rest with
        error_code "server_shutdown". Returns at once when nothing is running (a server that has
        already ended its requests does not wait a second grace)."""
        await self.wait_for_requests(grace)
        ended = await self.end_requests(SERVER_SHUTDOWN, "the server is shutting down")
        if ended:
            log.info("Ended requests still running", requests=ended, error_code=SERVER_SHUTDOWN)

    async def wait_for_requests(self, timeout: float) -> int:
        """Stop accepting; wait up to `timeout` seconds for the running requests to finish.

        Returns how many still run. A request counts as running until its stream has its last
        output, whether or not its reader has taken it yet.
        """
        self._accepting = False
        if self._num_running():
            log.info("Waiting for requests to finish", requests=self._num_running(), grace_seconds=timeout)
            with anyio.move_on_after(timeout):
                while self._num_running():
                    self._streams_closed = anyio.Event()  # set as a stream leaves, or by end_requests
                    await self._streams_closed.wait()
        return self._num_running()

    async def end_requests(self, code: str, message: str) -> int:
        """End every running request now and free its KV blocks; returns how many.

        Each stream's last output has finish_reason "error" with `code` and `message`; the stream
        is then finished, so the abort's own "abort" delivery (and any token still on its way) is
        dropped and each request finishes exactly once.
        """
        ended = self._end_streams(code, message)
        for stream in ended:
            await self._scheduler_inbox.send(AbortRequest(stream.request_id, "abort"))
        return len(ended)

    def _end_streams(self, code: str, message: str) -> list[RequestStream]:
        """Give every unfinished stream its last output, an error with `code`; returns them."""
        ended = [stream for stream in self._streams.values() if not stream.finished]
        for stream in ended:
            stream.cancelled = True  # the ingress drops it if it has not admitted it yet
            stream.put(TextDelta(stream.request_id, "", (), None, "error", error=message, error_code=code))
        if self._streams_closed is not None:
            self._streams_closed.set()
        return ended

    def _num_running(self) -> int:
        return sum(not stream.finished for stream in self._streams.values())

    @property
    def healthy(self) -> bool:
        return self._unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        return self._unhealthy_reason

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def register_metrics(self, registry) -> None:
        """Add what the engine reports beyond `metrics` to a Prometheus `registry`: nothing for one
        engine (the server's metrics read `metrics` itself); an engine over replicas adds theirs."""

    # --- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[GenerationOutput]:
        """Stream a request's output; leaving the loop early aborts the request."""
        if params is not None and params.n != 1:
            raise ValueError(
                f"n={params.n}: AsyncEngine.generate streams one completion per request; for n completions "
                "use LLM.generate or the OpenAI API's n, or make n requests"
            )
        if not self._accepting:
            raise EngineClosedError(self._unhealthy_reason or "the engine is not accepting requests")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()
        stream = RequestStream(request_id, arrival, self.max_pending_tokens)
        self._streams[request_id] = stream
        self.metrics.requests_started += 1
        finished = False
        try:
            await self._ingress.send(SubmitRequest(request_id, prompt, params or SamplingParams(), arrival, priority))
            while True:
                output = await stream.get()
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self.abort(request_id)
            self._streams.pop(request_id, None)
            self.metrics.requests_ended += 1
            if self._streams_closed is not None:
                self._streams_closed.set()

    def pooling_params(self, dimensions: int | None = None) -> PoolingParams:
        """The deployment's pooling (`embeddings` config section), with `dimensions` if given."""
        section = self.runtime.config.embeddings
        return PoolingParams(pooling=section.pooling, normalize=section.normalize, dimensions=dimensions)

    async def embed(
        self, prompt: Any, pooling: PoolingParams | None = None, *, request_id: str | None = None, priority: int = 0
    ) -> GenerationOutput:
        """Embed a prompt: prefill only, batched with generation by the same scheduler; the last
        output, whose `embedding` is the vector (None when it failed: finish_reason "error").
        `pooling`: None takes the deployment's."""
        params = SamplingParams(max_tokens=1, pooling=pooling or self.pooling_params())
        last = None
        async for last in self.generate(prompt, params, request_id=request_id, priority=priority):
            pass
        return last

    async def settle(self) -> None:
        """Wait until the cache manager has handled everything sent to it before this call.

        Finished and aborted requests release their blocks before their callers hear of it, so
        after `settle()` the cache reflects every request that has finished.
        """
        send, receive = anyio.create_memory_object_stream[None](1)
        async with receive:
            await self._cache_inbox.send(SyncCache(send))
            await receive.receive()

    async def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its stream ends with finish_reason "abort"."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        stream.cancelled = True
        await self._scheduler_inbox.send(AbortRequest(request_id, "abort"))
