"""Anthropic's Messages API to and from cadenza's chat core (`api/openai/completions.py`).

A Messages request becomes a `ChatCompletionRequest` (OpenAI's shape): the system prompt a system
message, a user turn's `tool_result` blocks `tool` messages, an assistant turn's `tool_use` blocks
`tool_calls` and its `thinking` blocks `reasoning_content`; a last assistant turn with text is a
prefill (the model goes on from it: vLLM's `continue_final_message`). The chat core's answer, OpenAI's
`chat.completion`, becomes a Messages `message`: reasoning a `thinking` block, then the text, then
each call a `tool_use` block. Errors take Anthropic's shape (`error_body`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from cadenza.api.anthropic.protocol import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from cadenza.api.errors import APIError, validation_error
from cadenza.api.openai.protocol import ChatCompletionRequest

# OpenAI's finish_reason -> Anthropic's stop_reason (a stop string makes "stop" a stop_sequence).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# The chat core's field names, in its errors, -> this API's.
_PARAMS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
           "chat_template_kwargs": "thinking", "max_completion_tokens": "max_tokens"}
_NESTED_PARAMS = ((r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
                  (r"^tools\.(\d+)\.function\.", r"tools.\1."), (r"^tool_choice\.function\.", "tool_choice."))


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, "unsupported_content", f"{param}: {what} are not supported by this server "
                    "(it serves a text-only model); send text", param)


def _texts(blocks: list, param: str) -> str:
    """Text blocks as one text; an image or document among them is refused."""
    parts = []
    for i, block in enumerate(blocks):
        if isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported(f"{param}.{i}", f"{block.type} blocks")
        parts.append(block.text)
    return "\n".join(parts)


def _user_turn(content: str | list, param: str) -> list[dict[str, Any]]:
    """A user turn as OpenAI messages: each tool result a `tool` message, the text a user one, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict[str, Any]] = []
    text: list[str] = []
    for i, block in enumerate(content):
        where = f"{param}.{i}"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if text:
                messages.append({"role": "user", "content": "\n".join(text)})
                text = []
            result = block.content
            if not isinstance(result, str):
                result = _texts(result or [], f"{where}.content")
            # The template has no place for the flag: the model reads it in the result.
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {result}" if block.is_error else result})
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported(where, f"{block.type} blocks")
        else:
            raise APIError(400, "invalid_messages", f"{where}: a user turn cannot hold a {block.type} block", where)
    if text or not messages:
        messages.append({"role": "user", "content": "\n".join(text)})
    return messages


def _assistant_turn(content: str | list, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, thoughts, calls = [], [], []
    for i, block in enumerate(content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted for Anthropic's models: nothing here can read it
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported(f"{param}.{i}", f"{block.type} blocks")
        else:
            where = f"{param}.{i}"
            message = f"{where}: an assistant turn cannot hold a {block.type} block"
            raise APIError(400, "invalid_messages", message, where)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls in OpenAI's shape."""
    body: dict[str, Any] = {}
    for i, tool in enumerate(req.tools or ()):
        if tool.type not in (None, "custom"):
            raise APIError(400, "unsupported_tool", f"tools.{i}: server tools ({tool.type}) are not supported by this "
                           "server; define a client tool (name, description, input_schema)", f"tools.{i}.type")
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return body
    if not req.tools:
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
            raise APIError(400, "invalid_request", f"tool_choice {choice.type!r} requires tools", "tool_choice")
        return body
    if isinstance(choice, ToolChoiceNone):
        body["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceTool):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else "auto"
    if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    return body


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat core's request for `req` (a count_tokens request is rendered as a request for one token)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(req.messages):
        param = f"messages.{i}.content"
        if turn.role == "user":
            messages.extend(_user_turn(turn.content, param))
        else:
            messages.append(_assistant_turn(turn.content, param))
    body: dict[str, Any] = {"model": req.model, "messages": messages, **_tools(req)}
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and last.get("content", "").strip() and not last.get("tool_calls"):
        # A prefill: the model goes on from the assistant's text (Anthropic's answer is what follows it).
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.thinking is not None:
        thinks = isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive))
        body["chat_template_kwargs"] = {"enable_thinking": thinks}
    if isinstance(req, MessagesRequest):
        sampling = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
                    "top_p": req.top_p, "top_k": req.top_k}
        body.update({k: v for k, v in sampling.items() if v is not None})
        if req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
    else:
        body["max_tokens"] = 1
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # what this API's models let through and OpenAI's do not
        from fastapi.exceptions import RequestValidationError

        raise validation_error(RequestValidationError(exc.errors(include_url=False))) from None


def renamed(error: APIError) -> APIError:
    """An error from the chat core, naming this API's field where the two differ (in `param`
    and where the message begins with it)."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    param = _PARAMS.get(head, head) + dot + rest
    for ours, theirs in _NESTED_PARAMS:
        param = re.sub(ours, theirs, param)
    if error.message.startswith(f"{error.param}:"):
        error.message = param + error.message[len(error.param):]
    error.param = param
    return error


# --- answers --------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object; arguments cut short (max_tokens) as far as they parse,
    as Anthropic's SDK reads a streamed call's partial JSON."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) from OpenAI's finish_reason and vLLM's stop_reason."""
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage(openai_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens the prefix cache did not serve."""
    openai_usage = openai_usage or {}
    prompt = openai_usage.get("prompt_tokens", 0)
    cached = (openai_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": openai_usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_head(message_id: str, model: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": []}


def whole_message(completion: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A `chat.completion` (one choice) as a Messages `message`."""
    choice = completion["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {**message_head(message_id, completion["model"]), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(completion.get("usage"))}


# --- errors ---------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error shape; any other 4xx is an invalid request, any other 5xx an api_error.
    The shape has no `param`: the message begins with the field at fault."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message_naming_param()
    if error.code == "invalid_api_key":
        message = "a valid API key is required: send it as 'x-api-key: <key>'"
    return {"type": "error", "error": {"type": kind, "message": message}}
