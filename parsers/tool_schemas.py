"""A forced tool call's arguments schema: the tool's `parameters`, closed to its declared keys.

JSON Schema lets an object carry keys it does not declare unless `additionalProperties` says
otherwise. llguidance writes declared keys once each, in their declared order, but an undeclared
key may come again and again (a small model wrote `"description"` three times). A grammar cannot
keep an open set of keys unique, and llguidance has no option for it, so the forcing grammar closes
each object to the keys it declares: an object schema that lists `properties` and says nothing of
other keys (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`) gets
`additionalProperties: false`. A schema that allows other keys explicitly keeps them (and may
repeat them). Objects whose keys other subschemas may add to are left as written: an object
beside `allOf`/`anyOf`/`oneOf`/`$ref`/`if`, the alternatives of an `anyOf`/`oneOf` that stands
beside other keywords about the object, anything under `allOf`, `not`, `if/then/else` or in
`$defs`, and an object whose `required` names a key it does not declare. Only forced calls are
closed; `response_format`, `guided_json` and `structured_outputs` follow their schema as written.

A forcing grammar places the arguments schema inside a call's own schema (beside the function's
name), so the schema's local references (`#/$defs/Address`, `#` for a recursive one) would point at
the wrong root: `embedded` rewrites them to the place the schema is put (`#/properties/arguments/
$defs/Address`). A pydantic model with a nested model is written that way, so every forced call of
one depends on it.
"""

from __future__ import annotations

import json
from typing import Any

# The schema of a tool that declares no parameters: a call takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords beside `properties` through which other keys may be declared.
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")
# What may stand beside anyOf/oneOf for its alternatives to be closed each on its own.
_ALTERNATIVES_ONLY = {"anyOf", "oneOf", "type", "title", "description", "default", "examples", "$comment", "deprecated"}


def closed_arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a forced call's arguments follow: `parameters` (a copy) with each plain object
    closed to its declared keys (the module's docstring says which)."""
    return _close(parameters or NO_PARAMETERS, closing=True)


# The whitespace a forced call may write between JSON tokens: none, one blank, or a line break or
# two and an indent of up to 20 (llama.cpp's JSON grammars bound it alike). Unbounded, a small or
# unsure model pads its call with blanks until max_tokens ends it.
FORCED_WHITESPACE = r"(?:[ \t]|\r?\n{1,2}[ \t]{0,20})?"


def json_rule(schema: dict[str, Any]) -> str:
    """The Lark rule (llguidance's `%json`) a forcing grammar writes `schema` with, its whitespace
    bounded (`FORCED_WHITESPACE`)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": FORCED_WHITESPACE}},
                                 ensure_ascii=False)


# Keywords whose values are data, not schemas: a `$ref` key inside them is not a reference.
_DATA_KEYS = ("const", "enum", "default", "examples")


def embedded(schema: Any, pointer: str) -> Any:
    """`schema` (a copy) as it reads when placed at JSON pointer `pointer` (`/properties/arguments`)
    of another document: each local `$ref` (`#`, `#/...`) is prefixed with `pointer`."""
    if isinstance(schema, list):
        return [embedded(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYS:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            # Names of properties or definitions, each mapping to a schema: a key named `$ref` here is
            # a name, not a reference.
            out[key] = {k: embedded(v, pointer) for k, v in value.items()} if isinstance(value, dict) else value
        else:
            out[key] = embedded(value, pointer)
    return out


def has_local_refs(schema: Any) -> bool:
    """Whether `schema` holds a local `$ref` anywhere (so that it cannot be cut out of its root)."""
    return embedded(schema, "/x") != schema


def resolved(root: Any, spec: Any, depth: int = 8) -> Any:
    """`spec` (a schema inside `root`), or, when it is only a local `$ref`, what that points at
    (followed through up to `depth` references; a pointer that leads nowhere gives `spec`)."""
    while depth and isinstance(spec, dict) and isinstance(spec.get("$ref"), str) and spec["$ref"].startswith("#"):
        node = root
        for token in spec["$ref"][1:].split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return spec
        spec, depth = node, depth - 1
    return spec


def pointer_token(name: str) -> str:
    """`name` as one token of a JSON pointer (RFC 6901: `~` as `~0`, `/` as `~1`)."""
    return name.replace("~", "~0").replace("/", "~1")


def _close(node: Any, closing: bool) -> Any:
    if isinstance(node, list):
        return [_close(item, closing) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            # Definitions may be referenced from under allOf, dependent schemas add to an object.
            keep = closing and key in ("properties", "patternProperties")
            out[key] = {k: _close(v, keep) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("anyOf", "oneOf"):
            # Whole alternatives only when nothing beside them speaks of the same object's keys.
            out[key] = _close(value, closing and set(node) <= _ALTERNATIVES_ONLY)
        elif key in ("items", "prefixItems", "additionalProperties", "additionalItems", "contains"):
            out[key] = _close(value, closing)
        elif key in ("allOf", "not", "if", "then", "else"):
            out[key] = _close(value, False)  # their objects combine with others: never closed
        else:
            out[key] = value
    properties = node.get("properties")
    if (
        closing
        and isinstance(properties, dict)
        and not any(k in node for k in (*_OPEN_KEYS, *_COMBINED))
        and set(node.get("required") or ()) <= set(properties)
    ):
        out["additionalProperties"] = False
    return out
