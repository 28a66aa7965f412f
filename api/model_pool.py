"""Several models on one server: loaded on first use, unloaded when idle or for room.

A deployment's `models` list names the models; a request picks one by its body's `model`
(`ModelRouting` reads it before the route does, for every protocol alike). The first model listed
is loaded at start-up and stays (WebSocket sessions and routes that name no model use it); the
others load on their first request, one engine each, and unload after `keep_alive` seconds with no
request (`server.keep_alive`, the model's own, or a request's), or when loading another would pass
`server.max_loaded_models` or `server.models_memory_budget` (least recently used idle ones first).

A request holds a lease on its model from the moment its body names it until its response has been
sent whole (streams included): a model is never unloaded under a request. A request for a model
that is loading, or waiting for room, waits up to `server.model_load_timeout`, then gets a 503;
loads run at most `server.max_concurrent_loads` at once. A load that fails is a 503 naming why,
and the next request tries again. An unknown model is a 404 naming the models served.

One `ModelPool` per app, owned by its lifespan; its state changes on the event loop only.
"""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Literal

import anyio
import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadenza.api.durations import duration_seconds
from cadenza.api.errors import APIError, written
from cadenza.api.state import ServerState
from cadenza.config import CadenzaConfig, load_config
from cadenza.kv_connectors.blocks import cache_tensors

log = structlog.get_logger("cadenza.api")

# Starts one model's engine (its name, its config) and yields its state; leaving the block stops it
# and frees its memory.
StartModel = Callable[[str, CadenzaConfig], AsyncContextManager[ServerState]]
Status = Literal["unloaded", "loading", "loaded", "unloading"]

# Bodies longer than this are not read for their `model` here: the route refuses them (413) anyway.
_MAX_PEEK_BYTES = 8 << 20
# How often idle models are checked against their keep_alive.
_REAP_SECONDS = 1.0


def model_config(deployment: CadenzaConfig, path: str | None, overrides: dict[str, Any]) -> CadenzaConfig:
    """One model's config: the deployment's, its model at `path`, with its own dotted `overrides`."""
    base = deployment.model_dump(mode="json")
    return load_config(None, overrides={**base, "model.path": path, **overrides}, env={})


