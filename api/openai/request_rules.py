"""What a request body must satisfy beyond its fields' own types, as `/openapi.json` states it.

The request models (`openai/protocol.py`, `tokenizer.py`, `openai_ws/responses_protocol.py`) check
these rules; this module writes them into the served document, so that the document is the
contract: a body it allows is refused only for a relation it names.

- Rules a JSON Schema can say (a field that only goes with another's value, content that only an
  assistant message may leave out) join the request's schema under `allOf`: a client generated
  from the document never sends a body the server refuses for them.
- What only the running server knows goes in as bounds at start-up: token ids below the
  vocabulary's size, `dimensions` at most the hidden size, `extra`'s keys among the plugins that
  run here.
- Relations a JSON Schema cannot say (min_tokens at most max_tokens, a prompt that fits the
  context, a grammar that compiles, a tool_choice naming one of the tools) are written into the
  description of each field they concern and listed under the request schema's
  `x-cadenza-relations` as `{"params": [...], "rule": ...}`: `params` are the `error.param`
  values (dotted, `*` for any index or key) a refusal for that relation carries.
- One rule holds for every integer field: an integer is written as a JSON integer (`2`, not
  `2.0`), as OpenAI checks it; JSON Schema counts `2.0` as an integer, so the document's
  description says it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

API_DESCRIPTION = (
    "cadenza's API: OpenAI's (/v1/...), Anthropic's Messages (/v1/messages), Ollama's (/api/...) and "
    "model management (/models/...). Integers are written as JSON integers: 2.0 where an integer "
    "is expected is a 400 naming the field, as OpenAI answers (JSON Schema counts 2.0 as an "
    "integer, so the schemas below cannot say it). A request schema's `x-cadenza-relations` lists "
    "the rules across fields, or against the model and deployment, that a JSON Schema cannot say; "
    "each is also in its fields' descriptions, and a body that breaks one is a 400 naming one of "
    "the rule's `params`: in OpenAI's error shape as `error.param`; Anthropic's "
    "(`{\"type\": \"error\", \"error\": {\"type\", \"message\"}}`) and Ollama's (`{\"error\": \"...\"}`) "
    "have no param, so their messages begin with the field at fault (`messages.0.content: ...`). "
    "The WebSocket APIs (`/v1/sessions`, `/v1/responses` and `/v1/realtime` upgraded) are described "
    "in docs/websocket.md."
)


@dataclass(frozen=True)
class ServedLimits:
    """What the running server knows of its model and deployment, for the document's bounds."""

    vocab_size: int
    hidden_size: int
    plugin_names: tuple[str, ...] | None = None  # what `extra` may name; None: not known here


@dataclass(frozen=True)
class Relation:
    params: tuple[str, ...]
    rule: str


_NULL = {"type": "null"}


def _unset(field: str) -> dict[str, Any]:
    """The body leaves `field` out or null."""
    return {"properties": {field: _NULL}}


def _is(field: str, value: Any) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"const": value}}}


def _not_true(field: str) -> dict[str, Any]:
    return {"properties": {field: {"anyOf": [{"const": False}, _NULL]}}}


# --- rules a JSON Schema can say, by request schema ----------------------------------------------

_SAMPLING_CONDITIONS = [
    # _SamplingFields.check: as OpenAI and vLLM refuse them.
    {"anyOf": [_unset("stream_options"), _is("stream", True)], "description": "stream_options only with stream: true."},
    {"anyOf": [_unset("prompt_logprobs"), _not_true("stream")], "description": "prompt_logprobs only without stream."},
]
CONDITIONS: dict[str, list[dict[str, Any]]] = {
    "CompletionRequest": [
        *_SAMPLING_CONDITIONS,
        {"anyOf": [{"properties": {"max_tokens": {"anyOf": [{"minimum": 1}, _NULL]}}}, _is("echo", True)],
         "description": "max_tokens 0 only with echo: true (the prompt alone)."},
    ],
    "ChatCompletionRequest": [
        *_SAMPLING_CONDITIONS,
        {"anyOf": [_unset("top_logprobs"), _is("logprobs", True)], "description": "top_logprobs only with logprobs: true."},
        {"anyOf": [{"properties": {"tool_choice": {"anyOf": [{"enum": ["none", "auto"]}, _NULL]}}},
                   {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}],
         "description": "tool_choice 'required' or a named function only with tools."},
    ],
    "ResponseCreateRequest": [
        {"anyOf": [{"properties": {"tool_choice": {"anyOf": [{"enum": ["none", "auto"]}, _NULL]}}},
                   {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}],
         "description": "tool_choice 'required' or a named function only with tools."},
    ],
    "TextFormat": [{"anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}}, {"required": ["schema"]}],
                    "description": "schema is required with type json_schema."}],
    # ChatMessage.to_engine: only an assistant turn may leave out its content or carry tool_calls.
    "ChatMessage": [
        {"anyOf": [_is("role", "assistant"),
                   {"required": ["content"], "properties": {"content": {"type": ["string", "array"]},
                                                            "tool_calls": {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]}}}],
         "description": "content is required, and tool_calls not allowed, but in an assistant message."},
    ],
}  # fmt: skip
# Fields a validator requires though the model gives them a default.
REQUIRED = {"ResponseCreateRequest": ["input"]}

