"""OpenAI-compatible /v1/completions and /v1/chat/completions, streaming (SSE) or not.

Each choice of a request (n per prompt) is an engine request of its own, all run at once. A
request the engine rejects (bad prompt, too long, queue full) gets its HTTP status; a failure once
a stream has started is an SSE error event followed by `[DONE]`. A client that disconnects aborts
every choice still running.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cadenza.api.errors import APIError, engine_error, error_responses
from cadenza.api.http_streaming import Emit, EventStreamResponse, parse_body, run_choices, sse, until_disconnected
from cadenza.api.openai.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from cadenza.api.openai.schema import ChatCompletionResponse, CompletionResponse, openapi_request_body
from cadenza.api.openai.tool_schemas import check_tool_schemas
from cadenza.api.state import ServerState, server_state
from cadenza.engine.streams import GenerationOutput
from cadenza.models.prompts import ChatPrompt, PromptError, tokenize_prompt
from cadenza.models.tokenizer import ChatTemplateError
from cadenza.outputs import TokenLogprob
from cadenza.parsers.markers import format_params
from cadenza.parsers.reasoning import ReasoningParser, ReasoningStream
from cadenza.parsers.tool_calls import HermesToolParser, ToolCallStream, ToolParser, forcing_grammar
from cadenza.samplers.vocab import token_bytes_lookup
from cadenza.sampling_params import SamplingParams, StructuredOutputs

log = structlog.get_logger("cadenza.api")
router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _documented(request_model, response_model) -> dict[str, Any]:
    """The OpenAPI description of a generation route: its body (parsed by hand, so FastAPI cannot
    see it), the whole or streamed answer, and every error status in OpenAI's error shape."""
    # itemSchema describes each event of a stream (OpenAPI 3.2).
    data = "A chunk as JSON, or an error in OpenAI's shape if the request fails mid-stream; `[DONE]` last."
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description": data}}}
    streamed = {"itemSchema": event}
    return {
        "openapi_extra": {"requestBody": openapi_request_body(request_model)},
        "responses": {
            200: {"model": response_model, "content": {"text/event-stream": streamed}},
            **error_responses(400, 401, 404, 408, 413, 429, 500, 503),
        },
    }


@router.post("/v1/completions", **_documented(CompletionRequest, CompletionResponse))
async def completions(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CompletionRequest)
    return await _answer(request, state, prepare_completion(state, req))


def prepare_completion(state: ServerState, req: CompletionRequest) -> PreparedRun:
    """A completion request made ready to run (`whole_answer`, `streamed_chunks`), as
    `prepare_chat` makes a chat: the model admitted, one job per prompt and choice. The Ollama
    protocol runs its raw generations through this. An `APIError` names what is wrong."""
    _admit(state, req)
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    prompts = req.prompts()
    structured, structured_param = req.structured()
    # Echo only (max_tokens 0): the engine computes the prompt and one token, which is left out.
    jobs = [
        (prompt, to_sampling_params(req, state.config.sampling.defaults, max_tokens=max_tokens or 1,
                                    logprobs=req.logprobs, choice=j, rename={}, structured=structured,
                                    prompt_logprobs=req.engine_prompt_logprobs()))
        for prompt in prompts
        for j in range(req.n)
    ]  # fmt: skip
    tokenizer = state.engine.runtime.tokenizer
    echo = [_prompt_text(state, p) for p in prompts] if req.echo else None
    shape = _CompletionShape(_TokenTexts(tokenizer), req.n, req.logprobs, echo, req.echo_only, req.prompt_logprobs)
    shape.structured_param = structured_param
    return PreparedRun(shape, jobs, bool(req.stream), bool(req.stream_options and req.stream_options.include_usage))


