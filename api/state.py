"""What every route needs: the engine, the config, the served model's name, metrics, auth."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import HTTPConnection

from cadenza.api.errors import APIError
from cadenza.api.metrics import ServerMetrics
from cadenza.config import CadenzaConfig
from cadenza.engine.async_engine import AsyncEngine
from cadenza.models.default_model import DEFAULT_MODEL_NAME


@dataclass
class ServerState:
    engine: AsyncEngine
    config: CadenzaConfig
    model_name: str
    metrics: ServerMetrics
    draining: bool = False


def served_model_name(config: CadenzaConfig) -> str:
    if config.model.path is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model.path)
    return path.stem if path.suffix == ".gguf" else path.name


def server_state(connection: HTTPConnection) -> ServerState:
    state = getattr(connection.app.state, "server", None)
    if state is None:
        raise APIError(503, "not_ready", "the server is starting up")
    return state


def check_api_key(connection: HTTPConnection, state: ServerState) -> None:
    """`Authorization: Bearer KEY` (HTTP and WebSocket), or `?api_key=KEY` where a browser's
    WebSocket cannot set headers."""
    expected = state.config.server.api_key
    if expected is None:
        return
    header = connection.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else connection.query_params.get("api_key", "")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(401, "invalid_api_key", "a valid API key is required: send 'Authorization: Bearer <key>'")
