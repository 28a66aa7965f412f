"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed as Server-Sent Events), `GET`,
`DELETE` and `POST .../cancel` of a stored response, and the same API over a WebSocket at
`/v1/responses` (what `client.responses.connect()` opens: `response.create` in, the streaming
events out, one response at a time per `stream_id` lane).

A stored response keeps its conversation: `previous_response_id` continues it (a fork: two
responses may continue the same one), and since the new prompt starts with the old one's tokens,
the prefix cache serves them. A turn goes through two cores: `api/sessions/core.py` (like the
WebSocket sessions') runs the context providers and policy over the conversation, then the chat
core (`api/openai/completions.py`'s `prepare_chat`, the conversation translated to a chat request)
renders it with the tools and chooses the formats; its chat deltas become the Responses' output
items and events (`responses_output.py`). The engine loop is this module's, so that `cancel`
reaches the request and a cancelled or cut response keeps what it wrote.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
import structlog
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cadenza.api.errors import ENGINE_CODE_STATUS, APIError, engine_error, error_responses
from cadenza.api.http_streaming import EventStreamResponse, parse_body, until_disconnected
from cadenza.api.openai.completions import PreparedRun, prepare_chat
from cadenza.api.openai.protocol import across_fields_param
from cadenza.api.openai.schema import openapi_request_body
from cadenza.api.openai_ws.responses_items import answer_message
from cadenza.api.openai_ws.responses_output import OutputItems
from cadenza.api.openai_ws.responses_protocol import (
    CancelledResponse,
    DeletedResponse,
    ResponseCreateBody,
    ResponseCreateRequest,
    ResponseObject,
    engine_overrides,
    response_object,
    split_turns,
    usage,
)
from cadenza.api.protocols import Protocol
from cadenza.api.sessions.conversation import Conversation
from cadenza.api.sessions.core import ContextSettings, SessionCore, TurnError
from cadenza.api.state import ServerState, server_state
from cadenza.api.tenants import CURRENT_TENANT, Tenant
from cadenza.api.ws_connection import admit, parse_frame, write_outbox
from cadenza.engine.async_engine import EngineClosedError
from cadenza.sampling_params import SamplingParams, SamplingParamsError, describe_error, merge_sampling

log = structlog.get_logger("cadenza.api.responses")
router = APIRouter()

# The HTTP status of each turn error (the engine's codes have theirs in `ENGINE_CODE_STATUS`).
TURN_STATUS = {"context_provider_error": 500, "context_provider_timeout": 500, "context_policy_error": 500}


@dataclass
class _Live:
    """A response being generated: how to stop it, and when it has ended; `owner`, the tenant whose
    connection started it (api/tenants.py; None on a server without keys)."""

    engine_id: str
    owner: Tenant | None = None
    cancelled: bool = False
    preparing: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)
    final: dict[str, Any] | None = None


class ResponseStore:
    """Finished responses (their objects and conversations), least recently used dropped first,
    and the responses being generated now, so `cancel` can reach them from any connection.

    Each belongs to the tenant whose connection made it (`CURRENT_TENANT`, api/tenants.py): another
    tenant's lookups, continuations, deletes and cancels find nothing, as for an id never stored, so
    one tenant cannot read, continue or learn of another's conversations. A server without keys has
    one tenant, None."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stored: OrderedDict[str, tuple[dict[str, Any], Conversation, Tenant | None]] = OrderedDict()
        self.live: dict[str, _Live] = {}

    def put(self, response: dict[str, Any], conversation: Conversation) -> None:
        if self.capacity == 0:
            return
        self.stored[response["id"]] = (response, conversation, CURRENT_TENANT.get())
        self.stored.move_to_end(response["id"])
        while len(self.stored) > self.capacity:
            self.stored.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[dict[str, Any], Conversation]:
        found = self.stored.get(response_id)
        if found is None or found[2] != CURRENT_TENANT.get():
            raise APIError(404, "response_not_found", f"no stored response {response_id!r} (never stored, deleted, or dropped: sessions.stored_responses)", param)
        self.stored.move_to_end(response_id)
        return found[0], found[1]

    def running(self, response_id: str) -> _Live | None:
        """The response being generated under `response_id` for this connection's tenant, or None."""
        live = self.live.get(response_id)
        return live if live is not None and live.owner == CURRENT_TENANT.get() else None

    @staticmethod
    def of(app, state: ServerState) -> "ResponseStore":
        store = getattr(app.state, "response_store", None)
        if store is None:
            store = app.state.response_store = ResponseStore(state.config.sessions.stored_responses)
        return store


def _core(connection) -> SessionCore:
    return connection.app.state.session_core


async def response_events(core: SessionCore, store: ResponseStore, body: ResponseCreateRequest, response_id: str) -> AsyncIterator[dict[str, Any]]:
    """The events of one response, `response.created` first and a final `response.completed`,
    `response.incomplete` (also for a cancelled one: status "cancelled") or `response.failed`.
    Raises `APIError` before the first event when the request cannot start."""
    state = core.state
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, "model_not_found", f"the model {body.model!r} does not exist; this server serves {state.model_name!r}", "model")
    if state.draining or not state.engine.healthy:
        raise APIError(503, "unavailable", "the server is shutting down or unhealthy")
    try:
        params = merge_sampling(state.config.sampling.defaults, body.sampling, **engine_overrides(body))
    except SamplingParamsError as exc:
        raise APIError(400, "invalid_request", exc.describe({"max_tokens": "max_output_tokens"}), _sampling_param(exc, body)) from None
    conversation = store.get(body.previous_response_id)[1].fork() if body.previous_response_id else Conversation()
    conversation.system_prompt = body.instructions  # OpenAI: instructions are not carried over
    messages = body.messages()
    if conversation.turns and messages and messages[0]["role"] not in ("user", "system"):
        messages = conversation.turns.pop() + messages  # the results of the stored turn's calls: that turn goes on
    earlier, new_turn = split_turns(messages)
    conversation.turns += earlier
    settings = _settings(core, body)
    live = store.live[response_id] = _Live(f"resp:{response_id}", CURRENT_TENANT.get())
    created = time.time()
    try:
        prepared = run = None
        with live.preparing:
            try:
                prepared = await core.prepare(conversation, new_turn, params, settings, session_id=response_id, request_id=live.engine_id)
            except TurnError as exc:
                status = TURN_STATUS.get(exc.code, 400)
                raise APIError(status, exc.code, exc.message, "input" if status == 400 else None) from None
            run = await _chat_run(state, body, conversation)
        if prepared is None or run is None:
            raise APIError(400, "cancelled", "the response was cancelled before it started")
        prompt, params = run.jobs[0]
        if prompt == conversation.messages():  # no tools, template variables or reasoning: the ids are already made
            prompt = prepared.token_ids

        def snapshot(status: str, **kw) -> dict[str, Any]:
            return response_object(response_id, body, state.model_name, status, created=created, **kw)

        yield {"type": "response.created", "response": snapshot("in_progress")}
        yield {"type": "response.in_progress", "response": snapshot("in_progress")}
        output, last = OutputItems(), None
        failure = APIError(500, "internal_error", "the request ended without output")
        try:
            async for out in state.engine.generate(prompt, params, request_id=live.engine_id):
                if last is None and live.cancelled:
                    await state.engine.abort(live.engine_id)
                last = out
                if out.finish_reason == "error":
                    break
                ending = "incomplete" if out.finish_reason == "length" else "completed"
                for delta in run.shape.deltas(0, out):
                    for event in output.feed(delta["delta"], ending):
                        yield event
        except EngineClosedError as exc:
            last = None
            failure = APIError(503, "unavailable", str(exc))
        finally:
            state.metrics.observe_ended("responses", live.engine_id, last)
        if last is not None and last.finish_reason == "error":
            failure = engine_error(last.error_code, last.error)
            if failure.message.startswith("structured_outputs") and run.shape.structured_param:
                failure.param = body.param(run.shape.structured_param)
        if last is None or last.finish_reason == "error":
            core.settle(conversation, prepared, None)
            final = live.final = snapshot("failed", error=failure)
            yield {"type": "response.failed", "response": final}
            return
        status = "cancelled" if last.finish_reason == "abort" else "incomplete" if last.finish_reason == "length" else "completed"
        for event in output.finish("completed" if status == "completed" else "incomplete"):
            yield event
        core.settle(conversation, prepared, answer_message(output.items))
        reasoning_tokens = _reasoning_tokens(state, output.items)
        final = live.final = snapshot(status, output=output.items,
                                      usage={**usage(last, reasoning_tokens), "context": prepared.report()},
                                      incomplete="max_output_tokens" if status == "incomplete" else None)  # fmt: skip
        if body.store:
            store.put(final, conversation)
        yield {"type": "response.completed" if status == "completed" else "response.incomplete", "response": final}
        log.info("access", api="responses", request_id=response_id, status=status, prompt_tokens=last.num_prompt_tokens,
                 cached_tokens=last.num_cached_tokens, completion_tokens=last.num_output_tokens)  # fmt: skip
    finally:
        store.live.pop(response_id, None)
        live.ended.set()


