"""`/tokenize`, `/detokenize` and `/apply-template`: the served model's tokenizer and chat template
as the engine applies them, so clients count and render tokens exactly as the server does
(vLLM's and llama.cpp's endpoints, with their field names).

Chat messages are the chat completions' own (`ChatMessage`): a conversation renders here exactly
as `/v1/chat/completions` would render it. Bodies are parsed by hand like the OpenAI routes'
(bounded, unknown fields refused, errors in OpenAI's shape).
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from cadenza.api.errors import APIError, error_responses
from cadenza.api.http_streaming import parse_body
from cadenza.api.openai.protocol import ChatMessage, Tool, _Strict
from cadenza.api.openai.schema import openapi_request_body
from cadenza.api.state import ServerState, server_state
from cadenza.models.prompts import ChatPrompt, PromptError, check_encodable

router = APIRouter()

# Texts longer than this are tokenized off the event loop (a megabyte takes ~100 ms).
_THREAD_CHARS = 16_384


class _ModelField(_Strict):
    model: str | None = Field(None, description="The served model's name; any other is a 404.")


# What the model validator below checks, for the OpenAPI document: exactly one input; tools only
# with messages.
_ONE_INPUT = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}, "not": {"anyOf": [{"required": ["messages"]}, {"required": ["tools"]}]}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}, "not": {"required": ["prompt"]}},
    ]
}


class TokenizeRequest(_ModelField):
    """Either `prompt` (text) or `messages` (a conversation, rendered by the chat template)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_INPUT)

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128, description="Tools the template renders (with messages).")
    add_generation_prompt: StrictBool = Field(True, description="Open the assistant's turn after the messages.")
    add_special_tokens: StrictBool = Field(True, description="With prompt: add the tokenizer's special tokens (BOS).")
    return_token_strs: StrictBool = Field(False, description="Also return each token's text.")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_ModelField):
    tokens: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        description="Token ids, each below the vocabulary's size, written as JSON integers (648, not 648.0: a 400).")


class DetokenizeResponse(_Strict):
    prompt: str


class ApplyTemplateRequest(_ModelField):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_generation_prompt: StrictBool = True


class ApplyTemplateResponse(_Strict):
    prompt: str


REQUEST_MODELS = (TokenizeRequest, DetokenizeRequest, ApplyTemplateRequest)


def _documented(request_model, response_model) -> dict[str, Any]:
    return {
        "openapi_extra": {"requestBody": openapi_request_body(request_model)},
        "responses": {200: {"model": response_model}, **error_responses(400, 401, 404, 413)},
    }


def _check_model(state: ServerState, req: _ModelField) -> None:
    if req.model is not None and req.model != state.model_name:
        raise APIError(404, "model_not_found", f"the model {req.model!r} does not exist; this server serves {state.model_name!r}", "model")


def _render(state: ServerState, messages: list[ChatMessage], tools: list[Tool] | None, add_generation_prompt: bool) -> str:
    """The conversation as the chat template renders it for `/v1/chat/completions`."""
    engine_messages = [m.to_engine(i) for i, m in enumerate(messages)]
    prompt = ChatPrompt(engine_messages, [t.model_dump(exclude_none=True) for t in tools] if tools else None)
    kwargs = {"tools": list(prompt.tools)} if prompt.tools else {}
    try:
        return state.engine.runtime.tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ValueError as exc:  # the template refused the conversation (raise_exception)
        raise APIError(400, "invalid_messages", str(exc), "messages") from None


async def _off_loop(size: int, fn, *args):
    return await anyio.to_thread.run_sync(fn, *args) if size > _THREAD_CHARS else fn(*args)


@router.post("/tokenize", **_documented(TokenizeRequest, TokenizeResponse))
async def tokenize(request: Request) -> TokenizeResponse:
    state = server_state(request)
    req = await parse_body(request, TokenizeRequest)
    _check_model(state, req)
    runtime = state.engine.runtime
    tokenizer = runtime.tokenizer
    if req.messages is not None:
        text = _render(state, req.messages, req.tools, req.add_generation_prompt)
        ids = await _off_loop(len(text), lambda: tokenizer.encode(text, add_special_tokens=False))
    else:
        try:
            check_encodable(req.prompt, "prompt")
        except PromptError as exc:
            raise APIError(400, "invalid_prompt", str(exc), "prompt") from None
        ids = await _off_loop(len(req.prompt), lambda: tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=runtime.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", **_documented(DetokenizeRequest, DetokenizeResponse))
async def detokenize(request: Request) -> DetokenizeResponse:
    state = server_state(request)
    req = await parse_body(request, DetokenizeRequest)
    _check_model(state, req)
    vocab_size = state.engine.runtime.loaded.arch.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, "invalid_tokens", f"token ids out of range [0, {vocab_size}): {bad[:5]}", "tokens")
    return DetokenizeResponse(prompt=state.engine.runtime.tokenizer.decode(req.tokens, skip_special_tokens=False))


@router.post("/apply-template", **_documented(ApplyTemplateRequest, ApplyTemplateResponse))
async def apply_template(request: Request) -> ApplyTemplateResponse:
    state = server_state(request)
    req = await parse_body(request, ApplyTemplateRequest)
    _check_model(state, req)
    return ApplyTemplateResponse(prompt=_render(state, req.messages, req.tools, req.add_generation_prompt))
