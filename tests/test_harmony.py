"""gpt-oss's harmony: its real chat template (as llama.cpp's source keeps it) with tools, a past
call, a tool result and `reasoning_effort`; the parsers on harmony outputs, whole and split at every
boundary; the grammar that forces a call; and a tiny model served with gpt-oss's template and a
tokenizer whose harmony markers are special tokens, through the official `openai` SDK."""

from __future__ import annotations

import json

import llguidance
import pytest

from cadenza.models.tokenizer import Tokenizer
from cadenza.parsers.harmony import GptOssReasoningParser, HarmonyToolParser
from cadenza.parsers.reasoning import parser_name_for_template
from cadenza.parsers.tool_calls import ToolCallStream, tool_parser_name_for_template

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
SPECIAL = ["<|endoftext|>", *HARMONY]  # ids 0 to 7: <|return|> is 6, <|call|> 7
RETURN_ID, CALL_ID = 6, 7
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def template() -> str:
    from cadenza.bench.peers.llamacpp_build import version_dir

    path = version_dir() / "build" / "source" / "models" / "templates" / "openai-gpt-oss-120b.jinja"
    if not path.is_file():
        pytest.skip("llama.cpp's source (its models/templates) is not in the cache")
    return path.read_text()


def harmony_tokenizer(corpus: str = ""):
    """A byte-level BPE of 300 tokens whose harmony markers are special tokens, as gpt-oss's are."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([corpus, "analysis commentary final functions assistant json Paris weather"], trainer=trainer)
    assert [backend.token_to_id(t) for t in SPECIAL] == list(range(len(SPECIAL)))
    return backend


# --- the real template ---------------------------------------------------------------------------


def test_the_template_chooses_the_harmony_parsers(template):
    assert parser_name_for_template(template) == "gpt_oss"
    assert tool_parser_name_for_template(template) == "harmony"


def test_the_template_renders_tools_a_past_call_its_result_and_the_reasoning_effort(template):
    from cadenza.models.prompts import ChatPrompt

    tokenizer = Tokenizer(backend=harmony_tokenizer(), eos_token_ids=(RETURN_ID, CALL_ID), chat_template=template)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "The weather tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    text = ChatPrompt(messages, TOOLS, {"reasoning_effort": "high"}).render(tokenizer)
    assert "Reasoning: high" in text and "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {" in text
    assert '// The weather in a city.\ntype get_weather = (_: {\ncity: "Paris" | "Tokyo",\ndays: number,\n}) => any;' in text
    # A past call with its reasoning (the template reads `thinking`), then its result.
    assert ('<|start|>assistant<|channel|>analysis<|message|>The weather tool.<|end|>'
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny"<|end|>') in text  # fmt: skip
    assert text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in ChatPrompt(messages[:2], TOOLS).render(tokenizer)  # the default


def test_a_past_turns_reasoning_content_reaches_the_template_as_its_thinking(template):
    """A client sends back an assistant turn as the API returned it (`reasoning_content`); gpt-oss's
    template reads `thinking`, so the model sees its earlier reasoning again."""
    from cadenza.api.openai.protocol import ChatMessage
    from cadenza.models.prompts import ChatPrompt

    tokenizer = Tokenizer(backend=harmony_tokenizer(), eos_token_ids=(RETURN_ID, CALL_ID), chat_template=template)
    turn = ChatMessage(role="assistant", content=None, reasoning_content="The weather tool.", tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}])
    messages = [{"role": "user", "content": "Weather in Paris?"}, turn.to_engine(1),
                {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}]  # fmt: skip
    text = ChatPrompt(messages, TOOLS).render(tokenizer)
    assert "<|start|>assistant<|channel|>analysis<|message|>The weather tool.<|end|>" in text
    # A preamble beside the calls: the template takes one or the other, so the content stays.
    turn = ChatMessage(role="assistant", content="Checking.", reasoning_content="The weather tool.",
                       tool_calls=turn.tool_calls)
    assert "thinking" not in turn.to_engine(1)


def test_openais_reasoning_effort_field_reaches_the_template(template):
    from cadenza.api.openai.protocol import ChatCompletionRequest
    from cadenza.models.prompts import ChatPrompt

    tokenizer = Tokenizer(backend=harmony_tokenizer(), eos_token_ids=(RETURN_ID, CALL_ID), chat_template=template)
    question = [{"role": "user", "content": "Hi"}]
    request = ChatCompletionRequest(model="m", messages=question, reasoning_effort="high")
    assert request.template_kwargs() == {"reasoning_effort": "high"}
    assert "Reasoning: high" in ChatPrompt(question, None, request.template_kwargs()).render(tokenizer)
    both = ChatCompletionRequest(model="m", messages=question, reasoning_effort="high",
                                 chat_template_kwargs={"reasoning_effort": "low"})
    assert both.template_kwargs() == {"reasoning_effort": "low"}  # the explicit template variable wins
    assert ChatCompletionRequest(model="m", messages=question).template_kwargs() is None


def test_a_turn_the_template_writes_parses_back(template):
    """The assistant turn gpt-oss's template renders (reasoning, then a call with the recipient
    after the role), as the model would write it after the prompt: its reasoning and its call."""
    tokenizer = Tokenizer(backend=harmony_tokenizer(), eos_token_ids=(RETURN_ID, CALL_ID), chat_template=template)
    question = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    turn = {"role": "assistant", "content": "", "thinking": "Paris, two days.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}  # fmt: skip
    before = tokenizer.apply_chat_template(question, add_generation_prompt=True, tools=TOOLS)
    whole = tokenizer.apply_chat_template([*question, turn], add_generation_prompt=False, tools=TOOLS)
    assert whole.startswith(before)
    output = whole[len(before) :]
    assert output.startswith("<|channel|>analysis<|message|>") and output.endswith("<|call|>")
    for pieces in split_everywhere(output):
        assert through_the_api(pieces, before) == ("Paris, two days.", None, [("get_weather", '{"city": "Paris", "days": 2}')])


# --- the parsers ---------------------------------------------------------------------------------


def split_everywhere(text: str) -> list[list[str]]:
    """`text` in two pieces at every boundary, and a character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def through_the_api(pieces: list[str], prompt: str | None = PROMPT, tools: bool = True):
    """What the chat API makes of an output arriving in `pieces`, streamed: the reasoning stream,
    then the tool-call stream on its content, as `_ChatShape.deltas` runs them: (reasoning or
    None, content or None, [(name, arguments)]). The same whole (`split` then `parse`) is checked."""
    reasoning_stream, calls_stream = GptOssReasoningParser().stream(prompt), ToolCallStream(HarmonyToolParser(TOOLS))
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        delta = reasoning_stream.feed(piece, final)
        reasoning += delta.reasoning
        shown, done = calls_stream.feed(delta.content, final) if tools else (delta.content, [])
        assert "<|" not in delta.reasoning and (not tools or "<|" not in shown), (delta, shown)
        content += shown
        calls += [(c.name, c.arguments) for c in done]
    streamed = (reasoning.strip() or None, content.strip() or None, calls)
    thought, answer = GptOssReasoningParser().split("".join(pieces), prompt)
    answer, whole = HarmonyToolParser(TOOLS).parse(answer or "") if tools else (answer, [])
    assert streamed == (thought, answer or None, [(c.name, c.arguments) for c in whole])
    return streamed


ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather. Use get_weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":2}<|call|>'
ROLE_CALL = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>'
WEATHER_CALL, TIME_CALL = ("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "UTC"}')
THOUGHT = "The user asks for the weather. Use get_weather."


@pytest.mark.parametrize("output, expected", [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", (THOUGHT, "It is sunny.", [])),
    (ANALYSIS + CALL, (THOUGHT, None, [WEATHER_CALL])),
    (ANALYSIS + CALL + ROLE_CALL, (THOUGHT, None, [WEATHER_CALL, TIME_CALL])),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>" + CALL,
     (THOUGHT, "Checking the weather.", [WEATHER_CALL])),  # a preamble is content
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
     (None, None, [WEATHER_CALL])),  # no reasoning first
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>', (None, None, [TIME_CALL])),
    # gpt-oss-20b's stray channel before the real one; a built-in tool's call is the model's reasoning.
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>Hm.<|end|>"
     "<|start|>assistant<|channel|>analysis to=python code<|message|>print(2 + 2)<|call|>", ("Hm.\n\nprint(2 + 2)", None, [])),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 4 <|end|> sunny", (THOUGHT, "It is 4 \n\n sunny", [])),
    ("No harmony at all: <b>plain</b>.", (None, "No harmony at all: <b>plain</b>.", [])),
    ("<|channel|>analysis<|message|>cut short by max_tok", ("cut short by max_tok", None, [])),
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa',
     (THOUGHT, None, [("get_weather", '{"city": "Pa')])),  # a call cut short: its arguments so far
])  # fmt: skip
def test_harmony_outputs_split_the_same_streamed_at_every_boundary_as_whole(output, expected):
    for pieces in split_everywhere(output):
        assert through_the_api(pieces) == expected, pieces


