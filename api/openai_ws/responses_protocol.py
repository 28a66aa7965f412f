"""The Responses API's request (`POST /v1/responses`, and `response.create` over its WebSocket),
validated, and the response objects and events cadenza sends back, built.

Text only: input messages whose content is a string or `input_text` / `output_text` parts. What
cadenza cannot honour (tools, background runs, non-text formats) is refused with a 400 naming the
field; what changes nothing for a local server (store of metadata, user, service_tier, include)
is accepted and ignored. Sampling beyond OpenAI's fields goes in `sampling` (cadenza's own, the
same object as the WebSocket sessions'), plugin parameters in `sampling.extra`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cadenza.api.errors import APIError
from cadenza.api.sessions.protocol import SamplingOptions
from cadenza.policies.context import Message, Turn
from cadenza.sampling_params import MaxTokens, Temperature, TopP


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts echoed back from an earlier response
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    """A message item; `developer` counts as `system`."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def as_message(self) -> Message:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseCreateRequest(_Strict):
    """`POST /v1/responses`'s body (over the WebSocket, `ResponseCreateBody`)."""

    model: str | None = None
    input: str | list[InputMessage] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: drop the oldest turns when the conversation outgrows the model (the "
        "deployment's context policy if it cuts, else drop_oldest); disabled: fail. Unset: the deployment's policy.",
    )
    stream: bool = False
    store: bool = True
    sampling: SamplingOptions | None = Field(None, description="cadenza: any sampling field, plugin `extra` included.")
    # Accepted, with no effect on a local server.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted only with the value that means "not used".
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    background: bool | None = None
    text: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tool calling is not supported; send no tools")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("text")
    @classmethod
    def _plain_text(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (value or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise ValueError(f"format must be an object such as {{'type': 'text'}} (got {fmt!r})")
        kind = (fmt or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"only the 'text' format is supported (got {kind!r})")
        return value

    @model_validator(mode="after")
    def _has_input(self) -> "ResponseCreateRequest":
        if self.input is None or self.input == []:
            raise ValueError("input is required: a string or a list of messages")
        return self

    def turns(self) -> tuple[list[Turn], list[Message]]:
        """The input as (earlier turns, the new turn): a turn starts at each user message that
        follows an answer, so a client that resends a whole chat still has whole turns to cut."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else [m.as_message() for m in self.input]
        turns: list[Turn] = [[]]
        for message in items:
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
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "store": body.store,
        "metadata": body.metadata or {},
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "error": {"code": error.code, "message": error.message} if error else None,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(last) -> dict[str, Any]:
    prompt, completion = last.num_prompt_tokens, last.num_output_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


# --- what goes back, for the OpenAPI document ----------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


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
    output: list[OutputMessage]
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    truncation: Literal["auto", "disabled"]
    parallel_tool_calls: bool
    tool_choice: Literal["none"]
    tools: list[Any]
    store: bool
    metadata: dict[str, str]
    text: dict[str, Any]
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
