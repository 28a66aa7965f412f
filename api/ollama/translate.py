"""Ollama's requests as cadenza's own: a chat (and a templated generate) as a
`ChatCompletionRequest`, a raw generate as a `CompletionRequest`, so that every protocol runs on
the same chat core (api/openai/completions.py) and refuses the same things.

Names: Ollama clients name models `name:tag`. The served model is listed as `<name>:latest` and
answers to its name with or without that tag (any case, as Ollama compares names); any other name
is a 404 naming the served one. Both requests are always run streamed, with usage last, whatever
the client asked: the answer is assembled from the chunks (api/ollama/answers.py).
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from cadenza.api.errors import APIError, validation_error
from cadenza.api.ollama.protocol import ChatRequest, Format, GenerateRequest, Message, Options, Think
from cadenza.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from cadenza.api.state import ServerState

log = structlog.get_logger("cadenza.api")

# Ollama's option -> the sampling field it sets (cadenza's OpenAI-shaped request).
_SAMPLING = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
    "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}  # fmt: skip
# How a refusal of the translated request names the fields, in the client's terms.
_FIELD_NAMES = (
    ("response_format.json_schema.schema", "format"), ("response_format", "format"),
    ("max_completion_tokens", "options.num_predict"), ("max_tokens", "options.num_predict"),
    ("repetition_penalty", "options.repeat_penalty"), ("chat_template_kwargs", "think"), ("reasoning_effort", "think"),
)  # fmt: skip
_logged: set[str] = set()  # what has been logged once already


def _once(key: str, event: str, **fields: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(event, **fields)


def listed_name(model_name: str) -> str:
    """How the served model is listed: its name with Ollama's default tag, unless it has a tag."""
    return model_name if ":" in model_name else f"{model_name}:latest"


def check_model(state: ServerState, name: str) -> None:
    """A 404 in Ollama's words unless `name` is the served model (with or without `:latest`)."""
    wanted, served = name.strip().lower(), state.model_name.lower()
    if wanted not in (served, listed_name(served)):
        raise APIError(404, "model_not_found", f"model '{name}' not found; this server serves "
                       f"'{listed_name(state.model_name)}'", "model")


def in_ollama_terms(error: APIError) -> APIError:
    """`error` naming the fields as the client sent them (a refusal of the translated request names
    the fields of cadenza's OpenAI-shaped one)."""
    for ours, theirs in _FIELD_NAMES:
        error.message = error.message.replace(ours, theirs)
        if error.param is not None and error.param.startswith(ours):
            error.param = theirs
    return error


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise in_ollama_terms(validation_error(RequestValidationError(exc.errors(include_url=False)))) from None


def sampling(state: ServerState, options: Options | None, *, raw: bool = False) -> dict[str, Any]:
    """The sampling fields `options` sets; the ones cadenza does not map are logged once each."""
    if options is None:
        return {"max_tokens": _default_max_tokens(state)} if raw else {}
    given = {ours: getattr(options, theirs) for theirs, ours in _SAMPLING.items()}
    fields = {name: value for name, value in given.items() if value is not None}
    limit = state.engine.runtime.max_model_len
    if options.num_predict is not None:
        # -1 (until the end) and -2 (fill the context): the engine stops at max_model_len.
        fields["max_tokens"] = limit if options.num_predict < 0 else options.num_predict
    elif raw:
        fields["max_tokens"] = _default_max_tokens(state)
    if options.num_ctx is not None and options.num_ctx > limit:
        _once(f"num_ctx>{limit}", "Ollama num_ctx capped at max_model_len", num_ctx=options.num_ctx,
              max_model_len=limit)
    for name in options.ignored():
        _once(f"option:{name}", "Ollama option ignored", option=name)
    return fields


def _default_max_tokens(state: ServerState) -> int:
    return state.config.sampling.defaults.max_tokens or state.engine.runtime.max_model_len


def response_format(fmt: Format | None) -> dict[str, Any]:
    if not fmt:
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "ollama_format", "schema": fmt}}}