def test_without_tools_the_answer_is_content_and_a_call_stays_as_written():
    assert through_the_api([ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"], tools=False) == (
        THOUGHT, "Sunny.", [])
    _, content, _ = through_the_api([ANALYSIS + CALL], tools=False)
    assert content == CALL  # no tool parser to read it (tool_choice none): the call as the model wrote it


def test_a_prompt_that_opened_a_message_starts_the_output_inside_it():
    prompt = PROMPT + "<|channel|>analysis<|message|>"
    assert through_the_api(["Hm.<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>"], prompt) == (
        "Hm.", "Yes.", [])


def test_the_raw_output_keeps_its_other_messages_and_gives_its_calls():
    """Without the reasoning parser (`reasoning_parser: none`) the tool parser reads the raw output."""
    content, calls = HarmonyToolParser(TOOLS).parse(ANALYSIS + CALL)
    assert content == ANALYSIS and [(c.name, c.arguments) for c in calls] == [WEATHER_CALL]


FORCED = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'


@pytest.mark.parametrize("end, call", [
    (0, None),
    (len("<|channel|>"), ("", "")),  # two names begin with "get_"
    (FORCED.index("get_w") + 5, ("get_weather", "")),  # only one name starts so
    (FORCED.index(" <|constrain|>"), ("get_weather", "")),
    (FORCED.index('"Paris"') + 3, ("get_weather", '{"city": "Pa')),
    (len(FORCED) - len("<|call|>"), WEATHER_CALL),
    (len(FORCED), WEATHER_CALL),
])  # fmt: skip
def test_a_forced_output_cut_anywhere_reads_as_its_call_so_far(end, call):
    calls = HarmonyToolParser(TOOLS).parse_forced(FORCED[:end], NAMES)
    assert [(c.name, c.arguments) for c in calls] == ([] if call is None else [call])


def test_the_forcing_grammar_writes_the_markers_as_special_tokens():
    from cadenza.samplers.grammars import build_lltokenizer

    backend = harmony_tokenizer()
    tokenizer = build_lltokenizer(Tokenizer(backend=backend, eos_token_ids=(RETURN_ID, CALL_ID)), 300, (RETURN_ID, CALL_ID))
    grammar = llguidance.LLMatcher.grammar_from_lark(HarmonyToolParser(TOOLS).grammar(TOOLS, parallel=False))
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(backend.encode(text, add_special_tokens=False).ids) and matcher.is_stopped()

    assert accepts(FORCED) and not accepts(FORCED.replace("Paris", "Rome"))
    assert not accepts(FORCED.replace('"days": 2', '"days": 2, "x": 1'))  # closed to the declared keys
    # A marker spelt out in ordinary tokens is not the special token the grammar wants.
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.consume_tokens(backend.encode("<", add_special_tokens=False).ids)


# --- served, through the openai SDK ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, template):
    """A tiny Llama with gpt-oss's template and harmony's special tokens; the server picks the
    harmony parsers itself. Its config names <|return|> its only EOS, as a GGUF of gpt-oss does:
    <|call|> ends an output because the parsers say it does (`end_tokens`)."""
    import openai
    from server_process import running_server
    from tiny_models import build_tiny_model
    from transformers import PreTrainedTokenizerFast

    directory = build_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "model", "llama3", max_position_embeddings=4096,
                                 eos_token_id=RETURN_ID, bos_token_id=0)  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=harmony_tokenizer(template), eos_token="<|return|>",
                                   pad_token="<|endoftext|>")  # fmt: skip
    fast.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(template)
    with running_server(directory) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            yield client, client.models.list().data[0].id


