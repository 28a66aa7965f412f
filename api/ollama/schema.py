"""Ollama's API in the OpenAPI document: its request models (components named `Ollama*`, the
served model's name with and without `:latest` as `model`'s values), the rules beyond their types
(`request_rules.write_rules`), its answers and NDJSON streams, and errors in Ollama's shape.

Ollama's error body is `{"error": "..."}`: a refusal's message begins with the field at fault
(`options.num_predict: ...`), and a relation's `params` are what that prefix may be.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from cadenza.api.errors import error_responses
from cadenza.api.ollama.protocol import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest
from cadenza.api.ollama.translate import listed_name
from cadenza.api.openai.request_rules import Relation, ServedLimits, write_rules
from cadenza.api.openai.schema import openapi_request_body, prefixed_schemas

PREFIX = "Ollama"
REQUEST_MODELS = (ChatRequest, GenerateRequest, EmbedRequest, EmbeddingsRequest, ShowRequest)

_NULL = {"type": "null"}
_NONE = "Not supported: empty or null only."
_EMPTY_TEXT = {"anyOf": [{"type": "string", "maxLength": 0}, _NULL]}
_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
_FITS = "must leave room to generate within the model's context (max_model_len, in /api/ps)"
_GENERATING = [
    Relation(("format",), "A format schema must compile (llguidance): a JSON schema it supports, that something can "
             "satisfy."),
    Relation(("think",), "think true or a level only where the model reasons (/api/show's capabilities list "
             "thinking)."),
]  # fmt: skip
_RELATIONS = {
    "ChatRequest": [
        *_GENERATING,
        Relation(("messages",), f"The conversation, rendered by the chat template, {_FITS}; the template may refuse it "
                 "(roles out of the order it allows)."),
        Relation(("tools",), "Tool function names are unique."),
        Relation(("tools.*.function.parameters",), "Each tool's parameters must compile as a JSON schema "
                 "(llguidance)."),
    ],
    "GenerateRequest": [
        *_GENERATING,
        Relation(("prompt", "system"), f"The prompt (with system, rendered by the chat template unless raw) {_FITS}."),
    ],
    "EmbedRequest": [Relation(("input",), "With truncate false, each input, tokenized, must fit the model's context.")],
}  # fmt: skip
_NOT_TRUE = {"anyOf": [{"const": False}, _NULL]}
_CONDITIONS = {
    "Message": [{"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                           {"properties": {"tool_calls": _EMPTY_LIST}}],
                 "description": "tool_calls only in an assistant message."}],
    "GenerateRequest": [{"anyOf": [{"properties": {"raw": {"const": False}}}, {"properties": {"logprobs": _NOT_TRUE}}],
                         "description": "logprobs not with raw: true."}],
}  # fmt: skip
_FIELD_SCHEMAS = {
    "Message": {"images": {**_EMPTY_LIST, "description": f"Images: the served models read text. {_NONE}"}},
    "GenerateRequest": {
        "suffix": {**_EMPTY_TEXT, "description": f"Fill-in-the-middle. {_NONE}"},
        "template": {**_EMPTY_TEXT, "description": f"Go templates: the model's own template applies (or raw). {_NONE}"},
        "context": {**_EMPTY_LIST, "description": f"Answers carry none: send the conversation to /api/chat. {_NONE}"},
        "images": {**_EMPTY_LIST, "description": f"Images: the served models read text. {_NONE}"},
    },
}  # fmt: skip


def ollama_schemas(model_name: str, limits: ServedLimits) -> dict[str, dict[str, Any]]:
    """The request models as components, with the served model's names and the rules written in."""
    schemas = prefixed_schemas(REQUEST_MODELS, PREFIX)
    names = sorted({model_name, listed_name(model_name)})
    for model in REQUEST_MODELS[:-1]:
        schemas[PREFIX + model.__name__]["properties"]["model"]["enum"] = names
    show = schemas[PREFIX + "ShowRequest"]
    for field in ("model", "name"):
        show["properties"][field]["anyOf"] = [{"enum": names}, _NULL]
    show["anyOf"] = [{"required": [field], "properties": {field: {"enum": names}}} for field in ("model", "name")]
    show["description"] = "The model, by model or (older clients) name."

    def named(table: dict[str, Any]) -> dict[str, Any]:
        return {PREFIX + name: value for name, value in table.items()}

    write_rules(schemas, named(_CONDITIONS), named(_FIELD_SCHEMAS), named(_RELATIONS))
    dimensions = schemas[PREFIX + "EmbedRequest"]["properties"]["dimensions"]["anyOf"][0]
    dimensions["maximum"] = limits.hidden_size
    return schemas


# --- answers --------------------------------------------------------------------------------------


class OllamaError(BaseModel):
    """Ollama's error shape: the body of every error under /api/ (and a failed stream's last line)."""

    error: str = Field(description="What went wrong; a refusal of a field begins with it (`options.top_p: ...`).")


class OllamaFunctionCall(BaseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCallOut(BaseModel):
    function: OllamaFunctionCall


class OllamaAnswerMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class _Done(BaseModel):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = Field(None, description="stop, length; load or unload for a request that only loads.")
    total_duration: int | None = Field(None, description="Nanoseconds, as every duration.")
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[dict[str, Any]] | None = None


class OllamaChatResponse(_Done):
    """A whole answer, or one line of a stream (the last with done: true and the counts)."""

    message: OllamaAnswerMessage


class OllamaGenerateResponse(_Done):
    """A whole answer, or one line of a stream (the last with done: true and the counts)."""

    response: str
    thinking: str | None = None


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingResponse(BaseModel):
    embedding: list[float]


class OllamaModelDetails(BaseModel):
    format: str
    parent_model: str | None = None
    family: str | None = None
    families: list[str] | None = None
    parameter_size: str | None = None
    quantization_level: str | None = None


class OllamaListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTags(BaseModel):
    models: list[OllamaListedModel]


class OllamaRunningModel(OllamaListedModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcesses(BaseModel):
    models: list[OllamaRunningModel]


class OllamaShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(BaseModel):
    version: str


class OllamaStatus(BaseModel):
    status: str


_MEANING = {400: "The request is invalid; the message begins with the field at fault.",
            404: "No such model: the message names the served one.",
            501: "Not supported: this server manages no models."}  # fmt: skip


def documented(response_model: type[BaseModel], request_model: type[BaseModel] | None = None, *,
               streams: bool = False, errors: tuple[int, ...] = (400, 401, 404, 413, 503)) -> dict[str, Any]:
    """A route's OpenAPI description: its body, its answer (NDJSON lines too where it streams), its
    errors in Ollama's shape."""
    answer: dict[str, Any] = {"model": response_model}
    if streams:
        line = {"anyOf": [{"$ref": f"#/components/schemas/{response_model.__name__}"},
                          {"$ref": "#/components/schemas/OllamaError"}]}  # fmt: skip
        answer["content"] = {"application/x-ndjson": {"itemSchema": line}}
    failures = error_responses(*errors, model=OllamaError, meaning=_MEANING)
    described: dict[str, Any] = {"responses": {200: answer, **failures}}
    if request_model is not None:
        described["openapi_extra"] = {"requestBody": openapi_request_body(request_model, PREFIX)}
    return described


def unsupported_route(path: str) -> dict[str, Any]:
    """A model-management route's OpenAPI description: a 501, whatever is sent."""
    described: dict[str, Any] = {"responses": error_responses(501, model=OllamaError, meaning=_MEANING)}
    if "{digest}" in path:
        parameter = {"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}}
        described["openapi_extra"] = {"parameters": [parameter]}
    return described
