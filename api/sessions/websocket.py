"""WebSocket sessions at /v1/sessions: several requests at once on one connection, server-side
conversations (reset, truncate, fork; a context policy when they outgrow the model; context
providers before each turn) with cancel and barge-in, and errors that never end the connection.
Conversation turns go through `api/sessions/core.py`, as the Responses and Realtime APIs' do.

A connection runs a reader (client messages) and a writer (server messages) plus one task per
request; when the reader or the writer ends, everything else on the connection is cancelled, and
every request still running is aborted, which returns its KV blocks at once.

On shutdown, once the engine has ended the requests still running (`server_shutdown`), each session
sends their errors and then closes the connection with 1001 (going away), idle sessions at once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cadenza.api.protocols import Protocol
from cadenza.api.sessions.conversation import Conversation
from cadenza.api.sessions.core import ContextSettings, PreparedTurn, SessionCore, TurnError
from cadenza.api.sessions.protocol import (
    MAIN,
    Cancel,
    Generate,
    Interrupt,
    Ping,
    ProtocolError,
    SamplingOptions,
    SessionDelete,
    SessionFork,
    SessionGet,
    SessionReset,
    SessionTruncate,
    SessionUpdate,
    error,
    parse_client_message,
)
from cadenza.api.state import ServerState
from cadenza.api.ws_connection import CLOSE, MAX_FRAME_CHARS, admit, write_outbox
from cadenza.engine.async_engine import EngineClosedError
from cadenza.sampling_params import SamplingParams, SamplingParamsError, merge_sampling

log = structlog.get_logger("cadenza.api.websocket")
router = APIRouter()

# Messages waiting for the writer. Past it, request tasks wait, so their engine streams merge
# tokens instead; a client that stays too slow is cut off per request by the engine's bound.
OUTBOX_MESSAGES = 64


@dataclass
class _Running:
    client_id: str
    engine_id: str
    conversation: str | None  # the conversation a turn belongs to; None for a stateless request
    interrupted: bool = False
    cancelled: bool = False
    text: list[str] = field(default_factory=list)
    ended: anyio.Event = field(default_factory=anyio.Event)  # its last message is in the outbox
    preparing: anyio.CancelScope = field(default_factory=anyio.CancelScope)  # providers and policy

    @property
    def is_turn(self) -> bool:
        return self.conversation is not None


class Session:
    def __init__(self, state: ServerState, core: SessionCore, websocket: WebSocket, outbox: MemoryObjectSendStream, tg) -> None:
        self.state = state
        self.core = core
        self.engine = state.engine
        self.websocket = websocket
        self.outbox = outbox
        self.tg = tg
        self.id = f"sess-{uuid.uuid4().hex[:12]}"
        self.system_prompt: str | None = None
        self.sampling = SamplingOptions()
        self.context: ContextSettings = core.plugins.defaults
        self.conversations: dict[str, Conversation] = {MAIN: Conversation()}
        self.running: dict[str, _Running] = {}
        self.going_away = anyio.Event()  # the server is shutting down: close once requests ended
        self.log = log.bind(session_id=self.id)

    # --- messages in ----------------------------------------------------------------------------

    async def handle(self, frame: str) -> None:
        try:
            if len(frame) > MAX_FRAME_CHARS:
                raise ProtocolError("message_too_large", f"messages are limited to {MAX_FRAME_CHARS} characters")
            message = parse_client_message(frame)
            match message:
                case SessionUpdate():
                    self._update(message)
                    await self.send({"type": "session.updated", **self.describe()})
                case Generate():
                    self._start(message)
                case Cancel(request_id=request_id):
                    await self._stop(request_id, interrupt=False)
                case Interrupt(request_id=request_id, conversation=name):
                    turn = request_id or next(
                        (r.client_id for r in self.running.values() if r.is_turn and name in (None, r.conversation)), None
                    )
                    if turn is None:
                        raise ProtocolError("nothing_to_interrupt", "no conversation turn is running")
                    await self._stop(turn, interrupt=True)
                case SessionGet(conversation=name):
                    self._conversation(name)
                    await self.send(self.state_message(name))
                case SessionReset() | SessionTruncate() | SessionFork() | SessionDelete():
                    await self.send(self._edit(message))
                case Ping():
                    await self.send({"type": "pong"})
        except ProtocolError as exc:
            await self.send(error(exc.code, exc.message, exc.request_id))

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "model": self.state.model_name,
            "system_prompt": self.system_prompt,
            "sampling": self.sampling.model_dump(exclude_none=True),
            "context": {"policy": self.context.policy, "providers": list(self.context.providers)},
            "limits": {
                "max_requests_in_flight": self.state.config.server.max_requests_per_connection,
                "max_model_len": self.engine.runtime.max_model_len,
                "max_conversations": self.state.config.sessions.max_conversations,
            },
        }

    def available(self) -> dict[str, Any]:
        """What a client may choose (the playground lists it): context plugins, and the sampling
        plugins that take `sampling.extra`, each with its parameters' JSON schema (None: a switch)."""
        extra = self.engine.runtime.extra_params
        components = extra.components if extra is not None else {}
        return {
            "context_policies": sorted(self.core.plugins.policies),
            "context_providers": sorted(self.core.plugins.providers),
            "extras": {
                name: cls.params_model.model_json_schema() if getattr(cls, "params_model", None) else None
                for name, cls in sorted(components.items())
            },
        }

    def state_message(self, name: str) -> dict[str, Any]:
        conversation = self.conversations[name]
        return {
            "type": "session.state", **self.describe(), "conversation": name, "turns": conversation.num_turns,
            "history": conversation.history(), "conversations": sorted(self.conversations),
        }  # fmt: skip

    def _update(self, message: SessionUpdate) -> None:
        if message.context is not None:  # checked first: a refused update changes nothing
            given = message.context
            settings = ContextSettings(
                given.policy or self.context.policy,
                tuple(given.providers) if given.providers is not None else self.context.providers,
            )
            try:
                self.context = self.core.plugins.check(settings)
            except TurnError as exc:
                raise ProtocolError(exc.code, f"context: {exc.message}") from None
        if "system_prompt" in message.model_fields_set:
            self.system_prompt = message.system_prompt or None
            for conversation in self.conversations.values():
                conversation.system_prompt = self.system_prompt
        if message.sampling is not None:
            merged = {**self.sampling.model_dump(exclude_none=True), **message.sampling.model_dump(exclude_none=True)}
            self.sampling = SamplingOptions(**merged)

    def _conversation(self, name: str) -> Conversation:
        found = self.conversations.get(name)
        if found is None:
            known = ", ".join(sorted(self.conversations))
            raise ProtocolError("unknown_conversation", f"no conversation {name!r} in this session; it has: {known}")
        return found

    def _edit(self, message: SessionReset | SessionTruncate | SessionFork | SessionDelete) -> dict[str, Any]:
        """Reset, truncate, fork or delete a conversation with no turn running; its new state."""
        name = message.conversation
        conversation = self._conversation(name)
        if any(r.conversation == name for r in self.running.values()):
            raise ProtocolError("turn_in_progress", f"a turn of conversation {name!r} is running; interrupt it first")
        match message:
            case SessionReset():
                conversation.reset()
            case SessionTruncate(turns=turns):
                conversation.truncate(turns)
            case SessionFork(name=new, turns=turns):
                if new in self.conversations:
                    raise ProtocolError("conversation_exists", f"the session already has a conversation {new!r}")
                limit = self.state.config.sessions.max_conversations
                if len(self.conversations) >= limit:
                    raise ProtocolError("too_many_conversations", f"a session holds at most {limit} conversations (sessions.max_conversations)")
                self.conversations[new] = conversation.fork(turns)
                name = new
            case SessionDelete():
                if name == MAIN:
                    raise ProtocolError("invalid_params", "the main conversation cannot be deleted; reset it instead")
                del self.conversations[name]
                name = MAIN
        return self.state_message(name)

    def _start(self, message: Generate) -> None:
        request_id = message.request_id
        if request_id in self.running:
            raise ProtocolError("duplicate_request_id", f"request {request_id!r} is already running", request_id)
        limit = self.state.config.server.max_requests_per_connection
        if len(self.running) >= limit:
            raise ProtocolError("too_many_requests", f"at most {limit} requests may run at once on a connection", request_id)
        if self.state.draining or not self.engine.healthy:
            raise ProtocolError("unavailable", "the server is shutting down or unhealthy", request_id)
        params = self._params(message.sampling, request_id)
        conversation = None
        if message.user is not None:
            conversation = message.conversation or MAIN
            if conversation not in self.conversations:
                raise ProtocolError("unknown_conversation", f"no conversation {conversation!r} in this session", request_id)
            if any(r.conversation == conversation for r in self.running.values()):
                raise ProtocolError("turn_in_progress", "a conversation turn is running; interrupt it first", request_id)
            prompt: Any = message.user
        elif message.messages is not None:
            prompt = [m.model_dump() for m in message.messages]
        elif message.token_ids is not None:
            prompt = message.token_ids
        else:
            prompt = message.prompt
        running = _Running(request_id, f"{self.id}:{request_id}", conversation)
        self.running[request_id] = running
        self.tg.start_soon(self._run, running, prompt, params)

    def _params(self, sampling: SamplingOptions | None, request_id: str) -> SamplingParams:
        try:
            return merge_sampling(self.state.config.sampling.defaults, self.sampling, sampling)
        except SamplingParamsError as exc:  # a rule across fields (min_tokens over max_tokens)
            raise ProtocolError("invalid_params", str(exc), request_id) from None

    async def _stop(self, request_id: str, interrupt: bool) -> None:
        running = self.running.get(request_id)
        if running is None:
            raise ProtocolError("unknown_request_id", f"no running request {request_id!r}", request_id)
        if interrupt:
            running.interrupted = True
        else:
            running.cancelled = True
        running.preparing.cancel()  # a turn still in its providers or policy stops there
        await self.engine.abort(running.engine_id)

    # --- one request ----------------------------------------------------------------------------

    async def _run(self, running: _Running, prompt: Any, params: SamplingParams) -> None:
        try:
            prepared = None
            if running.is_turn:
                prepared = await self._prepare(running, prompt, params)
                if prepared is None:
                    return
                prompt = prepared.token_ids
            await self._stream(running, prompt, params, prepared)
        finally:
            running.ended.set()

    async def _prepare(self, running: _Running, user: str, params: SamplingParams) -> PreparedTurn | None:
        """The turn's prompt through providers and policy, committed to its conversation; None
        when it failed (its error sent) or was stopped first (its `done` sent)."""
        request_id = running.client_id
        conversation = self.conversations[running.conversation]
        try:
            with running.preparing:
                return await self.core.prepare(
                    conversation, [{"role": "user", "content": user}], params, self.context,
                    session_id=self.id, request_id=running.engine_id,
                )  # fmt: skip
            # Stopped before it reached the engine: nothing was generated, nothing is kept.
            self.running.pop(request_id, None)
            await self.send({"type": "done", "request_id": request_id, "finish_reason": "abort", "interrupted": running.interrupted,
                             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}, "timings": None})  # fmt: skip
        except TurnError as exc:
            self.running.pop(request_id, None)
            await self.send(error(exc.code, exc.message, request_id))
        return None

    async def _stream(self, running: _Running, prompt: Any, params: SamplingParams, prepared: PreparedTurn | None) -> None:
        request_id = running.client_id
        last, refused = None, False
        try:
            async for out in self.engine.generate(prompt, params, request_id=running.engine_id):
                if last is None and (running.cancelled or running.interrupted):
                    await self.engine.abort(running.engine_id)  # stopped before its stream existed
                last = out
                if out.text or out.token_ids:
                    running.text.append(out.text)
                    delta: dict[str, Any] = {
                        "type": "delta", "request_id": request_id, "text": out.text, "token_ids": list(out.token_ids),
                    }
                    if out.logprobs is not None:
                        delta["logprobs"] = [_logprob_json(lp) for lp in out.logprobs]
                    if out.prompt_logprobs is not None:  # the first delta of a request that asked
                        delta["prompt_logprobs"] = [None if lp is None else _logprob_json(lp) for lp in out.prompt_logprobs]
                    await self.send(delta)
        except EngineClosedError as exc:
            refused = True
            await self.send(error("unavailable", str(exc), request_id))
            return
        finally:
            self.running.pop(request_id, None)
            if prepared is not None:
                self._settle_turn(running, prepared, last)
            if not refused:  # also when the session closed under the request: counted as aborted
                self.state.metrics.observe_ended("websocket", running.engine_id, last)
        if last.finish_reason == "error":
            await self.send(error(last.error_code or "internal_error", last.error or "the request failed", request_id))
            return
        timings = last.timings
        turn = {"conversation": running.conversation, "context": prepared.report()} if prepared is not None else {}
        await self.send(
            {
                **turn,
                "type": "done",
                "request_id": request_id,
                "finish_reason": last.finish_reason,
                "interrupted": running.interrupted,
                "usage": {
                    "prompt_tokens": last.num_prompt_tokens,
                    "completion_tokens": last.num_output_tokens,
                    "cached_tokens": last.num_cached_tokens,
                },
                "timings": {
                    "queue_ms": _ms(timings.queue_seconds) if timings else None,
                    "ttft_ms": _ms(timings.ttft_seconds) if timings else None,
                    "tpot_ms": _ms(timings.tpot_seconds) if timings else None,
                    "total_ms": _ms(timings.e2e_seconds) if timings else None,
                },
            }
        )
        self.log.info(
            "access", api="websocket", request_id=request_id, finish_reason=last.finish_reason,
            prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
        )

    def _settle_turn(self, running: _Running, prepared: PreparedTurn, last) -> None:
        """A finished or interrupted turn keeps its answer; a cancelled or failed one is undone."""
        kept = last is not None and (running.interrupted or last.finish_reason in ("stop", "length"))
        answer = {"role": "assistant", "content": "".join(running.text)} if kept else None
        conversation = self.conversations.get(running.conversation)
        if conversation is not None:
            self.core.settle(conversation, prepared, answer)

    async def send(self, message: dict[str, Any]) -> None:
        await self.outbox.send(message)

    async def close_when_ended(self) -> None:
        """Once every running request has queued its last message (its error, on shutdown), have
        the writer close the connection with 1001. No request starts meanwhile: the server is draining."""
        for running in list(self.running.values()):
            await running.ended.wait()
        await self.outbox.send(CLOSE)