def written(text: str) -> dict:
    """A body that makes the model write exactly `text`: the markers as the special tokens, the
    rest as text (llguidance's Lark)."""
    parts = []
    for piece in text.split("<|")[1:]:
        marker, _, rest = piece.partition("|>")
        parts += [f"<|{marker}|>"] + ([json.dumps(rest)] if rest else [])
    return {"guided_grammar": "start: " + " ".join(parts) + "\n", "temperature": 0}


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"


def accumulate(chunks) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(reasoning, content, calls, finish_reason) of a stream, as the SDK's helpers join them."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            name, arguments = calls.get(delta.index, ("", ""))
            calls[delta.index] = (name + (delta.function.name or ""), arguments + (delta.function.arguments or ""))
        reason = choice.finish_reason or reason
    return reasoning, content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_served_reasoning_then_answer(served, stream):
    client, model = served
    kwargs = dict(model=model, messages=QUESTION, max_tokens=200, extra_body={
        **written(ANSWER), "chat_template_kwargs": {"reasoning_effort": "high"}})  # fmt: skip
    if stream:
        reasoning, content, calls, reason = accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        (choice,) = client.chat.completions.create(**kwargs).choices
        reasoning, content, calls, reason = choice.message.reasoning_content, choice.message.content, [], choice.finish_reason
    assert (reasoning.strip(), content, calls, reason) == ("Two and two.", "It is 4.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_served_reasoning_then_a_call(served, stream):
    client, model = served
    # <|call|> ends the output: what the grammar has after it is never written.
    output = ANALYSIS + CALL + "<|start|>assistant<|channel|>final<|message|>Never written.<|return|>"
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=300, extra_body=written(output))
    if stream:
        reasoning, content, calls, reason = accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        (choice,) = client.chat.completions.create(**kwargs).choices
        message = choice.message
        reasoning, content, reason = message.reasoning_content, message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert (reasoning.strip(), content or None, calls, reason) == (THOUGHT, None, [WEATHER_CALL], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_served_required_call_in_harmony_and_its_round_trip(served, stream):
    """tool_choice required: the grammar makes the model write a harmony call (its markers the
    special tokens), which `<|call|>` ends; the call and its result then render back."""
    client, model = served
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0)
    if stream:
        _, content, calls, reason = accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        (choice,) = client.chat.completions.create(**kwargs).choices
        content, reason = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert reason == "tool_calls" and not content and len(calls) == 1
    ((name, arguments),) = calls
    assert name in NAMES and set(json.loads(arguments)) == {"get_weather": {"city", "days"}, "get_time": {"zone"}}[name]
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]  # fmt: skip
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert answer.choices[0].message.tool_calls is None and answer.usage.prompt_tokens > 0


