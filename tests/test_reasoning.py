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