async def _chat_run(state: ServerState, body: ResponseCreateRequest, conversation: Conversation) -> PreparedRun:
    """The chat core's run of the conversation as it stands (the context policy's cut made, the
    new turn in): the prompt rendered with the tools, the formats chosen, one job."""
    history = [{k: v for k, v in m.items() if k != "id"} for turn in conversation.turns for m in turn]
    chat = body.chat_request(state.model_name, conversation.system() + history)
    try:
        return await prepare_chat(state, chat)
    except APIError as exc:
        exc.param = body.param(exc.param)
        for old in ("response_format.json_schema.schema", "max_completion_tokens"):
            if exc.message.startswith(old):
                exc.message = body.param(old) + exc.message.removeprefix(old)
        raise


def _reasoning_tokens(state: ServerState, items: list[dict[str, Any]]) -> int:
    """The reasoning's length in tokens (re-encoded: the engine counts the output's tokens, not
    whose they were)."""
    text = "".join(p["text"] for item in items if item["type"] == "reasoning" for p in item["content"])
    return len(state.engine.runtime.tokenizer.encode(text, add_special_tokens=False)) if text else 0


def _sampling_param(exc: SamplingParamsError, body: ResponseCreateRequest) -> str | None:
    """Where in the body a sampling refusal points: OpenAI's own fields at the top, the rest
    under `sampling`."""
    field = exc.field()
    if field is None:
        across = across_fields_param(exc, body.sampling) if body.sampling is not None else None
        return f"sampling.{across}" if across else None
    top = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}.get(field)
    if top is not None and getattr(body, top) is not None:
        return top
    return f"sampling.{field}"


