"""What every route needs: the engine, the config, the served model's name, metrics, auth."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import HTTPConnection

from cadenza.api.errors import APIError
from cadenza.api.metrics import ServerMetrics
from cadenza.api.tenants import APIKeys, Tenant
from cadenza.config import CadenzaConfig
from cadenza.engine.async_engine import AsyncEngine
from cadenza.models.default_model import DEFAULT_MODEL_NAME
from cadenza.parsers.reasoning import ReasoningParser, parser_name_for_template
from cadenza.parsers.tool_calls import ToolParser, tool_parser_name_for_template
from cadenza.runtime.registries import Registries


@dataclass
class ServerState:
    engine: AsyncEngine
    config: CadenzaConfig
    model_name: str
    metrics: ServerMetrics
    draining: bool = False
    # Splits chat answers' reasoning from their content (`server.reasoning_parser`); None: off.
    reasoning_parser: ReasoningParser | None = None
    # The tool-call format (`server.tool_parser`), made anew for each request that offers tools.
    tool_parser: type[ToolParser] | None = None
    # The keys `server.api_key` and `server.api_keys` name, with their tenants (`api/tenants.py`).
    keys: APIKeys = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.keys = APIKeys(self.config.server)


def resolve_tool_parser(name: str, registries: Registries, chat_template: str | None) -> type[ToolParser]:
    """The tool-call format `server.tool_parser` names, or (auto) the one the chat template's
    text teaches its model."""
    return registries.tool_parsers.get(tool_parser_name_for_template(chat_template) if name == "auto" else name)


def resolve_reasoning_parser(name: str, registries: Registries, chat_template: str | None) -> ReasoningParser | None:
    """The reasoning parser `server.reasoning_parser` names: a registered one, the one the chat
    template's text teaches its model (auto; None when it teaches none), or None (none)."""
    if name == "none":
        return None
    if name == "auto":
        name = parser_name_for_template(chat_template)
        if name is None or name not in registries.reasoning_parsers:
            return None
    return registries.reasoning_parsers.get(name)()


def served_model_name(config: CadenzaConfig) -> str:
    """The name requests give the (default) model: the first of `models` where they are listed,
    else taken from the model's path."""
    if config.models:
        return config.models[0].name
    if config.model.path is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model.path)
    return path.stem if path.suffix == ".gguf" else path.name


def server_state(connection: HTTPConnection) -> ServerState:
    """The state of the model this request runs on: the one its body named (leased by
    `api/model_pool.py`'s routing), else the server's default model."""
    state = connection.scope.get("state", {}).get("model_state") or getattr(connection.app.state, "server", None)
    if state is None:
        raise APIError(503, "not_ready", "the server is starting up")
    return state


def check_api_key(connection: HTTPConnection, state: ServerState) -> Tenant | None:
    """The tenant of the key the connection sends, `Authorization: Bearer KEY` (HTTP and
    WebSocket), `x-api-key: KEY` (Anthropic's SDK), or `?api_key=KEY` where a browser's WebSocket
    cannot set headers; None when the server has no keys. The caller sets `CURRENT_TENANT` to it."""
    if not state.keys:
        return None
    header = connection.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        given = header[7:]
    else:
        given = connection.headers.get("x-api-key") or connection.query_params.get("api_key", "")
    tenant = state.keys.match(given)
    if tenant is None:
        raise APIError(401, "invalid_api_key", "a valid API key is required: send 'Authorization: Bearer <key>'")
    return tenant
