"""Per-request sampling parameters: the one definition of every sampling field and its bounds.

Each field's type below (`Temperature`, `TopP`, ...) carries its bounds, its finiteness and its
description. `SamplingParams` (the Python API) declares its fields with them; `SamplingOverrides`,
the same fields all optional, is what the WebSocket and OpenAI protocols accept; the YAML defaults
(`config.schema.SamplingDefaults`) declare theirs with the same types. So a bound is written once
and no API can accept what another refuses. `describe_errors` turns pydantic's errors into a
message that names each field and its allowed range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo

from cadenza.pooling_params import PoolingParams

_GREEDY_EPSILON = 1e-5
MAX_N = 64  # choices one request may ask for; each is an engine request of its own
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class Bound:
    """An allowed interval of a numeric field: pydantic constraints, and the text errors show."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, ... rather than [low, ...
    integer: bool = False

    def constraints(self) -> dict[str, float]:
        found: dict[str, float] = {}
        if self.low is not None:
            found["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            found["le"] = self.high
        return found

    def text(self) -> str:
        low = "-inf" if self.low is None else _number(self.low)
        high = "inf" if self.high is None else _number(self.high)
        return f"{'(' if self.low is None or self.low_open else '['}{low}, {high}{')' if self.high is None else ']'}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N, integer=True),
    "max_tokens": Bound(1, integer=True),
    "min_tokens": Bound(0, integer=True),
    "temperature": Bound(0),
    "top_p": Bound(0, 1, low_open=True),
    "top_k": Bound(-1, integer=True),
    "min_p": Bound(0, 1),
    "repetition_penalty": Bound(0, low_open=True),
    "presence_penalty": Bound(-2, 2),
    "frequency_penalty": Bound(-2, 2),
    "logit_bias": Bound(-100, 100),  # each value; keys are token ids
    "seed": Bound(SEED_MIN, SEED_MAX, integer=True),
    "stop_token_ids": Bound(0, integer=True),  # each id; the vocabulary's size is checked at the ingress
    "logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS, integer=True),
}


def _int(name: str, description: str) -> Any:
    return Annotated[int, Field(description=description, **BOUNDS[name].constraints())]


def _float(name: str, description: str) -> Any:
    # Finite only: JSON parsers here accept NaN and Infinity, and neither means anything as a
    # temperature or a bias.
    return Annotated[float, Field(description=description, allow_inf_nan=False, **BOUNDS[name].constraints())]