# The HTTP status of a failed response's error code, beside the engine's (`ENGINE_CODE_STATUS`).
_FAILURE_STATUS = {"unavailable": 503, "internal_error": 500}


def _failure(error: dict[str, Any]) -> APIError:
    """A failed response's error, as the HTTP error a whole (not streamed) response answers."""
    failure = engine_error(error["code"], error["message"])
    failure.status = ENGINE_CODE_STATUS.get(error["code"]) or _FAILURE_STATUS.get(error["code"], 500)
    if failure.code in ("invalid_prompt", "invalid_messages", "prompt_too_long"):
        failure.param = "input"
    elif failure.status == 400:  # the engine's refusals of sampling params begin with the field
        field = failure.message.partition(":")[0]
        failure.param = f"sampling.{field}" if field.partition(".")[0] in SamplingParams.model_fields else None
    return failure


def _settings(core: SessionCore, body: ResponseCreateRequest) -> ContextSettings:
    defaults = core.plugins.defaults
    if body.truncation == "disabled":
        return ContextSettings("error", defaults.providers)
    if body.truncation == "auto" and defaults.policy == "error":
        return ContextSettings("drop_oldest", defaults.providers)
    return defaults


def _new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


# --- HTTP ---------------------------------------------------------------------------------------


_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "The event's type (response.created, response.output_text.delta, ...)."},
    "data": {"type": "string", "description": "The event as JSON, with its sequence_number."}}}  # fmt: skip


@router.post(
    "/v1/responses",
    openapi_extra={"requestBody": openapi_request_body(ResponseCreateRequest)},
    responses={200: {"model": ResponseObject, "content": {"text/event-stream": {"itemSchema": _EVENT}}, "links": {
                   name: {"operationId": name, "parameters": {"response_id": "$response.body#/id"}}
                   for name in ("getResponse", "deleteResponse", "cancelResponse")}},
               **error_responses(400, 401, 404, 408, 413, 429, 500, 503)},
)  # fmt: skip
async def create_response(request: Request) -> Response:
    """A response, whole, or streamed as its events with `stream` (`type` and `stream_id` are the
    WebSocket's `response.create` envelope, not fields of this body)."""
    state = server_state(request)
    body = await parse_body(request, ResponseCreateRequest)
    store, core, response_id = ResponseStore.of(request.app, state), _core(request), _new_id()
    if not body.stream:
        final: dict[str, Any] = {}

        async def collect() -> None:
            async with aclosing(response_events(core, store, body, response_id)) as events:
                async for event in events:
                    if "response" in event:
                        final.update(event["response"])

        disconnected, _ = await until_disconnected(request, collect)
        if disconnected:
            return Response(status_code=499)
        if final.get("status") == "failed":
            raise _failure(final["error"])
        return JSONResponse(final)

    async def produce(emit) -> None:
        sequence = 0
        async with aclosing(response_events(core, store, body, response_id)) as events:
            async for event in events:
                await emit(f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': sequence})}\n\n".encode())
                sequence += 1

    return EventStreamResponse(produce, request_id=response_id)


_STORED = error_responses(401, 404)


@router.get("/v1/responses/{response_id}", operation_id="getResponse", responses={200: {"model": ResponseObject}, **_STORED})
async def get_response(request: Request, response_id: str):
    state = server_state(request)
    return ResponseStore.of(request.app, state).get(response_id, "response_id")[0]


@router.delete("/v1/responses/{response_id}", operation_id="deleteResponse", responses={200: {"model": DeletedResponse}, **_STORED})
async def delete_response(request: Request, response_id: str):
    store = ResponseStore.of(request.app, server_state(request))
    store.get(response_id, "response_id")
    del store.stored[response_id]
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", operation_id="cancelResponse",
             responses={200: {"model": ResponseObject | CancelledResponse}, **_STORED})  # fmt: skip
