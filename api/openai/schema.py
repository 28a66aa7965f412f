"""The OpenAI routes in the OpenAPI document: their request models (which the routes parse
themselves, so FastAPI cannot see them) and the response shapes, which exist for the document only."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from cadenza.api.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from cadenza.api.openai.request_rules import ServedLimits, document_rules

_REF = "#/components/schemas/{model}"
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest)


def openapi_request_body(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """A route's `requestBody` (through `openapi_extra`): `model` as JSON, required; `prefix`: the
    one its protocol's components are named with (`prefixed_schemas`)."""
    ref = _REF.format(model=prefix + model.__name__)
    return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}


class _OpenAPIJsonSchema(GenerateJsonSchema):
    """Pydantic's JSON Schema, saying also that an int-keyed object's keys are decimal integers
    (logit_bias' token ids)."""

    def dict_schema(self, schema):
        json_schema = super().dict_schema(schema)
        keys = schema.get("keys_schema", {})
        if keys.get("type") == "int" and "propertyNames" not in json_schema:
            json_schema["propertyNames"] = {"pattern": "^[0-9]+$" if keys.get("ge") == 0 else "^-?[0-9]+$"}
        return json_schema


def openapi_schemas(model_name: str, limits: ServedLimits,
                    optional_model: tuple[type[BaseModel], ...] = ()) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The request models and every model they use, as OpenAPI components (what `$ref`s point to);
    `model` is the one model this server serves (any other is a 404); `optional_model`: the other
    routes' request models, whose `model` may also be null (the tokenizer's, the Responses API's).
    The rules beyond the fields' types, and the served model's bounds, are written in
    (`request_rules.py`)."""
    pairs = [(m, "validation") for m in (*REQUEST_MODELS, *optional_model)]
    _, document = models_json_schema(pairs, ref_template=_REF, schema_generator=_OpenAPIJsonSchema)
    schemas = document["$defs"]
    for model in REQUEST_MODELS:
        schemas[model.__name__]["properties"]["model"]["enum"] = [model_name]
    for model in optional_model:  # the served name or null
        schemas[model.__name__]["properties"]["model"]["anyOf"] = [{"enum": [model_name]}, {"type": "null"}]
    document_rules(schemas, limits)
    return schemas


def prefixed_schemas(models: tuple[type[BaseModel], ...], prefix: str) -> dict[str, dict[str, Any]]:
    """Another protocol's request models and every model they use, as components named
    `prefix + name`, so that its `Message` or `Tool` is not OpenAI's."""
    pairs = [(m, "validation") for m in models]
    template = _REF.replace("{model}", prefix + "{model}")
    _, document = models_json_schema(pairs, ref_template=template, schema_generator=_OpenAPIJsonSchema)
    return {prefix + name: schema for name, schema in document["$defs"].items()}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


_FinishReason = Literal["stop", "length"]
_ChatFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """Per token; with echo the prompt's tokens come first, the first of them with null (it has no
    logprob: nothing comes before it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = Field(description="The token's 1-based rank in the model's distribution at that position.")
    decoded_token: str


_PROMPT_LOGPROBS = (
    "vLLM's prompt_logprobs, when the request asked: per prompt token, null for the first, else the "
    "prompt token and the prompt_logprobs most likely tokens at its position, by token id."
)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: _FinishReason
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description=_PROMPT_LOGPROBS)


class CompletionResponse(BaseModel):
    """A whole /v1/completions answer (a streamed one is `text_completion` chunks, then `[DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="The text; null when the answer is tool calls alone.")
    refusal: None
    reasoning_content: str | None = Field(None, description="The model's reasoning before its answer (vLLM's field), "
                                                              "split out by the server's reasoning parser; absent without one.")
    tool_calls: list[ToolCall] | None = Field(None, description="Calls of the request's tools, parsed from the model's format.")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: _ChatFinishReason


class ChatCompletionResponse(BaseModel):
    """A whole /v1/chat/completions answer (a streamed one is `chat.completion.chunk`s, then `[DONE]`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description=_PROMPT_LOGPROBS)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="Its context length; while it is loaded.")
    status: Literal["unloaded", "loading", "loaded", "unloading"] = Field(
        description="Whether it is loaded (docs/multi-model.md): a server may serve several models.")
    pinned: bool = Field(description="Never unloaded.")
    in_flight: int = Field(description="Requests running on it now.")
    memory_bytes: int = Field(description="Its weights and KV cache while loaded; 0 otherwise.")
    error: str | None = Field(None, description="Why its last load failed, where it did.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int = Field(description="The input's position in the request.")
    embedding: list[float] | str = Field(description="The vector: numbers, or base64 of float32 little-endian bytes.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
