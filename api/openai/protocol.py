"""OpenAI's request shapes for /v1/completions and /v1/chat/completions, and what they map to.

Requests are pydantic models that forbid unknown fields (a typo is a 400 naming the field, never
silently ignored). Parameters OpenAI defines but cadenza does not implement are declared so they
can be rejected with a message naming them; parameters with no effect here (user, metadata, store,
service_tier) are accepted and ignored. `to_sampling_params` fills what a request leaves out from
`config.sampling.defaults`.

The routes parse their bodies themselves (bounded, errors in OpenAI's shape), so FastAPI cannot see
these models; `api/openai/schema.py` puts them into the OpenAPI document.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema, field_validator

from cadenza.api.errors import APIError
from cadenza.config.schema import SamplingDefaults
from cadenza.models.prompts import RESERVED_TEMPLATE_VARIABLES
from cadenza.sampling_params import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    CacheSalt,
    Logprobs,
    MaxTokens,
    N,
    SamplingOverrides,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
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
_CONTENT_SCHEMA = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}],
    "description": "Text, or text parts. Required, and not null, but in an assistant message (which may leave it out, "
    "with tool_calls or without).",
}
_NO_FUNCTIONS = "Only an empty value: the deprecated function calling is not supported; use tools."
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a-z, A-Z, 0-9, _ and -; at most 64.")]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, ignored


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The ways a request may constrain its output, and the name each goes by in errors.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _SamplingFields(SamplingOverrides):
    """What both endpoints share. The sampling fields and their bounds are `SamplingParams`' own
    (through `SamplingOverrides`): a value one API refuses, every API refuses."""

    model: str
    n: N = 1
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true, as OpenAI and vLLM require.")
    cache_salt: CacheSalt | None = Field(
        None, description="vLLM's: prefix-cache hits only among requests with the "
        "same salt (one tenant's prompts cannot be probed by another's timing).",
    )
    # Accepted and ignored: they change nothing about how a local server generates.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* (older) or structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="A JSON schema, or its JSON text.")
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    def check(self) -> None:
        """Rejections that need more than one field, or name a feature cadenza lacks."""
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM refuses it
            raise _invalid("prompt_logprobs", "prompt_logprobs is not available when stream is true")
        self.structured()

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint the request asks for and the field it came from (for errors)."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise _invalid("response_format.json_schema", "response_format of type json_schema needs json_schema.schema")
            given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
        for name in _GUIDED:
            value = getattr(self, name)
            if value is not None:
                given.append((name, {name.removeprefix("guided_"): value}))
        if len(given) > 1:
            names = ", ".join(name.partition(".")[0] for name, _ in given)
            raise _invalid(given[1][0].partition(".")[0], f"give at most one of response_format, guided_*, structured_outputs (got {names})")
        if not given:
            return None, None
        param, spec = given[0]
        try:
            return StructuredOutputs.model_validate(spec), param
        except ValueError as exc:
            errors = getattr(exc, "errors", lambda **_: [])(include_url=False)
            message = errors[0]["msg"].removeprefix("Value error, ") if errors else str(exc)
            raise _invalid(param, f"{param}: {message}", "invalid_value") from None


# /v1/completions' max_tokens also takes 0, with echo: the prompt alone (with logprobs, the prompt
# tokens' logprobs), nothing generated: OpenAI's legacy way to score a text. Every other API, and
# this one without echo, generates at least one token (`MaxTokens`).
CompletionMaxTokens = Annotated[
    int, Field(ge=0, description="Most tokens to generate; 0 (with echo only): none, the prompt alone.")
]


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: CompletionMaxTokens | None = None
    echo: bool = Field(
        False, description="Return the prompt before the completion; with logprobs, its tokens' logprobs too (the first's null)."
    )
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
        if self.max_tokens == 0 and not self.echo:
            raise _invalid("max_tokens", "max_tokens: must be an integer in [1, inf) (got 0); 0, the prompt alone, goes with echo")

    @property
    def echo_only(self) -> bool:
        """The prompt alone: echo with max_tokens 0 (the engine generates one token, left out)."""
        return self.echo and self.max_tokens == 0

    def engine_prompt_logprobs(self) -> int | None:
        """How many most likely tokens each prompt position needs: echo's logprobs, vLLM's
        prompt_logprobs, the larger of them; None: neither asks."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string and a list of token ids are one prompt each."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallParam(_Strict):
    """A call an earlier assistant turn made (as this API returned it)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str = Field(json_schema_extra={"enum": list(_ROLES)})
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    # What an assistant turn round-tripped from a response may carry, and a tool result's call id.
    refusal: str | None = None
    reasoning_content: str | None = Field(None, description="An assistant turn's reasoning, as a response returned it; "
                                                              "the chat template decides whether the model sees it again.")
    tool_calls: list[ToolCallParam] | None = Field(None, description="An assistant message's calls (no other role carries any).")
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    function_call: Annotated[
        dict[str, Any] | None,
        WithJsonSchema({"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}], "description": _NO_FUNCTIONS}),
    ] = None

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role not in _ROLES:
            raise ValueError(f"role {role!r} is not supported; use one of system, developer, user, assistant, tool")
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

    @field_validator("function_call")
    @classmethod
    def _no_functions(cls, value):
        if value:
            raise ValueError("function_call is not supported by this server; use tools")
        return value

    def to_engine(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's arguments
        as an object, a tool result with its `tool_call_id`)."""
        if self.content is None and self.role != "assistant":
            raise _invalid(f"messages.{index}.content", f"messages[{index}] has no content", "invalid_messages")
        if self.tool_calls and self.role != "assistant":
            raise _invalid(f"messages.{index}.tool_calls", f"messages[{index}]: only assistant messages carry tool_calls", "invalid_messages")
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
            # gpt-oss's template reads an earlier turn's reasoning from `thinking`, and refuses it
            # beside content on a turn with calls: given there too, where the two cannot clash.
            if not (self.tool_calls and message["content"]):
                message["thinking"] = self.reasoning_content
        return message