def tag_free(name: str) -> str:
    """`name` without the ':latest' tag Ollama's clients add."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


@dataclass(eq=False)
class PooledModel:
    """One model of the pool and where it stands."""

    name: str
    config: CadenzaConfig
    keep_alive: float  # seconds idle before it is unloaded; negative: never
    pinned: bool
    status: Status = "unloaded"
    state: ServerState | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # a request's keep_alive, from its end; None: keep_alive's
    nbytes: int = 0  # weights and KV cache, once loaded
    error: str | None = None  # why the last load failed
    loaded: anyio.Event = field(default_factory=anyio.Event)
    stop: anyio.Event | None = None  # set: its engine's task stops it
    stopped: anyio.Event | None = None  # set once its engine has stopped

    def idle_until(self) -> float | None:
        """When it is to be unloaded if nothing uses it; None: never."""
        if self.pinned or self.status != "loaded" or self.leases:
            return None
        if self.expires_at is not None:
            return self.expires_at
        return None if self.keep_alive < 0 else self.last_used + self.keep_alive

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "status": self.status, "pinned": self.pinned, "in_flight": self.leases,
                "memory_bytes": self.nbytes, **({"error": self.error} if self.error else {})}


class ModelPool:
    """The served models (the first is the default) and the engines of those loaded."""

    def __init__(self, deployment: CadenzaConfig, default: ServerState, start: StartModel) -> None:
        self.server = deployment.server
        self.start = start
        first = PooledModel(default.model_name, default.config, -1.0, True, "loaded", default)
        first.loaded.set()
        self.default = first
        self.models: dict[str, PooledModel] = {first.name: first}
        for entry in deployment.models[1:]:
            keep = entry.keep_alive if entry.keep_alive is not None else self.server.keep_alive
            self.models[entry.name] = PooledModel(entry.name, model_config(deployment, entry.path, entry.overrides),
                                                  keep, entry.pinned)  # fmt: skip
        self._loads = anyio.Semaphore(self.server.max_concurrent_loads)
        self._room = anyio.Condition()  # notified whenever a model is released or unloaded
        self._tasks: anyio.abc.TaskGroup | None = None

    # --- lookups ---------------------------------------------------------------------------------

    def find(self, name: str) -> PooledModel | None:
        return self.models.get(name) or self.models.get(tag_free(name))

    def named(self, name: str) -> PooledModel:
        model = self.find(name)
        if model is None:
            served = ", ".join(repr(n) for n in self.models)
            raise APIError(404, "model_not_found", f"the model {name!r} does not exist; this server serves {served}",
                           "model")
        return model

    def loaded_states(self) -> list[ServerState]:
        return [m.state for m in self.models.values() if m.state is not None]

    # --- running ---------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator["ModelPool"]:
        """Unloads idle models while open; on leaving, every model it loaded is stopped."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            tasks.start_soon(self._reap)
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):  # each engine stops in its own task, in turn
                    for model in list(self.models.values()):
                        if model is not self.default and model.stop is not None:
                            await self._stop(model)
                tasks.cancel_scope.cancel()

    @asynccontextmanager
    async def lease(self, name: str, keep_alive: float | None = None) -> AsyncIterator[ServerState]:
        """The model's state, loaded first if need be, kept loaded until the block ends.
        `keep_alive`: this request's own (seconds after it ends; 0 unloads it then)."""
        model = self.named(name)
        model.leases += 1
        try:
            state = await self._ready(model)
            yield state
        finally:
            model.leases -= 1
            model.last_used = time.monotonic()
            if keep_alive is not None and model is not self.default:
                model.expires_at = model.last_used + keep_alive if keep_alive >= 0 else None
                model.keep_alive = -1.0 if keep_alive < 0 else model.keep_alive
            async with self._room:
                self._room.notify_all()
            if model.idle_until() is not None and model.idle_until() <= time.monotonic():
                await self._unload_later(model)

    async def load(self, name: str) -> PooledModel:
        """Load a model now (the load endpoint); returns it loaded."""
        model = self.named(name)
        model.leases += 1
        try:
            await self._ready(model)
        finally:
            model.leases -= 1
            model.last_used = time.monotonic()
        return model

    async def unload(self, name: str) -> PooledModel:
        """Unload a model now, once its requests have ended (the unload endpoint, keep_alive 0)."""
        model = self.named(name)
        if model is self.default or model.pinned:
            raise APIError(400, "model_pinned", f"the model {model.name!r} is pinned: it stays loaded", "model")
        await self._unload(model)
        return model

    async def _ready(self, model: PooledModel) -> ServerState:
        if model.status == "loaded" and model.state is not None:
            return model.state
        with anyio.move_on_after(self.server.model_load_timeout) as waited:
            while not (model.status == "loaded" and model.state is not None):
                if model.status == "unloaded":
                    await self._load(model)
                else:  # loading (by another request) or unloading: wait for it to settle
                    event = model.loaded
                    await event.wait() if model.status == "loading" else await anyio.sleep(0.05)
                if model.status == "unloaded" and model.error is not None:
                    raise APIError(503, "model_load_failed", f"the model {model.name!r} could not be loaded: "
                                   f"{model.error}", "model")
        if waited.cancelled_caught:
            raise APIError(503, "model_loading", f"the model {model.name!r} did not load within "
                           f"{self.server.model_load_timeout:g} s (loading, or waiting for room); try again", "model")
        return model.state

    async def _load(self, model: PooledModel) -> None:
        model.status, model.error, model.loaded = "loading", None, anyio.Event()
        try:
            async with self._loads:
                await self._make_room(model)
                started = time.monotonic()
                log.info("Loading model", model=model.name)
                # The engine runs in a task of the pool's own: its task groups must be left by the
                # task that entered them, and a request's task ends before the model does.
                up, model.stop, model.stopped = anyio.Event(), anyio.Event(), anyio.Event()
                self._tasks.start_soon(self._hold, model, up)
                await up.wait()
                if model.state is None:
                    raise RuntimeError(model.error or "the engine did not start")
                model.status = "loaded"
                model.nbytes = _memory_bytes(model.state)
                model.last_used, model.expires_at = time.monotonic(), None
                log.info("Loaded model", model=model.name, seconds=round(time.monotonic() - started, 2),
                         memory_bytes=model.nbytes)
        except Exception as exc:
            model.status, model.state, model.error = "unloaded", None, model.error or str(exc) or repr(exc)
            log.warning("Model failed to load", model=model.name, error=model.error)
        finally:
            if model.status != "loaded":
                model.status = "unloaded"
            model.loaded.set()

    async def _hold(self, model: PooledModel, up: anyio.Event) -> None:
        """Run `model`'s engine until it is told to stop (`_stop`)."""
        try:
            async with self.start(model.name, model.config) as state:
                model.state = state
                up.set()
                await model.stop.wait()
        except Exception as exc:
            model.error = str(exc) or repr(exc)
        finally:
            model.state = None
            up.set()
            model.stopped.set()

    async def _make_room(self, loading: PooledModel) -> None:
        """Unload least recently used idle models until `loading` fits the limits; wait while it
        does not fit and every loaded model is in use."""
        budget, most = self.server.models_memory_budget_bytes, self.server.max_loaded_models
        estimate = _estimate_bytes(loading.config)
        while True:
            others = [m for m in self.models.values() if m is not loading and m.status in ("loaded", "loading")]
            over_count = most is not None and len([m for m in others if m is not self.default]) + 1 > most
            used = sum(m.nbytes or _estimate_bytes(m.config) for m in others)
            over_budget = budget is not None and used + estimate > budget
            if not (over_count or over_budget):
                return
            idle = sorted((m for m in others if m.status == "loaded" and not m.leases and not m.pinned
                           and m is not self.default), key=lambda m: m.last_used)  # fmt: skip
            if idle:
                log.info("Unloading for room", model=idle[0].name, loading=loading.name)
                await self._unload(idle[0])
                continue
            async with self._room:
                await self._room.wait()

    async def _unload(self, model: PooledModel) -> None:
        while model.leases or model.status == "loading":
            async with self._room:
                await self._room.wait()
        if model.status != "loaded":
            return
        await self._stop(model)

    async def _unload_later(self, model: PooledModel) -> None:
        if self._tasks is not None:
            self._tasks.start_soon(self._unload, model)

    async def _stop(self, model: PooledModel) -> None:
        model.status = "unloading"
        try:
            if model.stop is not None:
                model.stop.set()
                await model.stopped.wait()
        finally:
            model.status, model.state, model.nbytes, model.expires_at = "unloaded", None, 0, None
            model.stop = model.stopped = None
            log.info("Unloaded model", model=model.name)
            async with self._room:
                self._room.notify_all()

    async def _reap(self) -> None:
        while True:
            await anyio.sleep(_REAP_SECONDS)
            now = time.monotonic()
            for model in list(self.models.values()):
                until = model.idle_until()
                if until is not None and until <= now:
                    log.info("Unloading idle model", model=model.name)
                    await self._stop(model)


