"""Tool calls: the parsers of model formats, tools reaching the chat template, and a round trip
(call, tool result, answer) with the official `openai` SDK against a real server, streamed or not."""

from __future__ import annotations

import json
import re

import httpx
import llguidance
import pytest
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)

from cadenza.models.prompts import ChatPrompt, tokenize_prompt
from cadenza.models.tokenizer import Tokenizer, load_hf_tokenizer
from cadenza.parsers.tool_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    ToolCallStream,
    tool_parser_name_for_template,
)
from cadenza.parsers.tool_schemas import closed_arguments

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]


# --- parsers ------------------------------------------------------------------------------------


def test_hermes_parses_calls_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'  # fmt: skip
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    # A block that is not a call stays content, as written.
    assert HermesToolParser().parse("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_hermes_streamed_in_any_pieces_gives_the_same_as_whole(cut):
    text = 'Hi <tool<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> bye'
    stream = ToolCallStream(HermesToolParser())
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    content, calls = "", []
    for i, piece in enumerate(pieces):
        shown, done = stream.feed(piece, final=i == len(pieces) - 1)
        content += shown
        calls += done
    assert content == "Hi <tool bye"
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "CET"}')]


def test_llama3_json_parses_calls_only_when_the_output_is_calls():
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parser.parse("The answer is {not json}") == ("The answer is {not json}", [])
    assert parser.parse('{"no": "name"}') == ('{"no": "name"}', [])


def test_the_parser_follows_the_chat_template():
    assert tool_parser_name_for_template("{{ '<tool_call>' }}") == "hermes"
    assert tool_parser_name_for_template("<|python_tag|>") == "llama3_json"
    assert tool_parser_name_for_template("{{- '[TOOL_CALLS]' + name }}") == "mistral"
    assert tool_parser_name_for_template("<tool_call>\n<function=f>") == "qwen3_coder"
    assert tool_parser_name_for_template(None) == "hermes"


def _format(parser, name: str, arguments: dict) -> str:
    """One call as `parser`'s format writes it."""
    if parser.name == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    if parser.name == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    if parser.name == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(), Qwen3CoderToolParser(TOOLS)])
def test_the_forcing_grammar_accepts_the_format_and_nothing_else(parser):
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar(TOOLS, parallel=True))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    tokenizer = llguidance.LLTokenizer(_ByteTokenizer(), n_vocab=257, eos_token=256)
    text = _format(parser, "get_weather", {"city": "Paris", "days": 3})
    bad = text.replace("Paris", "Rome")

    def accepts(sentence: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(sentence.encode())) and matcher.is_accepting()

    assert accepts(text) and not accepts(bad)
    assert parser.parse(text)[1][0].name == "get_weather"


class _ByteTokenizer:
    """One token per byte, and EOS: enough for llguidance to run a grammar on text."""

    is_tokenizer_wrapper = True
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

    def __call__(self, text):
        return list(text.encode())


# --- the chat template sees the tools -----------------------------------------------------------


def test_tools_and_tool_messages_reach_the_chat_template(tiny_model_dir):
    base = load_hf_tokenizer(tiny_model_dir("llama3"), [2])
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}"
    )
    tokenizer = Tokenizer(backend=base.backend, eos_token_ids=(2,), chat_template=template)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    text, _ = tokenize_prompt(ChatPrompt(messages, TOOLS), tokenizer, 320)
    assert text == "TOOLS:get_weather;get_time;|user:weather?|assistant:[call get_weather Paris]|tool:sunny(c1)|"
    text, _ = tokenize_prompt(messages, tokenizer, 320)
    assert not text.startswith("TOOLS")


# --- a round trip through the OpenAI API --------------------------------------------------------


