"""Ollama's API (`/api/...`) as a protocol, for the official clients and the tools built on them."""

from cadenza.api.ollama.routes import OllamaProtocol

__all__ = ["OllamaProtocol"]
