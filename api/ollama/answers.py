"""OpenAI's stream chunks (api/openai/completions.py `streamed_chunks`) as Ollama's answers.

`Answer` is the synchronous core: `feed(chunk)` gives the Ollama fields each chunk adds (text,
thinking, whole tool calls with their arguments as objects, logprobs); `final(clock)` the closing
fields (`done: true`, `done_reason`, the counts and durations in nanoseconds); `whole(clock)` the
answer of a request with `stream: false`. It serves chat (`message`), templated generate
(`response`, `thinking`) and raw generate (OpenAI's completion chunks) alike.

Durations are measured here, at the edge: `load_duration` is the request's preparation (the model
is always loaded), `prompt_eval_duration` from then to the first output, `eval_duration` the rest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

Kind = Literal["chat", "generate"]


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Clock:
    arrived: int = field(default_factory=time.perf_counter_ns)
    prepared: int | None = None
    first: int | None = None
    last: int | None = None

    def mark_prepared(self) -> None:
        self.prepared = time.perf_counter_ns()

    def mark_output(self) -> None:
        now = time.perf_counter_ns()
        self.first = self.first or now
        self.last = now


def done_reason(finish_reason: str | None) -> str:
    """Ollama says `stop` for an answer that ends in tool calls too."""
    return "stop" if finish_reason in (None, "stop", "tool_calls") else finish_reason


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the object Ollama sends; what is not a JSON object (a
    call cut short by num_predict) is kept whole under "arguments"."""
    try:
        value = json.loads(text) if text.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


class Answer:
    """One answer, assembled from the chunks of its only choice."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self._calls: dict[int, dict[str, str]] = {}  # index -> name and arguments so far

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The fields this chunk adds to the answer (a streamed line's), None when it adds none."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta", choice)  # a completion chunk's choice is its own delta
        text, thought = delta.get("content") or delta.get("text") or "", delta.get("reasoning_content") or ""
        calls = [c for c in map(self._call, delta.get("tool_calls") or ()) if c is not None]
        logprobs = _logprobs(choice.get("logprobs"))
        self.content.append(text)
        self.thinking.append(thought)
        self.tool_calls += calls
        self.logprobs += logprobs
        if not (text or thought or calls or logprobs):
            return None
        return self._fields(text, thought, calls, logprobs)

    def _call(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        """A whole call, once its arguments are in (the chat core sends a call's name, then its
        arguments, as soon as the call is complete)."""
        function = delta.get("function") or {}
        if "id" in delta:
            self._calls[delta["index"]] = {"name": function.get("name", ""), "arguments": function.get("arguments", "")}
            return None
        call = self._calls.pop(delta["index"])
        call["arguments"] += function.get("arguments", "")
        return {"function": {"name": call["name"], "arguments": arguments_object(call["arguments"])}}

    def _fields(self, text: str, thought: str, calls: list[dict[str, Any]],
                logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thought:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = calls
            fields: dict[str, Any] = {"message": message}
        else:
            fields = {"response": text}
            if thought:
                fields["thinking"] = thought
        if logprobs:
            fields["logprobs"] = logprobs
        return fields

    def final(self, clock: Clock) -> dict[str, Any]:
        """A streamed answer's last line's fields, beside model and created_at."""
        end = clock.last or time.perf_counter_ns()
        prepared = clock.prepared or clock.arrived
        first = clock.first or end
        empty = {"message": {"role": "assistant", "content": ""}} if self.kind == "chat" else {"response": ""}
        return {
            **empty, "done": True, "done_reason": done_reason(self.finish_reason),
            "total_duration": end - clock.arrived, "load_duration": prepared - clock.arrived,
            "prompt_eval_count": self.usage.get("prompt_tokens", 0), "prompt_eval_duration": first - prepared,
            "eval_count": self.usage.get("completion_tokens", 0), "eval_duration": end - first,
        }  # fmt: skip

    def whole(self, clock: Clock) -> dict[str, Any]:
        """The answer of a request that asked for no stream."""
        thought = "".join(self.thinking)
        body = self.final(clock)
        return {**body, **self._fields("".join(self.content), thought, self.tool_calls, self.logprobs)}


def _logprobs(given: dict[str, Any] | None) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs as Ollama's: per token its text, logprob and the most likely ones."""
    if not given or not given.get("content"):
        return []
    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}

    return [{**entry(t), "top_logprobs": [entry(o) for o in t.get("top_logprobs") or ()]} for t in given["content"]]