def _accumulate(chunks):
    """What the openai SDK's stream helpers do with tool-call deltas: join them by index."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _required_call(client, model, messages, stream: bool, max_tokens: int = 300, **extra) -> dict:
    """The one call a tool_choice "required" request gets, asserted well-formed for TOOLS."""
    kwargs = dict(model=model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens,
                  temperature=1.0, **extra)
    if stream:
        content, calls, reason = _accumulate(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    else:
        (choice,) = client.chat.completions.create(messages=messages, **kwargs).choices
        reason, content = choice.finish_reason, choice.message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert reason == "tool_calls" and not content and len(calls) == 1
    (call,) = calls
    arguments = json.loads(call["arguments"])
    assert call["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
    assert arguments in ({"zone": "UTC"}, {"zone": "CET"}) or (arguments["city"] in ("Paris", "Tokyo") and 1 <= arguments["days"] <= 3)
    return call


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_round_trip(client, model, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = _required_call(client, model, messages, stream)

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"},
    ]  # fmt: skip
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"


def test_a_named_function_is_the_one_called(client, model):
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "time?"}], tools=TOOLS, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_auto_leaves_plain_text_as_content(client, model):
    completion = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                max_tokens=6, temperature=0)  # fmt: skip
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("length", "stop")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])  # fmt: skip
def test_bad_tool_requests_are_400s(server, model, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"model": model, "messages": [{"role": "user", "content": "x"}], **body})  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


BROKEN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}},
                                         {"type": "function", "function": {"name": "get_time"}}])  # fmt: skip
@pytest.mark.parametrize("position", [0, 1])
def test_a_tool_whose_schema_does_not_compile_is_a_400_whatever_tool_choice_says(server, model, tool_choice, position):
    tools = [BROKEN, TIME] if position == 0 else [TIME, BROKEN]
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "tools": tools, "max_tokens": 2}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"tools.{position}.function.parameters", error
    assert error["message"].startswith(f"tools.{position}.function.parameters: ") and "Invalid type: nope" in error["message"]
    # The same tools with a schema that compiles are served.
    fixed = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    good = {**body, "tools": [fixed if t is BROKEN else t for t in tools]}
    assert httpx.post(server.url + "/v1/chat/completions", timeout=30, json=good).status_code == 200


# --- a forced call cut short by max_tokens ------------------------------------------------------

NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize("text, calls", [
    ("", []),
    ("<tool", [("", "")]),
    ('<tool_call>\n{ \n "name"  :\t"get_w', [("get_weather", "")]),  # only one name starts so
    ('<tool_call>\n{"name": "get_', [("", "")]),  # two names do
    ('<tool_call>\n{"name": "get_time"', [("get_time", "")]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U', [("get_time", '{"zone": "U')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool', [("get_time", '{"zone": "UTC"}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"ci', [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"ci')]),
])  # fmt: skip
def test_hermes_reads_a_forced_output_cut_anywhere(text, calls):
    assert [(c.name, c.arguments) for c in HermesToolParser().parse_forced(text, NAMES)] == calls


def test_llama3_json_reads_a_forced_output_cut_anywhere():
    parser = Llama3JsonToolParser()
    cut = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Pa'
    assert [(c.name, c.arguments) for c in parser.parse_forced(cut, NAMES)] == [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Pa')]
    assert [(c.name, c.arguments) for c in parser.parse_forced('{"na', ["only"])] == [("only", "")]


def _chat(client, model, stream, **kwargs):
    """(content, [(name, arguments)], finish_reason, the output's tokens' texts (from the logprobs)
    when not streamed)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        content, calls, reason = _accumulate(client.chat.completions.create(messages=messages, model=model, stream=True, **kwargs))
        return content or None, [(c["name"], c["arguments"]) for c in calls], reason, None
    (choice,) = client.chat.completions.create(messages=messages, model=model, logprobs=True, **kwargs).choices
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason, [t.token for t in choice.logprobs.content]


