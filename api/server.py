"""Running the app under uvicorn, with graceful shutdown on SIGINT/SIGTERM.

Shutdown phases, each logged: (1) draining: new requests are refused (HTTP 503, WebSocket error
"unavailable") while running ones may finish for up to `server.shutdown_grace` seconds; (2) uvicorn
stops accepting connections and closes them; (3) the engine aborts whatever still runs. A second
signal skips straight to the end.
"""

from __future__ import annotations

import asyncio
import socket

import structlog
import uvicorn

from cadenza.api.app import create_app
from cadenza.config import CadenzaConfig
from cadenza.runtime import build_runtime

log = structlog.get_logger("cadenza.api")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float, ask: str | None = None) -> None:
        super().__init__(config)
        self.grace = grace
        self.ask = ask
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("Started server", url=f"http://{host}:{port}", host=host, port=port)
            # Tests and scripts wait for this line: it carries the real port when port 0 was asked.
            print(f"cadenza listening on http://{host}:{port}", flush=True)
            if self.ask:
                asyncio.ensure_future(_ask_over_websocket(f"ws://{host}:{port}/v1/sessions", self.ask, self.config.app))

    def handle_exit(self, sig, frame) -> None:
        state = getattr(self.config.app.state, "server", None)
        if self._draining or state is None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        state.draining = True
        log.info("Draining", requests_in_flight=state.engine.num_active_requests, grace_seconds=self.grace)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(sig, frame, state)))

    async def _drain_then_exit(self, sig, frame, state) -> None:
        deadline = self._loop.time() + self.grace
        while state.engine.num_active_requests and self._loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        left = state.engine.num_active_requests
        if left:
            log.info("Grace period over; aborting the rest", requests_in_flight=left)
        else:
            log.info("All requests finished")
        super().handle_exit(sig, frame)


async def _ask_over_websocket(url: str, question: str, app) -> None:
    """Show the server answering: one chat turn through its own WebSocket endpoint, streamed."""
    import json

    from websockets.asyncio.client import connect

    headers = {}
    key = app.state.server.config.server.api_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with connect(url, additional_headers=headers) as ws:
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "generate", "request_id": "ask", "user": question, "sampling": {"temperature": 0}}))
            print(f"\n> {question}\n", flush=True)
            async for raw in ws:
                message = json.loads(raw)
                if message["type"] == "delta":
                    print(message["text"], end="", flush=True)
                elif message["type"] in ("done", "error"):
                    print(f"\n\n[{message.get('finish_reason') or message.get('code')}; serving on {url}; Ctrl-C stops]\n", flush=True)
                    return
    except Exception as exc:  # the demo must never take the server down
        log.warning("The --ask demo failed", error=repr(exc))


def run_server(config: CadenzaConfig, ask: str | None = None) -> None:
    """Load the model, then listen; the port opens only once the engine can serve."""
    runtime = build_runtime(config)
    server = config.server
    app = create_app(runtime, shutdown_grace=server.shutdown_grace)
    uv_config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        ws="websockets-sansio",
        log_config=None,
        access_log=False,  # the app logs one structured access line per request itself
        limit_concurrency=server.max_connections,
        timeout_graceful_shutdown=server.shutdown_grace,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        lifespan="on",
    )
    _Server(uv_config, server.shutdown_grace, ask).run(sockets=[_listening_socket(server.host, server.port, server.socket_send_buffer)])


def _listening_socket(host: str, port: int, send_buffer: int | None) -> socket.socket:
    """Bound here rather than by uvicorn so that accepted connections inherit a fixed send buffer:
    a client that stops reading then fills a bounded buffer quickly, and the per-request bound in
    the engine cuts it off, instead of megabytes piling up in an autotuned kernel buffer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
