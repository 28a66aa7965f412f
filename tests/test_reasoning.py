"""Reasoning apart from the answer: the parsers alone, the chat templates that choose them, and
served chat answers through the official `openai` SDK, streamed and whole.

The templates are the families' real ones, as llama.cpp's source keeps them
(`models/templates/`, from the source the bench builds llama.cpp from). The served model is a tiny
random Qwen3 with Qwen3's template; a `guided_regex` of one literal text makes it write exactly
that text, so what the server splits is known.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from server_process import running_server

from cadenza.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, parser_name_for_template

QWEN3, R1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()


@pytest.fixture(scope="module")
def templates():
    from cadenza.bench.peers.llamacpp_build import source_dir

    return source_dir() / "models" / "templates"


def streamed(parser, text: str, prompt: str | None, cut: int) -> tuple[str, str, list[str]]:
    """`text` fed `cut` characters at a time: (reasoning, content, the order deltas came in)."""
    stream = parser.stream(prompt)
    reasoning, content, order = [], [], []
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)] or [""]
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        if delta.reasoning:
            reasoning.append(delta.reasoning)
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
            order.append("content")
    return "".join(reasoning), "".join(content), order


QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING_PROMPT = QWEN_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>hi<｜Assistant｜><think>\n"


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    (QWEN3, QWEN_PROMPT, "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", "Let me see: 2 + 2.", "It is 4."),
    (QWEN3, NO_THINKING_PROMPT, "It is 4.", None, "It is 4."),
    (QWEN3, QWEN_PROMPT, "It is 4, no <think> at the start.", None, "It is 4, no <think> at the start."),
    (QWEN3, QWEN_PROMPT, "<think>\ncut short by max_tokens", "cut short by max_tokens", None),
    (R1, R1_PROMPT, "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (R1, R1_PROMPT, "still thinking when the output ended </thi", "still thinking when the output ended </thi", None),
    (QWEN3, None, "<think>a < b, and </ is not </think>\n\nyes", "a < b, and </ is not", "yes"),
])  # fmt: skip
def test_streamed_in_any_pieces_gives_what_the_whole_output_gives(parser, prompt, text, reasoning, content, cut):
    assert parser.split(text, prompt) == (reasoning, content)
    got_reasoning, got_content, order = streamed(parser, text, prompt, cut)
    assert (got_reasoning.strip() or None, got_content.strip() or None) == (reasoning, content)
    assert order == sorted(order, key=["reasoning", "content"].index)  # reasoning first, then content


def test_a_tag_split_across_deltas_is_held_back_not_shown():
    stream = QWEN3.stream(QWEN_PROMPT)
    assert stream.feed("<thi", final=False).reasoning == ""  # perhaps the tag: nothing shown yet
    assert stream.feed("nk>\nabc</th", final=False).reasoning == "abc"
    delta = stream.feed("ink>\n\nanswer", final=False)
    assert (delta.reasoning, delta.content) == ("", "answer")


def test_the_chat_template_chooses_the_parser(templates):
    assert parser_name_for_template((templates / "Qwen-Qwen3-0.6B.jinja").read_text()) == "qwen3"
    assert parser_name_for_template((templates / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()) == "qwen3"
    assert parser_name_for_template((templates / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()) is None
    assert parser_name_for_template(None) is None


def test_where_the_output_starts_is_read_from_the_real_templates(templates):
    from tiny_models import build_tokenizer

    from cadenza.models.tokenizer import Tokenizer

    backend = build_tokenizer().backend_tokenizer
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    def rendered(name: str, **kwargs) -> str:
        tokenizer = Tokenizer(backend=backend, eos_token_ids=(2,), chat_template=(templates / name).read_text())
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)

    qwen3 = "Qwen-Qwen3-0.6B.jinja"
    assert not QWEN3.starts_in_reasoning(rendered(qwen3))  # the model opens <think> itself
    assert not QWEN3.starts_in_reasoning(rendered(qwen3, enable_thinking=False))  # closed in the prompt
    assert rendered(qwen3, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    # This copy of DeepSeek-R1's template opens <think> in the prompt, and closes it at once
    # unless enable_thinking is set.
    r1 = rendered("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", enable_thinking=True)
    assert R1.starts_in_reasoning(r1) and r1.endswith("<think>\n")
    assert not R1.starts_in_reasoning(rendered("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))


# --- served, through the openai SDK ----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, templates):
    from tiny_models import build_tiny_model

    directory = build_tiny_model(tmp_path_factory.mktemp("qwen3-thinking"), "qwen3")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    shutil.copy(templates / "Qwen-Qwen3-0.6B.jinja", directory / "chat_template.jinja")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def served(qwen3_dir):
    with running_server(qwen3_dir) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            yield server, client, client.models.list().data[0].id


def forced(text: str) -> dict:
    """A body that makes the model write exactly `text`, and stop."""
    return {"guided_regex": re.escape(text), "temperature": 0}


THOUGHT = "<think>\nTwo and two.\n</think>\n\nIt is 4."
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_whole_answer_carries_reasoning_content_beside_content(served):
    _, client, model = served
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=64, extra_body=forced(THOUGHT))
    message = answer.choices[0].message
    assert message.reasoning_content == "Two and two."
    assert message.content == "It is 4."
    assert answer.choices[0].finish_reason == "stop"


def test_a_stream_gives_reasoning_deltas_then_content_deltas(served):
    _, client, model = served
    chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=64, stream=True,
                                            extra_body=forced(THOUGHT))
    order, reasoning, content = [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thought = (delta.model_extra or {}).get("reasoning_content")
        if thought:
            reasoning.append(thought)
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
            order.append("content")
    assert "".join(reasoning).strip() == "Two and two."
    assert "".join(content) == "It is 4."
    assert order.index("content") > order.index("reasoning") and order == sorted(order, key=["reasoning", "content"].index)
    assert len(reasoning) > 1  # deltas as the tokens came, not one piece at the end


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(served):
    _, client, model = served
    text = "It is 4."
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, extra_body={
        **forced(text), "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True})
    message = answer.choices[0].message
    assert message.content == text and message.reasoning_content is None
    # The prompt had the empty <think></think> in it: its tokens count, so it is longer.
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, extra_body=forced(text))
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens


def test_chat_template_kwargs_may_not_set_what_the_server_sets(served):
    server, _, model = served
    body = {"model": model, "messages": QUESTION, "chat_template_kwargs": {"add_generation_prompt": False}}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "add_generation_prompt" in error["message"]


def test_reasoning_parser_none_leaves_the_tags_in_the_content(qwen3_dir):
    with running_server(qwen3_dir, "--reasoning-parser", "none") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            model = client.models.list().data[0].id
            answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=64, extra_body=forced(THOUGHT))
    assert answer.choices[0].message.content == THOUGHT
    assert getattr(answer.choices[0].message, "reasoning_content", None) is None


def test_an_unknown_reasoning_parser_fails_start_up_naming_the_known_ones(qwen3_dir):
    from cadenza.config import load_config
    from cadenza.plugins.errors import UnknownNameError
    from cadenza.runtime.plugins import resolve_plugins

    config = load_config(overrides={"model.path": str(qwen3_dir), "server.reasoning_parser": "no_such"})
    with pytest.raises(UnknownNameError, match="no_such.*deepseek_r1.*qwen3"):
        resolve_plugins(config)


# --- reasoning before a forced call -------------------------------------------------------------

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def _forcing(parser, prompt_text, budget=64):
    import llguidance

    from cadenza.parsers.tool_calls import HermesToolParser, forcing_grammar

    text = forcing_grammar(HermesToolParser().grammar([TIME_TOOL], False), parser.forced_call_reasoning(prompt_text, budget))
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""

    class Bytes:  # one token per byte, and EOS
        is_tokenizer_wrapper = True
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

        def __call__(self, s):
            return list(s.encode())

    tokenizer = llguidance.LLTokenizer(Bytes(), n_vocab=257, eos_token=256)

    def accepts(output: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(output.encode())) and matcher.is_accepting()

    return accepts


def test_a_forced_call_may_follow_the_model_s_thought_within_its_budget():
    accepts = _forcing(Qwen3ReasoningParser(), "<|im_start|>assistant\n")
    assert accepts(CALL) and accepts("<think>\nThe time tool.\n</think>\n\n" + CALL)
    assert accepts("<think>x < y</think>" + CALL)  # a '<' in the thought is no closing tag
    assert not accepts("It is noon." + CALL)  # an answer is no thought
    assert not accepts("<think>a</think>b</think>" + CALL)  # the first closing tag ends it
    # Thinking turned off (the template closed an empty thought): the call comes first.
    assert Qwen3ReasoningParser().forced_call_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", 64) is None
    # A prompt that opened the thought (DeepSeek-R1's): the model closes it before the call.
    opened = _forcing(DeepSeekR1ReasoningParser(), "<｜Assistant｜><think>\n")
    assert opened("Plan.</think>\n" + CALL) and not opened(CALL)


@pytest.fixture(scope="module")
def scripted(templates, tmp_path_factory):
    """A tiny Qwen3 with Qwen3's template (its tool preamble is long: a longer context), its model
    made to write one text that thinks, then calls."""
    from tiny_models import build_tiny_model

    from cadenza.config.schema import DEFAULT_LOGITS_PROCESSORS

    qwen3_dir = build_tiny_model(tmp_path_factory.mktemp("qwen3-tools"), "qwen3", max_position_embeddings=2048)
    (qwen3_dir / "chat_template.jinja").unlink(missing_ok=True)
    shutil.copy(templates / "Qwen-Qwen3-0.6B.jinja", qwen3_dir / "chat_template.jinja")
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (qwen3_dir / "tokenizer_config.json").write_text(json.dumps(config))

    tests = __import__("pathlib").Path(__file__).parent
    deployment = tmp_path_factory.mktemp("scripted") / "deploy.yaml"
    deployment.write_text(json.dumps({
        "plugins": ["anthropic_test_plugins"],
        "sampling": {"logits_processors": [*DEFAULT_LOGITS_PROCESSORS, "scripted"]},
        "plugin_options": {"scripted": {"text": "<think>\nThe time tool, in UTC.\n</think>\n\n" + CALL}}}))  # fmt: skip
    with running_server(qwen3_dir, "--config", str(deployment), env={"PYTHONPATH": str(tests)}) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            yield client, client.models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_after_reasoning_through_the_sdk(scripted, stream):
    """tool_choice required on a model that reasons: its thought is reasoning_content, its call
    a tool call, as vLLM gives them."""
    client, model = scripted
    kwargs = dict(model=model, messages=QUESTION, tools=[TIME_TOOL], tool_choice="required", max_tokens=120)
    if stream:
        reasoning, arguments, name = "", "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            assert not delta.content
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, (call,) = message.reasoning_content, message.tool_calls
        name, arguments = call.function.name, call.function.arguments
        assert message.content is None
    assert reasoning.strip() == "The time tool, in UTC."
    assert (name, json.loads(arguments)) == ("get_time", {"zone": "UTC"})
