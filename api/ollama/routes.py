"""Ollama's API as a protocol: /api/chat, /api/generate, /api/embed (and the older /api/embeddings),
/api/tags, /api/show, /api/ps and /api/version, for the official clients and the tools built on
them (docs/ollama-api.md).

Generation answers stream as NDJSON unless `stream: false` (Ollama's default is to stream); the
last line has `done: true` and the counts. Every error under /api/ is `{"error": "..."}` with its
HTTP status, and a stream that fails once begun ends with such a line. A chat without messages or
a generate without a prompt is Ollama's way to load a model: it is loaded, and the answer says so.
The routes are in the OpenAPI document (`schema.py`).
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cadenza.api.errors import APIError
from cadenza.api.http_streaming import Emit, EventStreamResponse, parse_body, run_choices, until_disconnected
from cadenza.api.ollama import model_info
from cadenza.api.ollama.answers import Answer, Clock, created_at
from cadenza.api.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    KeepAlive,
    ShowRequest,
    keep_alive_seconds,
)
from cadenza.api.ollama.schema import (
    OllamaChatResponse,
    OllamaEmbeddingResponse,
    OllamaEmbedResponse,
    OllamaGenerateResponse,
    OllamaProcesses,
    OllamaShowResponse,
    OllamaStatus,
    OllamaTags,
    OllamaVersion,
    documented,
    ollama_schemas,
    unsupported_route,
)
from cadenza.api.ollama.translate import (
    chat_request,
    check_generate,
    check_model,
    generate_as_chat,
    in_ollama_terms,
    listed_name,
    raw_completion,
)
from cadenza.api.openai.completions import PreparedRun, _check_finish, prepare_chat, prepare_completion, streamed_chunks
from cadenza.api.openai.request_rules import ServedLimits
from cadenza.api.protocols import Protocol
from cadenza.api.state import ServerState, server_state
from cadenza.models.prompts import tokenize_prompt
from cadenza.pooling_params import PoolingParams
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger("cadenza.api")
router = APIRouter()

# The statuses each kind of route answers with (besides 200), in the OpenAPI document.
_GENERATING = (400, 401, 404, 408, 413, 429, 500, 503)
_EMBEDDING = (400, 401, 404, 413, 429, 500, 503)
API_VERSION = "0.9.0"  # the Ollama release whose API this serves (think, tools, structured outputs)
FOREVER = "2318-08-04T00:00:00Z"  # /api/ps' expires_at: the model is never unloaded


class OllamaProtocol(Protocol):
    name = "ollama"
    prefixes = ("/api/",)

    def router(self) -> APIRouter:
        return router

    def error_response(self, error: APIError) -> Response:
        return JSONResponse({"error": in_ollama_terms(error).message_naming_param()}, status_code=error.status)

    def openapi_schemas(self, model_name: str, limits: ServedLimits) -> dict[str, dict[str, Any]]:
        return ollama_schemas(model_name, limits)


def _line(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _failure(error: APIError) -> bytes:
    """How a stream that fails once begun ends: Ollama's error line."""
    return _line({"error": in_ollama_terms(error).message_naming_param()})


def _admit(request: Request, state: ServerState, model: str, keep_alive: KeepAlive | None) -> float | None:
    """The model checked, `keep_alive` recorded (it changes nothing: the model stays loaded); its seconds."""
    check_model(state, model)
    seconds = keep_alive_seconds(keep_alive)
    if seconds is not None and getattr(request.app.state, "ollama_keep_alive", None) != seconds:
        request.app.state.ollama_keep_alive = seconds
        log.info("Ollama keep_alive recorded; the model stays loaded", keep_alive_s=seconds)
    if state.draining:
        raise APIError(503, "draining", "the server is shutting down")
    return seconds


def _loaded(state: ServerState, keep_alive: float | None, fields: dict[str, Any]) -> JSONResponse:
    """The answer to a load (or unload: keep_alive 0) request: the model is loaded, and stays."""
    reason = "unload" if keep_alive == 0 else "load"
    return JSONResponse({"model": listed_name(state.model_name), "created_at": created_at(), **fields,
                         "done": True, "done_reason": reason})


