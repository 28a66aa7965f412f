"""Anthropic's Messages API (`/v1/messages`), served as a protocol plugin: see `routes.py`."""

from cadenza.api.anthropic.routes import AnthropicProtocol

__all__ = ["AnthropicProtocol"]
