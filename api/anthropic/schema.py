"""Anthropic's Messages API in the OpenAPI document: its request models (components named
`Anthropic*`, the served model's name as `model`'s only value), the rules beyond their types
(`request_rules.write_rules`), its answers, and errors in Anthropic's shape.

Anthropic's error body has no `param`: a refusal's `error.message` begins with the field at fault
(`messages.0.content: ...`), and a relation's `params` are what that prefix may be.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from cadenza.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from cadenza.api.errors import error_responses
from cadenza.api.openai.request_rules import Relation, ServedLimits, write_rules
from cadenza.api.openai.schema import openapi_request_body, prefixed_schemas

PREFIX = "Anthropic"
REQUEST_MODELS = (MessagesRequest, CountTokensRequest)

_NULL = {"type": "null"}
_TEXT = {"type": "string", "minLength": 1}
_STOP = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, _NULL]}  # one string is a list of one
_NEEDS_TOOLS = {
    "anyOf": [{"properties": {"tool_choice": {"anyOf": [{"properties": {"type": {"enum": ["auto", "none"]}}}, _NULL]}}},
              {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}],
    "description": "tool_choice any or tool only with tools.",
}  # fmt: skip
_FITS = ("must leave room to generate within the model's context (max_model_len, in /v1/models) and "
         "server.max_prompt_tokens")
_RELATIONS = [
    Relation(("messages",), f"The conversation, rendered by the chat template, {_FITS}; the template may refuse it "
             "(roles out of the order it allows)."),
    Relation(("messages.*.content.*",), "A user turn holds text and tool_result blocks, an assistant turn text, "
             "thinking, redacted_thinking and tool_use blocks; image and document blocks are not supported (the "
             "served model reads text)."),
    Relation(("tools",), "Tool names are unique."),
    Relation(("tool_choice", "tool_choice.name"), "A tool tool_choice names one of the tools."),
    Relation(("tools.*.input_schema",), "Each tool's input_schema must compile as a JSON schema (llguidance), "
             "whatever tool_choice says."),
]  # fmt: skip


def anthropic_schemas(model_name: str, limits: ServedLimits) -> dict[str, dict[str, Any]]:
    """The request models as components, with the served model's name and the rules written in."""
    schemas = prefixed_schemas(REQUEST_MODELS, PREFIX)
    names = [PREFIX + m.__name__ for m in REQUEST_MODELS]
    for name in names:
        schemas[name]["properties"]["model"]["enum"] = [model_name]
    tool_type = {"anyOf": [{"const": "custom"}, _NULL], "description": "custom, or left out: server tools (web search, "
                 "code execution) are not supported."}  # fmt: skip
    stop = {**_STOP, "description": "Strings that end the output; one string is a list of one."}
    write_rules(
        schemas,
        conditions={name: [_NEEDS_TOOLS] for name in names},
        field_schemas={PREFIX + "Tool": {"type": tool_type},
                       PREFIX + "MessagesRequest": {"stop_sequences": stop}},
        relations={name: _RELATIONS for name in names},
    )
    return schemas


# --- answers --------------------------------------------------------------------------------------


class AnthropicErrorDetail(BaseModel):
    type: Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                  "request_too_large", "rate_limit_error", "api_error", "overloaded_error"]
    message: str = Field(description="What went wrong; a refusal of a field begins with it (`max_tokens: ...`).")


class AnthropicError(BaseModel):
    """Anthropic's error shape: the body of every error under /v1/messages."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens the prefix cache did not serve.")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class AnthropicAnswerBlock(BaseModel):
    """A block of the answer: thinking (`thinking`, `signature`), text (`text`) or tool_use
    (`id`, `name`, `input`)."""

    type: Literal["thinking", "text", "tool_use"]
    thinking: str | None = None
    signature: str | None = None
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class AnthropicMessageResponse(BaseModel):
    """A whole answer (a streamed one is Anthropic's events: message_start, content_block_start,
    content_block_delta, content_block_stop, message_delta, message_stop, ping)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicAnswerBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    input_tokens: int = Field(description="The prompt's tokens as the chat template renders it, tools included.")


_MEANING = {
    400: "The request is invalid: `invalid_request_error`, its message beginning with the field at fault.",
    404: "No such model (`not_found_error`): the message names the served one.",
    503: "The server is starting, shutting down or out of room (`overloaded_error`); try again later.",
}
_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "The event's type (message_start, content_block_delta, ..., error)."},
    "data": {"type": "string", "description": "The event as JSON."}}}  # fmt: skip


def documented(request_model: type[BaseModel], response_model: type[BaseModel], *, streams: bool) -> dict[str, Any]:
    """A route's OpenAPI description: its body, its answer, its errors in Anthropic's shape."""
    answer: dict[str, Any] = {"model": response_model}
    if streams:
        answer["content"] = {"text/event-stream": {"itemSchema": _EVENT}}
    statuses = (400, 401, 404, 408, 413, 429, 500, 503) if streams else (400, 401, 404, 413, 503)
    return {
        "openapi_extra": {"requestBody": openapi_request_body(request_model, PREFIX)},
        "responses": {200: answer, **error_responses(*statuses, model=AnthropicError, meaning=_MEANING)},
    }