_ARGUMENTS = re.compile(r'"arguments"[ \t\n\r]*:[ \t\n\r]*')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_short_is_still_tool_calls_with_the_arguments_so_far(client, model, tool_choice):
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=11)
    _, whole_calls, reason, texts = _chat(client, model, False, max_tokens=400, **kwargs)
    assert reason in ("tool_calls", "length") and _ARGUMENTS.search("".join(texts)), texts
    # Cut where the arguments have begun, and before: the same seed writes the same tokens, so
    # the output is a prefix of the whole one, and the call's arguments are what it wrote of them.
    opened = next(i for i in range(len(texts)) if "{" in "".join(texts[:i]).partition('"arguments"')[2])
    for max_tokens in (1, 3, opened, opened + 2):
        assert max_tokens < len(texts)
        prefix = "".join(texts[:max_tokens])
        content, calls, reason, cut = _chat(client, model, False, max_tokens=max_tokens, **kwargs)
        assert cut == texts[:max_tokens] and reason == "length" and content is None, (cut, reason, content)
        ((name, arguments),) = calls
        assert name == "get_weather" if isinstance(tool_choice, dict) else name in ("", *NAMES)
        head = _ARGUMENTS.search(prefix)
        assert arguments == (prefix[head.end() :].rstrip(" \t\n\r") if head else ""), (arguments, prefix)
        if max_tokens >= opened:
            assert arguments.startswith("{") and name == whole_calls[0][0], (arguments, name)
        # Streamed: the same call, as tool_calls deltas, and no content.
        assert _chat(client, model, True, max_tokens=max_tokens, **kwargs)[:3] == (None, calls, "length")


# --- no key twice in a forced call's arguments --------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}, "required": ["city"]}


def test_object_schemas_are_closed_to_their_declared_keys_where_they_say_nothing_else():
    closed = closed_arguments({"type": "object", "properties": {"a": CITY, "b": {"type": "array", "items": CITY}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed_arguments(None) == {"type": "object", "properties": {}, "additionalProperties": False}
    # Left as written: keys allowed explicitly, and objects other subschemas add keys to.
    for schema in ({**CITY, "additionalProperties": True}, {**CITY, "additionalProperties": {"type": "integer"}},
                   {**CITY, "patternProperties": {"^x": {}}}, {**CITY, "allOf": [{"properties": {"y": {}}}]},
                   {**CITY, "anyOf": [{"properties": {"y": {}}}]}, {**CITY, "required": ["city", "zip"]}):  # fmt: skip
        assert closed_arguments(schema) == schema
    assert "additionalProperties" not in closed_arguments({"allOf": [CITY]})["allOf"][0]
    assert closed_arguments({"anyOf": [CITY, {"type": "string"}]})["anyOf"][0]["additionalProperties"] is False


def test_the_forcing_grammar_writes_no_key_twice():
    duplicated = '<tool_call>\n{"name": "f", "arguments": {"city": "Rom", "description": "x", "description": "y"}}\n</tool_call>'
    once = '<tool_call>\n{"name": "f", "arguments": {"city": "Rom"}}\n</tool_call>'
    tokenizer = llguidance.LLTokenizer(_ByteTokenizer(), n_vocab=257, eos_token=256)

    def accepts(parameters, sentence):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        grammar = llguidance.LLMatcher.grammar_from_lark(HermesToolParser().grammar([tool], parallel=False))
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(sentence.encode())) and matcher.is_accepting()

    assert accepts(CITY, once) and not accepts(CITY, duplicated)
    # A schema that allows other keys explicitly keeps them, repeats and all (JSON Schema cannot forbid those).
    assert accepts({**CITY, "additionalProperties": True}, duplicated)


def _keys_begun(arguments: str) -> list[str]:
    """The keys an object's JSON text (possibly cut short) begins at its top level."""
    keys, depth, i, expect_key = [], 0, 0, False
    while i < len(arguments):
        char = arguments[i]
        if char == '"':
            end = i + 1
            while end < len(arguments) and arguments[end] != '"':
                end += 2 if arguments[end] == "\\" else 1
            if depth == 1 and expect_key:
                keys.append(arguments[i + 1 : end])
                expect_key = False
            i = end + 1
            continue
        if char in "{[":
            depth += 1
            expect_key = depth == 1 and char == "{"
        elif char in "}]":
            depth -= 1
            if depth == 0:
                break  # the object's end
        elif char == "," and depth == 1:
            expect_key = True
        i += 1
    return keys


def test_a_forced_call_on_the_model_writes_only_declared_keys_once(client, model):
    def keys(parameters, seed):
        tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
        _, calls, _, texts = _chat(client, model, False, max_tokens=300, tools=[tool], tool_choice="required",
                               parallel_tool_calls=False, temperature=1.0, seed=seed)  # fmt: skip
        raw = "".join(texts)  # the text as written: parsed arguments would have lost any repeat
        head = _ARGUMENTS.search(raw)
        return _keys_begun(raw[head.end() :]) if head else []

    seeds = range(6)
    written = [keys(CITY, seed) for seed in seeds]
    assert all(k in ([], ["city"]) for k in written), written
    assert ["city"] in written
    # The same model, the same seeds, under the schema with other keys allowed: it writes some.
    opened = [keys({**CITY, "additionalProperties": True}, seed) for seed in seeds]
    assert any(set(k) - {"city"} for k in opened), opened


# --- each family's real chat template, as llama.cpp's source keeps them ---------------------------

FAMILY_TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "Qwen3-Coder.jinja": "qwen3_coder",
}
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
           "qwen3_coder": Qwen3CoderToolParser}


