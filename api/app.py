"""The ASGI app: the wire protocols served (`api/protocols.py`: OpenAI's chat, completions and
Responses over HTTP, the Responses and Realtime WebSocket APIs, cadenza's WebSocket sessions, and
what plugins add), the browser playground at `/`, health, metrics and the model list, on one port."""

from __future__ import annotations

import functools
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Literal

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from cadenza.api.builtin_protocols import BUILTIN_PROTOCOLS
from cadenza.api.errors import APIError, error_responses, install_error_handlers, written
from cadenza.api.http_streaming import parse_body
from cadenza.api.metrics import ServerMetrics
from cadenza.api.model_pool import ModelPool, ModelRouting
from cadenza.api.openai.request_rules import API_DESCRIPTION, Relation, ServedLimits, write_rules
from cadenza.api.openai.schema import ModelList, openapi_request_body, openapi_schemas, prefixed_schemas
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
from cadenza.api.tenants import CURRENT_TENANT, TenantEngine
from cadenza.config import CadenzaConfig
from cadenza.engine.async_engine import AsyncEngine
from cadenza.models.loading import release_free_memory
from cadenza.runtime.build import build_runtime
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


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="A model the server serves (its `models` list).")


class ModelUnload(ModelAction):
    """The model to unload: not the first, nor a pinned one (they stay loaded: a 400, model_pinned)."""


class ModelState(BaseModel):
    id: str
    status: Literal["unloaded", "loading", "loaded", "unloading"]
    pinned: bool = Field(description="Never unloaded.")
    in_flight: int = Field(description="Requests running on it now.")
    memory_bytes: int = Field(description="Its weights and KV cache while loaded; 0 otherwise.")
    error: str | None = Field(None, description="Why its last load failed, where it did.")


_PINNED = Relation(("model",), "The first model and the pinned ones stay loaded: unloading one is a 400 (model_pinned).")


def model_action_schemas(names: list[str]) -> dict[str, dict[str, Any]]:
    """The load and unload bodies as OpenAPI components: `model` one of the served `names`."""
    schemas = prefixed_schemas((ModelAction, ModelUnload), "")
    for schema in schemas.values():
        schema["properties"]["model"]["enum"] = names
    write_rules(schemas, {}, {}, {"ModelUnload": [_PINNED]})
    return schemas


def _model_action(body: type[BaseModel], *statuses: int) -> dict[str, Any]:
    return {"openapi_extra": {"requestBody": openapi_request_body(body)},
            "responses": {200: {"model": ModelState}, **error_responses(*statuses)}}


def create_app(runtime: Served, *, serve_engine: ServeEngine | None = None, shutdown_grace: float = 10.0) -> FastAPI:
    """The app over `runtime`, served by `serve_engine` (`AsyncEngine.serve`, one engine in this
    process, unless given: the replica front end's `serve_engine`, an engine over its replicas)."""
    config = runtime.config
    serve_engine = serve_engine or functools.partial(AsyncEngine.serve, runtime)

    @asynccontextmanager
    async def serve_model(name: str, served: Served, serve: ServeEngine) -> AsyncIterator[ServerState]:
        """One model's engine running, and the state its routes read."""
        model_config = served.config
        async with serve(
            shutdown_grace=shutdown_grace, max_pending_tokens=model_config.server.max_pending_tokens
        ) as engine:
            template = engine.runtime.tokenizer.chat_template
            reasoning = resolve_reasoning_parser(model_config.server.reasoning_parser, served.registries, template)
            tools = resolve_tool_parser(model_config.server.tool_parser, served.registries, template)
            # Under cache.salt_per_api_key every request runs under its tenant's salt (api/tenants.py).
            routed = TenantEngine(engine) if model_config.cache.salt_per_api_key else engine
            state = ServerState(routed, model_config, name, ServerMetrics(engine.metrics),
                                reasoning_parser=reasoning, tool_parser=tools)
            engine.register_metrics(state.metrics.registry)
            try:
                yield state
            finally:
                state.draining = True
                log.info("Stopping engine", model=name, requests_in_flight=engine.num_active_requests)

    @asynccontextmanager
    async def start_model(name: str, model_config: CadenzaConfig) -> AsyncIterator[ServerState]:
        """A model of the pool: its runtime built (weights loaded) off the event loop, then served."""
        served = await anyio.to_thread.run_sync(build_runtime, model_config)
        try:
            async with serve_model(name, served, functools.partial(AsyncEngine.serve, served)) as state:
                yield state
        finally:
            await anyio.to_thread.run_sync(served.close)
            await anyio.to_thread.run_sync(release_free_memory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        name = served_model_name(config)
        async with serve_model(name, runtime, serve_engine) as state:
            app.state.server = state
            # Context providers build their indexes here, once (a folder of documents, say).
            context_plugins = await anyio.to_thread.run_sync(ContextPlugins, config, runtime.registries)
            app.state.session_core = SessionCore(state, context_plugins)
            async with ModelPool(config, state, start_model).running() as pool:
                app.state.model_pool = pool
                log.info("Application startup complete", model=state.model_name, models=list(pool.models))
                yield

    app = FastAPI(title="cadenza", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(ModelRouting)
    registered = runtime.registries.protocols
    protocols = select_protocols(
        BUILTIN_PROTOCOLS,
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

            name = served_model_name(config)
            schemas = openapi_schemas(name, limits, (*TOKENIZER_MODELS, ResponseCreateRequest))
            for protocol in protocols:
                schemas.update(protocol.openapi_schemas(name, limits))
            pool = getattr(app.state, "model_pool", None)
            schemas.update(model_action_schemas(list(pool.models) if pool is not None else [name]))
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
        tenant, token = None, None
        try:
            if request.url.path not in _OPEN_PATHS:
                tenant = check_api_key(request, server_state(request))
                token = CURRENT_TENANT.set(tenant)  # the route's task inherits it (api/tenants.py)
            response = await call_next(request)
        except APIError as exc:
            response = written(request.scope, exc)
        finally:
            if token is not None:
                CURRENT_TENANT.reset(token)
        log.info(
            "access",
            request_id=request_id,
            method=request.method,
            path=request.url.path,
            status=response.status_code,
            ms=round((time.perf_counter() - started) * 1000, 1),
            **({"tenant": tenant.label} if tenant is not None else {}),
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
        server_state(request)  # 503 while starting
        pool: ModelPool = request.app.state.model_pool
        data = []
        for model in pool.models.values():
            entry = {"id": model.name, "object": "model", "created": 0, "owned_by": "cadenza", **model.describe()}
            if model.state is not None:
                entry["max_model_len"] = model.state.engine.runtime.max_model_len
            data.append(entry)
        return {"object": "list", "data": data}

    @app.post("/models/load", **_model_action(ModelAction, 400, 401, 404, 413, 503))
    async def load_model(request: Request):
        """Load a model of the deployment's `models` now (llama.cpp's router mode)."""
        body = await parse_body(request, ModelAction)
        model = await request.app.state.model_pool.load(body.model)
        return {"id": model.name, **model.describe()}

    @app.post("/models/unload", **_model_action(ModelUnload, 400, 401, 404, 413, 503))
    async def unload_model(request: Request):
        """Unload a model now, once its running requests have ended."""
        body = await parse_body(request, ModelUnload)
        model = await request.app.state.model_pool.unload(body.model)
        return {"id": model.name, **model.describe()}

    from cadenza.api import playground

    for protocol in protocols:
        app.include_router(protocol.router())
    app.include_router(playground.router)
    return app
