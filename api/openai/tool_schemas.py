"""A tool's `parameters` schema, checked when a request offers the tool.

Every tool a chat request offers has its `parameters` compiled by llguidance when the request
arrives, whatever `tool_choice` says, so a schema that could never constrain a call is a 400 naming
`tools.<i>.function.parameters` at once, not only on the day a call is forced. It is compiled as a
forced call would use it: closed to its declared keys (`parsers/tool_schemas.py`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Sequence

import anyio
import llguidance

from cadenza.api.errors import APIError
from cadenza.parsers.tool_schemas import closed_arguments

# Schemas up to this size (JSON characters) compile on the event loop and are remembered; a
# larger one compiles in a worker thread each time (a huge schema takes up to about a second).
_INLINE_CHARS = 16_384


def _problem(schema_json: str) -> str:
    """llguidance's complaint about a JSON schema (its JSON text), or '' when it compiles."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar).strip()


_remembered_problem = lru_cache(maxsize=256)(_problem)


async def check_tool_schemas(schemas: Sequence[dict[str, Any] | None]) -> None:
    """Compile each tool's `parameters` (in the request's order; None: the tool declares none)
    as a forced call would; a 400 naming the first that does not (`tools.<i>.function.parameters`)."""
    for i, parameters in enumerate(schemas):
        if parameters is None:
            continue
        text = json.dumps(closed_arguments(parameters), sort_keys=True, ensure_ascii=False)
        if len(text) <= _INLINE_CHARS:
            problem = _remembered_problem(text)
        else:
            problem = await anyio.to_thread.run_sync(_problem, text)
        if problem:
            param = f"tools.{i}.function.parameters"
            first = problem.splitlines()[0]
            raise APIError(400, "invalid_value", f"{param}: not a JSON schema llguidance can compile: {first}", param)
