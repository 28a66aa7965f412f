"""Tool calls in a model's own format: parsing them out of its text, and the grammar that forces one.

Each model family writes tool calls its own way. A `ToolParser` knows one format: how to split
generated text into content and calls (`consume`, which also works on a stream), and a Lark
grammar (llguidance's dialect, with `%json{...}` for each tool's argument schema) that makes the
model emit calls in that format, for `tool_choice` "required" or a named function.

Built-in: `hermes` (Qwen 2.5/3, Hermes, many others: `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), `llama3_json` (Llama 3.1+: `{"name": ..., "parameters": ...}`, calls separated by
`;`), `mistral` (`[TOOL_CALLS]`, as a JSON list or `name[ARGS]{...}`) and `qwen3_coder` (XML:
`<function=f><parameter=p>`); `harmony` (gpt-oss) is in parsers/harmony.py. They are plugins
(`register_tool_parsers`, parsers/builtins.py); `tool_parser_name_for_template` picks one by the
chat template's text.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from cadenza.parsers.markers import FormatTokens, partial_suffix
from cadenza.parsers.tool_schemas import (
    closed_arguments,
    embedded,
    has_local_refs,
    json_rule,
    pointer_token,
    resolved,
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI's API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Consumed:
    """What `consume` made of the text so far: content that is safe to show, the calls complete
    so far, and the text to keep until more arrives (a call, or what may be the start of one)."""

    content: str
    calls: list[ToolCall]
    rest: str


class ToolParser(FormatTokens, ABC):
    """One model family's tool-call format, made for one request: `tools` are the request's
    (OpenAI function tools), for a format whose parsing depends on their schemas."""

    name: ClassVar[str]

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.tools = list(tools or ())

    @abstractmethod
    def consume(self, text: str, final: bool) -> Consumed:
        """Split `text` (everything not yet consumed) into content, complete calls and a rest.
        With `final` the text is all there is: nothing is kept back, and text that is not a
        well-formed call is content."""

    @abstractmethod
    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (several with `parallel`) to one of
        `tools` (OpenAI function tools), with arguments valid for that tool's schema."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output: (content or None when there is none, calls)."""
        done = self.consume(text, final=True)
        content = done.content.strip() if done.calls else done.content
        return (content or None), done.calls

    @abstractmethod
    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        """The calls of an output that `grammar` forced, whole or cut short (max_tokens): every
        call it began, the last one as far as it got (`partial_call`). `names`: the functions
        the grammar allowed."""