def test_served_named_call(served):
    client, model = served
    completion = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=300,
                                                tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_a_forced_call_may_follow_an_analysis_message():
    """gpt-oss reasons before it calls: the forcing grammar lets an analysis message come first,
    and the stream routes it to reasoning, the call to the tool parser."""
    from cadenza.parsers.tool_calls import forcing_grammar
    from cadenza.samplers.grammars import build_lltokenizer

    backend = harmony_tokenizer()
    tokenizer = build_lltokenizer(Tokenizer(backend=backend, eos_token_ids=(RETURN_ID, CALL_ID)), 300, (RETURN_ID, CALL_ID))
    reasoning = GptOssReasoningParser()
    before = reasoning.forced_call_reasoning("<|start|>user<|message|>hi<|end|><|start|>assistant", 64)
    grammar = llguidance.LLMatcher.grammar_from_lark(forcing_grammar(HarmonyToolParser(TOOLS).grammar(TOOLS, False), before))
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
    thought = "<|channel|>analysis<|message|>The weather tool, for Paris.<|end|><|start|>assistant"

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(backend.encode(text, add_special_tokens=False).ids) and matcher.is_stopped()

    assert accepts(FORCED) and accepts(thought + FORCED)
    assert not accepts("<|channel|>final<|message|>Sunny.<|end|><|start|>assistant" + FORCED)  # reasoning only
    split = reasoning.stream(None).feed(thought + FORCED, final=True)
    assert split.reasoning == "The weather tool, for Paris."
    calls = HarmonyToolParser(TOOLS).parse_forced(split.content, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(NAMES[0], json.loads(FORCED.partition("<|message|>")[2].partition("<|call|>")[0]))]
    # Inside a message the prompt opened, there is no room for one.
    assert reasoning.forced_call_reasoning("<|start|>assistant<|channel|>final<|message|>Sun", 64) is None