@router.post("/v1/chat/completions", **_documented(ChatCompletionRequest, ChatCompletionResponse))
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    return await _answer(request, state, await prepare_chat(state, req))


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> PreparedRun:
    """A chat request made ready to run (`whole_answer`, `streamed_chunks`): the model admitted,
    the tools' schemas compiled, the template's formats (tool calls, reasoning) chosen, one job
    per choice. The Anthropic and Ollama protocols run their chats through this too, as a
    `ChatCompletionRequest` translated from theirs. An `APIError` names what is wrong."""
    _admit(state, req)
    defaults = state.config.sampling.defaults
    max_tokens = next((v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), defaults.max_tokens)
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    rename = {"logprobs": "top_logprobs", "max_tokens": max_name}
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tokenizer = state.engine.runtime.tokenizer
    tools = req.active_tools()
    parser = (state.tool_parser or HermesToolParser)(tools) if tools else None
    structured, structured_param = req.structured()
    if req.tools:  # every tool's schema compiles, whatever tool_choice says
        offered = [t.model_dump(exclude_none=True) for t in req.tools]
        await check_tool_schemas(offered, (state.tool_parser or HermesToolParser)(offered))
    forced = req.forced_tools()
    forced_names = None
    template_kwargs = req.template_kwargs()
    chat = ChatPrompt(req.engine_messages(), tools, template_kwargs, req.continue_final_message,
                      req.add_generation_prompt)
    plain = not (tools or template_kwargs or req.continue_final_message or not req.add_generation_prompt)
    prompt = chat.messages if plain else chat
    reasoning = state.reasoning_parser
    rendered = None
    if reasoning is not None:  # the parser reads the rendered prompt: render it once, and send its tokens
        rendered, ids = _rendered(chat, tokenizer, state.engine.runtime.loaded.arch.vocab_size)
        prompt = ids if ids is not None else prompt
    if forced is not None and parser is not None:  # "required" or a named function: the grammar makes the call
        # The family's reasoning may come first, where its parser says how (else the call is all),
        # in at most half of max_tokens, so that the call has the other half.
        budget = max(16, max_tokens // 2)
        before = reasoning.forced_call_reasoning(rendered, budget) if reasoning is not None else None
        reasoning = reasoning if before is not None else None
        grammar = forcing_grammar(parser.grammar(*forced), before)
        structured, structured_param = StructuredOutputs(grammar=grammar), "tools"
        forced_names = [t["function"]["name"] for t in forced[0]]
    # A format written in special tokens (gpt-oss's harmony) reads them, and ends on its own.
    formats = [f for f in (parser, reasoning) if f is not None]
    jobs = [
        (prompt, format_params(to_sampling_params(req, defaults, max_tokens=max_tokens, logprobs=logprobs, choice=j,
                                                  rename=rename, structured=structured,
                                                  prompt_logprobs=req.prompt_logprobs),
                               formats, lambda token: tokenizer.backend.token_to_id(token)))
        for j in range(req.n)
    ]  # fmt: skip
    shape = _ChatShape(_TokenTexts(tokenizer), req.n, req.logprobs, parser, req.prompt_logprobs, forced_names,
                       reasoning, rendered)
    shape.structured_param = structured_param
    return PreparedRun(shape, jobs, bool(req.stream), bool(req.stream_options and req.stream_options.include_usage))


def _rendered(chat: ChatPrompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int] | None]:
    """(the prompt text the engine would make of `chat`, its token ids), as the engine's ingress
    makes them: the text tells a reasoning parser whether the template opened the reasoning, and
    the ids spare the engine a second rendering. (None, None) where it cannot render (the engine,
    given the chat, then fails the request with the template's own message)."""
    try:
        return tokenize_prompt(chat, tokenizer, vocab_size)
    except (ChatTemplateError, PromptError):
        return None, None


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    vocab_size = state.engine.runtime.loaded.arch.vocab_size
    # Ids out of range fail the request in the engine, with a message saying so.
    return state.engine.runtime.tokenizer.decode(prompt) if all(0 <= t < vocab_size for t in prompt) else ""