@router.post("/api/chat", **documented(OllamaChatResponse, ChatRequest, streams=True, errors=_GENERATING))
async def chat(request: Request) -> Response:
    clock = Clock()
    state = server_state(request)
    req = await parse_body(request, ChatRequest)
    keep_alive = _admit(request, state, req.model, req.keep_alive)
    if not req.messages:
        return _loaded(state, keep_alive, {"message": {"role": "assistant", "content": ""}})
    run = await prepare_chat(state, chat_request(state, req))
    return await _respond(request, state, run, Answer("chat"), req.stream, clock)


@router.post("/api/generate", **documented(OllamaGenerateResponse, GenerateRequest, streams=True, errors=_GENERATING))
async def generate(request: Request) -> Response:
    clock = Clock()
    state = server_state(request)
    req = await parse_body(request, GenerateRequest)
    keep_alive = _admit(request, state, req.model, req.keep_alive)
    check_generate(req)
    if not req.prompt and not req.system:
        return _loaded(state, keep_alive, {"response": ""})
    if req.raw:
        run = prepare_completion(state, raw_completion(state, req))
    else:
        run = await prepare_chat(state, generate_as_chat(state, req))
    return await _respond(request, state, run, Answer("generate"), req.stream, clock)


async def _respond(request: Request, state: ServerState, run: PreparedRun, answer: Answer, stream: bool,
                   clock: Clock) -> Response:
    clock.mark_prepared()
    model = listed_name(state.model_name)
    request_id = getattr(request.state, "request_id", None)
    if not stream:

        async def collect() -> None:
            async with aclosing(streamed_chunks(state, run)) as chunks:
                async for chunk in chunks:
                    clock.mark_output()
                    answer.feed(chunk)

        disconnected, _ = await until_disconnected(request, collect)
        if disconnected:
            log.info("Client disconnected", request_id=request_id)
            return Response(status_code=499)
        return JSONResponse({"model": model, "created_at": created_at(), **answer.whole(clock)})

    async def produce(emit: Emit) -> None:
        async with aclosing(streamed_chunks(state, run)) as chunks:
            async for chunk in chunks:
                clock.mark_output()
                fields = answer.feed(chunk)
                if fields is not None:
                    await emit(_line({"model": model, "created_at": created_at(), **fields, "done": False}))
        await emit(_line({"model": model, "created_at": created_at(), **answer.final(clock)}))

    return EventStreamResponse(produce, media_type="application/x-ndjson", fail=_failure, request_id=request_id)


# --- embeddings ------------------------------------------------------------------------------------


@router.post("/api/embed", **documented(OllamaEmbedResponse, EmbedRequest, errors=_EMBEDDING))
async def embed(request: Request) -> Response:
    clock = Clock()
    state = server_state(request)
    req = await parse_body(request, EmbedRequest)
    _admit(request, state, req.model, req.keep_alive)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    inputs = [] if inputs == [""] else inputs  # the client's default: load the model
    found = await _embeddings(request, state, inputs, req.truncate, req.dimensions)
    if found is None:
        return Response(status_code=499)
    vectors, tokens = found
    clock.mark_output()
    return JSONResponse({"model": listed_name(state.model_name), "embeddings": vectors,
                         "total_duration": clock.last - clock.arrived, "load_duration": 0, "prompt_eval_count": tokens})


@router.post("/api/embeddings", **documented(OllamaEmbeddingResponse, EmbeddingsRequest, errors=_EMBEDDING))
async def embeddings(request: Request) -> Response:
    """The older route: one prompt, one `embedding`."""
    state = server_state(request)
    req = await parse_body(request, EmbeddingsRequest)
    _admit(request, state, req.model, req.keep_alive)
    found = await _embeddings(request, state, [req.prompt] if req.prompt else [], True, None)
    if found is None:
        return Response(status_code=499)
    return JSONResponse({"embedding": found[0][0] if found[0] else []})


async def _embeddings(request: Request, state: ServerState, inputs: list[str], truncate: bool,
                      dimensions: int | None) -> tuple[list[list[float]], int] | None:
    """Each input's vector (the deployment's pooling, as /v1/embeddings) and the tokens read;
    None when the client left. With `truncate`, an input longer than the context is cut to fit."""
    hidden = state.engine.runtime.loaded.arch.hidden_size
    if dimensions is not None and dimensions > hidden:
        message = f"dimensions: at most {hidden}, the model's hidden size (got {dimensions})"
        raise APIError(400, "invalid_value", message, "dimensions")
    section = state.config.embeddings
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling=section.pooling, normalize=section.normalize,
                                                                dimensions=dimensions))
    prompts = [_truncated(state, text) if truncate else text for text in inputs]
    vectors: list[list[float]] = [[] for _ in prompts]
    tokens = 0

    async def collect() -> None:
        nonlocal tokens
        jobs = [(p, params) for p in prompts]
        async with run_choices(state.engine, jobs, f"embd-{uuid.uuid4().hex}", state.metrics) as items:
            async for index, out in items:
                out = _check_finish(out, "input")
                if out.finished:
                    vectors[index], tokens = list(out.embedding or ()), tokens + out.num_prompt_tokens

    disconnected, _ = await until_disconnected(request, collect)
    return None if disconnected else (vectors, tokens)


