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
"""

from __future__ import annotations

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
