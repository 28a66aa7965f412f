"""A streamed Messages answer: the chat core's OpenAI chunks as Anthropic's Server-Sent Events.

    message_start, ping,
    (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, usage), message_stop

Blocks come in the order the model writes them: reasoning a `thinking` block (`thinking_delta`s),
text a `text` block (`text_delta`s), each tool call a `tool_use` block whose input arrives as one
`input_json_delta`. Thinking blocks carry an empty `signature` (nothing here signs them), so no
`signature_delta` is sent. `message_start` has no token counts yet (the engine reports them at the
end): `message_delta`'s usage has them all, and Anthropic's SDK takes them from there.
A stream that fails after it began ends with an `error` event (`failure`).
"""

from __future__ import annotations

import json
from typing import Any

from cadenza.api.anthropic.translate import error_body, message_head, stop_reason, tool_use_id, usage
from cadenza.api.errors import APIError


def event(kind: str, body: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n".encode()


def failure(error: APIError) -> bytes:
    """How a stream that already began ends when it fails."""
    return f"event: error\ndata: {json.dumps(error_body(error))}\n\n".encode()


class MessageEvents:
    """Synchronous core: feed it the OpenAI chunks of one choice, in order; it returns the events."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's type
        self.finish: str | None = None
        self.stop: Any = None
        self.started = self.ended = False

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        head = {**message_head(self.message_id, self.model), "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [event("message_start", {"message": head}), event("ping", {})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = self._start()
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                frames += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                frames.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                frames += self._into("text", {"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                if call.get("id"):  # a call's head: a block of its own
                    block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                             "input": {}}
                    frames += self._close() + self._open("tool_use", block)
                arguments = (call.get("function") or {}).get("arguments")
                if arguments and self.open == "tool_use":
                    frames.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            if choice.get("finish_reason") is not None:
                self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
                frames += self._close()
        if chunk.get("usage") is not None:
            frames += self.end(chunk["usage"])
        return frames

    def end(self, openai_usage: dict[str, Any] | None) -> list[bytes]:
        """message_delta and message_stop, once."""
        if self.ended:
            return []
        self.ended = True
        reason, sequence = stop_reason(self.finish, self.stop)
        return self._start() + self._close() + [
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": usage(openai_usage)}),
            event("message_stop", {}),
        ]

    def _into(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        return [] if self.open == kind else self._close() + self._open(kind, block)

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = kind
        return [event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})
