"""The ASGI app: the wire protocols served (`api/protocols.py`: OpenAI's chat, completions and
Responses over HTTP, the Responses and Realtime WebSocket APIs, cadenza's WebSocket sessions, and
what plugins add), the browser playground at `/`, health, metrics and the model list, on one port."""

from __future__ import annotations

import functools
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncContextManager, Callable, Literal

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from cadenza.api.errors import APIError, error_responses, install_error_handlers
from cadenza.api.metrics import ServerMetrics
from cadenza.api.openai.request_rules import API_DESCRIPTION, ServedLimits
from cadenza.api.openai.schema import ModelList, openapi_schemas
from cadenza.api.protocols import ErrorWriters, select_protocols
from cadenza.api.sessions.core import ContextPlugins, SessionCore
from cadenza.api.state import (
    ServerState,
    check_api_key,
    resolve_reasoning_parser,
    resolve_tool_parser,
    served_model_name,
    server_state,
)
from cadenza.engine.async_engine import AsyncEngine
from cadenza.runtime.served import Served

log = structlog.get_logger("cadenza.api")

# Paths anyone may call, key or not: liveness probes and scrapers do not carry API keys, and the
# playground page holds no data (it asks for the key and sends it on its WebSocket).
_OPEN_PATHS = ("/health", "/metrics", "/", "/favicon.ico")


# How an app starts its engine: `AsyncEngine.serve`'s signature, less the runtime it is bound to.
ServeEngine = Callable[..., AsyncContextManager[Any]]


class Health(BaseModel):
    status: Literal["ok"]
    model: str


def create_app(runtime: Served, *, serve_engine: ServeEngine | None = None, shutdown_grace: float = 10.0) -> FastAPI:
    """The app over `runtime`, served by `serve_engine` (`AsyncEngine.serve`, one engine in this
    process, unless given: the replica front end's `serve_engine`, an engine over its replicas)."""
    config = runtime.config
    serve_engine = serve_engine or functools.partial(AsyncEngine.serve, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with serve_engine(
            shutdown_grace=shutdown_grace, max_pending_tokens=config.server.max_pending_tokens
        ) as engine:
            template = engine.runtime.tokenizer.chat_template
            reasoning = resolve_reasoning_parser(config.server.reasoning_parser, runtime.registries, template)
            tools = resolve_tool_parser(config.server.tool_parser, runtime.registries, template)
            app.state.server = ServerState(engine, config, served_model_name(config), ServerMetrics(engine.metrics),
                                           reasoning_parser=reasoning, tool_parser=tools)
            engine.register_metrics(app.state.server.metrics.registry)
            # Context providers build their indexes here, once (a folder of documents, say).
            context_plugins = await anyio.to_thread.run_sync(ContextPlugins, config, runtime.registries)
            app.state.session_core = SessionCore(app.state.server, context_plugins)
            log.info("Application startup complete", model=app.state.server.model_name)
            yield
            app.state.server.draining = True
            log.info("Stopping engine", requests_in_flight=engine.num_active_requests)

    app = FastAPI(title="cadenza", lifespan=lifespan, docs_url=None, redoc_url=None)
    registered = runtime.registries.protocols
    protocols = select_protocols(
        [(name, registered.get(name), registered.source_of(name)) for name in registered.names()],
        config.server.protocols,
    )
    app.state.error_writers = ErrorWriters(protocols)
    install_error_handlers(app)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the request models that the OpenAI routes parse themselves,
        with the served model's bounds (its vocabulary, hidden size and plugins)."""
        if app.openapi_schema is None:
            document = FastAPI.openapi(app)
            arch = runtime.loaded.arch
            names = tuple(runtime.extra_params.names) if runtime.extra_params is not None else None
            limits = ServedLimits(arch.vocab_size, arch.hidden_size, names)
            from cadenza.api.openai_ws.responses_protocol import ResponseCreateRequest
            from cadenza.api.tokenizer import REQUEST_MODELS as TOKENIZER_MODELS

            schemas = openapi_schemas(served_model_name(config), limits, (*TOKENIZER_MODELS, ResponseCreateRequest))
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            document["info"]["description"] = API_DESCRIPTION
            # FastAPI documents a 422 for routes with path parameters; this server answers its
            # validation errors with 400 (and a path segment is any string).
            for operations in document["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                document["components"]["schemas"].pop(unused, None)
        return app.openapi_schema

    app.openapi = openapi

    @app.middleware("http")
    async def access_log_and_auth(request: Request, call_next):
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        request.state.request_id = request_id
        try:
            if request.url.path not in _OPEN_PATHS:
                check_api_key(request, server_state(request))
            response = await call_next(request)
        except APIError as exc:
            response = app.state.error_writers.response(request.url.path, exc)
        log.info(
            "access",
            request_id=request_id,
            method=request.method,
            path=request.url.path,
            status=response.status_code,
            ms=round((time.perf_counter() - started) * 1000, 1),
        )
        response.headers["x-request-id"] = request_id
        return response

    @app.get("/health", responses={200: {"model": Health}, **error_responses(503)})
    async def health(request: Request):
        state = server_state(request)
        if not state.engine.healthy:
            raise APIError(503, "unhealthy", state.engine.unhealthy_reason or "the engine is unhealthy")
        if state.draining:
            raise APIError(503, "draining", "the server is shutting down")
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 503)})
    async def models(request: Request):
        state = server_state(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "cadenza",
                    "max_model_len": state.engine.runtime.max_model_len,
                }
            ],
        }

    from cadenza.api import playground

    for protocol in protocols:
        app.include_router(protocol.router())
    app.include_router(playground.router)
    return app
