"""The Responses API's request (`POST /v1/responses`, and `response.create` over its WebSocket),
validated and translated to the chat request it runs as, and the response objects cadenza sends
back, built.

Input is text or items (`responses_items.py`: messages, function calls and their outputs,
reasoning). Function tools (Responses' flat shape), `tool_choice`, `parallel_tool_calls`,
`text.format` (json_object, json_schema) and `reasoning.effort` become the chat request's own
fields (`chat_request`), so the chat core parses calls in the model's format, forces them by
grammar, constrains structured output and splits reasoning as it does for /v1/chat/completions;
`param` names this body's field for an error the chat core raised about its own. What cadenza
cannot honour (hosted tools such as web_search, background runs, conversations, prompt templates)
is refused with a 400 naming the field; what changes nothing for a local server (metadata, user,
service_tier, include, top_logprobs) is accepted and ignored. Sampling beyond OpenAI's fields
goes in `sampling` (cadenza's own, the same object as the WebSocket sessions'), plugin parameters
in `sampling.extra`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cadenza.api.errors import APIError
from cadenza.api.openai.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
)
from cadenza.api.openai_ws.responses_items import Input, OutputItem, chat_messages
from cadenza.api.sessions.protocol import SamplingOptions
from cadenza.policies.context import Message, Turn
from cadenza.sampling_params import MaxTokens, SamplingParams, Temperature, TopP, describe_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    """A function the model may call, in the Responses API's flat shape."""

    type: str = Field(description="Only 'function': cadenza runs no hosted tools (web_search, file_search, ...).")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported; this server runs function tools only")
        return value

    def as_chat(self) -> Tool:
        definition = FunctionDefinition(name=self.name, description=self.description, parameters=self.parameters,
                                        strict=self.strict)  # fmt: skip
        return Tool(type="function", function=definition)


