"""OpenAI's request shapes for /v1/completions and /v1/chat/completions, and what they map to.

Requests are pydantic models that forbid unknown fields (a typo is a 400 naming the field, never
silently ignored). Parameters OpenAI defines but cadenza does not implement are declared so they
can be rejected with a message naming them; parameters with no effect here (user, metadata, store,
service_tier) are accepted and ignored. `to_sampling_params` fills what a request leaves out from
`config.sampling.defaults`.

The routes parse their bodies themselves (bounded, errors in OpenAI's shape), so FastAPI cannot see
these models; `api/openai_schema.py` puts them into the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from cadenza.api.errors import APIError
from cadenza.config.schema import SamplingDefaults
from cadenza.sampling_params import (
    Logprobs,
    MaxTokens,
    N,
    SamplingOverrides,
    SamplingParams,
    SamplingParamsError,
    completion_seed,
    merge_sampling,
)


def _invalid(param: str | None, message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, code, message, param)


def _unsupported(param: str, message: str) -> APIError:
    return _invalid(param, message, "unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# What the validators and checks below accept where the types alone say more, for the OpenAPI
# document (`WithJsonSchema` changes the document only, never validation).
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA = {
    "anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _TOKEN_IDS,
              {"type": "array", "minItems": 1, "items": _TOKEN_IDS}],
    "description": "Text, token ids, or a batch of either; token ids must be below the vocabulary's size.",
}  # fmt: skip
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
_NO_TOOLS = "Only an empty value: tool calling is not supported."


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, ignored


class _SamplingFields(SamplingOverrides):
    """What both endpoints share. The sampling fields and their bounds are `SamplingParams`' own
    (through `SamplingOverrides`): a value one API refuses, every API refuses."""

    model: str
    n: N = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they change nothing about how a local server generates.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check(self) -> None:
        """Rejections that need more than one field, or name a feature cadenza lacks."""
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true")


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA)]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if not self.prompt or any(isinstance(p, list) and not p for p in self.prompt):
            raise _invalid("prompt", "the prompt is empty", "invalid_prompt")
        if self.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "best_of is not supported; use n")
        if self.echo and self.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs is not supported (no prompt logprobs)")

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string and a list of token ids are one prompt each."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ChatMessage(_Strict):
    role: str = Field(json_schema_extra={"enum": list(_ROLES)})
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    # Fields an assistant message round-tripped from a response may carry; they must be empty.
    refusal: str | None = None
    tool_calls: Annotated[
        list[dict[str, Any]] | None,
        WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}], "description": _NO_TOOLS}),
    ] = None
    function_call: Annotated[
        dict[str, Any] | None,
        WithJsonSchema({"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}], "description": _NO_TOOLS}),
    ] = None

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role not in _ROLES:
            raise ValueError(f"role {role!r} is not supported; use one of system, user, assistant (no tool calling)")
        return _ROLES[role]

    @field_validator("content")
    @classmethod
    def _content(cls, content):
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content[{i}]: only 'text' content parts are supported (got type {kind!r})")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"content[{i}]: a text part is {{'type': 'text', 'text': '...'}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tool calls are not supported by this server")
        return value

    def to_engine(self, index: int) -> dict[str, str]:
        if self.content is None and self.role != "assistant":
            raise _invalid(f"messages.{index}.content", f"messages[{index}] has no content", "invalid_messages")
        message = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Strict):
    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False  # type: ignore[assignment]  # chat's logprobs is a switch; top_logprobs the count
    top_logprobs: Logprobs | None = None
    # Declared so that asking for them is a clear 400 rather than an unknown field.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None

    def check(self) -> None:
        super().check()
        unsupported = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "response_format": self.response_format is not None and self.response_format.type != "text",
            "modalities": bool(self.modalities) and self.modalities != ["text"],
        }
        for name, asked in unsupported.items():
            if asked:
                raise _unsupported(name, f"{name} is not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true")

    def engine_messages(self) -> list[dict[str, str]]:
        return [m.to_engine(i) for i, m in enumerate(self.messages)]


# --- sampling parameters ------------------------------------------------------------------------


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: SamplingDefaults,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    rename: dict[str, str],
) -> SamplingParams:
    """The engine's parameters for one choice: what the request set, else the config's defaults.

    Choice `i` of a seeded request samples with `seed + i` (wrapping within the seed's range), so
    choices differ yet repeat. `rename` maps SamplingParams names to the request's own, for errors.
    """
    try:
        return merge_sampling(
            defaults, req, n=1, max_tokens=max_tokens, logprobs=logprobs, seed=completion_seed(req.seed, choice)
        )
    except SamplingParamsError as exc:
        raise _invalid(exc.field(rename), exc.describe(rename), "invalid_value") from exc
