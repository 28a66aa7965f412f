"""Anthropic's Messages API as a protocol: `POST /v1/messages` (whole, or streamed as Anthropic's
events) and `POST /v1/messages/count_tokens`, so that Anthropic's SDK and the apps built on it
(Claude Code among them) run on the served model.

Each request is translated into the chat core's (`translate.py`) and run by it (`prepare_chat`,
`whole_answer`, `streamed_chunks`), so tools, reasoning, sampling and every refusal behave as they
do on /v1/chat/completions. Every error under /v1/messages, bad JSON, an unknown field, a wrong
model or API key included, is written in Anthropic's shape. `anthropic-version` and
`anthropic-beta` headers are accepted and not read. The routes are in the OpenAPI document
(`schema.py`); docs/anthropic-api.md describes them.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cadenza.api.anthropic.events import MessageEvents, failure
from cadenza.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from cadenza.api.anthropic.schema import (
    AnthropicMessageResponse,
    AnthropicTokenCount,
    anthropic_schemas,
    documented,
)
from cadenza.api.anthropic.translate import chat_request, error_body, renamed, whole_message
from cadenza.api.errors import APIError
from cadenza.api.http_streaming import Emit, EventStreamResponse, parse_body
from cadenza.api.openai.completions import prepare_chat, streamed_chunks, whole_answer
from cadenza.api.openai.request_rules import ServedLimits
from cadenza.api.protocols import Protocol
from cadenza.api.state import server_state
from cadenza.models.prompts import ChatPrompt, PromptError, tokenize_prompt
from cadenza.models.tokenizer import ChatTemplateError

router = APIRouter()


@router.post("/v1/messages", **documented(MessagesRequest, AnthropicMessageResponse, streams=True))
async def messages(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, MessagesRequest)
    try:
        run = await prepare_chat(state, chat_request(req))
    except APIError as exc:
        raise renamed(exc) from None
    message_id = f"msg_{run.id}"
    if not run.stream:
        try:
            whole = await whole_answer(request, state, run)
        except APIError as exc:
            raise renamed(exc) from None
        return Response(status_code=499) if whole is None else JSONResponse(whole_message(whole, message_id))

    async def produce(emit: Emit) -> None:
        events = MessageEvents(message_id, state.model_name)
        async with aclosing(streamed_chunks(state, run)) as chunks:
            try:
                async for chunk in chunks:
                    for frame in events.feed(chunk):
                        await emit(frame)
            except APIError as exc:
                raise renamed(exc) from None
        for frame in events.end(None):
            await emit(frame)

    return EventStreamResponse(produce, fail=failure, request_id=getattr(request.state, "request_id", None),
                               completion_id=message_id)


@router.post("/v1/messages/count_tokens", **documented(CountTokensRequest, AnthropicTokenCount, streams=False))
async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CountTokensRequest)
    chat = chat_request(req)
    if chat.model != state.model_name:
        message = f"the model {chat.model!r} does not exist; this server serves {state.model_name!r}"
        raise APIError(404, "model_not_found", message, "model")
    try:
        chat.check()
    except APIError as exc:
        raise renamed(exc) from None
    prompt = ChatPrompt(chat.engine_messages(), chat.active_tools(), chat.template_kwargs(),
                        chat.continue_final_message, chat.add_generation_prompt)
    runtime = state.engine.runtime
    try:
        vocab_size = runtime.loaded.arch.vocab_size
        _, ids = await anyio.to_thread.run_sync(tokenize_prompt, prompt, runtime.tokenizer, vocab_size)
    except (ChatTemplateError, PromptError) as exc:
        raise APIError(400, "invalid_messages", f"messages: {exc}", "messages") from None
    return JSONResponse({"input_tokens": len(ids)})


class AnthropicProtocol(Protocol):
    """Anthropic's Messages API (whole and streamed answers, tools, thinking, token counting)."""

    name = "anthropic"
    prefixes = ("/v1/messages",)

    def router(self) -> APIRouter:
        return router

    def error_response(self, error: APIError) -> Response:
        return JSONResponse(error_body(error), status_code=error.status)

    def openapi_schemas(self, model_name: str, limits: ServedLimits) -> dict[str, dict[str, Any]]:
        return anthropic_schemas(model_name, limits)