class NamedFunction(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = Field(None, description="With json_schema: the schema's name.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="With json_schema: the schema to follow.")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    def as_chat(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        schema = JsonSchemaFormat(name=self.name or "output", description=self.description, schema=self.schema_,
                                  strict=self.strict)  # fmt: skip
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = Field(None, description="Accepted, with no effect.")


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Given to the chat template as its `reasoning_effort` variable (gpt-oss's reads it), "
        "as chat's "
        "reasoning_effort is.")  # fmt: skip
    # Accepted, with no effect: cadenza returns the reasoning's text, never a summary.
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponseCreateRequest(_Strict):
    """`POST /v1/responses`'s body (over the WebSocket, `ResponseCreateBody`)."""

    model: str | None = None
    input: Input = Field(None, description="The new input: text, or items (a whole conversation, or what follows "
                         "previous_response_id).")  # fmt: skip
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: drop the oldest turns when the conversation outgrows the model (the "
        "deployment's context policy if it cuts, else drop_oldest); disabled: fail. Unset: the deployment's policy.",
    )
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        None, description="none, auto (the default), required, or a named function; the last two only with tools.")
    parallel_tool_calls: bool | None = Field(None, description="false: a forced call is one call.")
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    store: bool = True
    sampling: SamplingOptions | None = Field(None, description="cadenza: any sampling field, plugin `extra` included.")
    # Accepted, with no effect on a local server.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Accepted; no logprobs are returned.")
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted, with no effect.")
    # Accepted only with the value that means "not used".
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[Any] | None = None

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("conversation", "prompt", "context_management")
    @classmethod
    def _unused(cls, value: Any, info) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server (use previous_response_id)")
        return value

    @model_validator(mode="after")
    def _has_input(self) -> "ResponseCreateRequest":
        if self.input is None or self.input == []:
            raise ValueError("input is required: a string or a list of items")
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (OpenAI's chat shape)."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else chat_messages(self.input)

    def chat_request(self, model: str, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs as (`messages`: the whole conversation); an
        `APIError` naming this body's field."""
        unused = {"logprobs", "n", "prompt_logprobs"}  # nothing in a response carries them
        sampling = self.sampling.model_dump(exclude_none=True, exclude=unused) if self.sampling else {}
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunction):  # chat's shape nests the name
            choice = {"type": "function", "function": {"name": choice.name}}
        top = {"max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls}  # fmt: skip
        fields: dict[str, Any] = {**sampling, **{k: v for k, v in top.items() if v is not None}}
        fields.update(model=model, messages=messages)
        if self.tools:
            fields["tools"] = [t.as_chat() for t in self.tools]
        fmt = self.text.format if self.text else None
        forced = self.tools and self.tool_choice not in (None, "none", "auto")
        if fmt is not None and fmt.as_chat() is not None and not forced:  # a forced call writes no text to format
            fields["response_format"] = fmt.as_chat()
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, "invalid_request", describe_error(first), self.param(loc)) from None

    def param(self, chat_param: str | None) -> str | None:
        """The field of this body that a chat request's field (in an error) came from."""
        if chat_param is None:
            return None
        head, _, rest = chat_param.partition(".")
        if head == "messages":
            return "input"
        if head == "tools":
            index, _, tail = rest.partition(".")
            return f"tools.{index}.{tail.removeprefix('function.')}".rstrip(".") if index else "tools"
        if head == "response_format":
            return "text.format.schema" if "schema" in rest else "text.format"
        if head in ("max_completion_tokens", "max_tokens"):
            return "max_output_tokens"
        if head == "chat_template_kwargs":
            return "reasoning.effort"
        if head in ("tool_choice", "parallel_tool_calls"):
            return chat_param
        if head in ("temperature", "top_p") and getattr(self, head) is not None:
            return chat_param
        return f"sampling.{chat_param}" if head in SamplingParams.model_fields else chat_param


def split_turns(messages: list[dict[str, Any]]) -> tuple[list[Turn], list[Message]]:
    """Messages as (earlier turns, the new turn): a turn starts at each user message that follows
    an answer, so a client that resends a whole chat still has whole turns to cut (a call's
    result stays in the turn of the call)."""
    turns: list[Turn] = [[]]
    for message in messages:
        if message["role"] == "user" and any(m["role"] == "assistant" for m in turns[-1]):
            turns.append([])
        turns[-1].append(message)
    return turns[:-1], turns[-1]


class ResponseCreateBody(ResponseCreateRequest):
    """`response.create` over the WebSocket: the HTTP body and its envelope."""

    type: Literal["response.create"] | None = None
    stream_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None


def engine_overrides(body: ResponseCreateRequest) -> dict[str, Any]:
    """OpenAI's sampling fields, under SamplingParams' names."""
    fields = {"max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p}
    return {k: v for k, v in fields.items() if v is not None}


# --- what goes back -----------------------------------------------------------------------------


def response_object(response_id: str, body: ResponseCreateRequest, model: str, status: str, *, created: float,
                    output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                    incomplete: str | None = None, error: APIError | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": time.time() if status in ("completed", "incomplete", "cancelled") else None,
        "status": status,
        "model": model,
        "output": output or [],
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
        else body.tool_choice or "auto",
        "tools": [t.model_dump() for t in body.tools or ()],
        "store": body.store,
        "metadata": body.metadata or {},
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "usage": usage,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "error": {"code": error.code, "message": error.message} if error else None,
    }


def usage(last, reasoning_tokens: int = 0) -> dict[str, Any]:
    prompt, completion = last.num_prompt_tokens, last.num_output_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


# --- what goes back, for the OpenAPI document ----------------------------------------------------


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Input tokens served from the prefix cache.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ContextReport(BaseModel):
    policy: str = Field(description="The context policy that ran.")
    cut: bool = Field(description="Whether the policy dropped anything.")
    turns_dropped: int
    messages_added: int = Field(description="Messages the context providers added.")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    context: ContextReport = Field(description="cadenza: what the context policy did to fit the conversation.")


class IncompleteDetails(BaseModel):
    reason: str


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response as `response_object` builds it (a stream's events carry the same object)."""

    id: str
    object: Literal["response"]
    created_at: float
    completed_at: float | None
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[OutputItem]
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    truncation: Literal["auto", "disabled"]
    parallel_tool_calls: bool
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any]
    tools: list[dict[str, Any]]
    store: bool
    metadata: dict[str, str]
    text: dict[str, Any]
    reasoning: dict[str, Any]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None


class CancelledResponse(BaseModel):
    """What cancelling a response that was stopped before it started returns."""

    id: str
    object: Literal["response"]
    status: Literal["cancelled"]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]
