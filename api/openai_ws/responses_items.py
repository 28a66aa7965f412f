"""The Responses API's items: those a request's `input` carries (validated) and made into chat
messages, and those a response's `output` holds (built).

Input: `message` (a string or `input_text` / `output_text` parts; `developer` counts as `system`),
`function_call` (a call an earlier response made) and `function_call_output` (its result),
and `reasoning` (an earlier response's reasoning, echoed back). Each becomes a chat message in
OpenAI's chat shape (`api/openai/protocol.py`'s `ChatMessage`), as the chat core takes them: calls
join the assistant message before them (or make one), a result is a `tool` message, reasoning
rides on the assistant message after it as `reasoning_content`. Item ids are accepted and not
kept; an unknown item type is a 400 naming `input.<i>.type`.

Output: `message` with one `output_text` part, `function_call` (`id` "fc_...", `call_id` the
call's "call_..." id, `arguments` JSON text) and `reasoning` (its text as a `reasoning_text`
content part, `summary` empty: cadenza makes no summaries).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from cadenza.api.openai.protocol import FunctionName
from cadenza.policies.context import Message


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


class FunctionCallItem(_Strict):
    """A call an earlier response made, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: FunctionName
    arguments: str = Field(description="The arguments as JSON text.")
    id: str | None = None
    status: str | None = None
    # OpenAI's, echoed back by its SDK; with no effect here.
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Strict):
    """A call's result; `output` is text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    # OpenAI's; with no effect here.
    name: str | None = None
    caller: dict[str, Any] | None = None
    namespace: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier response's reasoning; its text (else its summary) goes back as the next
    assistant message's `reasoning_content`, for the chat template to show or drop."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # OpenAI's; cadenza encrypts nothing, so it carries nothing
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


_ITEMS: dict[str, type[_Strict]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def parse_items(value: Any) -> str | list[InputItem]:
    """`input` as text or items, each validated as its `type` says (a message's may be left
    out); the errors' locations are the item's index and field, so `param` reads `input.3.call_id`."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("input_type", "input must be a string or a list of items")
    items, errors = [], []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            message = f"item type {kind!r} is not supported; use one of {', '.join(_ITEMS)}"
            loc = (i, "type") if isinstance(raw, dict) else (i,)
            errors.append(
                InitErrorDetails(
                    type=PydanticCustomError("item_type", message),
                    loc=loc,
                    input=kind if isinstance(raw, dict) else raw,
                )
            )
            continue
        try:
            items.append(model.model_validate(raw, strict=True))
        except ValidationError as exc:
            errors += [InitErrorDetails(type=e["type"], loc=(i, *e["loc"]), input=e["input"], ctx=e.get("ctx", {}))
                       for e in exc.errors(include_url=False)]  # fmt: skip
    if errors:
        raise ValidationError.from_exception_data("input", errors)
    return items


Input = Annotated[Any, PlainValidator(parse_items, json_schema_input_type=str | list[InputItem])]


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages (OpenAI's chat shape: `tool_calls` with JSON-text arguments,
    `tool` messages with their `tool_call_id`)."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # waits for the assistant message it belongs to
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            continue
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
                continue
            message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            message = dict(item.as_message())
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
    return messages


# --- output items -------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [reasoning_part(text)] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant message its conversation keeps (chat shape)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] += item["content"][0]["text"] if item["content"] else ""
        elif item["type"] == "reasoning":
            message["reasoning_content"] = message.get("reasoning_content", "") + "".join(
                p["text"] for p in item["content"]
            )
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            message.setdefault("tool_calls", []).append(call)
    return message


# --- output items, for the OpenAPI document -------------------------------------------------------


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


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str = Field(description="The item's id (fc_...).")
    call_id: str = Field(description="The call's id (call_...), which its function_call_output names.")
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    status: Literal["in_progress", "completed", "incomplete"]


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any] = Field(description="Always empty: cadenza makes no summaries; the text is in content.")
    content: list[OutputReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]
