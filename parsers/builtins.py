"""cadenza's own reasoning and tool-call parsers, registered as any plugin registers its own."""

from __future__ import annotations

from cadenza.parsers.harmony import GptOssReasoningParser, HarmonyReasoningParser, HarmonyToolParser
from cadenza.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ThinkTagParser
from cadenza.parsers.tool_calls import BUILTIN_TOOL_PARSERS
from cadenza.plugins.hookspecs import Register, hookimpl


@hookimpl
def register_tool_parsers(register: Register) -> None:
    for parser in (*BUILTIN_TOOL_PARSERS, HarmonyToolParser):
        register(parser.name, parser)


@hookimpl
def register_reasoning_parsers(register: Register) -> None:
    # gpt_oss and harmony are one parser under two names: the model's and the format's.
    for parser in (ThinkTagParser, Qwen3ReasoningParser, DeepSeekR1ReasoningParser, GptOssReasoningParser,
                   HarmonyReasoningParser):
        register(parser.name, parser)
