"""OpenAI's Realtime API, text modality, at `/v1/realtime` (what `client.realtime.connect()` opens).

One connection is one session holding one conversation of items. Client events: `session.update`,
`conversation.item.create` / `.delete` / `.retrieve`, `response.create`, `response.cancel`. Server
events: `session.created` / `.updated`, `conversation.item.added` / `.done` / `.deleted` /
`.retrieved`, the response's lifecycle (`response.created`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, ... `response.done`), and `error`
(the connection carries on). Audio events are answered with an error: there is no audio here.

Turns go through `api/sessions/core.py` (providers, context policy, prefix-cache reuse) like the
WebSocket sessions' and the Responses API's.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import anyio
import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cadenza.api.errors import APIError
from cadenza.api.protocols import Protocol
from cadenza.api.sessions.conversation import Conversation
from cadenza.api.sessions.core import ContextSettings, SessionCore, TurnError
from cadenza.api.sessions.protocol import SamplingOptions
from cadenza.api.state import ServerState
from cadenza.api.ws_connection import admit, parse_frame, write_outbox
from cadenza.engine.async_engine import EngineClosedError
from cadenza.sampling_params import MaxTokens, SamplingParamsError, describe_error, merge_sampling

log = structlog.get_logger("cadenza.api.realtime")
router = APIRouter()


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class Item(_Model):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(min_length=1)
    id: str | None = Field(None, min_length=1, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: str | None = None


class SessionConfig(_Model):
    """The fields of a text session; audio settings are accepted and have no effect."""

    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    output_modalities: list[Literal["text"]] | None = None
    max_output_tokens: MaxTokens | Literal["inf"] | None = None
    truncation: Literal["auto", "disabled"] | dict[str, Any] | None = None
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none", "auto"] | None = None
    audio: dict[str, Any] | None = None
    include: list[str] | None = None
    tracing: Any = None
    prompt: Any = None
    sampling: SamplingOptions | None = Field(None, description="cadenza: sampling fields, plugin extras included.")


class ResponseConfig(_Model):
    instructions: str | None = None
    max_output_tokens: MaxTokens | Literal["inf"] | None = None
    conversation: Literal["auto", "none"] | None = None
    output_modalities: list[Literal["text"]] | None = None
    metadata: dict[str, str] | None = None
    sampling: SamplingOptions | None = None


class _Event(_Model):
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionConfig


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: str | None = None


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseConfig | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


EVENTS = {m.model_fields["type"].annotation.__args__[0]: m for m in (SessionUpdate, ItemCreate, ItemDelete, ItemRetrieve, ResponseCreate, ResponseCancel)}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeSession:
    def __init__(self, state: ServerState, core: SessionCore, outbox, tg) -> None:
        self.state, self.core, self.outbox, self.tg = state, core, outbox, tg
        self.id = _id("sess")
        self.config = SessionConfig(model=state.model_name, output_modalities=["text"])
        self.conversation = Conversation()
        self.active: dict[str, Any] | None = None  # the response being generated: id, engine id, scope
        self.log = log.bind(session_id=self.id)

    async def send(self, event: dict[str, Any]) -> None:
        await self.outbox.send({"event_id": _id("event"), **event})

    def session_object(self) -> dict[str, Any]:
        body = self.config.model_dump(exclude_none=True, exclude={"sampling"})
        return {**body, "id": self.id, "object": "realtime.session", "max_output_tokens": self.config.max_output_tokens or "inf"}

    async def handle(self, text: str | None) -> None:
        event_id = None
        try:
            raw = _parse(text)
            event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
            kind = raw.get("type")
            model = EVENTS.get(kind)
            if model is None:
                what = "audio is not supported here (text only)" if str(kind).startswith(("input_audio_buffer.", "output_audio_buffer.")) else f"unknown event type {kind!r}"
                raise APIError(400, "unsupported_event" if "audio" in what else "unknown_event", f"{what}; known: {', '.join(EVENTS)}", "type")
            try:
                event = model.model_validate(raw)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                param = ".".join(str(p) for p in errors[0].get("loc", ())) or None
                raise APIError(400, "invalid_value", "; ".join(describe_error(e) for e in errors), param) from None
            await self._dispatch(event)
        except APIError as exc:
            await self.send({"type": "error", "error": {"type": exc.error_type, "code": exc.code, "message": exc.message,
                                                        "param": exc.param, "event_id": event_id}})  # fmt: skip

    async def _dispatch(self, event: _Event) -> None:
        match event:
            case SessionUpdate(session=update):
                if update.model not in (None, self.state.model_name):
                    raise APIError(400, "model_not_found", f"this server serves {self.state.model_name!r}", "session.model")
                merged = {**self.config.model_dump(exclude_unset=True), **update.model_dump(exclude_unset=True)}
                self.config = SessionConfig.model_validate(merged)
                await self.send({"type": "session.updated", "session": self.session_object()})
            case ItemCreate(item=item, previous_item_id=previous):
                last = self._items()[-1]["id"] if self._items() else None
                if previous not in (None, last):
                    raise APIError(400, "invalid_value", "items can only be appended: previous_item_id must be the last item's id", "previous_item_id")
                message = {"id": item.id or _id("item"), "role": item.role, "content": "".join(p.text for p in item.content)}
                if any(m["id"] == message["id"] for m in self._items()):
                    raise APIError(400, "duplicate_item_id", f"the conversation already has an item {message['id']!r}", "item.id")
                self._append(message)
                await self.send({"type": "conversation.item.added", "previous_item_id": last, "item": _item(message, "completed")})
                await self.send({"type": "conversation.item.done", "previous_item_id": last, "item": _item(message, "completed")})
            case ItemDelete(item_id=item_id):
                self._find(item_id)
                for turn in self.conversation.turns:
                    turn[:] = [m for m in turn if m["id"] != item_id]
                self.conversation.turns[:] = [t for t in self.conversation.turns if t]
                await self.send({"type": "conversation.item.deleted", "item_id": item_id})
            case ItemRetrieve(item_id=item_id):
                await self.send({"type": "conversation.item.retrieved", "item": _item(self._find(item_id), "completed")})
            case ResponseCreate(response=config):
                if self.active is not None:
                    raise APIError(400, "conversation_already_has_active_response", f"response {self.active['id']} is in progress; cancel it or wait for response.done")
                response_id = _id("resp")
                self.active = {"id": response_id, "engine_id": f"rt:{self.id}:{response_id}", "scope": anyio.CancelScope(), "cancelled": False}
                self.tg.start_soon(self._respond, self.active, config or ResponseConfig())
            case ResponseCancel(response_id=response_id):
                active = self.active
                if active is None or response_id not in (None, active["id"]):
                    raise APIError(400, "response_cancel_not_active", "there is no such response in progress", "response_id")
                active["cancelled"] = True
                active["scope"].cancel()
                await self.state.engine.abort(active["engine_id"])

    def _items(self) -> list[dict[str, str]]:
        return [m for turn in self.conversation.turns for m in turn]

    def _find(self, item_id: str) -> dict[str, str]:
        found = next((m for m in self._items() if m["id"] == item_id), None)
        if found is None:
            raise APIError(400, "item_not_found", f"no item {item_id!r} in the conversation", "item_id")
        return found

    def _append(self, message: dict[str, str]) -> None:
        """A user message after an answer starts a turn; anything else joins the last turn."""
        turns = self.conversation.turns
        if not turns or (message["role"] == "user" and any(m["role"] == "assistant" for m in turns[-1])):
            turns.append([])
        turns[-1].append(message)

    async def _respond(self, active: dict[str, Any], config: ResponseConfig) -> None:
        try:
            await self._generate(active, config)
        finally:
            self.active = None

    async def _generate(self, active: dict[str, Any], config: ResponseConfig) -> None:
        response_id, engine_id = active["id"], active["engine_id"]
        state = self.state
        max_tokens = config.max_output_tokens or self.config.max_output_tokens or state.config.sampling.defaults.max_tokens
        try:
            params = merge_sampling(state.config.sampling.defaults, self.config.sampling, config.sampling,
                                    max_tokens=None if max_tokens == "inf" else max_tokens)  # fmt: skip
        except SamplingParamsError as exc:
            return await self._fail_early(response_id, APIError(400, "invalid_value", str(exc)))
        out_of_band = config.conversation == "none"
        conversation = self.conversation.fork() if out_of_band else self.conversation
        conversation.system_prompt = config.instructions if config.instructions is not None else self.config.instructions
        defaults = self.core.plugins.defaults
        truncation = self.config.truncation
        settings = ContextSettings("error", defaults.providers) if truncation == "disabled" else (
            ContextSettings("drop_oldest", defaults.providers) if defaults.policy == "error" and truncation is not None else defaults)
        prepared = None
        with active["scope"]:
            try:
                prepared = await self.core.prepare(conversation, [], params, settings, session_id=self.id, request_id=engine_id)
            except TurnError as exc:
                return await self._fail_early(response_id, APIError(400, exc.code, exc.message))
        if prepared is None:  # cancelled while its providers or policy ran
            return await self._finish(response_id, "cancelled", [], None, reason="client_cancelled")
        item = {"id": _id("item"), "role": "assistant", "content": ""}
        await self.send({"type": "response.created", "response": _response(response_id, "in_progress", [])})
        where = {"response_id": response_id, "item_id": item["id"], "output_index": 0}
        await self.send({"type": "response.output_item.added", "response_id": response_id, "output_index": 0, "item": _item(item, "in_progress")})
        await self.send({"type": "conversation.item.added", "previous_item_id": None, "item": _item(item, "in_progress")})
        await self.send({"type": "response.content_part.added", **where, "content_index": 0, "part": {"type": "text", "text": ""}})
        text, last = [], None
        try:
            async for out in state.engine.generate(prepared.token_ids, params, request_id=engine_id):
                if last is None and active["cancelled"]:
                    await state.engine.abort(engine_id)
                last = out
                if out.text:
                    text.append(out.text)
                    await self.send({"type": "response.output_text.delta", **where, "content_index": 0, "delta": out.text})
        except EngineClosedError:
            last = None
        finally:
            state.metrics.observe_ended("realtime", engine_id, last)
        item["content"] = "".join(text)
        if last is None or last.finish_reason == "error":
            self.core.settle(conversation, prepared, None)
            error = {"type": "server_error", "code": last.error_code if last else "unavailable", "message": last.error if last else "the server is not accepting requests"}
            return await self._finish(response_id, "failed", [], last, error=error)
        status = {"abort": "cancelled", "length": "incomplete"}.get(last.finish_reason, "completed")
        self.core.settle(conversation, prepared, dict(item))
        done = _item(item, "completed" if status == "completed" else "incomplete")
        await self.send({"type": "response.output_text.done", **where, "content_index": 0, "text": item["content"]})
        await self.send({"type": "response.content_part.done", **where, "content_index": 0, "part": {"type": "text", "text": item["content"]}})
        await self.send({"type": "response.output_item.done", "response_id": response_id, "output_index": 0, "item": done})
        await self.send({"type": "conversation.item.done", "previous_item_id": None, "item": done})
        reason = {"cancelled": "client_cancelled", "incomplete": "max_output_tokens"}.get(status)
        await self._finish(response_id, status, [done], last, reason=reason, context=prepared.report())

    async def _fail_early(self, response_id: str, error: APIError) -> None:
        await self.send({"type": "response.created", "response": _response(response_id, "in_progress", [])})
        await self._finish(response_id, "failed", [], None, error={"type": error.error_type, "code": error.code, "message": error.message})

    async def _finish(self, response_id, status, output, last, *, reason=None, error=None, context=None) -> None:
        response = _response(response_id, status, output)
        response["status_details"] = {"type": status, "reason": reason, "error": error}
        if last is not None:
            cached, prompt, completion = last.num_cached_tokens, last.num_prompt_tokens, last.num_output_tokens
            response["usage"] = {
                "total_tokens": prompt + completion, "input_tokens": prompt, "output_tokens": completion,
                "input_token_details": {"cached_tokens": cached, "text_tokens": prompt, "audio_tokens": 0, "image_tokens": 0},
                "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
            }  # fmt: skip
        if context is not None:
            response["metadata"] = {"context_policy": context["policy"], "context_cut": str(context["cut"]).lower(),
                                    "turns_dropped": str(context["turns_dropped"])}  # fmt: skip
        await self.send({"type": "response.done", "response": response})


def _response(response_id: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": response_id, "object": "realtime.response", "status": status, "output": output,
            "conversation_id": None, "output_modalities": ["text"]}  # fmt: skip


def _item(message: dict[str, str], status: str) -> dict[str, Any]:
    kind = "output_text" if message["role"] == "assistant" else "input_text"
    return {"id": message["id"], "object": "realtime.item", "type": "message", "status": status, "role": message["role"],
            "content": [{"type": kind, "text": message["content"]}]}  # fmt: skip


def _parse(text: str | None) -> dict[str, Any]:
    raw = parse_frame(text, "events")
    if not isinstance(raw, dict):
        raise APIError(400, "invalid_message", "an event is a JSON object with a 'type'")
    return raw


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    def served_model(state: ServerState) -> None:
        model = websocket.query_params.get("model")
        if model not in (None, state.model_name):
            raise APIError(404, "model_not_found", f"this server serves {state.model_name!r}")

    state = await admit(websocket, served_model)
    if state is None:
        return
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[dict](64)
    async with anyio.create_task_group() as tg:
        session = RealtimeSession(state, websocket.app.state.session_core, outbox_tx, tg)
        session.log.info("Realtime session opened")

        tg.start_soon(write_outbox, websocket, outbox_rx, tg.cancel_scope)
        await session.send({"type": "session.created", "session": session.session_object()})
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                await session.handle(frame.get("text"))
        except WebSocketDisconnect:
            pass
        finally:
            session.log.info("Realtime session closed")
            tg.cancel_scope.cancel()


class RealtimeProtocol(Protocol):
    """OpenAI's Realtime API over a WebSocket (text sessions)."""

    name = "realtime"

    def router(self) -> APIRouter:
        return router
