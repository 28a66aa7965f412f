"""The hooks a cadenza plugin may implement.

Every hook receives a `register(name, factory)` callback, so cadenza keeps naming, de-duplication
and validation. Hooks run once, at engine start-up, never on the per-token path. docs/plugins.md
documents each hook and the contract of the classes they register.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT_NAME = "cadenza"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends: `register(name, cls)`, cls an `AttentionBackend` subclass."""


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers and logits processors: `register(name, cls)`, routed by cls's base class."""


@hookspec
def register_eviction_policies(register: Register) -> None:
    """Register KV-cache eviction policies: `register(name, cls)`, cls an `EvictionPolicy`."""


@hookspec
def register_context_policies(register: Register) -> None:
    """Register context policies for long conversations: `register(name, cls)`, cls a `ContextPolicy`."""


@hookspec
def register_context_providers(register: Register) -> None:
    """Register context providers (retrieval, memory): `register(name, cls)`, cls a `ContextProvider`."""


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers: `register(name, cls)`, cls a `Proposer` subclass."""


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register KV connectors (prefill/decode disaggregation): `register(name, cls)`, cls a `KVConnector`."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call formats: `register(name, cls)`, cls a `ToolParser` subclass."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: `register(name, cls)`, cls a `ReasoningParser` subclass."""


@hookspec
def register_protocols(register: Register) -> None:
    """Register wire protocols the HTTP server speaks: `register(name, cls)`, cls an `api.protocols.Protocol`."""
