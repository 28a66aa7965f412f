"""cadenza's own wire protocols, in mounting order (each is a `api.protocols.Protocol`)."""

from __future__ import annotations

from cadenza.api.anthropic import AnthropicProtocol
from cadenza.api.ollama import OllamaProtocol
from cadenza.api.openai.routes import OpenAIProtocol
from cadenza.api.openai_ws.realtime import RealtimeProtocol
from cadenza.api.openai_ws.responses import ResponsesProtocol
from cadenza.api.protocols import Protocol
from cadenza.api.sessions.websocket import SessionsProtocol

BUILTIN_PROTOCOLS: tuple[type[Protocol], ...] = (
    OpenAIProtocol, ResponsesProtocol, RealtimeProtocol, SessionsProtocol, AnthropicProtocol, OllamaProtocol,
)