class Sessions:
    """An app's open sessions, so that shutdown can close them."""

    def __init__(self) -> None:
        self.open: set[Session] = set()
        self.closed = anyio.Event()  # set when the last session leaves after `close_all`
        self.closing = False

    @staticmethod
    def of(app) -> "Sessions":
        sessions = getattr(app.state, "websocket_sessions", None)
        if sessions is None:
            sessions = app.state.websocket_sessions = Sessions()
        return sessions

    def add(self, session: Session) -> None:
        self.open.add(session)
        if self.closing:  # accepted as shutdown began
            session.going_away.set()

    def remove(self, session: Session) -> None:
        self.open.discard(session)
        if self.closing and not self.open:
            self.closed.set()

    async def close_all(self) -> int:
        """Shutdown: each session closes with 1001 once its requests' last messages are out (the
        engine has ended them); returns when all are closed. Returns how many were open."""
        self.closing = True
        count = len(self.open)
        for session in self.open:
            session.going_away.set()
        if self.open:
            await self.closed.wait()
        return count


def session_core(connection) -> SessionCore:
    """The app's `SessionCore`, built with the server state at start-up (`api/app.py`)."""
    return connection.app.state.session_core


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@router.websocket("/v1/sessions")
async def sessions(websocket: WebSocket) -> None:
    state = await admit(websocket)
    if state is None:
        return
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[dict](OUTBOX_MESSAGES)
    open_sessions = Sessions.of(websocket.app)
    async with anyio.create_task_group() as tg:
        session = Session(state, session_core(websocket), websocket, outbox_tx, tg)
        session.log.info("Session opened")

        async def go_away() -> None:
            await session.going_away.wait()
            await session.close_when_ended()

        tg.start_soon(write_outbox, websocket, outbox_rx, tg.cancel_scope)
        tg.start_soon(go_away)
        open_sessions.add(session)
        await session.send({"type": "session.created", **session.describe(), "available": session.available()})
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                if frame.get("text") is not None:
                    await session.handle(frame["text"])
                else:
                    await session.send(error("invalid_message", "send JSON text frames, not binary ones"))
        except WebSocketDisconnect:
            pass
        finally:
            session.log.info("Session closed", requests_aborted=len(session.running))
            tg.cancel_scope.cancel()
            open_sessions.remove(session)


def _logprob_json(lp) -> dict[str, Any]:
    """A `TokenLogprob` on the wire: `rank` only where it was computed (prompt tokens)."""
    out: dict[str, Any] = {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
    if lp.rank is not None:
        out["rank"] = lp.rank
    return out


class SessionsProtocol(Protocol):
    """cadenza's own bidirectional WebSocket sessions."""

    name = "sessions"

    def router(self) -> APIRouter:
        return router
