"""HTTP plumbing for generation routes: bounded bodies, n concurrent choices, Server-Sent Events,
and aborting whatever a client stops waiting for.

A client that goes away aborts its requests, streaming or not: the route's work runs beside a
task that waits for `http.disconnect` and cancels it, and cancelling leaves the engine's
`async for`, which frees the request's KV blocks at once.
"""

from __future__ import annotations

import json
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cadenza.api.errors import APIError, validation_error, written
from cadenza.api.metrics import ServerMetrics
from cadenza.engine.async_engine import AsyncEngine, EngineClosedError
from cadenza.engine.streams import GenerationOutput
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger("cadenza.api")

MAX_BODY_BYTES = 8 << 20
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# One item of a multiplexed generation: (choice index, its next output or why it could not start).
ChoiceItem = tuple[int, GenerationOutput | APIError]


async def parse_body(request: Request, model: type[M], limit: int = MAX_BODY_BYTES) -> M:
    """The request body as `model`, refusing bodies over `limit` bytes before reading them."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, "request_too_large", f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, "request_too_large", f"the request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        raise APIError(400, "client_disconnected", "the client went away while sending the body") from None
    try:
        # Strict: JSON types as the schema gives them, as OpenAI checks them ("8" is no integer, 0
        # no boolean); numbers still stand for floats, and JSON's string keys for integer ones.
        return model.model_validate_json(bytes(body), strict=True)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors(include_url=False))) from None


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()`, cancelling it if the client disconnects: (disconnected, its result).

    An exception from `work` is raised as itself, never wrapped in an exception group.
    """
    result: T | None = None
    error: Exception | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            await _wait_for_disconnect(request.receive)
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:
            error = exc
        tg.cancel_scope.cancel()
    if error is not None and not disconnected:
        raise error
    return disconnected, result


Emit = Callable[[bytes], Awaitable[None]]


def openai_failure(error: APIError) -> bytes:
    """How an OpenAI stream ends when it fails after it began: an error event, then `[DONE]`."""
    return sse(json.dumps(error.body())) + sse("[DONE]")


class EventStreamResponse(Response):
    """A stream (Server-Sent Events unless `media_type` says otherwise) written by `produce(emit)`.

    The status is decided at the first `emit`: an `APIError` raised before it becomes a plain
    HTTP error response (in the shape of the protocol that owns the path, api/protocols.py), so a
    rejected request gets its proper status rather than a 200 stream. A failure after it ends the
    stream with `fail(error)` (OpenAI's error event by default). A client disconnect cancels
    `produce` wherever it waits.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], *, media_type: str | None = None,
                 fail: Callable[[APIError], bytes] = openai_failure, **log_context: Any) -> None:
        self.produce = produce
        self.fail = fail
        self.media_type = media_type or self.media_type
        self.log_context = log_context  # what the disconnect and failure log lines carry
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def emit(frame: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": frame, "more_body": True})

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await _wait_for_disconnect(receive)
                log.info("Client disconnected", **self.log_context)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.produce(emit)
                if not started:
                    await emit(b"")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client is gone
            except Exception as exc:
                if not isinstance(exc, APIError):
                    log.exception("Event stream failed", **self.log_context)
                    exc = APIError(500, "internal_error", f"the stream failed: {exc!r}")
                if started:
                    await send({"type": "http.response.body", "body": self.fail(exc), "more_body": False})
                else:
                    started = True
                    await written(scope, exc)(scope, receive, send)
            tg.cancel_scope.cancel()
        if not started:
            # The client left before anything was sent; end the exchange all the same (499, as
            # nginx logs it), so that the layers above see a response.
            await send({"type": "http.response.start", "status": 499, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})



def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


@asynccontextmanager
async def run_choices(
    engine: AsyncEngine,
    jobs: Sequence[tuple[Any, SamplingParams]],
    request_id: str,
    metrics: ServerMetrics,
) -> AsyncIterator[MemoryObjectReceiveStream[ChoiceItem]]:
    """Run each (prompt, params) job as an engine request at once; yield their merged outputs.

    Leaving the block early aborts every choice still running. Each finished choice is recorded
    in the metrics, an abandoned one with finish_reason "abort".
    """
    send, receive = anyio.create_memory_object_stream[ChoiceItem](max(16, 2 * len(jobs)))
    async with anyio.create_task_group() as tg:
        for index, (prompt, params) in enumerate(jobs):
            tg.start_soon(_run_choice, engine, prompt, params, f"{request_id}-{index}", index, send.clone(), metrics)
        send.close()
        error: Exception | None = None
        try:
            async with receive:
                yield receive
        except Exception as exc:  # raised as itself below, not wrapped in an exception group
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error


async def _run_choice(
    engine: AsyncEngine,
    prompt: Any,
    params: SamplingParams,
    request_id: str,
    index: int,
    send: MemoryObjectSendStream[ChoiceItem],
    metrics: ServerMetrics,
) -> None:
    last: GenerationOutput | None = None
    refused = False
    async with send:
        try:
            try:
                async with aclosing(engine.generate(prompt, params, request_id=request_id)) as outputs:
                    async for out in outputs:
                        last = out
                        await send.send((index, out))
            except EngineClosedError as exc:
                refused = True
                code = "draining" if engine.healthy else "unhealthy"
                await send.send((index, APIError(503, code, f"the server is not accepting requests: {exc}")))
        except anyio.BrokenResourceError:
            pass  # the reader left; leaving the loop above aborted the request
        finally:
            if not refused:
                metrics.observe_ended("openai", request_id, last)
