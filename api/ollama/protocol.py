"""Ollama's request shapes: /api/chat, /api/generate, /api/embed, /api/embeddings, /api/show.

Ollama's server ignores fields it does not know, and its clients send the fields of newer versions
than the one they talk to: unknown fields are ignored here too, at every level. Known fields are
typed strictly (a string where a number belongs is a 400 naming the field). Options carry the
bounds of cadenza's sampling parameters (`cadenza.sampling_params`), so `options.temperature: -1`
is a 400 naming it; the options Ollama defines that mean nothing here (num_gpu, mirostat, ...) and
those nobody defines are kept aside (`Options.ignored`), for the routes to log once each.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator

from cadenza.api.durations import duration_seconds
from cadenza.api.errors import APIError
from cadenza.api.openai.protocol import FunctionName
from cadenza.sampling_params import (
    FrequencyPenalty,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(BaseModel):
    """The options cadenza maps (docs/ollama-api.md); any other is kept in `model_extra`."""

    model_config = ConfigDict(extra="allow")

    num_ctx: int | None = Field(None, ge=1, description="The context window; above max_model_len it is capped.")
    num_predict: int | None = Field(None, ge=-2, json_schema_extra={"not": {"const": 0}},
                                    description="Most tokens to generate; -1 or -2: until the end; not 0.")
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: list[Annotated[str, Field(min_length=1)]] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None

    @field_validator("num_predict")
    @classmethod
    def _generates_something(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("0 generates nothing; give a positive number, or -1 for until the end")
        return value

    def ignored(self) -> list[str]:
        """The options given that cadenza does not map."""
        return sorted(self.model_extra or ())


class ToolCallFunction(_Lenient):
    name: FunctionName
    arguments: dict[str, Any] = Field(default_factory=dict, description="The arguments, as an object.")


class ToolCall(_Lenient):
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = Field(None, description="An assistant turn's reasoning.")
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = Field(None, description="A tool turn's: the function whose result it is.")


class ToolFunction(_Lenient):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: ToolFunction


def _format(value: Any) -> Any:
    if value in ("", "json") or isinstance(value, dict):
        return value
    raise ValueError('must be "json" or a JSON schema (an object)')


def _think(value: Any) -> Any:
    if isinstance(value, bool) or value in ("low", "medium", "high"):
        return value
    raise ValueError('must be true, false, or a level: "low", "medium" or "high"')


def _keep_alive(value: Any) -> Any:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return value
    raise ValueError('must be a duration: seconds, or text such as "5m" (negative: forever)')


# One message each for what a union of types would answer with one per member; the document
# states what each validator (and `keep_alive_seconds`) accepts.
_DURATION = r"^[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|ms|s|m|h))+$|^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$"
Format = Annotated[str | dict[str, Any], PlainValidator(_format),
                   WithJsonSchema({"anyOf": [{"enum": ["", "json"]}, {"type": "object"}]})]
Think = Annotated[bool | str, PlainValidator(_think),
                  WithJsonSchema({"anyOf": [{"type": "boolean"}, {"enum": ["low", "medium", "high"]}]})]
KeepAlive = Annotated[float | str, PlainValidator(_keep_alive),
                      WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "string", "pattern": _DURATION}],
                                      "description": 'Seconds, or a duration such as "5m" or "1h30m"; negative: '
                                                     "forever."})]


class _Generating(_Lenient):
    """What chat and generate share."""

    model: str = Field(min_length=1)
    stream: bool = Field(True, description="NDJSON chunks (Ollama's default), or one object with false.")
    format: Format | None = Field(None, description='"json", or a JSON schema the output follows.')
    options: Options | None = None
    think: Think | None = Field(None, description="true/false: the template's enable_thinking; a level: gpt-oss's.")
    keep_alive: KeepAlive | None = Field(None, description="Accepted; the model stays loaded whatever it says.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list, description="None: load the model (it is loaded).")
    tools: list[Tool] | None = Field(None, max_length=128)


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = Field(True, description="Cut inputs longer than the context (else a 400).")
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class EmbeddingsRequest(_Lenient):
    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class ShowRequest(_Lenient):
    model: str | None = None
    name: str | None = Field(None, description="The older clients' name for `model`.")
    verbose: bool = False

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise APIError(400, "invalid_request", "model is required", "model")
        return name


def keep_alive_seconds(value: KeepAlive | None) -> float | None:
    """`keep_alive` in seconds (negative: forever), None when not given; a 400 when it is no
    duration. Ollama unloads a model after it; cadenza's model stays loaded, so this is recorded."""
    if value is None:
        return None
    seconds = duration_seconds(value)
    if seconds is None:
        raise APIError(400, "invalid_request", f"keep_alive: {value!r} is no duration (e.g. \"5m\", \"1h\", -1)",
                       "keep_alive")
    return seconds