def _arguments(text: str) -> Any:
    """A call's JSON arguments as an object for the template; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False  # type: ignore[assignment]  # chat's logprobs is a switch; top_logprobs the count
    top_logprobs: Logprobs | None = Field(None, description="Most likely tokens per position; only with logprobs: true.")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function; the last two only with tools."
    )
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (vLLM's), such as Qwen3's "
        "{\"enable_thinking\": false}; messages, tools and add_generation_prompt are the server's.")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="OpenAI's field: given to the chat template as its `reasoning_effort` variable "
        "(gpt-oss's reads it: 'Reasoning: high'), unless chat_template_kwargs sets that variable itself.")
    continue_final_message: bool = Field(
        False, description="vLLM's: the model goes on with the last message, which must be the assistant's "
        "(a prefill): the prompt ends inside it, and the answer is what follows its text.")
    add_generation_prompt: bool = Field(
        True, description="vLLM's: open the assistant's turn after the messages (false only with "
        "continue_final_message, or to let the model write its own turn header).")
    # Declared so that asking for them is a clear 400 rather than an unknown field.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None

    def check(self) -> None:
        super().check()
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "modalities": bool(self.modalities) and self.modalities != ["text"],
        }
        for name, asked in unsupported.items():
            if asked:
                raise _unsupported(name, f"{name} is not supported by this server; use tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise _invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: "
                           "the server passes those itself")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise _invalid("continue_final_message", "continue_final_message needs add_generation_prompt false "
                               "(the model goes on with the last message rather than opening a new one)")
            if self.messages[-1].role != "assistant":
                raise _invalid("continue_final_message", "continue_final_message needs the last message to be the assistant's")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise _invalid("tools", "tool function names must be unique")
        if self.tool_choice not in (None, "none", "auto"):
            if not self.tools:
                raise _invalid("tool_choice", "tool_choice requires tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise _invalid("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
            if self.structured()[0] is not None:
                raise _invalid("tool_choice", "a required or named tool_choice cannot be combined with response_format or guided_*")

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs or None

    def engine_messages(self) -> list[dict[str, Any]]:
        return [m.to_engine(i) for i, m in enumerate(self.messages)]

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call (as templates take them), None when it may call none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> tuple[list[dict[str, Any]], bool] | None:
        """(the tools one of which must be called, whether several calls may be made) when
        tool_choice requires a call, else None."""
        tools = self.active_tools()
        if tools is None or self.tool_choice in (None, "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name], False
        return tools, self.parallel_tool_calls is not False


# --- sampling parameters ------------------------------------------------------------------------


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: SamplingDefaults,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    rename: dict[str, str],
    structured: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's parameters for one choice: what the request set, else the config's defaults.

    Choice `i` of a seeded request samples with `seed + i` (wrapping within the seed's range), so
    choices differ yet repeat. `rename` maps SamplingParams names to the request's own, for errors.
    `structured` is the output constraint, wherever in the request it came from; `prompt_logprobs`
    what the prompt's positions report (echo's logprobs, vLLM's prompt_logprobs).
    """
    try:
        return merge_sampling(
            defaults, req, n=1, max_tokens=max_tokens, logprobs=logprobs, seed=completion_seed(req.seed, choice),
            structured_outputs=structured, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
    except SamplingParamsError as exc:
        raise _invalid(exc.field(rename) or across_fields_param(exc, req), exc.describe(rename), "invalid_value") from exc


def across_fields_param(exc: SamplingParamsError, fields: BaseModel) -> str | None:
    """The field to name for a refusal across fields (min_tokens above max_tokens; an output
    constraint with min_tokens or ignore_eos): the one of them `fields` (the request's sampling
    fields) set."""
    if getattr(fields, "min_tokens", None):
        return "min_tokens"
    if getattr(fields, "ignore_eos", None):
        return "ignore_eos"
    return None


# --- /v1/embeddings -------------------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request. Pooling and normalization are the deployment's (`embeddings`
    config section); `dimensions` truncates each vector (then renormalized when the deployment
    normalizes)."""

    model: str
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(
        {**_PROMPT_SCHEMA, "description": "Text, token ids, or a batch of either (at most 2048); each is embedded on its own."}
    )]  # fmt: skip
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the float32 little-endian bytes, base64-encoded."
    )
    dimensions: int | None = Field(None, ge=1, description="Keep the first this many values of each vector; at most the model's hidden size.")
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")

    def inputs(self) -> list[str | list[int]]:
        """The batch: a string and a list of token ids are one input each."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)

    def check(self, hidden_size: int) -> None:
        inputs = self.inputs()
        if not self.input or any(not p for p in inputs):
            raise _invalid("input", "input: must not be empty, nor hold an empty string or list", "invalid_prompt")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise _invalid("input", f"input: at most {MAX_EMBEDDING_INPUTS} inputs a request (got {len(inputs)})")
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise _invalid("dimensions", f"dimensions: must be an integer in [1, {hidden_size}], the model's hidden size (got {self.dimensions})")
