"""OpenAI-compatible /v1/embeddings: the served decoder's pooled last hidden states.

Each input is an engine request of its own (prefill only, nothing sampled), all run at once and
batched with generation by the same scheduler. Pooling and normalization are the deployment's
(`embeddings` config section); `dimensions` truncates. A client that disconnects aborts every
input still running.
"""

from __future__ import annotations

import base64
import struct
import uuid

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cadenza.api.errors import APIError, error_responses
from cadenza.api.http_streaming import parse_body, run_choices, until_disconnected
from cadenza.api.openai.completions import _check_finish
from cadenza.api.openai.protocol import EmbeddingRequest
from cadenza.api.openai.schema import EmbeddingResponse, openapi_request_body
from cadenza.api.state import server_state
from cadenza.engine.streams import GenerationOutput
from cadenza.pooling_params import PoolingParams
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger("cadenza.api")
router = APIRouter()


@router.post(
    "/v1/embeddings",
    openapi_extra={"requestBody": openapi_request_body(EmbeddingRequest)},
    responses={200: {"model": EmbeddingResponse}, **error_responses(400, 401, 404, 413, 429, 500, 503)},
)
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, EmbeddingRequest)
    if req.model != state.model_name:
        message = f"the model {req.model!r} does not exist; this server serves {state.model_name!r}"
        raise APIError(404, "model_not_found", message, "model")
    req.check(state.engine.runtime.loaded.arch.hidden_size)
    if state.draining:
        raise APIError(503, "draining", "the server is shutting down")
    section = state.config.embeddings
    pooling = PoolingParams(pooling=section.pooling, normalize=section.normalize, dimensions=req.dimensions)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    inputs = req.inputs()
    outputs: list[GenerationOutput | None] = [None] * len(inputs)
    rid = f"embd-{uuid.uuid4().hex}"

    async def collect() -> None:
        async with run_choices(state.engine, [(p, params) for p in inputs], rid, state.metrics) as items:
            async for index, out in items:
                out = _check_finish(out, "input")
                if out.finished:
                    outputs[index] = out

    disconnected, _ = await until_disconnected(request, collect)
    if disconnected:
        log.info("Client disconnected", request_id=getattr(request.state, "request_id", None), embedding_id=rid)
        return Response(status_code=499)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(out.embedding, req.encoding_format)}
        for i, out in enumerate(outputs)
    ]
    tokens = sum(out.num_prompt_tokens for out in outputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": usage})


def _encode(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what OpenAI's SDKs decode: float32, little-endian
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)
