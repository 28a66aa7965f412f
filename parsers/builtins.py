"""cadenza's own reasoning parsers, registered as any plugin registers its own."""

from __future__ import annotations

from cadenza.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ThinkTagParser
from cadenza.plugins.hookspecs import Register, hookimpl


@hookimpl
def register_reasoning_parsers(register: Register) -> None:
    for parser in (ThinkTagParser, Qwen3ReasoningParser, DeepSeekR1ReasoningParser):
        register(parser.name, parser)
