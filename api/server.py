"""Running the app under uvicorn, with graceful shutdown on SIGINT/SIGTERM.

Shutdown phases, each logged: (1) draining: new requests are refused (HTTP 503, WebSocket error
"unavailable") while running ones may finish for up to `server.shutdown_grace` seconds; (2) every
request still running ends with the error `server_shutdown` (an SSE error event then `[DONE]`, a 503,
a WebSocket `error`) and its KV blocks are freed; WebSocket sessions then close with 1001; (3)
uvicorn stops listening, closes the idle connections and the app stops the engine. Phases 2 and 3
take a few seconds at most (`CLOSE_SECONDS` each), so the process exits, with status 0, soon after
the grace. A second signal cuts the grace short: phase 2 at once.
"""

from __future__ import annotations

import asyncio
import socket

import anyio
import structlog
import uvicorn

from cadenza.api.app import create_app
from cadenza.api.model_pool import model_config
from cadenza.api.sessions.websocket import Sessions
from cadenza.config import CadenzaConfig
from cadenza.engine.async_engine import SERVER_SHUTDOWN
from cadenza.runtime.build import build_runtime

log = structlog.get_logger("cadenza.api")

# Once requests have been ended: how long WebSocket sessions get to send their errors and close,
# then how long uvicorn waits for connections to close. Both usually take milliseconds.
CLOSE_SECONDS = 2.0


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float, ask: str | None = None) -> None:
        super().__init__(config)
        self.grace = grace
        self.ask = ask
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._hurried = False
        self._waiting: anyio.CancelScope | None = None
        self._shutdown: asyncio.Future | None = None  # held: the loop keeps only weak references

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
        """SIGINT/SIGTERM (run between bytecodes on the main thread, which runs the loop): the first
        starts the shutdown, the next cuts what it waits for short. Unlike uvicorn's own, it does
        not record the signal to raise again at exit: the shutdown is the signal's whole answer,
        and the process exits with status 0."""
        state = getattr(self.config.app.state, "server", None)
        if self._loop is None or state is None:  # not serving yet: just stop
            self.should_exit = True
        elif not self._draining:
            self._draining = True
            self._loop.call_soon_threadsafe(self._begin_shutdown, state)
        else:
            self._loop.call_soon_threadsafe(self._hurry)

    def _begin_shutdown(self, state) -> None:
        state.draining = True
        self._shutdown = asyncio.ensure_future(self._shut_down(state))

    def _hurry(self) -> None:
        if not self._hurried:
            log.info("Second signal; skipping the rest of the wait")
        self._hurried = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _shut_down(self, state) -> None:
        engine = state.engine
        try:
            log.info("Draining", requests_in_flight=engine.num_active_requests, grace_seconds=self.grace)
            with self._wait(self.grace):
                await engine.wait_for_requests(self.grace)
            ended = await engine.end_requests(SERVER_SHUTDOWN, "the server is shutting down")
            if ended:
                event = "Ending the rest now" if self._hurried else "Grace period over; ending the rest"
                log.info(event, requests_ended=ended, error_code=SERVER_SHUTDOWN)
            else:
                log.info("All requests finished")
            sessions = Sessions.of(self.config.app)
            if sessions.open:
                log.info("Closing WebSocket sessions", sessions=len(sessions.open), close_code=1001)
            with self._wait(CLOSE_SECONDS):
                await sessions.close_all()
        except Exception:
            log.exception("Shutdown failed; stopping all the same")
        finally:
            self.should_exit = True  # uvicorn's own shutdown: stop listening, close connections, lifespan

    def _wait(self, seconds: float) -> anyio.CancelScope:
        """A bounded wait that a second signal cancels (at once, if one came already)."""
        self._waiting = anyio.move_on_after(seconds)
        if self._hurried:
            self._waiting.cancel()
        return self._waiting


async def _ask_over_websocket(url: str, question: str, app) -> None:
    """Show the server answering: one chat turn through its own WebSocket endpoint.

    On a terminal the answer streams in as it is generated. Piped, it comes in whole lines (the
    last with the closing note, once done), each in one write, so the server's log lines on stderr
    fall between the answer's lines, never inside one.
    """
    import json
    import sys

    from websockets.asyncio.client import connect

    headers = {}
    server = app.state.server.config.server
    key = server.api_key or (server.api_keys[0].key if server.api_keys else None)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    live = sys.stdout.isatty()
    try:
        async with connect(url, additional_headers=headers) as ws:
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "generate", "request_id": "ask", "user": question, "sampling": {"temperature": 0}}))
            print(f"\n> {question}\n", flush=True)
            held = ""  # piped: the answer's unfinished last line
            async for raw in ws:
                message = json.loads(raw)
                if message["type"] == "delta":
                    if live:
                        print(message["text"], end="", flush=True)
                        continue
                    lines, newline, held = (held + message["text"]).rpartition("\n")
                    if newline:
                        print(lines, flush=True)
                elif message["type"] in ("done", "error"):
                    outcome = message.get("finish_reason") or message.get("code")
                    print(f"{held}\n\n[{outcome}; serving on {url}; Ctrl-C stops]\n", flush=True)
                    return
    except Exception as exc:  # the demo must never take the server down
        log.warning("The --ask demo failed", error=repr(exc))


def run_server(config: CadenzaConfig, ask: str | None = None) -> None:
    """Load the model, then listen; the port opens only once the engine can serve. With a
    `models` list, the first is the model loaded now (the others load on their first request)."""
    if config.models:
        first = config.models[0]
        config = model_config(config, first.path, first.overrides)
    if config.parallel.data_parallel_size > 1:
        from cadenza.cluster.replicas import start_replicas

        served = start_replicas(config)
        serve_engine = served.serve_engine
    else:
        served, serve_engine = build_runtime(config), None  # one engine: AsyncEngine.serve
    try:
        _serve(config, create_app(served, serve_engine=serve_engine, shutdown_grace=config.server.shutdown_grace), ask)
    finally:
        served.close()  # tensor-parallel ranks or data-parallel replicas end with the server


def _serve(config: CadenzaConfig, app, ask: str | None) -> None:
    server = config.server
    uv_config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        ws="websockets-sansio",
        log_config=None,
        access_log=False,  # the app logs one structured access line per request itself
        limit_concurrency=server.max_connections,
        timeout_graceful_shutdown=CLOSE_SECONDS,  # requests have ended by then (phase 2)
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
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted connections only for a
    # socket created so, and without it Nagle's algorithm held every HTTP response ~40 ms (uvicorn
    # writes headers and body apart; the second write waited for the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
