"""Wire protocols as plugins: each API the server speaks (OpenAI's, Anthropic's, Ollama's, the
WebSocket sessions) is a `Protocol` that hands the app its routes and writes its own errors.

Built-ins are listed in `api/builtin_protocols.py`; a third-party package adds one through the
`register_protocols` hook (entry point group `cadenza`, as every plugin), and `server.protocols`
picks which are served (every registered one by default). Every protocol runs on the same engine,
`ServerState` (`api/state.py`), sampling parameters and `APIError`; only the shape of requests,
answers and errors differs. The core routes (`/health`, `/metrics`, `/v1/models`, the playground)
are the app's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Sequence

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from cadenza.api.errors import APIError
from cadenza.plugins.errors import PluginError, UnknownNameError

if TYPE_CHECKING:
    from cadenza.api.openai.request_rules import ServedLimits


class Protocol(ABC):
    """One wire protocol. Made once per app, with no arguments, before the engine starts; its
    routes reach the engine per request through `server_state(request)`.

    `prefixes`: the URL paths (prefixes) whose errors `error_response` writes, so that a client
    of this protocol gets errors in the shape its SDK parses (an unknown path or a bad API key
    under them too). Paths no protocol claims get OpenAI's shape.
    """

    name: ClassVar[str]
    prefixes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def router(self) -> APIRouter:
        """The protocol's routes (HTTP and WebSocket), mounted on the app once."""

    def error_response(self, error: APIError) -> Response:
        """How this protocol writes `error` (status, body, headers); OpenAI's shape by default."""
        return JSONResponse(error.body(), status_code=error.status)

    def openapi_schemas(self, model_name: str, limits: ServedLimits) -> dict[str, dict[str, Any]]:
        """The OpenAPI components its routes' documented request bodies refer to (models the
        routes parse themselves, which FastAPI cannot see), for the served model; none by default."""
        return {}


def select_protocols(builtins: Sequence[type[Protocol]], plugins: Iterable[tuple[str, type, str]],
                     wanted: Sequence[str] | None) -> list[Protocol]:
    """The protocols to serve: `builtins` (api/builtin_protocols.py) and `plugins` ((name, class,
    registering plugin) from the `register_protocols` hook), restricted to `wanted`
    (`server.protocols`; None: all), each made once. A plugin's class that is not a `Protocol`, a
    name registered twice or an unknown wanted name is a `PluginError` at start-up."""
    classes: dict[str, type[Protocol]] = {}
    sources: dict[str, str] = {}
    for cls in builtins:
        classes[cls.name], sources[cls.name] = cls, "cadenza"
    for name, cls, source in plugins:
        if not (isinstance(cls, type) and issubclass(cls, Protocol)):
            raise PluginError(f"plugin {source!r} registered protocol {name!r} as {cls!r}, "
                              "which is not a subclass of Protocol")
        if name in classes:
            raise PluginError(f"protocol {name!r} is registered twice: by {sources[name]!r} and by {source!r}")
        if getattr(cls, "name", name) != name:
            raise PluginError(f"plugin {source!r} registered protocol {name!r} whose class is named {cls.name!r}")
        classes[name], sources[name] = cls, source
    names = list(classes) if wanted is None else list(wanted)
    for name in names:
        if name not in classes:
            raise UnknownNameError("protocol", name, list(classes))
    made = []
    for name in names:
        try:
            made.append(classes[name]())
        except Exception as exc:
            raise PluginError(f"protocol {name!r} ({sources[name]}) failed to start: {exc!r}") from exc
    return made


class ErrorWriters:
    """Which protocol writes the errors of a path: the one whose prefix is the longest match."""

    def __init__(self, protocols: Sequence[Protocol]) -> None:
        self._by_prefix = sorted(((p, protocol) for protocol in protocols for p in protocol.prefixes),
                                 key=lambda item: -len(item[0]))

    def response(self, path: str, error: APIError) -> Response:
        for prefix, protocol in self._by_prefix:
            if path.startswith(prefix):
                return protocol.error_response(error)
        return JSONResponse(error.body(), status_code=error.status)