N = _int("n", "Independent completions to generate for the prompt.")
MaxTokens = _int("max_tokens", "Most tokens to generate.")
MinTokens = _int("min_tokens", "Tokens to generate before EOS and stop token ids may end the output.")
Temperature = _float("temperature", "Softmax temperature; 0 is greedy.")
TopP = _float("top_p", "Nucleus sampling mass; 1 is off.")
TopK = _int("top_k", "Keep the k most likely tokens; 0 or -1 is off.")
MinP = _float("min_p", "Drop tokens below min_p times the top probability.")
RepetitionPenalty = _float("repetition_penalty", "Multiplicative penalty on seen tokens (HF style); 1 is off.")
PresencePenalty = _float("presence_penalty", "Additive penalty on tokens already generated.")
FrequencyPenalty = _float("frequency_penalty", "Additive penalty per occurrence of a generated token.")
TokenId = Annotated[int, Field(ge=0)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
LogitBias = Annotated[
    dict[TokenId, _float("logit_bias", "Added to the token's logit.")],
    Field(description="Token id -> bias in [-100, 100] added to its logit."),
]
Seed = _int(
    "seed",
    "Seeds this request's own generator: the same seed gives the same tokens whatever else runs. Any "
    "integer torch takes, negatives too: -1 is a seed like any other (not llama.cpp's 'random'); leave "
    "the field out for an unseeded request.",
)
StopTokenIds = Annotated[list[_int("stop_token_ids", "A token id.")], Field(description="Token ids that end the output.")]
StopStrings = Annotated[
    list[Annotated[str, Field(min_length=1)]],
    BeforeValidator(lambda value: [value] if isinstance(value, str) else value),  # one string is a list of one
    Field(description="Strings that end the output (not included unless include_stop_str_in_output)."),
]
Logprobs = _int("logprobs", "Return the chosen token's log-probability and this many most likely tokens.")
PromptLogprobs = _int(
    "prompt_logprobs",
    "Return each prompt token's log-probability given the tokens before it (the first token has none) and "
    "this many most likely tokens at its position; 0: the prompt token's own only. The prompt is then "
    "computed whole, never taken from the prefix cache.",
)

MAX_GRAMMAR_CHARS = 200_000  # a regex or grammar; a JSON schema is bounded by the request body
MAX_CHOICES = 1024


def _json_text(value: Any) -> Any:
    """A JSON schema may come as JSON text (vLLM's `guided_json` allows it): parse it here."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    return value


_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _one_kind(schema: dict[str, Any]) -> None:
    """The OpenAPI document says what validation checks: exactly one kind, not null."""
    schema["oneOf"] = [
        {"required": [wire], "properties": {wire: {"not": {"type": "null"}}}} for wire in _KINDS
    ]


class StructuredOutputs(BaseModel):
    """What the output must match, enforced token by token by the `structured_output` logits processor.

    Exactly one of `json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` or
    `grammar` (Lark, llguidance's dialect with `%json{...}`, or GBNF). vLLM's `structured_outputs`
    names. The grammar itself is checked when the request is admitted (an invalid schema fails the
    request with `invalid_value`, naming the problem); this model checks only its shape.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra=_one_kind)

    json_schema: Annotated[dict[str, Any] | bool | None, BeforeValidator(_json_text)] = Field(
        None,
        validation_alias=AliasChoices("json", "json_schema"),
        serialization_alias="json",
        description="A JSON schema (an object, or its JSON text) the output must validate against.",
    )
    json_object: Literal[True] | None = Field(None, description="The output is any JSON object (true).")
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="A regular expression the whole output matches.")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES, description="The output is exactly one of these strings."
    )
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
        description="A context-free grammar: Lark (llguidance's dialect, `%json{...}` embeds a schema) or GBNF.",
    )  # fmt: skip
    disable_any_whitespace: bool = Field(
        False, description="JSON without free whitespace between tokens (compact); the default lets the model lay it out."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = self.kinds()
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})")
        return self

    def kinds(self) -> list[str]:
        """The constraint kinds set, by their wire names."""
        values = {"json": self.json_schema, "json_object": self.json_object or None, "regex": self.regex,
                  "choice": self.choice, "grammar": self.grammar}  # fmt: skip
        return [name for name, value in values.items() if value is not None]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> str:
        """The spec as canonical JSON: equal constraints have equal keys (for a compile cache)."""
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True, separators=(",", ":"))


MAX_SPECULATIVE_TOKENS = 16


class SpeculativeParams(BaseModel):
    """One request's speculative decoding, over the deployment's `speculative` section.

    `num_tokens: 0` switches it off for this request; a smaller number caps how many tokens are
    proposed a step. `method` picks another proposer the deployment built (`ngram`, `suffix`, or
    its configured one); a name it did not build fails the request.
    """

    model_config = ConfigDict(extra="forbid")

    method: str | None = Field(None, min_length=1, description="Proposer for this request; null: the deployment's.")
    num_tokens: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS, description="Most tokens proposed a step; 0: no speculation; null: the deployment's."
    )


