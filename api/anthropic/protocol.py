"""Anthropic's Messages API request shapes (`POST /v1/messages`, `/v1/messages/count_tokens`).

Models forbid unknown fields, so a typo is a 400 naming it. Fields with no meaning for a local
server (`metadata`, `service_tier`, `cache_control` on blocks and tools, a text block's `citations`)
are accepted and ignored. Image and document blocks, server tools and redacted thinking parse, so
that the translation (`translate.py`) can refuse or drop them with a message saying why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from cadenza.api.openai.protocol import FunctionName
from cadenza.sampling_params import MaxTokens, StopStrings, Temperature, TopK, TopP


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """Prompt caching hints; accepted and ignored (the prefix cache needs none)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(None, description="Accepted and ignored.")


class _Unsupported(BaseModel):
    """A block this server cannot read (the model takes text only): parsed to be refused by name."""

    model_config = ConfigDict(extra="allow")


class ImageBlock(_Unsupported):
    type: Literal["image"]


class DocumentBlock(_Unsupported):
    type: Literal["document"]


class ToolUseBlock(_Strict):
    """A call an earlier assistant turn made (`caller` and `toolset_name`, which the SDK's own
    blocks carry, are accepted and ignored)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


def _text_or_blocks(value: Any) -> str:
    return "text" if isinstance(value, str) else "blocks"


def _text_or(blocks: Any) -> Any:
    """Text, or a list of `blocks`: tagged, so that an error names `content.blocks.0.text` rather
    than every member of the union."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[blocks, Tag("blocks")], Discriminator(_text_or_blocks)]


_ResultContent = _text_or(list[Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]])


class ToolResultBlock(_Strict):
    """What a call returned, in the user turn after it."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: _ResultContent | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Strict):
    """An earlier assistant turn's reasoning; its `signature` is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    """Encrypted reasoning from Anthropic's models: nothing a local model can read; dropped."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: _text_or(list[ContentBlock])


class Tool(_Strict):
    """A client tool. Server tools (web search, code execution: a `type` other than custom) are
    refused by the translation."""

    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON schema of the tool's input (an object).")
    type: str | None = Field(None, description="custom, or left out.")
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, description="Accepted; the reasoning ends where the model ends it, or at "
                                                 "max_tokens.")
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """What is counted: the prompt as the chat template renders it, tools included."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: _text_or(list[TextBlock]) | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="enabled or adaptive: the template's enable_thinking on; "
                                                        "disabled: off; left out: the template's default.")
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: StopStrings | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = Field(None, description="Accepted and ignored.")
