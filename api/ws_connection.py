"""What every WebSocket endpoint (sessions, Responses, Realtime) does around its own protocol:
admit or refuse the connection before the handshake, read a frame's JSON, and write its outbox to
the socket."""

from __future__ import annotations

import json
from typing import Any, Callable

from anyio import CancelScope
from anyio.streams.memory import MemoryObjectReceiveStream
from fastapi import WebSocket

from cadenza.api.errors import APIError
from cadenza.api.state import ServerState, check_api_key, server_state
from cadenza.api.tenants import CURRENT_TENANT

MAX_FRAME_CHARS = 1 << 20  # the longest text frame any endpoint reads
GOING_AWAY = 1001  # the close code of a server that is shutting down
CLOSE: dict[str, Any] = {}  # queued after a closing connection's last message: the writer closes then


async def admit(websocket: WebSocket, check: Callable[[ServerState], None] | None = None) -> ServerState | None:
    """Accept the connection and return the server state once the API key, the server not
    draining and `check(state)` (which raises `APIError`) pass. Otherwise refuse it before the
    handshake completes (the client sees the HTTP status: 403 for a close with 1008 or 1013) and
    return None. The key's tenant is the connection's from then on (`CURRENT_TENANT`, in the
    endpoint's context and so in every task it starts)."""
    try:
        state = server_state(websocket)
        CURRENT_TENANT.set(check_api_key(websocket, state))
        if state.draining:
            raise APIError(503, "unavailable", "the server is shutting down")
        if check is not None:
            check(state)
    except APIError as exc:
        await websocket.close(code=1008 if exc.status in (401, 404) else 1013, reason=exc.message[:120])
        return None
    await websocket.accept()
    return state


async def write_outbox(websocket: WebSocket, outbox: MemoryObjectReceiveStream[dict], scope: CancelScope) -> None:
    """Send each outbox message as a JSON text frame until the outbox closes, `CLOSE` arrives (close
    with 1001) or the client goes away; then cancel `scope`, the connection's task group."""
    try:
        async with outbox:
            async for message in outbox:
                if message is CLOSE:
                    await websocket.close(GOING_AWAY, "the server is shutting down")
                    break
                await websocket.send_text(json.dumps(message))
    except Exception:
        pass  # the client went away; the reader notices too
    scope.cancel()


def parse_frame(text: str | None, noun: str = "messages") -> Any:
    """A text frame's JSON value; `APIError` 400 for a binary frame, one over `MAX_FRAME_CHARS`
    (`noun` names what the endpoint calls its frames) or one that is not JSON."""
    if text is None:
        raise APIError(400, "invalid_message", "send JSON text frames, not binary ones")
    if len(text) > MAX_FRAME_CHARS:
        raise APIError(400, "message_too_large", f"{noun} are limited to {MAX_FRAME_CHARS} characters")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, "invalid_json", f"not valid JSON: {exc}") from None