async def cancel_response(request: Request, response_id: str):
    """Stop a response being generated (from any connection) and return it as it ended; a
    finished one is returned as it is."""
    state = server_state(request)
    store = ResponseStore.of(request.app, state)
    live = store.running(response_id)
    if live is None:
        return store.get(response_id, "response_id")[0]
    await _cancel(state, live)
    with anyio.move_on_after(30):  # an aborted request ends within a step
        await live.ended.wait()
    return live.final or {"id": response_id, "object": "response", "status": "cancelled"}


async def _cancel(state: ServerState, live: _Live) -> None:
    live.cancelled = True
    live.preparing.cancel()
    await state.engine.abort(live.engine_id)


# --- WebSocket ----------------------------------------------------------------------------------


def ws_error(error: APIError, stream_id: str | None = None) -> dict[str, Any]:
    body = {"type": "error", "status": error.status, "error": {"type": error.error_type, "code": error.code, "message": error.message, "param": error.param}}
    return {**body, "stream_id": stream_id} if stream_id else body


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket) -> None:
    state = await admit(websocket)
    if state is None:
        return
    store, core = ResponseStore.of(websocket.app, state), _core(websocket)
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[dict](64)
    lanes: dict[str | None, Any] = {}
    connection_id = uuid.uuid4().hex[:12]
    bound = log.bind(connection_id=connection_id)
    bound.info("Responses socket opened")

    async def run_lane(receive) -> None:
        async with receive:
            async for body in receive:  # FIFO within a lane
                await run_one(body)

    async def run_one(body: ResponseCreateBody) -> None:
        extra = {"stream_id": body.stream_id} if body.stream_id else {}
        sequence = 0
        try:
            async with aclosing(response_events(core, store, body, _new_id())) as events:
                async for event in events:
                    await outbox_tx.send({**event, "sequence_number": sequence, **extra})
                    sequence += 1
        except APIError as exc:
            await outbox_tx.send(ws_error(exc, body.stream_id))

    async with anyio.create_task_group() as tg:
        tg.start_soon(write_outbox, websocket, outbox_rx, tg.cancel_scope)
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                try:
                    body = _parse_event(frame.get("text"))
                except APIError as exc:
                    await outbox_tx.send(ws_error(exc))
                    continue
                if body is None:
                    continue
                if isinstance(body, str):  # response.cancel: its response_id
                    live = store.running(body)
                    if live is None:
                        await outbox_tx.send(ws_error(APIError(400, "response_not_found", f"no response {body!r} is running", "response_id")))
                    else:
                        await _cancel(state, live)
                    continue
                lane = lanes.get(body.stream_id)
                if lane is None:
                    lane, receive = anyio.create_memory_object_stream[ResponseCreateBody](16)
                    lanes[body.stream_id] = lane
                    tg.start_soon(run_lane, receive)
                try:
                    lane.send_nowait(body)
                except anyio.WouldBlock:
                    await outbox_tx.send(ws_error(APIError(429, "too_many_requests", "at most 16 responses may wait on one lane"), body.stream_id))
        except WebSocketDisconnect:
            pass
        finally:
            bound.info("Responses socket closed")
            tg.cancel_scope.cancel()


def _parse_event(text: str | None) -> ResponseCreateBody | str | None:
    """A `response.create`'s body, a `response.cancel`'s response id, or an `APIError`."""
    raw = parse_frame(text)
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "response.cancel":
        response_id = raw.get("response_id")
        if not isinstance(response_id, str):
            raise APIError(400, "invalid_request", "response.cancel needs a response_id", "response_id")
        return response_id
    if kind != "response.create":
        raise APIError(400, "unknown_type", f"unknown event type {kind!r}; this server takes response.create and response.cancel", "type")
    try:
        return ResponseCreateBody.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = ".".join(str(p) for p in errors[0].get("loc", ())) or None
        raise APIError(400, "invalid_request", "; ".join(describe_error(e) for e in errors), param) from None


class ResponsesProtocol(Protocol):
    """OpenAI's Responses API (HTTP, streamed or not, and its WebSocket mode): stored responses and `previous_response_id` conversations."""

    name = "responses"

    def router(self) -> APIRouter:
        return router