@pytest.fixture(scope="module")
def templates():
    from cadenza.bench.peers.llamacpp_build import source_dir

    return source_dir() / "models" / "templates"


def _assistant_turn(template: str, calls: list[dict]) -> str:
    """What the template writes for an assistant turn that makes `calls`: the render of the
    conversation with that turn, less the render of the conversation up to it."""
    from tiny_models import build_tokenizer

    tokenizer = Tokenizer(backend=build_tokenizer().backend_tokenizer, eos_token_ids=(2,), chat_template=template,
                          bos_token="<s>", eos_token="</s>")
    question = [{"role": "user", "content": "Weather in Paris for 2 days, and the time in UTC?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for i, c in enumerate(calls)]}  # fmt: skip
    before = tokenizer.apply_chat_template(question, add_generation_prompt=True, tools=TOOLS)
    whole = tokenizer.apply_chat_template([*question, turn], add_generation_prompt=False, tools=TOOLS)
    prefix = 0
    while prefix < min(len(before), len(whole)) and before[prefix] == whole[prefix]:
        prefix += 1
    # The end-of-turn token the model stops on, which the detokenizer never shows.
    return re.sub(r"(<\|eot_id\|>|</s>|<\|im_end\|>)\s*$", "", whole[prefix:])


@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_each_family_template_teaches_its_format_and_its_calls_parse_back(templates, name):
    template = (templates / name).read_text()
    family = FAMILY_TEMPLATES[name]
    assert tool_parser_name_for_template(template) == family
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]
    if family == "llama3_json":  # Llama 3.1's template takes one call a turn
        calls = calls[:1]
    turn = _assistant_turn(template, calls)
    parser = PARSERS[family](TOOLS)
    content, parsed = parser.parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls], turn
    # What is left is the template's end of turn, not any of the calls.
    assert content is None or "get_weather" not in content
    # Streamed a character at a time, the same calls.
    stream = ToolCallStream(PARSERS[family](TOOLS))
    streamed = [call for i, ch in enumerate(turn) for call in stream.feed(ch, final=i == len(turn) - 1)[1]]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in parsed]


