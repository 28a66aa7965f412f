"""The WebSocket session protocol's client messages (validated) and server messages (built).

Every message is a JSON text frame with a `type`. docs/websocket.md describes the exchange.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from cadenza.sampling_params import SamplingOverrides, describe_error


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


RequestId = Annotated[str, Field(min_length=1, max_length=128, description="The client's name for a request.")]
ConversationName = Annotated[
    str, Field(min_length=1, max_length=64, description="A conversation of the session; 'main' unless forked.")
]
MAIN = "main"


class SamplingOptions(SamplingOverrides):
    """Per-request sampling; anything left out comes from the session's, then the server's, defaults.
    Every field and bound is `SamplingParams`' own."""


class ChatMessage(_Message):
    role: Literal["system", "user", "assistant"]
    content: str


class ContextOptions(_Message):
    """What the session's conversations do when they outgrow the model, and what they retrieve."""

    policy: str | None = Field(None, min_length=1, description="A context policy: error, drop_oldest or a plugin's.")
    providers: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=16, description="Context providers run before every turn, in this order; [] for none."
    )


class SessionUpdate(_Message):
    type: Literal["session.update"]
    system_prompt: str | None = Field(None, description="Replaces the session's system prompt; '' clears it.")
    sampling: SamplingOptions | None = None
    context: ContextOptions | None = None


class Generate(_Message):
    """Exactly one of `prompt` (text), `token_ids`, `messages` (a whole chat) or `user` (append a
    user turn to the session's conversation and answer it)."""

    type: Literal["generate"]
    request_id: RequestId
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    conversation: ConversationName | None = Field(None, description="With `user`: which conversation; default 'main'.")
    sampling: SamplingOptions | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "Generate":
        given = [k for k in ("prompt", "token_ids", "messages", "user") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, token_ids, messages, user (got {given or 'none'})")
        if self.conversation is not None and self.user is None:
            raise ValueError("conversation goes with user (a conversation turn)")
        return self


class Cancel(_Message):
    type: Literal["cancel"]
    request_id: RequestId


class Interrupt(_Message):
    """Stop the running conversation turn and keep its partial answer in the history (barge-in)."""

    type: Literal["interrupt"]
    request_id: RequestId | None = None
    conversation: ConversationName | None = None


class SessionGet(_Message):
    type: Literal["session.get"]
    conversation: ConversationName = MAIN


class SessionReset(_Message):
    """Forget a conversation's history (its system prompt stays)."""

    type: Literal["session.reset"]
    conversation: ConversationName = MAIN


class SessionTruncate(_Message):
    """Keep a conversation's first `turns` turns."""

    type: Literal["session.truncate"]
    conversation: ConversationName = MAIN
    turns: int = Field(ge=0, description="How many turns to keep, from the first.")


class SessionFork(_Message):
    """Copy a conversation (its first `turns` turns when given) under a new name. The copy's
    prompts begin with the same tokens, so its next turn is served from the cached prefix."""

    type: Literal["session.fork"]
    conversation: ConversationName = MAIN
    name: ConversationName
    turns: int | None = Field(None, ge=0)


class SessionDelete(_Message):
    type: Literal["session.delete"]
    conversation: ConversationName


class Ping(_Message):
    type: Literal["ping"]


ClientMessage = Annotated[
    Union[SessionUpdate, Generate, Cancel, Interrupt, SessionGet, SessionReset, SessionTruncate, SessionFork, SessionDelete, Ping],
    Field(discriminator="type"),
]
_CLIENT = TypeAdapter(ClientMessage)
CLIENT_TYPES = (
    "session.update", "generate", "cancel", "interrupt", "session.get", "session.reset", "session.truncate",
    "session.fork", "session.delete", "ping",
)  # fmt: skip


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_client_message(frame: str) -> ClientMessage:
    """A validated client message, or a `ProtocolError` that names the problem."""
    try:
        raw = json.loads(frame)
    except json.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits; nesting too deep
        raise ProtocolError("invalid_json", f"not valid JSON: {exc}") from None
    request_id = raw.get("request_id") if isinstance(raw, dict) and isinstance(raw.get("request_id"), str) else None
    if _SURROGATE_ESCAPE.search(frame) and _has_lone_surrogate(raw):
        # json.loads lets "\ud800" through; it is no character, and no tokenizer takes it.
        request_id = None if request_id is None or _has_lone_surrogate(request_id) else request_id
        message = "not valid JSON: a string holds a lone surrogate escape (\\ud800-\\udfff)"
        raise ProtocolError("invalid_json", message, request_id)
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_message", "a message must be a JSON object with a 'type'")
    kind = raw.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}; known: {', '.join(CLIENT_TYPES)}", request_id)
    try:
        return _CLIENT.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(_describe(error, kind) for error in exc.errors(include_url=False))
        raise ProtocolError("invalid_params", problems, request_id) from None


def _has_lone_surrogate(raw: Any) -> bool:
    try:
        json.dumps(raw, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def _describe(error: dict[str, Any], kind: str) -> str:
    """One problem, located within the message (its first loc entry is the message type)."""
    loc = error["loc"][1:]
    if loc[:1] == ("sampling",):  # a sampling field: named with its allowed range
        return "sampling." + describe_error({**error, "loc": loc[1:]}) if loc[1:] else f"sampling: {error['msg']}"
    return describe_error({**error, "loc": loc}) if loc else f"{kind}: {error['msg'].removeprefix('Value error, ')}"


def error(code: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        body["request_id"] = request_id
    return body