def _truncated(state: ServerState, text: str) -> str | list[int]:
    """`text`, or its first tokens when it would not fit the context (Ollama's `truncate`)."""
    limit = state.engine.runtime.max_model_len - 1
    if len(text) + 2 < limit:  # fewer tokens than characters, and a BOS: it fits
        return text
    runtime = state.engine.runtime
    _, ids = tokenize_prompt(text, runtime.tokenizer, runtime.loaded.arch.vocab_size)
    return text if len(ids) <= limit else list(ids[:limit])


# --- the model -------------------------------------------------------------------------------------


@router.get("/api/version", **documented(OllamaVersion, errors=()))
async def version() -> dict[str, str]:
    return {"version": API_VERSION}


def _pooled(request: Request) -> list:
    """Every model the server serves (a deployment's `models`, api/model_pool.py), the default first."""
    pool = getattr(request.app.state, "model_pool", None)
    return list(pool.models.values()) if pool is not None else []


@router.get("/api/tags", **documented(OllamaTags, errors=(401, 503)))
async def tags(request: Request) -> dict[str, Any]:
    state = server_state(request)
    listed = []
    for model in _pooled(request) or [None]:
        if model is None or model.state is not None:
            listed.append(model_info.listing(state if model is None else model.state))
        else:  # not loaded: what its files say
            listed.append(model_info.unloaded_listing(model.name, model.config.model.path))
    return {"models": listed}


@router.get("/api/ps", **documented(OllamaProcesses, errors=(401, 503)))
async def ps(request: Request) -> dict[str, Any]:
    default = server_state(request)
    running = []
    for model in _pooled(request) or [None]:
        state = default if model is None else model.state
        if state is None:
            continue
        listed = model_info.listing(state)
        until = None if model is None else model.idle_until()
        expires = FOREVER if until is None else model_info.wall_clock(until)
        on_gpu = str(getattr(state.engine.runtime.loaded, "device", "cpu")).startswith("cuda")
        running.append({**listed, "expires_at": expires, "size_vram": listed["size"] if on_gpu else 0,
                        "context_length": state.engine.runtime.max_model_len})
    return {"models": running}


@router.post("/api/show", **documented(OllamaShowResponse, ShowRequest))
async def show(request: Request) -> dict[str, Any]:
    state = server_state(request)
    req = await parse_body(request, ShowRequest)
    check_model(state, req.model_name())
    return {
        "modelfile": model_info.modelfile(state), "parameters": model_info.parameters(state),
        "template": state.engine.runtime.tokenizer.chat_template or "", "details": model_info.details(state),
        "model_info": model_info.model_info(state), "capabilities": model_info.capabilities(state),
        "modified_at": model_info.listing(state)["modified_at"],
    }  # fmt: skip


@router.post("/api/pull", **documented(OllamaStatus, ShowRequest))
async def pull(request: Request) -> Response:
    """Pulling the served model succeeds at once (it is here); any other is not found."""
    state = server_state(request)
    body = await parse_body(request, ShowRequest)
    check_model(state, body.model_name())
    return JSONResponse({"status": "success"})


async def _unsupported(request: Request) -> Response:
    """Managing models: one model is served, the one the server started with."""
    raise APIError(501, "not_supported", f"{request.url.path} is not supported: this server serves only the model "
                   "it was started with")


for _path, _method in (("/api/push", "POST"), ("/api/create", "POST"), ("/api/copy", "POST"),
                       ("/api/delete", "DELETE"), ("/api/blobs/{digest}", "HEAD"), ("/api/blobs/{digest}", "POST")):
    _name = f"ollama_{_path.split('/')[2]}_{_method.lower()}"
    router.add_api_route(_path, _unsupported, methods=[_method], status_code=501, operation_id=_name,
                         summary=f"{_method} {_path} (not supported)", **unsupported_route(_path))