def _estimate_bytes(config: CadenzaConfig) -> int:
    """What a model will take once loaded, before it is: its weights' files (the KV cache comes on
    top, and is counted once it is loaded)."""
    path = config.model.path
    if path is None or not Path(path).exists():
        return 0
    target = Path(path)
    if target.is_file():
        return target.stat().st_size
    return sum(f.stat().st_size for f in target.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))


def _memory_bytes(state: ServerState) -> int:
    """A loaded model's weights and KV cache, in bytes."""
    runtime = state.engine.runtime
    weights = _estimate_bytes(state.config)
    caches = getattr(getattr(runtime, "runner", None), "kv_caches", None) or []
    return weights + sum(t.numel() * t.element_size() for t in cache_tensors(caches))


class ModelRouting:
    """ASGI middleware: a request whose JSON body names a `model` of the pool runs on that model
    (`request.state.model_state`, which `server_state` returns), holding a lease on it until the
    response has been sent; an unknown model is a 404 in the protocol's error shape. Requests that
    name no model (GETs, WebSockets) run on the default one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pool: ModelPool | None = getattr(scope["app"].state, "model_pool", None) if "app" in scope else None
        if (pool is None or scope["type"] != "http" or scope["method"] != "POST" or len(pool.models) == 1
                or scope["path"].startswith("/models/")):
            await self.app(scope, receive, send)
            return
        body, more, messages = bytearray(), True, []
        while more and len(body) <= _MAX_PEEK_BYTES:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        name, keep_alive = _named_model(bytes(body)) if not more else (None, None)
        if name is None or pool.find(name) is pool.default:
            await self.app(scope, replayed, send)
            return
        try:
            async with pool.lease(name, keep_alive) as state:
                scope.setdefault("state", {})["model_state"] = state
                await self.app(scope, replayed, send)
        except APIError as error:  # unknown, failed or timed out: before the route ran
            await written(scope, error)(scope, replayed, send)


def _named_model(body: bytes) -> tuple[str | None, float | None]:
    """The `model` a JSON body names, and its Ollama-style `keep_alive` in seconds, where given."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None, None  # the route refuses it, naming the problem
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str):
        return None, None
    return parsed["model"], duration_seconds(parsed.get("keep_alive"))
