"""The serving bench's two clients: WebSocket sessions (`/v1/sessions`) and OpenAI streaming
completions over HTTP (`/v1/completions`, Server-Sent Events).

Both send a `BenchRequest` as token ids with `ignore_eos`, and fill a `RequestRecord` with the
times a client sees: sent, first streamed tokens, finished. A client is used as

    async with client:                     # connect (untimed)
        async with anyio.create_task_group() as tg:
            client.start(tg)               # background readers, if the protocol needs them
            await client.warmup()
            await client.send(index, request, record)   # returns when the request has ended
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import anyio

from cadenza.bench.common.workload import BenchRequest

WARMUP_PROMPT = list(range(100, 116))


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are `time.perf_counter()` seconds.

    `status` is None while the request runs, then "completed", "failed" (with `error`) or
    "cancelled" (still running, or never sent, when the run's time was up).
    """

    index: int
    num_prompt_tokens: int
    max_tokens: int
    sent_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    num_streamed_tokens: int = 0  # counted from the stream where the protocol carries token ids
    num_output_tokens: int | None = None  # what the server's usage reported
    finish_reason: str | None = None
    status: str | None = None
    error: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens the server's prefix cache served (WebSocket usage)
    keep_token_ids: bool = False  # keep the streamed ids (a multi-turn conversation appends its answer)
    output_token_ids: list[int] = field(default_factory=list)

    def on_tokens(self, now: float, count: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.num_streamed_tokens += count

    def fail(self, now: float, reason: str) -> None:
        if self.status is None:
            self.finished_at, self.status, self.error = now, "failed", reason

    def complete(self, now: float, finish_reason: str | None, usage_tokens: int | None, streamed: bool) -> None:
        """Completed only with exactly `max_tokens` output tokens (the workload ignores EOS);
        `streamed` says the stream's own token count must agree too."""
        self.finished_at, self.finish_reason, self.num_output_tokens = now, finish_reason, usage_tokens
        if finish_reason != "length":
            self.fail(now, f"finish_reason {finish_reason!r}, expected 'length'")
        elif usage_tokens is None:
            self.fail(now, "the stream carried no usage")
        elif usage_tokens != self.max_tokens:
            self.fail(now, f"usage says {usage_tokens} output tokens, asked for {self.max_tokens}")
        elif streamed and self.num_streamed_tokens != self.max_tokens:
            self.fail(now, f"streamed {self.num_streamed_tokens} tokens, asked for {self.max_tokens}")
        elif self.first_token_at is None:
            self.fail(now, "nothing was streamed before the end")
        else:
            self.status = "completed"

    @property
    def ttft(self) -> float | None:
        if self.sent_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        if self.sent_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None for one token."""
        if self.status != "completed" or not self.num_output_tokens or self.num_output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.num_output_tokens - 1)


# --- WebSocket ----------------------------------------------------------------------------------


class _Connection:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.pending: dict[str, tuple[RequestRecord, anyio.Event]] = {}
        self.closed: str | None = None  # why the connection ended, once it has

    async def read(self) -> None:
        """Route each server message to its request; a lost connection fails what it carried."""
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                now = time.perf_counter()
                message = json.loads(raw)
                found = self.pending.get(message.get("request_id"))
                if found is None:
                    continue  # session messages, pongs, errors about no request
                record, done = found
                kind = message["type"]
                if kind == "delta":
                    record.on_tokens(now, len(message["token_ids"]))
                    if record.keep_token_ids:
                        record.output_token_ids.extend(message["token_ids"])
                    continue
                if kind == "done":
                    usage = message.get("usage") or {}
                    record.num_cached_tokens = usage.get("cached_tokens")
                    record.complete(now, message.get("finish_reason"), usage.get("completion_tokens"), streamed=True)
                elif kind == "error":
                    record.fail(now, f"{message.get('code')}: {message.get('message')}")
                else:
                    continue
                del self.pending[message["request_id"]]
                done.set()
            self.closed = "the server closed the connection"
        except ConnectionClosed as exc:
            self.closed = f"the connection was lost: {exc}"
        finally:
            now = time.perf_counter()
            for record, done in self.pending.values():
                record.fail(now, self.closed or "the connection was closed")
                done.set()
            self.pending.clear()


class WebSocketClient:
    """Requests multiplexed over as few sessions as the server's per-connection limit allows:
    ceil(num_requests / max_requests_in_flight) connections, request i on connection i mod n,
    so no connection ever carries more than its limit."""

    protocol = "ws"

    def __init__(self, base_url: str, num_requests: int, temperature: float, api_key: str | None = None) -> None:
        self.url = base_url.replace("http://", "ws://", 1).rstrip("/") + "/v1/sessions"
        self.num_requests, self.temperature = num_requests, temperature
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connections: list[_Connection] = []

    async def _connect(self) -> tuple[_Connection, dict]:
        from websockets.asyncio.client import connect
        from websockets.exceptions import WebSocketException

        try:
            # No keepalive pings from our side, no frame limit: nothing but the load should end a session.
            ws = await connect(self.url, additional_headers=self.headers, ping_interval=None, max_size=None,
                               open_timeout=30)
        except WebSocketException as exc:
            raise RuntimeError(f"could not open a session at {self.url}: {exc}") from exc
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            await ws.close()
            raise RuntimeError(f"expected session.created from {self.url}, got {created}")
        return _Connection(ws), created

    async def __aenter__(self) -> "WebSocketClient":
        try:
            first, created = await self._connect()
            self.connections.append(first)
            limit = int(created.get("limits", {}).get("max_requests_in_flight") or 1)
            for _ in range(math.ceil(self.num_requests / limit) - 1):
                self.connections.append((await self._connect())[0])
        except BaseException:
            await self.__aexit__(None, None, None)  # close the sessions already open
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        # Closing a session aborts whatever still runs on it (docs/websocket.md).
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            for connection in self.connections:
                await connection.ws.close()

    def start(self, tg) -> None:
        for connection in self.connections:
            tg.start_soon(connection.read)

    async def warmup(self, count: int = 1) -> None:
        """`count` distinct prompts at once: `count` data-parallel replicas each get one."""
        records = [RequestRecord(-1, len(WARMUP_PROMPT), 4) for _ in range(count)]
        async with anyio.create_task_group() as tg:
            for i, record in enumerate(records):
                connection = self.connections[i % len(self.connections)]
                tg.start_soon(self._send, connection, f"warmup-{i}", [t + i for t in WARMUP_PROMPT], record, 0.0)
        for record in records:
            if record.status != "completed":
                raise RuntimeError(f"the warm-up request over WebSocket failed: {record.error}")

    async def send(self, index: int, request: BenchRequest, record: RequestRecord, request_id: str | None = None) -> None:
        """Request `index` on connection `index mod n`, as `request_id` (default `r{index}`)."""
        connection = self.connections[index % len(self.connections)]
        await self._send(connection, request_id or f"r{index}", request.prompt_token_ids, record, self.temperature)

    async def _send(self, connection: _Connection, request_id: str, prompt: list[int], record: RequestRecord,
                    temperature: float) -> None:
        if connection.closed:
            record.fail(time.perf_counter(), connection.closed)
            return
        done = anyio.Event()
        connection.pending[request_id] = (record, done)
        message = {"type": "generate", "request_id": request_id, "token_ids": prompt,
                   "sampling": {"max_tokens": record.max_tokens, "ignore_eos": True, "temperature": temperature}}
        record.sent_at = time.perf_counter()
        try:
            await connection.ws.send(json.dumps(message))
            await done.wait()
        except anyio.get_cancelled_exc_class():
            # Time is up: tell the server now rather than when the session closes.
            connection.pending.pop(request_id, None)
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await connection.ws.send(json.dumps({"type": "cancel", "request_id": request_id}))
            raise


# --- OpenAI HTTP --------------------------------------------------------------------------------


def _import_httpx():
    try:
        import httpx
    except ImportError:
        raise RuntimeError("the HTTP protocol needs httpx: pip install httpx (or pip install 'cadenza[bench]')") from None
    return httpx


class HTTPClient:
    """`POST /v1/completions` with `stream: true` and the usage chunk, one HTTP/1.1 connection
    per request in flight. The first chunk with a choice marks the first token: a token that
    is part of a character streams no text, so this can be later than on WebSocket."""

    protocol = "http"

    def __init__(self, base_url: str, num_requests: int, temperature: float, model: str,
                 api_key: str | None = None) -> None:
        self.httpx = _import_httpx()
        self.base_url, self.temperature, self.model = base_url.rstrip("/"), temperature, model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = self.httpx.Limits(max_connections=num_requests + 1, max_keepalive_connections=num_requests + 1)
        self.client = self.httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                             timeout=self.httpx.Timeout(None, connect=30.0))

    async def __aenter__(self) -> "HTTPClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.client.aclose()

    def start(self, tg) -> None:
        pass  # each request reads its own stream

    async def warmup(self) -> None:
        record = RequestRecord(-1, len(WARMUP_PROMPT), 4)
        await self._send(WARMUP_PROMPT, record, temperature=0.0)
        if record.status != "completed":
            raise RuntimeError(f"the warm-up request over HTTP failed: {record.error}")

    async def send(self, index: int, request: BenchRequest, record: RequestRecord) -> None:
        await self._send(request.prompt_token_ids, record, self.temperature)

    async def _send(self, prompt: list[int], record: RequestRecord, temperature: float) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": record.max_tokens, "ignore_eos": True,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        finish_reason, usage = None, None
        record.sent_at = time.perf_counter()
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.fail(time.perf_counter(), f"HTTP {response.status_code}: {_error_message(text)}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.fail(now, f"stream error: {_error_message(data)}")
                        return
                    for choice in chunk.get("choices") or ():
                        record.on_tokens(now, 0)  # SSE text carries no token count; usage does
                        finish_reason = choice.get("finish_reason") or finish_reason
                    if chunk.get("usage"):
                        usage = chunk["usage"].get("completion_tokens")
        except (self.httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            record.fail(time.perf_counter(), f"{type(exc).__name__}: {exc}")
            return
        record.complete(time.perf_counter(), finish_reason, usage, streamed=False)


def _error_message(text: str) -> str:
    try:
        error = json.loads(text)["error"]
        return f"{error.get('code') or error.get('type')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return text[:200]