def _admit(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.model != state.model_name:
        message = f"the model {req.model!r} does not exist; this server serves {state.model_name!r}"
        raise APIError(404, "model_not_found", message, "model")
    req.check()  # token ids beyond the vocabulary are refused by the engine's ingress, for every API
    if state.draining:
        raise APIError(503, "draining", "the server is shutting down")


# --- running a request --------------------------------------------------------------------------


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: GenerationOutput | None = None
    prompt: GenerationOutput | None = None  # the output with the prompt logprobs, when asked

    def add(self, out: GenerationOutput) -> None:
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt = out


_PROMPT_ERRORS = ("invalid_prompt", "invalid_messages", "prompt_too_long")
# The engine's refusals of sampling params begin with the field: "logit_bias: token ids must be ...".
_PARAM_ERRORS = ("invalid_value", "invalid_extra")


def _engine_param(error: APIError, prompt_param: str) -> str | None:
    """The request field an engine refusal concerns, for `error.param`."""
    if error.code in _PROMPT_ERRORS:
        return prompt_param
    field = error.message.partition(":")[0]
    if error.code in _PARAM_ERRORS and field.partition(".")[0] in SamplingParams.model_fields:
        return field
    return None


def _check_finish(out: GenerationOutput | APIError, prompt_param: str, structured_param: str | None = None) -> GenerationOutput:
    """The output, or the error a client should see instead of it."""
    if isinstance(out, APIError):
        raise out
    if out.finish_reason == "error":
        error = engine_error(out.error_code, out.error)
        error.param = _engine_param(error, prompt_param)
        if structured_param not in (None, "structured_outputs") and error.message.startswith("structured_outputs"):
            # The grammar came from response_format, guided_* or tools: name the field the client sent.
            error.message = structured_param + error.message.partition(":")[1] + error.message.partition(":")[2]
            error.param = structured_param
        raise error
    if out.finish_reason == "abort":
        raise APIError(503, "aborted", "the request was aborted (the server may be shutting down)")
    return out


@dataclass
class PreparedRun:
    """A generation request made ready to run: how its answer is shaped, its engine jobs (one
    per choice: prompt and sampling params), and how it is to be answered."""

    shape: "_Shape"
    jobs: list[tuple[Any, SamplingParams]]
    stream: bool
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _head(state: ServerState, run: PreparedRun) -> dict[str, Any]:
    return {"id": f"{run.shape.id_prefix}{run.id}", "object": run.shape.object, "created": run.created,
            "model": state.model_name}


async def whole_answer(request: Request, state: ServerState, run: PreparedRun) -> dict[str, Any] | None:
    """The whole answer (a `chat.completion` or `text_completion` object), or None when the
    client disconnected first (its requests are aborted). An `APIError` for a refused request."""
    choices = [_Choice() for _ in run.jobs]
    shape = run.shape

    async def collect() -> None:
        async with run_choices(state.engine, run.jobs, _head(state, run)["id"], state.metrics) as items:
            async for index, out in items:
                choices[index].add(_check_finish(out, shape.prompt_param, shape.structured_param))

    disconnected, _ = await until_disconnected(request, collect)
    if disconnected:
        log.info("Client disconnected", request_id=getattr(request.state, "request_id", None),
                 completion_id=_head(state, run)["id"])
        return None
    whole = [shape.choice(i, c) for i, c in enumerate(choices)]
    return {**_head(state, run), "choices": whole, **shape.extra(choices), "usage": _usage(choices, shape.n, shape.generates)}


async def streamed_chunks(state: ServerState, run: PreparedRun) -> AsyncIterator[dict[str, Any]]:
    """The answer as OpenAI's stream chunks (`chat.completion.chunk` objects), the usage chunk
    last when `run.include_usage`. An `APIError` before the first chunk is a refused request;
    closing the iterator early aborts every choice still running."""
    shape = run.shape
    chunk_head = {**_head(state, run), "object": shape.chunk_object}
    choices = [_Choice() for _ in run.jobs]

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        body = {**chunk_head, "choices": [choice]}
        if run.include_usage:
            body["usage"] = None
        return body

    async with run_choices(state.engine, run.jobs, chunk_head["id"], state.metrics) as items:
        # Wait for every choice's first output, so a rejected request gets its HTTP status.
        buffered, firsts = [], {}
        async for index, out in items:
            buffered.append((index, _check_finish(out, shape.prompt_param, shape.structured_param)))
            firsts.setdefault(index, out)
            if len(firsts) == len(run.jobs):
                break
        for index in range(len(run.jobs)):
            for opening in shape.opening(index, firsts[index]):
                yield chunk(opening)
        for index, out in buffered:
            choices[index].add(out)
            for body in shape.deltas(index, out):
                yield chunk(body)
        async for index, out in items:
            out = _check_finish(out, shape.prompt_param, shape.structured_param)
            choices[index].add(out)
            for body in shape.deltas(index, out):
                yield chunk(body)
    if run.include_usage:
        yield {**chunk_head, "choices": [], "usage": _usage(choices, shape.n, shape.generates)}


async def _answer(request: Request, state: ServerState, run: PreparedRun) -> Response:
    """The HTTP response to a prepared run: JSON, or Server-Sent Events ending in `[DONE]`."""
    if not run.stream:
        whole = await whole_answer(request, state, run)
        return Response(status_code=499) if whole is None else JSONResponse(whole)

    async def produce(emit: Emit) -> None:
        async with aclosing(streamed_chunks(state, run)) as chunks:
            async for body in chunks:
                await emit(sse(_json(body)))
        await emit(sse("[DONE]"))

    return EventStreamResponse(produce, request_id=getattr(request.state, "request_id", None),
                               completion_id=_head(state, run)["id"])


def _usage(choices: list[_Choice], n: int, generates: bool = True) -> dict[str, Any]:
    """A prompt shared by n choices counts once, as OpenAI counts it; `generates` False (echo
    only): no completion tokens are returned, so none are counted."""
    lasts = [c.last for c in choices if c.last is not None]
    firsts = [c.last for c in choices[::n] if c.last is not None]
    prompt = sum(o.num_prompt_tokens for o in firsts)
    completion = sum(o.num_output_tokens for o in lasts) if generates else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


# --- response shapes ----------------------------------------------------------------------------


class _Shape:
    id_prefix: str
    object: str
    chunk_object: str
    prompt_param: str  # where a prompt the engine rejects came from
    structured_param: str | None = None  # where the output's grammar came from, for its errors
    generates = True  # False: the answer leaves the generated tokens out (echo only)

    def __init__(self, tokens: "_TokenTexts", n: int, want_logprobs: bool) -> None:
        self.tokens, self.n, self.want_logprobs = tokens, n, want_logprobs

    def opening(self, index: int, first: GenerationOutput) -> list[dict[str, Any]]:
        """What a streamed choice begins with, once its `first` output is in."""
        return []

    def extra(self, choices: list[_Choice]) -> dict[str, Any]:
        """Fields of a whole answer beside its choices."""
        return {}

    def deltas(self, index: int, out: GenerationOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class _ChatShape(_Shape):
    """Chat answers; with a tool parser (the request offered tools), tool calls in the model's
    format become `tool_calls`, streamed as each call completes: a delta with the call's index,
    id and function name, then one with its arguments, as OpenAI's SDK accumulates them.

    A forced call (`forced`: the functions tool_choice allows) is all the output is: the answer is
    `tool_calls` and null content, also when max_tokens cuts it short (`finish_reason` "length"):
    the last call then has its arguments as far as they got, as OpenAI cuts them."""

    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"
    prompt_param = "messages"

    def __init__(self, tokens, n, want_logprobs, tool_parser: ToolParser | None = None, prompt_logprobs: int | None = None,
                 forced: list[str] | None = None, reasoning: ReasoningParser | None = None,
                 prompt_text: str | None = None) -> None:  # fmt: skip
        super().__init__(tokens, n, want_logprobs)
        self.tool_parser = tool_parser
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.prompt_logprobs = prompt_logprobs
        self.forced = forced if tool_parser is not None else None
        # Reasoning apart from content (vLLM's `reasoning_content`), before any tool parsing.
        self.reasoning, self.prompt_text = reasoning, prompt_text
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def opening(self, index, first):
        return [{"index": index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]

    def extra(self, choices):
        """vLLM's prompt_logprobs, when asked: the choices share the prompt."""
        if self.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": _vllm_prompt_logprobs(self.tokens, choices[0].prompt, self.prompt_logprobs)}

    def deltas(self, index, out):
        bodies = []
        text, calls, first, thought = out.text, [], 0, ""
        final = out.finish_reason is not None
        if self.reasoning is not None:
            split = self.reasoning_streams.setdefault(index, self.reasoning.stream(self.prompt_text)).feed(text, final)
            thought, text = split.reasoning, split.content
        if self.tool_parser is not None:
            stream = self.tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
            first = stream.num_calls
            if self.forced is None:
                text, calls = stream.feed(text, final=final)
            else:
                text, calls = self._forced_calls(stream, text, final)
        logprobs = self._logprobs(out.logprobs) if self.want_logprobs and out.logprobs else None
        if thought:  # the step's logprobs ride on its first delta
            bodies.append({"index": index, "delta": {"reasoning_content": thought}, "logprobs": logprobs, "finish_reason": None})
        if text or (out.logprobs and self.forced is None and not thought):
            logprobs = None if thought else logprobs
            bodies.append({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None})
        elif out.logprobs and self.want_logprobs and not thought:  # a forced call's tokens: no content to carry them
            bodies.append({"index": index, "delta": {}, "logprobs": self._logprobs(out.logprobs), "finish_reason": None})
        for k, call in enumerate(calls):
            head = {"index": first + k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            arguments = {"index": first + k, "function": {"arguments": call.arguments}}
            for delta in (head, arguments):
                bodies.append({"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None})
        if out.finish_reason is not None:
            reason = out.finish_reason
            if self.tool_parser is not None and self.tool_streams[index].num_calls and reason == "stop":
                reason = "tool_calls"
            bodies.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                           **_stop_reason(out)})
        return bodies

    def _forced_calls(self, stream: ToolCallStream, text: str, final: bool) -> tuple[str, list]:
        """A forced call's streamed output (`text`, after any reasoning): calls as they complete
        (what the grammar writes between them is no content), and at the end whatever call was
        cut short."""
        if not final:
            return "", stream.feed(text, final=False)[1]
        calls = self.tool_parser.parse_forced(stream.pending + text, self.forced)
        stream.pending, stream.num_calls = "", stream.num_calls + len(calls)
        return "", calls

    def choice(self, index, choice):
        content: str | None = "".join(choice.text)
        reason = choice.last.finish_reason if choice.last else None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if self.reasoning is not None:
            message["reasoning_content"], content = self.reasoning.split(content, self.prompt_text)
            message["content"] = content
            content = content or ""
        if self.tool_parser is not None:
            if self.forced is None:
                content, calls = self.tool_parser.parse(content)
            else:
                content, calls = None, self.tool_parser.parse_forced(content, self.forced)
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs) if self.want_logprobs else None,
            "finish_reason": reason,
            **_stop_reason(choice.last),
        }

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in logprobs:
            text, raw = self.tokens(lp.token_id)
            top = []
            for token_id, value in lp.top:
                t, b = self.tokens(token_id)
                top.append({"token": t, "logprob": _finite(value), "bytes": b})
            content.append({"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}


def _stop_reason(last: GenerationOutput | None) -> dict[str, Any]:
    """vLLM's `stop_reason` (the stop string or stop token id that ended the choice), where one
    did: Anthropic's `stop_sequence` is read from it."""
    stop = last.stop_reason if last is not None else None
    return {} if stop is None else {"stop_reason": stop}


class _CompletionShape(_Shape):
    """Legacy completions. With echo the prompt comes first, and with logprobs its tokens' logprobs
    (null for the first token, which has none) before the completion's; echo only (max_tokens 0)
    leaves out the token the engine generated. vLLM's `prompt_logprobs`, when asked, go in each
    choice in vLLM's shape."""

    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"
    prompt_param = "prompt"

    def __init__(self, tokens, n, logprobs: int | None, echo: list[str] | None, echo_only: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        super().__init__(tokens, n, logprobs is not None)
        self.echo, self.top_n = echo, logprobs or 0
        self.generates = not echo_only
        self.prompt_logprobs = prompt_logprobs
        self.offsets: dict[int, int] = {}  # choice -> characters of text so far, for text_offset

    def _prompt_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def opening(self, index, first):
        text = self._prompt_text(index)
        logprobs = self._echo_logprobs(first) if text and self.want_logprobs else None
        self.offsets[index] = len(text)
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}] if text else []

    def deltas(self, index, out):
        if not self.generates:  # echo only: the prompt went in the opening
            return [{"index": index, "text": "", "logprobs": None, "finish_reason": "length"}] if out.finish_reason else []
        if not (out.text or out.logprobs or out.finish_reason):
            return []
        logprobs = self._logprobs(index, out.logprobs) if self.want_logprobs and out.logprobs else None
        return [{"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}]

    def choice(self, index, choice):
        prompt_text = self._prompt_text(index)
        self.offsets[index] = len(prompt_text)
        logprobs = None
        if self.want_logprobs:
            logprobs = self._logprobs(index, choice.logprobs if self.generates else [])
            if self.echo:  # the prompt's tokens first
                logprobs = {key: values + logprobs[key] for key, values in self._echo_logprobs(choice.prompt).items()}
        body = {
            "index": index,
            "text": prompt_text + ("".join(choice.text) if self.generates else ""),
            "logprobs": logprobs,
            "finish_reason": (choice.last.finish_reason if self.generates else "length") if choice.last else None,
        }
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.tokens, choice.prompt, self.prompt_logprobs)
        return body

    def _echo_logprobs(self, out: GenerationOutput | None) -> dict[str, Any]:
        """The prompt's tokens in the legacy shape, text offsets counted from the prompt's start."""
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        for token_id, lp in _prompt_entries(out):
            text, _ = self.tokens(token_id)
            tokens.append(text)
            values.append(None if lp is None else _finite(lp.logprob))
            tops.append(None if lp is None else self._top(lp.top[: self.top_n]))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for lp in logprobs:
            text, _ = self.tokens(lp.token_id)
            tokens.append(text)
            values.append(_finite(lp.logprob))
            tops.append(self._top(lp.top))
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        """The legacy shape keys the most likely tokens by their text: where two tokens read the
        same, the more likely one's value stands (they come most likely first)."""
        shown: dict[str, float] = {}
        for token_id, value in top:
            shown.setdefault(self.tokens(token_id)[0], _finite(value))
        return shown


def _prompt_entries(out: GenerationOutput | None) -> list[tuple[int, TokenLogprob | None]]:
    """(token id, its logprob) for each prompt token of the output that carries them."""
    if out is None or out.prompt_logprobs is None or out.prompt_token_ids is None:
        raise RuntimeError("the engine returned no prompt logprobs for a request that asked for them")
    return list(zip(out.prompt_token_ids, out.prompt_logprobs))


def _vllm_prompt_logprobs(tokens: "_TokenTexts", out: GenerationOutput | None, top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} for the prompt token and the `top_n` most likely."""
    result: list[dict[str, Any] | None] = []
    for token_id, lp in _prompt_entries(out):
        if lp is None:
            result.append(None)
            continue
        entries = {str(token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": tokens(token_id)[0]}}
        for rank, (top_id, value) in enumerate(lp.top[:top_n], start=1):
            entries.setdefault(str(top_id), {"logprob": _finite(value), "rank": rank, "decoded_token": tokens(top_id)[0]})
        result.append(entries)
    return result


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


# --- token text for logprobs --------------------------------------------------------------------


class _TokenTexts:
    """token id -> (its text, its UTF-8 bytes): the bytes the token adds to the output text, so a
    SentencePiece token keeps its leading space (decoding it alone would strip it) and a token that
    is part of a character keeps its exact bytes (its text alone is a replacement character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes_of = None  # built on first need
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self._bytes_of is None:
            self._bytes_of = token_bytes_lookup(self.tokenizer, keep_special=True)
        raw = self._bytes_of(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)