def test_mistral_reads_both_of_its_syntaxes_and_refuses_what_is_neither():
    parser = MistralToolParser()
    listed = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "abc123xyz"}]'
    inline = '[TOOL_CALLS]get_time[CALL_ID]abc123xyz[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 1}'
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(listed)[1]] == [("get_time", {"zone": "UTC"})]
    assert [c.name for c in parser.parse(inline)[1]] == ["get_time", "get_weather"]
    assert parser.parse("Sure. [TOOL_CALLS]not a call") == ("Sure. [TOOL_CALLS]not a call", [])
    forced = parser.parse_forced('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', ["get_weather", "get_time"])
    assert forced == [ToolCall("get_weather", '{"city": "Par', id=forced[0].id)]


def test_qwen3_coder_types_values_by_the_tools_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>")
    (call,) = Qwen3CoderToolParser(TOOLS).parse(text)[1]
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}  # an integer where the schema says so
    note = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}}}}}  # fmt: skip
    (call,) = Qwen3CoderToolParser([note]).parse("<tool_call>\n<function=note>\n<parameter=text>\n42\n</parameter>\n"
                                                 "</function>\n</tool_call>")[1]
    assert json.loads(call.arguments) == {"text": "42"}  # a string stays a string, digits or not


@pytest.fixture(scope="module", params=["Qwen3-Coder.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja"])
def family_server(request, tmp_path_factory, templates):
    """The tiny model served with a family's real chat template, whose format the server picks."""
    import openai
    from server_process import running_server
    from tiny_models import build_tiny_model

    # The templates' tool preambles are long in the tiny byte-level vocabulary: a longer context.
    directory = build_tiny_model(tmp_path_factory.mktemp("family-template") / "model", "llama3",
                                 max_position_embeddings=4096)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text((templates / request.param).read_text())
    with running_server(directory) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            yield client, client.models.list().data[0].id, FAMILY_TEMPLATES[request.param]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_in_the_family_s_own_syntax_through_the_sdk(family_server, stream):
    """tool_choice required: the grammar makes the model write a call in the template's syntax,
    and the server parses it back into `tool_calls`."""
    client, model, _ = family_server
    # Thinking off: a random model given room to reason first (Qwen3's template) would not stop.
    _required_call(client, model, [{"role": "user", "content": "What is the weather in Paris?"}], stream, max_tokens=200,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})


# --- schemas as users write them: $defs, definitions, recursive $ref --------------------------

# What pydantic writes for a model with a nested model: the nested one under `$defs`, referenced
# from the root of `parameters`.
PERSON = {"type": "function", "function": {"name": "Person", "parameters": {
    "type": "object", "required": ["name", "address"],
    "properties": {"name": {"enum": ["Ann", "Bo"]}, "address": {"$ref": "#/$defs/Address"}},
    "$defs": {"Address": {"type": "object", "required": ["city"], "properties": {"city": {"enum": ["Oslo", "Rome"]}}}}}}}  # fmt: skip
# Draft-07's `definitions`, and a schema that refers to its own root (a tree).
TREE = {"type": "function", "function": {"name": "Tree", "parameters": {
    "type": "object", "required": ["label"],
    "properties": {"label": {"$ref": "#/definitions/Label"}, "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
    "definitions": {"Label": {"enum": ["x", "y"]}}}}}  # fmt: skip


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(),
                                    Qwen3CoderToolParser([PERSON, TREE])])  # fmt: skip
def test_the_forcing_grammar_follows_references_into_the_user_s_schema(parser):
    """A forced call's grammar places `parameters` inside its own schema: `$ref`s still reach the
    user's definitions (and its root), whether one tool is forced or either of two."""
    tokenizer = llguidance.LLTokenizer(_ByteTokenizer(), n_vocab=257, eos_token=256)
    person = {"name": "Ann", "address": {"city": "Oslo"}}
    tree = {"label": "x", "kids": [{"label": "y", "kids": [{"label": "x"}]}]}
    for tools in ([PERSON], [TREE], [PERSON, TREE]):
        grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar(tools, parallel=False))
        assert llguidance.LLMatcher.validate_grammar(grammar) == "", tools

        def accepts(name: str, arguments: dict) -> bool:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            return matcher.consume_tokens(list(_format(parser, name, arguments).encode())) and matcher.is_accepting()

        if PERSON in tools:
            assert accepts("Person", person)
            assert not accepts("Person", {"name": "Ann", "address": {"city": "Paris"}})  # the definition binds
        if TREE in tools:
            assert accepts("Tree", tree)
            assert not accepts("Tree", {"label": "x", "kids": [{"label": "z"}]})  # the root binds, recursively