def _call_schema(tool: dict[str, Any], arguments_key: str, at: str = "") -> dict[str, Any]:
    """A call's JSON schema, placed at JSON pointer `at` of the grammar's schema (its local
    references are rewritten to match)."""
    function = tool["function"]
    # Closed to the declared keys, so that no key is written twice (api/openai/tool_schemas.py).
    parameters = embedded(closed_arguments(function.get("parameters")), f"{at}/properties/{pointer_token(arguments_key)}")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _json_rule(tools: Sequence[dict[str, Any]], arguments_key: str) -> str:
    if len(tools) == 1:
        schema = _call_schema(tools[0], arguments_key)
    else:
        schema = {"anyOf": [_call_schema(t, arguments_key, f"/anyOf/{i}") for i, t in enumerate(tools)]}
    return json_rule(schema)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _call_from_json(text: str, arguments_keys: Sequence[str]) -> ToolCall | None:
    """A call from its JSON object text, or None when it is not one."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = next((body[k] for k in arguments_keys if k in body), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        return ToolCall(body["name"], arguments)
    return ToolCall(body["name"], json.dumps(arguments, ensure_ascii=False))


# A call's JSON as the forcing grammar writes it, `name` first (its schema orders the keys), up to
# where the text ends; JSON whitespace anywhere between tokens. Function names need no escapes.
_WS = r"[ \t\n\r]*"
_NAME = re.compile(_WS + r'\{' + _WS + r'(?:"(?:n(?:a(?:m(?:e(?:"' + _WS + r'(?::' + _WS + r'(?:"(?P<name>[A-Za-z0-9_-]*)(?P<closed>")?)?)?)?)?)?)?)?)?')


def settled_name(written: str, names: Sequence[str]) -> str:
    """The function a name written only in part settles: the one of `names` it is the start of,
    when only one is; else ""."""
    fitting = [n for n in names if n.startswith(written)]
    return fitting[0] if len(fitting) == 1 else ""


def partial_call(text: str, arguments_key: str, names: Sequence[str]) -> ToolCall:
    """A call the forcing grammar began and `text` (its JSON, from `{`) leaves unfinished, as
    OpenAI returns a call cut short: the function's name, when what was written settles it
    (written whole, or a start only one of `names` has, or the only name there is), else "";
    the arguments, the JSON text as far as it got (possibly "")."""
    match = _NAME.match(text)
    written, closed = (match["name"] or "", bool(match["closed"])) if match else ("", False)
    name = written if closed else settled_name(written, names)
    arguments = ""
    if closed:
        rest = re.match(_WS + r',' + _WS + r'"' + re.escape(arguments_key) + r'"' + _WS + r':' + _WS, text[match.end() :])
        if rest:
            arguments = text[match.end() + rest.end() :].rstrip(" \t\n\r")
    return ToolCall(name, arguments)


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def consume(self, text: str, final: bool) -> Consumed:
        content, calls = [], []
        while True:
            begin = text.find(self.start)
            if begin < 0:
                keep = 0 if final else partial_suffix(text, self.start)
                content.append(text[: len(text) - keep])
                return Consumed("".join(content), calls, text[len(text) - keep :])
            content.append(text[:begin])
            stop = text.find(self.end, begin)
            if stop < 0:
                if not final:
                    return Consumed("".join(content), calls, text[begin:])
                body, after = text[begin + len(self.start) :], ""  # cut short (max_tokens): try it
            else:
                body, after = text[begin + len(self.start) : stop], text[stop + len(self.end) :]
            call = self.read_call(body)
            if call is None:  # not a call after all: show it as it was written
                content.append(text[begin : (stop + len(self.end)) if stop >= 0 else len(text)])
            else:
                calls.append(call)
            text = after

    def read_call(self, body: str) -> ToolCall | None:
        """The call written between the tags, or None when it is not one."""
        return _call_from_json(body.strip(), ("arguments", "parameters"))

    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        calls = []
        blocks = text.split(self.start)
        if len(blocks) == 1 and not (text.strip() and self.start.startswith(text.strip())):
            return []  # not even the start of a block yet
        for block in blocks[1:] if len(blocks) > 1 else [""]:
            body, ended, _ = block.partition(self.end)
            if not ended:  # cut short, maybe within the end marker
                body = body[: len(body) - partial_suffix(body, self.end)]
            call = _call_from_json(body.strip(), ("arguments", "parameters"))
            calls.append(call or partial_call(body, "arguments", names))
        return calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        call = f'{_lark_string(self.start + chr(10))} call_json {_lark_string(chr(10) + self.end)}'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f"{start}\ncall: {call}\ncall_json: {_json_rule(tools, 'arguments')}\n"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON calls: `{"name": "f", "parameters": {...}}`, several separated by `; `,
    optionally after `<|python_tag|>`. An output is calls only when it starts with one."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def consume(self, text: str, final: bool) -> Consumed:
        head = text.lstrip()
        if head.startswith(self.tag):
            head = head[len(self.tag) :].lstrip()
        maybe_call = head.startswith("{") or (not head and text) or self.tag.startswith(head)
        if not maybe_call:
            return Consumed(text, [], "")
        if not final:
            return Consumed("", [], text)
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(head):
            try:
                _, end = decoder.raw_decode(head, position)
            except json.JSONDecodeError:
                return Consumed(text, [], "")
            call = _call_from_json(head[position:end], ("parameters", "arguments"))
            if call is None:
                return Consumed(text, [], "")
            calls.append(call)
            position = end
            while position < len(head) and head[position] in " \t\n\r;":
                position += 1
        return Consumed("", calls, "") if calls else Consumed(text, [], "")

    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while text[position:].strip(" \t\n\r;"):
            position += len(text[position:]) - len(text[position:].lstrip(" \t\n\r;"))
            try:
                _, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                end = -1
            call = _call_from_json(text[position:end], ("parameters", "arguments")) if end > 0 else None
            if call is None:  # the last call, cut short
                calls.append(partial_call(text[position:], "parameters", names))
                break
            calls.append(call)
            position = end
        return calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\ncall: {_json_rule(tools, 'parameters')}\n"


class MistralToolParser(ToolParser):
    """Mistral's calls after `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` objects
    (Mistral-Nemo, the v3 tokenizers), or `name[ARGS]{...}` per call, optionally with
    `[CALL_ID]id` before `[ARGS]` (Mistral-Small-3.2, Devstral, Magistral). Text before the first
    `[TOOL_CALLS]` is content."""

    name = "mistral"
    tag, args_tag, id_tag = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def consume(self, text: str, final: bool) -> Consumed:
        begin = text.find(self.tag)
        if begin < 0:
            keep = 0 if final else partial_suffix(text, self.tag)
            return Consumed(text[: len(text) - keep], [], text[len(text) - keep :])
        if not final:  # calls run to the end of the output: parsed once it is whole
            return Consumed(text[:begin], [], text[begin:])
        parsed = self._calls(text[begin:])
        if parsed is None:  # not calls after all: show them as written
            return Consumed(text, [], "")
        calls, tail = parsed
        return Consumed(text[:begin] + tail, calls, "")

    def _calls(self, text: str) -> tuple[list[ToolCall], str] | None:
        """(the calls of `text`, from its first tag, and what follows the last), or None."""
        calls: list[ToolCall] = []
        decoder, tail = json.JSONDecoder(), ""
        blocks = text.split(self.tag)[1:]
        for i, block in enumerate(blocks):
            block = block.strip()
            if block.startswith("["):  # a JSON list of calls
                value_text = block
                name = None
            else:
                head, found, value_text = block.partition(self.args_tag)
                name = head.partition(self.id_tag)[0].strip()
                if not found or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                    return None
                value_text = value_text.strip()
            try:
                value, end = decoder.raw_decode(value_text)
            except (json.JSONDecodeError, RecursionError):
                return None
            rest = value_text[end:]
            if rest.strip() and i < len(blocks) - 1:
                return None
            tail = rest if i == len(blocks) - 1 else tail
            if name is not None:
                calls.append(ToolCall(name, json.dumps(value, ensure_ascii=False)))
                continue
            items = value if isinstance(value, list) else None
            parsed = [_call_from_json(json.dumps(item), ("arguments", "parameters")) for item in items or [None]]
            if not items or None in parsed:
                return None
            calls += parsed
        return calls, tail

    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        if not _begins(text, self.tag):
            return []  # not even the start of a call yet
        calls = []
        for block in text.split(self.tag)[1:] or [""]:
            head, found, arguments = block.partition(self.args_tag)
            written = head.partition(self.id_tag)[0].strip()
            if found:
                arguments = arguments.strip()
                try:
                    calls.append(ToolCall(written, json.dumps(json.loads(arguments), ensure_ascii=False)))
                except (json.JSONDecodeError, RecursionError):  # cut short: the arguments so far
                    calls.append(ToolCall(written, arguments))
                continue
            calls.append(ToolCall(written if written in names else settled_name(written, names), ""))
        return calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [
            f"call_{i}: {_lark_string(self.tag + t['function']['name'] + self.args_tag)} "
            f"{json_rule(closed_arguments(t['function'].get('parameters')))}"
            for i, t in enumerate(tools)
        ]
        start = "start: call call*" if parallel else "start: call"
        return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"


class Qwen3CoderToolParser(HermesToolParser):
    """Qwen3-Coder's XML calls: `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n
    </function>\n</tool_call>`. A value is the parameter's text; where the tool's schema (the
    request's `tools`) says the parameter is not a string, its JSON."""

    name = "qwen3_coder"  # Hermes's tags around each call, XML inside them
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        # Each parameter's schema, a local `$ref` followed (a pydantic enum is one).
        self.schemas = {}
        for tool in tools or ():
            parameters = tool["function"].get("parameters") or {}
            self.schemas[tool["function"]["name"]] = {
                name: resolved(parameters, spec) for name, spec in (parameters.get("properties") or {}).items()}

    def _value(self, function: str, parameter: str, text: str) -> Any:
        if _is_text(self.schemas.get(function, {}).get(parameter)):
            return text
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text

    def read_call(self, body: str) -> ToolCall | None:
        match = self._FUNCTION.search(body)
        if match is None:
            return None
        function = match.group(1).strip()
        arguments = {p.strip(): self._value(function, p.strip(), v) for p, v in self._PARAMETER.findall(match.group(2))}
        return ToolCall(function, json.dumps(arguments, ensure_ascii=False))

    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        if not _begins(text, self.start):
            return []  # not even the start of a call yet
        calls = []
        for block in text.split(self.start)[1:] or [""]:
            call = self.read_call(block)
            if call is None:
                written = block.partition("<function=")[2].partition(">")[0].strip()
                call = ToolCall(settled_name(written, names), "")
            calls.append(call)
        return calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        rules, alternatives = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = closed_arguments(function.get("parameters"))
            required = set(schema.get("required") or ())
            parts = []
            for j, (parameter, spec) in enumerate((schema.get("properties") or {}).items()):
                spec = resolved(schema, spec)
                value = (_text_rule(spec) if _is_text(spec)
                         else json_rule(_parameter_schema(schema, parameter)))
                rules.append(f"param_{i}_{j}: {_lark_string(f'<parameter={parameter}>' + chr(10))} {value} "
                             f"{_lark_string(chr(10) + '</parameter>' + chr(10))}")
                parts.append(f"param_{i}_{j}" + ("" if parameter in required else "?"))
            body = " ".join(parts)
            rules.append(f"call_{i}: {_lark_string(self.start + chr(10) + '<function=' + function['name'] + '>' + chr(10))} "
                         f"{body} {_lark_string('</function>' + chr(10) + self.end)}")
            alternatives.append(f"call_{i}")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {' | '.join(alternatives)}", *rules, 'text: /[^<]*/']) + "\n"


def _parameter_schema(arguments: dict[str, Any], parameter: str) -> dict[str, Any]:
    """One parameter's schema, standing alone: as written, or, when the arguments schema holds
    local references (`$defs`), a reference into the whole schema carried beside it."""
    spec = arguments["properties"][parameter] or {}
    if not has_local_refs(arguments):
        return spec
    return {"$defs": {"arguments": embedded(arguments, "/$defs/arguments")},
            "$ref": f"#/$defs/arguments/properties/{pointer_token(parameter)}"}


def forcing_grammar(calls: str, reasoning: str | None) -> str:
    """The grammar a forced call runs under: `calls` (a `ToolParser.grammar`), after the
    reasoning `reasoning` allows (a `ReasoningParser.forced_call_reasoning`; None: none)."""
    if reasoning is None:
        return calls
    if not calls.startswith("start:"):
        raise ValueError("a tool-call grammar must begin with its start rule")
    return f"start: reasoning forced_calls\n{reasoning.rstrip()}\nforced_calls:{calls[len('start:'):]}"


def _begins(text: str, marker: str) -> bool:
    """Whether `text` holds `marker`, or is (blanks aside) the start of it."""
    return marker in text or bool(text.strip()) and marker.startswith(text.strip())


def _is_text(spec: Any) -> bool:
    """Whether a parameter's schema takes only strings, which Qwen3-Coder writes bare (others: JSON)."""
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "string":
        return True
    choices = spec.get("enum", [spec["const"]] if "const" in spec else None)
    return bool(choices) and all(isinstance(c, str) for c in choices)


def _text_rule(spec: dict[str, Any]) -> str:
    choices = spec.get("enum", [spec["const"]] if "const" in spec else None)
    return "(" + " | ".join(_lark_string(c) for c in choices) + ")" if choices else "text"


BUILTIN_TOOL_PARSERS = (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser)

# Markers a chat template's text carries for its family's format, checked in order.
_TEMPLATE_MARKERS = (
    (re.compile(r"<\|channel\|>"), "harmony"),  # gpt-oss (parsers/harmony.py)
    (re.compile(r"<function="), "qwen3_coder"),
    (re.compile(r"<tool_call>"), "hermes"),
    (re.compile(r"\[TOOL_CALLS\]"), "mistral"),
    (re.compile(r"<\|python_tag\|>|\"parameters\""), "llama3_json"),
)


def tool_parser_name_for_template(chat_template: str | None) -> str:
    """The format a chat template teaches its model, by its registered name; Hermes (the most
    common) when it says none."""
    for pattern, name in _TEMPLATE_MARKERS:
        if chat_template and pattern.search(chat_template):
            return name
    return "hermes"


class ToolCallStream:
    """Splits a streamed output into content deltas and tool calls as they complete."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pending = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Add `text`; the content that may be shown now and the calls completed by it."""
        done = self.parser.consume(self.pending + text, final)
        self.pending = done.rest
        self.num_calls += len(done.calls)
        return done.content, done.calls
