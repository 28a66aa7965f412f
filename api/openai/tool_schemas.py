"""A tool's `parameters` schema, checked when a request offers the tool.

Every tool a chat request offers has its `parameters` compiled by llguidance when the request
arrives, whatever `tool_choice` says, so a schema that could never constrain a call is a 400 naming
`tools.<i>.function.parameters` at once, not only on the day a call is forced. It is compiled
twice: alone, as a forced call would use it (closed to its declared keys, `parsers/tool_schemas.py`),
so that llguidance's complaint points into the user's schema; then inside the grammar the served
tool-call format forces that tool with, so that what is checked is what a forced call will run.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Sequence

import anyio
import llguidance

from cadenza.api.errors import APIError
from cadenza.parsers.tool_calls import ToolParser
from cadenza.parsers.tool_schemas import closed_arguments

# Schemas up to this size (JSON characters) compile on the event loop and are remembered; a
# larger one compiles in a worker thread each time (a huge schema takes up to about a second).
_INLINE_CHARS = 16_384


def _problem(kind: str, text: str) -> str:
    """llguidance's complaint about a JSON schema (`kind` "json", its JSON text) or a Lark grammar
    ("grammar"), or '' when it compiles."""
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        else:
            grammar = llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar).strip()


_remembered_problem = lru_cache(maxsize=256)(_problem)


async def _compile(kind: str, text: str) -> str:
    if len(text) <= _INLINE_CHARS:
        return _remembered_problem(kind, text)
    return await anyio.to_thread.run_sync(_problem, kind, text)


async def check_tool_schemas(tools: Sequence[dict[str, Any]], parser: ToolParser | None = None) -> None:
    """Compile each tool's `parameters` (OpenAI function tools, in the request's order) as a
    forced call would, alone and, given the served format's `parser`, inside the grammar that
    forces it; a 400 naming the first that does not (`tools.<i>.function.parameters`)."""
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is None:
            continue
        param = f"tools.{i}.function.parameters"
        problem = await _compile("json", json.dumps(closed_arguments(parameters), sort_keys=True, ensure_ascii=False))
        if problem:
            first = problem.splitlines()[0]
            raise APIError(400, "invalid_value", f"{param}: not a JSON schema llguidance can compile: {first}", param)
        if parser is not None:
            problem = await _compile("grammar", parser.grammar([tool], False))
            if problem:
                first = problem.splitlines()[0]
                raise APIError(400, "invalid_value", f"{param}: the {parser.name} format's grammar for a call of "
                               f"{tool['function']['name']!r} does not compile: {first}", param)