def test_embedded_rewrites_local_references_only():
    from cadenza.parsers.tool_schemas import embedded

    schema = {"properties": {"$ref": {"$ref": "#/$defs/A"}, "b": {"$ref": "other.json#/x"}}, "items": {"$ref": "#"},
              "const": {"$ref": "#/data"}, "$defs": {"A": {"$ref": "#/$defs/A/x~1y"}}}  # fmt: skip
    assert embedded(schema, "/properties/arguments") == {
        "properties": {"$ref": {"$ref": "#/properties/arguments/$defs/A"}, "b": {"$ref": "other.json#/x"}},
        "items": {"$ref": "#/properties/arguments"}, "const": {"$ref": "#/data"},
        "$defs": {"A": {"$ref": "#/properties/arguments/$defs/A/x~1y"}}}  # fmt: skip


def test_a_harmony_forcing_grammar_with_references_compiles():
    from cadenza.parsers.harmony import HarmonyToolParser

    grammar = llguidance.LLMatcher.grammar_from_lark(HarmonyToolParser().grammar([PERSON, TREE], parallel=True))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("stream", [False, True])
def test_a_nested_pydantic_model_forced_as_a_tool_through_the_sdk(client, model, stream):
    """openai's `pydantic_function_tool` with a nested model (what instructor's TOOLS mode and
    pydantic-ai's output tools send), forced by name: the call parses into the model."""
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: Literal["Oslo", "Rome"]
        floor: int = Field(ge=0, le=9)

    class Person(BaseModel):
        name: Literal["Ann", "Bo"]
        home: Address
        past: list[Address] = Field(max_length=2)

    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Who?"}], tools=[tool], max_tokens=300,
                  tool_choice={"type": "function", "function": {"name": "Person"}}, temperature=1.0)
    if stream:
        _, calls, reason = _accumulate(client.chat.completions.create(stream=True, **kwargs))
        arguments = calls[0]["arguments"]
    else:
        (choice,) = client.chat.completions.create(**kwargs).choices
        reason, arguments = choice.finish_reason, choice.message.tool_calls[0].function.arguments
    assert reason == "tool_calls"
    Person.model_validate_json(arguments)  # raises when the grammar let a wrong shape through


def test_a_schema_whose_reference_points_nowhere_is_a_400_naming_the_tool(server, model):
    dangling = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "tools": [TIME, dangling], "max_tokens": 2}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools.1.function.parameters" and "/$defs/Missing" in error["message"], error
    assert "/properties/arguments" not in error["message"]  # the place in the user's schema, not the grammar's


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser()])
def test_the_forcing_grammar_bounds_the_whitespace_between_json_tokens(parser):
    """A blank, or a line break and an indent: what models write. Not a run of blanks that a small
    model pads a call with until max_tokens."""
    tokenizer = llguidance.LLTokenizer(_ByteTokenizer(), n_vocab=257, eos_token=256)
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar([TIME], parallel=False))

    def accepts(arguments_text: str) -> bool:
        text = _format(parser, "get_time", {"zone": "UTC"}).replace('{"zone": "UTC"}', arguments_text)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert accepts('{"zone": "UTC"}') and accepts('{"zone":"UTC"}') and accepts('{\n    "zone": "UTC"\n}')
    assert not accepts('{"zone":' + " " * 30 + '"UTC"}') and not accepts("{" + "\n \r\t" * 8 + '"zone": "UTC"}')