def thinking(state: ServerState, think: Think | None) -> dict[str, Any]:
    """`think` as the template's variables: a bool is `enable_thinking` (Qwen3's and others'), a
    level gpt-oss's `reasoning_effort`. Asking a model that writes no reasoning to think is a 400,
    as Ollama refuses it."""
    if think is None:
        return {}
    if think is not False and state.reasoning_parser is None:
        raise APIError(400, "invalid_request", f"'{listed_name(state.model_name)}' does not support thinking", "think")
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}


def _logprobs(logprobs: bool | None, top: int | None) -> dict[str, Any]:
    if not logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI's messages: calls get ids (Ollama's carry none), and each tool result the id of the
    call it answers (by its `tool_name`, else the next unanswered call), as templates want them."""
    out, unanswered = [], []
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, "unsupported_parameter", f"messages[{i}].images: images are not supported: the served "
                           "model reads text only", f"messages.{i}.images")
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, "invalid_messages", f"messages[{i}]: only assistant messages carry tool_calls",
                           f"messages.{i}.tool_calls")
        if m.role == "assistant":
            if m.thinking:
                message["reasoning_content"] = m.thinking
            if m.tool_calls:
                calls = [{"id": f"call_{i}_{k}", "type": "function",
                          "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                         for k, c in enumerate(m.tool_calls)]  # fmt: skip
                message["tool_calls"] = calls
                unanswered = [(c["id"], c["function"]["name"]) for c in calls]
        if m.role == "tool":
            if m.tool_name:
                message["name"] = m.tool_name
            match = next((c for c in unanswered if c[1] == m.tool_name), unanswered[0] if unanswered else None)
            if match is not None:
                message["tool_call_id"] = match[0]
                unanswered.remove(match)
        out.append(message)
    return out


def chat_request(state: ServerState, req: ChatRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": state.model_name, "messages": _messages(req.messages), "stream": True,
        "stream_options": {"include_usage": True}, **sampling(state, req.options), **response_format(req.format),
        **thinking(state, req.think), **_logprobs(req.logprobs, req.top_logprobs),
    }  # fmt: skip
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]
    return _validated(ChatCompletionRequest, body)


def check_generate(req: GenerateRequest) -> None:
    """What a generate may ask that cadenza does not do: a clear 400 each."""
    unsupported = {
        "suffix": (bool(req.suffix), "suffix (fill-in-the-middle) is not supported"),
        "template": (bool(req.template), "template is not supported: the served model's own chat template applies "
                     "(or send raw: true with the prompt as the model should read it)"),
        "context": (bool(req.context), "context is not supported (answers carry none): send the conversation as "
                    "/api/chat messages"),
        "images": (bool(req.images), "images are not supported: the served model reads text only"),
    }
    for name, (asked, message) in unsupported.items():
        if asked:
            raise APIError(400, "unsupported_parameter", message, name)


def generate_as_chat(state: ServerState, req: GenerateRequest) -> ChatCompletionRequest:
    """A templated generate: the prompt as the user's turn, after `system` when given."""
    messages = [Message(role="system", content=req.system)] if req.system else []
    messages.append(Message(role="user", content=req.prompt))
    shared = req.model_dump(exclude={"prompt", "system", "suffix", "template", "context", "raw", "images"})
    return chat_request(state, ChatRequest(**shared, messages=messages))


def raw_completion(state: ServerState, req: GenerateRequest) -> CompletionRequest:
    """A raw generate: the prompt as the model reads it, no template (`think` means nothing then)."""
    if req.logprobs:
        raise APIError(400, "unsupported_parameter", "logprobs are not supported with raw: true", "logprobs")
    body = {
        "model": state.model_name, "prompt": req.prompt, "stream": True, "stream_options": {"include_usage": True},
        **sampling(state, req.options, raw=True), **response_format(req.format),
    }  # fmt: skip
    return _validated(CompletionRequest, body)
