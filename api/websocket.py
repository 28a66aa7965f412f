"""WebSocket sessions at /v1/sessions: several requests at once on one connection, a server-side
conversation with cancel and barge-in, and errors that never end the connection.

A connection runs a reader (client messages) and a writer (server messages) plus one task per
request; when the reader or the writer ends, everything else on the connection is cancelled, and
every request still running is aborted, which returns its KV blocks at once.

On shutdown, once the engine has ended the requests still running (`server_shutdown`), each session
sends their errors and then closes the connection with 1001 (going away), idle sessions at once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cadenza.api.errors import APIError
from cadenza.api.state import ServerState, check_api_key, server_state
from cadenza.api.ws_protocol import (
    Cancel,
    Generate,
    Interrupt,
    Ping,
    ProtocolError,
    SamplingOptions,
    SessionGet,
    SessionUpdate,
    error,
    parse_client_message,
)
from cadenza.engine import EngineClosedError
from cadenza.sampling_params import SamplingParams, SamplingParamsError, merge_sampling

log = structlog.get_logger("cadenza.api.websocket")
router = APIRouter()

# Messages waiting for the writer. Past it, request tasks wait, so their engine streams merge
# tokens instead; a client that stays too slow is cut off per request by the engine's bound.
OUTBOX_MESSAGES = 64
MAX_FRAME_CHARS = 1 << 20
GOING_AWAY = 1001  # the close code of a server that is shutting down
_CLOSE: dict[str, Any] = {}  # queued after a closing session's last message: the writer closes then


@dataclass
class _Running:
    client_id: str
    engine_id: str
    is_turn: bool
    interrupted: bool = False
    cancelled: bool = False
    text: list[str] = field(default_factory=list)
    ended: anyio.Event = field(default_factory=anyio.Event)  # its last message is in the outbox


class Session:
    def __init__(self, state: ServerState, websocket: WebSocket, outbox: MemoryObjectSendStream, tg) -> None:
        self.state = state
        self.engine = state.engine
        self.websocket = websocket
        self.outbox = outbox
        self.tg = tg
        self.id = f"sess-{uuid.uuid4().hex[:12]}"
        self.system_prompt: str | None = None
        self.sampling = SamplingOptions()
        self.history: list[dict[str, str]] = []  # the conversation's user and assistant turns
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
                case Interrupt(request_id=request_id):
                    turn = request_id or next((r.client_id for r in self.running.values() if r.is_turn), None)
                    if turn is None:
                        raise ProtocolError("nothing_to_interrupt", "no conversation turn is running")
                    await self._stop(turn, interrupt=True)
                case SessionGet():
                    await self.send({"type": "session.state", **self.describe(), "history": self.history})
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
            "limits": {
                "max_requests_in_flight": self.state.config.server.max_requests_per_connection,
                "max_model_len": self.engine.runtime.max_model_len,
            },
        }

    def _update(self, message: SessionUpdate) -> None:
        if "system_prompt" in message.model_fields_set:
            self.system_prompt = message.system_prompt or None
        if message.sampling is not None:
            merged = {**self.sampling.model_dump(exclude_none=True), **message.sampling.model_dump(exclude_none=True)}
            self.sampling = SamplingOptions(**merged)

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
        is_turn = message.user is not None
        if is_turn:
            if any(r.is_turn for r in self.running.values()):
                raise ProtocolError("turn_in_progress", "a conversation turn is running; interrupt it first", request_id)
            self.history.append({"role": "user", "content": message.user})
            prompt: Any = self._conversation()
        elif message.messages is not None:
            prompt = [m.model_dump() for m in message.messages]
        elif message.token_ids is not None:
            prompt = message.token_ids
        else:
            prompt = message.prompt
        running = _Running(request_id, f"{self.id}:{request_id}", is_turn)
        self.running[request_id] = running
        self.tg.start_soon(self._run, running, prompt, params)

    def _conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.history

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
        await self.engine.abort(running.engine_id)

    # --- one request ----------------------------------------------------------------------------

    async def _run(self, running: _Running, prompt: Any, params: SamplingParams) -> None:
        try:
            await self._stream(running, prompt, params)
        finally:
            running.ended.set()

    async def _stream(self, running: _Running, prompt: Any, params: SamplingParams) -> None:
        request_id = running.client_id
        last, refused = None, False
        try:
            async for out in self.engine.generate(prompt, params, request_id=running.engine_id):
                last = out
                if out.text or out.token_ids:
                    running.text.append(out.text)
                    delta: dict[str, Any] = {
                        "type": "delta", "request_id": request_id, "text": out.text, "token_ids": list(out.token_ids),
                    }
                    if out.logprobs is not None:
                        delta["logprobs"] = [
                            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                            for lp in out.logprobs
                        ]
                    await self.send(delta)
        except EngineClosedError as exc:
            refused = True
            await self.send(error("unavailable", str(exc), request_id))
            return
        finally:
            self.running.pop(request_id, None)
            if running.is_turn:
                self._settle_turn(running, last)
            if not refused:  # also when the session closed under the request: counted as aborted
                self.state.metrics.observe_ended("websocket", running.engine_id, last)
        if last.finish_reason == "error":
            await self.send(error(last.error_code or "internal_error", last.error or "the request failed", request_id))
            return
        timings = last.timings
        await self.send(
            {
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

    def _settle_turn(self, running: _Running, last) -> None:
        """A finished or interrupted turn keeps its answer; a cancelled or failed one is undone."""
        kept = last is not None and (running.interrupted or last.finish_reason in ("stop", "length"))
        if kept:
            self.history.append({"role": "assistant", "content": "".join(running.text)})
        elif self.history and self.history[-1]["role"] == "user":
            self.history.pop()

    async def send(self, message: dict[str, Any]) -> None:
        await self.outbox.send(message)

    async def close_when_ended(self) -> None:
        """Once every running request has queued its last message (its error, on shutdown), have
        the writer close the connection with 1001. No request starts meanwhile: the server is draining."""
        for running in list(self.running.values()):
            await running.ended.wait()
        await self.outbox.send(_CLOSE)


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@router.websocket("/v1/sessions")
async def sessions(websocket: WebSocket) -> None:
    try:
        state = server_state(websocket)
        check_api_key(websocket, state)
        if state.draining:
            raise APIError(503, "unavailable", "the server is shutting down")
    except APIError as exc:
        # Refused before the handshake completes: the client sees the HTTP status (403 for a close).
        await websocket.close(code=1008 if exc.status == 401 else 1013, reason=exc.message[:120])
        return
    await websocket.accept()
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[dict](OUTBOX_MESSAGES)
    open_sessions = Sessions.of(websocket.app)
    async with anyio.create_task_group() as tg:
        session = Session(state, websocket, outbox_tx, tg)
        session.log.info("Session opened")

        async def write() -> None:
            try:
                async with outbox_rx:
                    async for message in outbox_rx:
                        if message is _CLOSE:
                            await websocket.close(GOING_AWAY, "the server is shutting down")
                            break
                        await websocket.send_text(json.dumps(message))
            except Exception:
                pass  # the client went away; the reader notices too
            tg.cancel_scope.cancel()

        async def go_away() -> None:
            await session.going_away.wait()
            await session.close_when_ended()

        tg.start_soon(write)
        tg.start_soon(go_away)
        open_sessions.add(session)
        await session.send({"type": "session.created", **session.describe()})
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