class SamplingParams(BaseModel):
    """How one request picks its tokens and when it stops.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` switch those filters off.
    Penalties follow OpenAI (presence, frequency: additive) and HF/vLLM (repetition: multiplicative,
    applied to prompt and output tokens). `logprobs=N` returns the chosen token's log-probability
    and the N most likely tokens of the model's raw distribution at each step; `prompt_logprobs=K`
    the same for every prompt token after the first (given the tokens before it, K most likely).
    `extra` carries parameters for sampler plugins, keyed by plugin name.
    Invalid values raise `SamplingParamsError` (a `ValueError`) naming each field and its range.
    """

    model_config = ConfigDict(extra="forbid")

    n: N = 1
    max_tokens: MaxTokens | None = 16
    min_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the output.")
    logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Constrain the output to a JSON schema, a regex, a choice or a grammar."
    )
    speculative: SpeculativeParams | None = Field(
        None, description="Speculative decoding for this request: switch it off, cap it or pick the proposer."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Parameters for sampler plugins, by plugin name.")
    pooling: PoolingParams | None = Field(
        None, description="Embed the prompt instead of generating (prefill only, nothing sampled): how to pool."
    )
    cache_salt: CacheSalt | None = Field(
        None, description="vLLM's cache salt: it enters the prompt's prefix "
        "hash chain, so cached prefixes (in memory and in the KV tiers) are shared only between requests "
        "that give the same salt; a tenant's hits then reveal nothing of another's prompts.",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            # The grammar decides where the output ends: once it is complete only EOS may follow.
            raise ValueError("structured_outputs cannot be combined with ignore_eos or min_tokens")
        return self

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SamplingParamsError(exc.errors(include_url=False)) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class SamplingParamsError(ValueError):
    """Sampling parameters out of their bounds; the message names each field and its range.

    `errors` are pydantic's, so a protocol can name its fields its own way (`describe(rename)`).
    """

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        super().__init__(describe_errors(errors))

    def describe(self, rename: dict[str, str] | None = None) -> str:
        return describe_errors(self.errors, rename)

    def field(self, rename: dict[str, str] | None = None) -> str | None:
        """The first field at fault, as `rename` names it; None for a rule across fields."""
        loc = self.errors[0].get("loc", ()) if self.errors else ()
        return (rename or {}).get(str(loc[0]), str(loc[0])) if loc else None


def _optional(info: FieldInfo) -> tuple[Any, Any]:
    """Field `info`, optional with default None (not set), its bounds and description kept."""
    inner = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return inner | None, Field(None, description=info.description)


# SamplingParams' per-token fields, each optional: a client sets what it wants and the rest comes
# from defaults. (`n`, how many outputs, and `pooling`, embedding instead of generating, are a
# request's shape; each protocol decides on them.)
SamplingOverrides: type[BaseModel] = create_model(
    "SamplingOverrides",
    __config__=ConfigDict(extra="forbid"),
    __doc__="SamplingParams' fields but n and pooling, each optional: None means 'not set here'.",
    **{name: _optional(info) for name, info in SamplingParams.model_fields.items() if name not in ("n", "pooling")},
)


def completion_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded with `seed` (n completions, OpenAI's
    choices): seed + index, wrapped within the range torch accepts, so completions differ yet repeat."""
    if seed is None:
        return None
    return SEED_MIN + (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1)


def merge_sampling(defaults: BaseModel, *overrides: BaseModel | None, **fixed: Any) -> SamplingParams:
    """SamplingParams from a deployment's `defaults` (every value counts, None included), then
    `overrides` (later ones win; their None values are 'not set'), then `fixed` values."""
    merged = {k: v for k, v in defaults.model_dump().items() if k in SamplingParams.model_fields}
    for layer in overrides:
        if layer is not None:
            merged.update(layer.model_dump(exclude_none=True, include=set(SamplingParams.model_fields)))
    merged.update(fixed)
    return SamplingParams(**merged)


# SamplingParams fields that only a sampling plugin can honour, and the built-in that does: a request
# setting one in a deployment that does not run that plugin is refused rather than left unconstrained.
PLUGIN_FIELDS = {"structured_outputs": "structured_output"}

# Protocol fields that carry a sampling field's bounds under another name (OpenAI's chat API).
SYNONYMS = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


def describe_errors(errors: list[dict[str, Any]], rename: dict[str, str] | None = None) -> str:
    """'temperature: must be a finite number in [0, inf) (got inf)'; one clause per problem.

    `rename` maps SamplingParams' field names to the names a protocol uses for them.
    """
    return "; ".join(describe_error(error, rename) for error in errors)


def describe_error(error: dict[str, Any], rename: dict[str, str] | None = None) -> str:
    raw_loc = error.get("loc", ())
    loc = [str(part) for part in raw_loc if part != "[key]"]
    if not loc:  # a rule across fields: its message names them
        return error.get("msg", "invalid").removeprefix("Value error, ")
    name = loc[0]
    shown = ".".join([(rename or {}).get(name, name), *loc[1:]])
    bound, kind = BOUNDS.get(SYNONYMS.get(name, name)), error.get("type", "")
    if kind == "missing":
        return f"{shown}: required"
    if kind == "extra_forbidden":
        message = "unknown field"
    elif "[key]" in raw_loc and name == "logit_bias":
        message = "keys must be token ids (non-negative integers)"
    elif bound is not None and (kind in _RANGE_ERRORS or kind.startswith(("int_", "float_"))):
        message = f"must be {'an integer' if bound.integer else 'a finite number'} in {bound.text()}"
    else:
        message = error.get("msg", "invalid").removeprefix("Value error, ")
    return f"{shown}: {message} (got {_shown_input(error.get('input'))})"


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def _shown_input(value: Any) -> str:
    text = str(value) if isinstance(value, float) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