# Fields whose schema states what a check in code allows.
FIELD_SCHEMAS: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionRequest": {
        "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, _NULL], "description": "Not supported: empty or null only."},
    },
    "ChatCompletionRequest": {
        "functions": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL], "description": "Not supported (use tools): empty or null only."},
        "function_call": {"anyOf": [{"enum": ["none", "auto"]}, _NULL], "description": "Not supported (use tools): none, auto or null only."},
        "modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}, "maxItems": 1}, _NULL], "description": "Text only."},
    },
    "ResponseCreateRequest": {
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"anyOf": [
                      {"$ref": f"#/components/schemas/{item}"}
                      for item in ("InputMessage", "FunctionCallItem", "FunctionCallOutputItem", "ReasoningItem")]}}],
                  "description": "The new input: text, or items (a whole conversation, or what follows previous_response_id)."},
        "background": {"anyOf": [{"const": False}, _NULL], "description": "Background responses are not supported: false or null only."},
        "conversation": {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "object", "maxProperties": 0}, _NULL],
                         "description": "Not supported (use previous_response_id): empty or null only."},
        "prompt": {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL], "description": "Prompt templates are not supported: empty or null only."},
        "context_management": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL], "description": "Not supported: empty or null only."},
    },
    "FunctionTool": {
        "type": {"const": "function", "description": "Function tools only: cadenza runs no hosted tools (web_search, file_search, ...)."},
    },
}  # fmt: skip

# --- relations a JSON Schema cannot say ------------------------------------------------------------

_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_SAMPLING_RELATIONS = [
    Relation(("min_tokens",), "min_tokens must not exceed max_tokens (the request's, else the default)."),
    Relation(("min_tokens", "ignore_eos"), "An output constraint (response_format, guided_*, structured_outputs, a forced "
             "tool call) goes with neither min_tokens nor ignore_eos: the grammar decides where the output ends."),
    Relation(("extra", "extra.*"), "extra's keys name the deployment's sampler and logits-processor plugins; each value "
             "(true, false, null or an object) must be what that plugin's parameters allow; a plugin asked for through a request "
             "field (structured_output: structured_outputs) takes only false or null here."),
    Relation(("speculative.method",), "speculative.method names a proposer this deployment built."),
    Relation(("structured_outputs", "structured_outputs.*"), "The constraint must compile (llguidance): a JSON schema it "
             "supports, a regular expression or grammar it parses, that something can satisfy."),
]  # fmt: skip
_OPENAI_RELATIONS = [
    *_SAMPLING_RELATIONS,
    Relation(_STRUCTURED, "At most one of response_format, guided_json, guided_regex, guided_choice, guided_grammar and "
             "structured_outputs."),
    Relation(("response_format.json_schema.schema", "guided_json", "guided_regex", "guided_grammar"),
             "The schema, regular expression or grammar must compile (llguidance); guided_json may be the schema's JSON text."),
]  # fmt: skip
_FITS = "must leave room to generate within the model's context (max_model_len, in /v1/models) and server.max_prompt_tokens"
RELATIONS: dict[str, list[Relation]] = {
    "CompletionRequest": [
        *_OPENAI_RELATIONS,
        Relation(("prompt",), f"Each prompt, tokenized, {_FITS}."),
        Relation(("best_of",), "best_of must equal n: cadenza returns every choice it generates."),
    ],
    "ChatCompletionRequest": [
        *_OPENAI_RELATIONS,
        Relation(("messages",), f"The conversation, rendered by the chat template, {_FITS}; the template may refuse it "
                 "(roles out of the order it allows)."),
        Relation(("tools",), "Tool function names are unique."),
        Relation(("tool_choice",), "A named tool_choice names one of the tools; a forced call (required or named) does not "
                 "go with response_format, guided_* or structured_outputs."),
        Relation(("tools.*.function.parameters",), "Each tool's parameters must compile as a JSON schema (llguidance), "
                 "whatever tool_choice says."),
        Relation(("continue_final_message",), "continue_final_message needs add_generation_prompt false and a last "
                 "message from the assistant."),
    ],
    "EmbeddingRequest": [Relation(("input",), "Each input, tokenized, must fit the model's context (max_model_len).")],
    "TokenizeRequest": [Relation(("messages",), "The chat template may refuse the conversation.")],
    "ApplyTemplateRequest": [Relation(("messages",), "The chat template may refuse the conversation.")],
    "ResponseCreateRequest": [
        *[Relation(tuple(f"sampling.{p}" for p in r.params), r.rule) for r in _SAMPLING_RELATIONS],
        Relation(("input",), f"The conversation (the stored one before it included), rendered by the chat template, {_FITS}, "
                 "unless truncation lets it drop old turns; the template may refuse it (roles out of the order it allows)."),
        Relation(("tools",), "Tool names are unique."),
        Relation(("tool_choice",), "A named tool_choice names one of the tools; a forced call (required or named) does not "
                 "go with sampling.structured_outputs (text.format applies to the turns that write text)."),
        Relation(("tools.*.parameters",), "Each tool's parameters must compile as a JSON schema (llguidance), "
                 "whatever tool_choice says."),
        Relation(("text.format", "text.format.schema"), "The json_schema format's schema must compile (llguidance); "
                 "at most one of text.format and sampling.structured_outputs."),
    ],
}  # fmt: skip


