"""A response's output items and their streamed events, made from the chat core's deltas.

The chat core (`api/openai/completions.py`'s chat shape) already splits the model's output into
reasoning (`reasoning_content`), text (`content`) and whole tool calls (`tool_calls`: a head with
the call's id and name, then its arguments). `OutputItems.feed` turns each such delta into the
Responses events OpenAI sends: an item opens (`response.output_item.added`, and for text and
reasoning `response.content_part.added`), grows (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`) and closes (the
`.done` events, then `response.output_item.done`) when the next kind of output starts or the
response ends (`close`). A call arrives whole, so its item opens and closes at once. Plain data,
no engine: `sequence_number` is the transport's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from cadenza.api.openai_ws.responses_items import (
    function_call_item,
    message_item,
    reasoning_item,
    reasoning_part,
    text_part,
)

Event = dict[str, Any]


@dataclass
class _Open:
    """The text or reasoning item being written."""

    kind: str  # "message" or "reasoning"
    index: int
    item_id: str
    text: list[str] = field(default_factory=list)


@dataclass
class OutputItems:
    """Output items in the order the model wrote them; `items` holds each one closed."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: _Open | None = None
    _call: dict[str, Any] | None = None  # a call's head, waiting for its arguments

    def feed(self, delta: dict[str, Any], status: str = "completed") -> list[Event]:
        """The events of one chat delta; `status` is what an item that closes with it ends as
        (a call cut short by max_output_tokens: "incomplete")."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if call.get("id"):  # the head: id and name
                events += self.close()
                self._call = {"call_id": call["id"], "name": call["function"]["name"]}
            elif self._call is not None:
                events += self._function_call(call["function"]["arguments"], status)
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close the item being written, if any, as `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        text = "".join(item.text)
        at = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        if item.kind == "message":
            done = message_item(item.item_id, text, status)
            events = [{"type": "response.output_text.done", **at, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **at, "part": text_part(text)}]  # fmt: skip
        else:
            done = reasoning_item(item.item_id, text, status)
            events = [{"type": "response.reasoning_text.done", **at, "text": text},
                      {"type": "response.content_part.done", **at, "part": reasoning_part(text)}]  # fmt: skip
        self.items.append(done)
        return [*events, {"type": "response.output_item.done", "output_index": item.index, "item": done}]

    def finish(self, status: str) -> list[Event]:
        """Close the last item as `status`; a response that wrote nothing still has its (empty)
        message, as OpenAI's does."""
        events = self._write("message", "")[:-1] if not self.items and self.open is None else []
        return [*events, *self.close(status)]

    def _write(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is not None and self.open.kind != kind:
            events += self.close()
        if self.open is None:
            prefix = "msg" if kind == "message" else "rs"
            self.open = _Open(kind, len(self.items), f"{prefix}_{uuid.uuid4().hex}")
            item = (
                message_item(self.open.item_id, "", "in_progress")
                if kind == "message"
                else reasoning_item(self.open.item_id, "", "in_progress")
            )
            part = text_part("") if kind == "message" else reasoning_part("")
            at = {"item_id": self.open.item_id, "output_index": self.open.index}
            events += [{"type": "response.output_item.added", "output_index": self.open.index, "item": item},
                       {"type": "response.content_part.added", **at, "content_index": 0, "part": part}]  # fmt: skip
        self.open.text.append(text)
        at = {"item_id": self.open.item_id, "output_index": self.open.index, "content_index": 0}
        if kind == "message":
            return [*events, {"type": "response.output_text.delta", **at, "delta": text, "logprobs": []}]
        return [*events, {"type": "response.reasoning_text.delta", **at, "delta": text}]

    def _function_call(self, arguments: str, status: str) -> list[Event]:
        head, self._call = self._call, None
        index, item_id = len(self.items), f"fc_{uuid.uuid4().hex}"
        added = function_call_item(item_id, head["call_id"], head["name"], "", "in_progress")
        done = function_call_item(item_id, head["call_id"], head["name"], arguments, status)
        self.items.append(done)
        at = {"item_id": item_id, "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index, "item": added},
                {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
                {"type": "response.function_call_arguments.done", **at, "arguments": arguments},
                {"type": "response.output_item.done", "output_index": index, "item": done}]  # fmt: skip
