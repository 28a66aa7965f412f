"""schemathesis hooks for tests/test_api_contract.py, loaded by the `schemathesis run` it starts
(`SCHEMATHESIS_HOOKS=contract_hooks`): in that process only, so the other fuzz tests' checks stay
schemathesis' own.

- `before_call`: integral floats become JSON integers (the document's global rule, stated in its
  description: JSON Schema counts 2.0 as an integer, cadenza refuses it as OpenAI does).
- `documented_refusal`, a check: a body the document allows that the server refuses (400) must
  break one of the relations the document lists for the operation (`x-cadenza-relations`): the
  field the error names is one of that relation's params. It stands in for schemathesis'
  `positive_data_acceptance`, which knows no relations. Each protocol's error shape names the
  field its own way (`field_named`): OpenAI's in `error.param`; Anthropic's
  (`{"type": "error", "error": {"type", "message"}}`) and Ollama's (`{"error": "..."}`) have no
  `param`, so their messages begin with it (`messages.0.content: ...`).
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any

import schemathesis


def as_json_integers(value: Any) -> Any:
    """`value` with every integral float written as an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [as_json_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json_integers(v) for k, v in value.items()}
    return value


@schemathesis.hook
def before_call(context, case, kwargs):
    if isinstance(case.body, (dict, list)):
        case.body = as_json_integers(case.body)


def relations_of(document: dict, path: str, method: str) -> list[dict]:
    """The relations the document lists for an operation's request body."""
    body = document["paths"][path][method.lower()].get("requestBody")
    if body is None:
        return []
    ref = body["content"]["application/json"]["schema"]["$ref"]
    return document["components"]["schemas"][ref.rpartition("/")[2]].get("x-cadenza-relations", [])


_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*): ")


def field_named(body: Any) -> tuple[str, str | None]:
    """(which error shape `body` is in, the field it names or None); AssertionError when it is in
    none of the protocols' shapes."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and body.get("type") == "error" and isinstance(error.get("message"), str):
        return "anthropic", _prefix(error["message"])
    if isinstance(error, dict) and "param" in error and isinstance(error.get("message"), str):
        return "openai", error["param"]
    if isinstance(error, str):
        return "ollama", _prefix(error)
    raise AssertionError(f"an error in no protocol's shape: {body!r}")


def _prefix(message: str) -> str | None:
    """The field a message begins with (`messages.0.content: ...`), if it begins with one."""
    found = _FIELD.match(message)
    return found.group(1) if found else None


@schemathesis.check
def documented_refusal(ctx, response, case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    if case.method.upper() != case.operation.method.upper():
        return None  # an undeclared method: the 405 checks judge it
    status = response.status_code
    if status == 429:  # the queue was full: a valid body may wait its turn
        return None
    document = case.operation.schema.raw_schema
    if status == 501 and "501" in document["paths"][case.operation.path][case.method.lower()]["responses"]:
        return None  # an operation documented as not supported (Ollama's model management)
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    shape, param = field_named(body)
    # A stored response that does not exist (the path's id or previous_response_id).
    if status == 404 and shape == "openai":
        assert param in ("response_id", "previous_response_id"), f"404 for a body the document allows: {body}"
        return None
    assert status == 400, f"{status} for a body the document allows: {body}"
    params = [p for r in relations_of(document, case.operation.path, case.method) for p in r["params"]]
    assert param is not None and any(fnmatch.fnmatchcase(param, p) for p in params), (
        f"a body the document allows was refused for no relation it documents: {body}"
    )
    return None