def document_rules(schemas: dict[str, dict[str, Any]], limits: ServedLimits) -> None:
    """Write the rules into the request models' component schemas, in place."""
    write_rules(schemas, CONDITIONS, FIELD_SCHEMAS, RELATIONS, REQUIRED)
    if "ResponseFormat" in schemas:
        schemas["ResponseFormat"]["anyOf"] = [
            {"properties": {"type": {"enum": ["text", "json_object"]}}},
            {"required": ["json_schema"], "properties": {"json_schema": {"required": ["schema"], "properties": {"schema": {"type": "object"}}}}},
        ]  # fmt: skip
        schemas["ResponseFormat"]["description"] = "json_schema (with its schema) is required with type json_schema."
    for schema in schemas.values():
        bound_fields(schema, limits)


def write_rules(schemas: dict[str, dict[str, Any]], conditions: dict[str, list[dict[str, Any]]],
                field_schemas: dict[str, dict[str, dict[str, Any]]], relations: dict[str, list[Relation]],
                required: dict[str, list[str]] | None = None) -> None:
    """Write rule tables (this module's, or another protocol's in its own terms) into the component
    schemas they name, in place: `conditions` under `allOf`, `field_schemas` over the fields'
    own, `relations` under `x-cadenza-relations` and into their fields' descriptions."""
    for name, more in conditions.items():
        if name in schemas:
            schemas[name].setdefault("allOf", []).extend(more)
    for name, fields in (required or {}).items():
        if name in schemas:
            schemas[name]["required"] = sorted({*schemas[name].get("required", ()), *fields})
    for name, fields in field_schemas.items():
        for field, schema in fields.items():
            if name in schemas:
                is_required = field in schemas[name].get("required", ())
                schemas[name]["properties"][field] = schema if is_required else {**schema, "default": None}
    for name, listed in relations.items():
        schema = schemas.get(name)
        if schema is None:
            continue
        schema["x-cadenza-relations"] = [{"params": list(r.params), "rule": r.rule} for r in listed]
        for relation in listed:
            for param in relation.params:
                field = schema["properties"].get(param.partition(".")[0])
                if field is not None and relation.rule not in field.get("description", ""):
                    field["description"] = f"{field.get('description', '')} {relation.rule}".strip()


# One stop string is a list of one (`sampling_params.StopStrings`); the model's schema shows the list only.
_STOP = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}}, _NULL]}


def bound_fields(schema: dict[str, Any], limits: ServedLimits) -> None:
    """The served model's bounds on the fields that name tokens, vectors and plugins."""
    properties = schema.get("properties", {})
    if "stop" in properties:
        properties["stop"] = {**_STOP, "default": None, "description": properties["stop"].get("description", "")}
    top = limits.vocab_size - 1
    for field in ("prompt", "input", "tokens", "stop_token_ids"):
        if field in properties:
            _bound_token_ids(properties[field], top)
    if "logit_bias" in properties:
        _each_object(properties["logit_bias"], lambda s: s.update(propertyNames={"pattern": f"^(?:{integers_below(limits.vocab_size)})$"}))
    if "dimensions" in properties:
        _each_of_type(properties["dimensions"], "integer", lambda s: s.update(maximum=limits.hidden_size))
    if "extra" in properties and limits.plugin_names is not None:
        names = sorted(limits.plugin_names)
        _each_object(properties["extra"], lambda s: s.update(propertyNames={"enum": names} if names else {"maxLength": 0}))


def _bound_token_ids(schema: Any, top: int) -> None:
    """Every `{"type": "integer", "minimum": 0}` inside `schema` (a token id) gets `maximum: top`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = top
        for value in schema.values():
            _bound_token_ids(value, top)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, top)


def _each_of_type(schema: dict[str, Any], kind: str, update) -> None:
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == kind:
            update(option)


def _each_object(schema: dict[str, Any], update) -> None:
    _each_of_type(schema, "object", update)


def integers_below(n: int) -> str:
    """A regular expression (without anchors) for the decimal integers 0 .. n-1, no leading zeros
    (the document's way to bound a token id written as an object key)."""
    top = str(n - 1)
    width = len(top)
    options = ["[0-9]" if width > 1 else f"[0-{top}]"]
    options += [f"[1-9][0-9]{{{k - 1}}}" if k > 2 else "[1-9][0-9]" for k in range(2, width)]
    if width > 1:  # as many digits as the top: below it at the first digit that differs
        for i, digit in enumerate(top):
            low = 1 if i == 0 else 0
            if int(digit) > low:
                rest = width - i - 1
                tail = f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]" if rest else ""
                below = f"[{low}-{int(digit) - 1}]" if int(digit) - 1 > low else str(low)
                options.append(f"{top[:i]}{below}{tail}")
        options.append(top)
    return "|".join(options)
