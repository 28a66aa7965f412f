"""Ollama's API (api/ollama/) through the official `ollama` client, against a real `cadenza serve`.

The served model is a tiny random llama with a chat template that shows tools and opens `<think>`
when `enable_thinking` is set (so the reasoning parser is Qwen3's, and a `think: true` answer is
all thinking): its text is noise, so the tests check shapes, counts, reasons, what greedy decoding
repeats, and what a `format` constrains. A model-written tool call is checked through the chat
core's own parsing, without a server.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import ollama
import pytest
from server_process import running_server

from cadenza.api.errors import APIError
from cadenza.api.ollama.answers import Answer, Clock
from cadenza.api.ollama.protocol import keep_alive_seconds
from cadenza.api.ollama.routes import _failure

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ollama") / "tiny-llama"
    shutil.copytree(tiny_model_dir("llama3"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    with running_server(directory) as process:
        yield process
        assert httpx.get(process.url + "/health", timeout=10).status_code == 200
        assert not [line for line in process.lines if "Traceback" in line or '"level": "error"' in line]


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def model(client):
    return client.list().models[0].model


def check_done(answer, num_predict: int | None = None) -> None:
    assert answer.done is True and answer.done_reason in ("stop", "length")
    assert answer.prompt_eval_count > 0 and answer.eval_count > 0
    assert 0 <= answer.eval_duration <= answer.total_duration and answer.prompt_eval_duration >= 0
    assert answer.load_duration >= 0
    if num_predict is not None:
        assert answer.eval_count <= num_predict
        assert answer.done_reason == "stop" or answer.eval_count == num_predict


# --- chat and generate ---------------------------------------------------------------------------


def test_logprobs(client, model):
    answer = client.chat(model=model, messages=HI, logprobs=True, top_logprobs=2, options=GREEDY)
    assert len(answer.logprobs) == answer.eval_count
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in answer.logprobs)
    streamed = list(client.generate(model=model, prompt="hi", logprobs=True, options=GREEDY, stream=True))
    assert sum(len(c.logprobs or ()) for c in streamed) == streamed[-1].eval_count


def test_chat_whole_and_streamed_agree(client, model):
    whole = client.chat(model=model, messages=HI, options=GREEDY)
    assert whole.model == model and whole.message.role == "assistant" and whole.message.content
    check_done(whole, 12)
    chunks = list(client.chat(model=model, messages=HI, options=GREEDY, stream=True))
    assert all(c.done is False for c in chunks[:-1]) and len(chunks) > 2
    last = chunks[-1]
    check_done(last, 12)
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert last.eval_count == whole.eval_count and last.prompt_eval_count == whole.prompt_eval_count


def test_the_name_with_or_without_its_tag(client, model):
    assert model.endswith(":latest")
    answer = client.chat(model=model.removesuffix(":latest"), messages=HI, options={"num_predict": 2})
    assert answer.done and answer.model == model


def test_generate_templated_raw_and_streamed(client, model):
    whole = client.generate(model=model, prompt="hi", options=GREEDY)
    check_done(whole, 12)
    streamed = list(client.generate(model=model, prompt="hi", options=GREEDY, stream=True))
    assert "".join(c.response for c in streamed) == whole.response
    check_done(streamed[-1], 12)
    system = client.generate(model=model, prompt="hi", system="Be brief.", options=GREEDY)
    raw = client.generate(model=model, prompt="hi", raw=True, options=GREEDY)
    check_done(raw, 12)
    # The template wraps the prompt in its turns: the raw prompt is the shortest.
    assert raw.prompt_eval_count < whole.prompt_eval_count < system.prompt_eval_count
    raw_streamed = list(client.generate(model=model, prompt="hi", raw=True, options=GREEDY, stream=True))
    assert "".join(c.response for c in raw_streamed) == raw.response


def test_a_chat_without_messages_loads_the_model(client, model):
    assert client.chat(model=model, messages=[]).done_reason == "load"
    assert client.generate(model=model).done_reason == "load"
    assert client.generate(model=model, keep_alive=0).done_reason == "unload"


def test_options_num_predict_seed_and_stop(client, model):
    short = client.generate(model=model, prompt="hi", raw=True, options={"num_predict": 3, "temperature": 0})
    check_done(short, 3)
    endless = client.generate(model=model, prompt="hi", raw=True, options={"num_predict": -1, "temperature": 0})
    assert endless.done and endless.eval_count >= short.eval_count
    sampled = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "repeat_penalty": 1.1,
               "presence_penalty": 0.2, "frequency_penalty": 0.1, "seed": 7, "num_predict": 16}
    first = client.chat(model=model, messages=HI, options=sampled)
    again = client.chat(model=model, messages=HI, options=sampled)
    assert first.message.content == again.message.content and first.eval_count == again.eval_count
    text = client.generate(model=model, prompt="hi", raw=True, options={"temperature": 0, "num_predict": 32}).response
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    stopped = client.generate(model=model, prompt="hi", raw=True,
                              options={"temperature": 0, "num_predict": 32, "stop": [stop]})
    assert stopped.response == text[: text.index(stop)] and stopped.done_reason == "stop"


def test_unmapped_options_and_a_large_num_ctx_are_accepted(client, model, server):
    answer = client.chat(model=model, messages=HI, options={"num_predict": 2, "num_ctx": 1 << 20, "mirostat": 1,
                                                             "num_gpu": 99, "no_such_option": True})
    assert answer.done
    client.chat(model=model, messages=HI, options={"num_predict": 2, "mirostat": 1})
    ignored = [line for line in server.log_events("Ollama option ignored") if '"mirostat"' in line]
    assert len(ignored) == 1  # logged once
    assert server.log_events("Ollama num_ctx capped at max_model_len")


def test_format_json_and_a_schema_constrain_the_output(client, model):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}  # fmt: skip
    answer = client.chat(model=model, messages=HI, format=schema, options={"temperature": 0, "num_predict": 100})
    assert answer.done_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), schema)
    generated = client.generate(model=model, prompt="hi", format=schema, options={"temperature": 0.7, "seed": 3,
                                                                                 "num_predict": 100})
    jsonschema.validate(json.loads(generated.response), schema)
    anything = client.chat(model=model, messages=HI, format="json", options={"temperature": 0, "num_predict": 60})
    # Any JSON object: a random model's may run past num_predict, unclosed.
    assert anything.message.content.startswith("{")
    assert anything.done_reason == "length" or isinstance(json.loads(anything.message.content), dict)


def test_think_puts_the_reasoning_in_thinking(client, model):
    thought = client.chat(model=model, messages=HI, think=True, options=GREEDY)
    assert thought.message.thinking and not thought.message.content  # the template opened <think>, never closed
    streamed = list(client.chat(model=model, messages=HI, think=True, options=GREEDY, stream=True))
    assert "".join(c.message.thinking or "" for c in streamed).strip() == thought.message.thinking
    plain = client.chat(model=model, messages=HI, think=False, options=GREEDY)
    assert plain.message.thinking is None and plain.message.content
    generated = client.generate(model=model, prompt="hi", think=True, options=GREEDY)
    assert generated.thinking and not generated.response
    # An earlier turn's thinking and tool calls are taken back.
    history = [*HI, {"role": "assistant", "content": "", "thinking": "hm",
                     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]  # fmt: skip
    assert client.chat(model=model, messages=history, options={"num_predict": 2}).done


def get_weather(city: str) -> str:
    """Get the weather in a city.

    Args:
      city: The city's name.

    Returns:
      str: The weather.
    """
    return "sunny"


def test_tools_are_accepted(client, model):
    answer = client.chat(model=model, messages=HI, tools=[get_weather], options={"num_predict": 4})
    assert answer.done and answer.message.role == "assistant"
    # The template shows the model its tools: the prompt is longer.
    plain = client.chat(model=model, messages=HI, options={"num_predict": 1})
    assert answer.prompt_eval_count > plain.prompt_eval_count
    assert "tools" in client.show(model).capabilities


def test_a_model_written_tool_call_becomes_message_tool_calls():
    """The chat core's parsing of a Hermes call, then this protocol's mapping of its chunks."""
    from cadenza.api.openai.completions import _ChatShape
    from cadenza.engine.streams import GenerationOutput
    from cadenza.parsers.tool_calls import HermesToolParser

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    shape = _ChatShape(None, 1, False, HermesToolParser(tools))
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    streamed, whole = Answer("chat"), Answer("chat")
    lines = []
    for i, piece in enumerate((text[:20], text[20:50], text[50:])):
        out = GenerationOutput(request_id="r", text=piece, token_ids=(), logprobs=None,
                               finish_reason="stop" if i == 2 else None, num_prompt_tokens=5,
                               num_output_tokens=i + 1, num_cached_tokens=0)
        for body in shape.deltas(0, out):
            chunk = {"choices": [body]}
            whole.feed(chunk)
            fields = streamed.feed(chunk)
            lines += [fields] if fields else []
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert [f["message"]["tool_calls"] for f in lines if "tool_calls" in f["message"]] == [[call]]
    answer = whole.whole(Clock())
    assert answer["message"]["tool_calls"] == [call] and answer["message"]["content"] == "Let me look. "
    assert answer["done_reason"] == "stop"  # Ollama's reason for an answer that ends in calls


# --- the model, embeddings ------------------------------------------------------------------------


def test_tags_show_ps_version(client, model, server):
    listed = client.list().models
    assert len(listed) == 1 and listed[0].model == model and listed[0].size > 0 and len(listed[0].digest) == 64
    assert listed[0].details.family == "llama" and listed[0].details.format == "safetensors"
    assert listed[0].details.parameter_size.endswith("K") and listed[0].details.quantization_level == "F32"
    shown = client.show(model)
    assert set(shown.capabilities) == {"completion", "tools", "thinking", "embedding"}
    assert "<think>" in shown.template and "FROM" in shown.modelfile and "temperature" in shown.parameters
    assert shown.modelinfo["llama.context_length"] == 512 and shown.modelinfo["general.architecture"] == "llama"
    running = client.ps().models
    assert running[0].model == model and running[0].size_vram == 0 and running[0].expires_at.year > 2100
    assert httpx.get(server.url + "/api/version").json()["version"]
    # The OpenAPI document describes these routes too, the model by both its names.
    document = httpx.get(server.url + "/openapi.json").json()
    assert {"/api/chat", "/api/tags", "/api/show", "/api/ps", "/api/version"} <= set(document["paths"])
    assert model in document["components"]["schemas"]["OllamaChatRequest"]["properties"]["model"]["enum"]


def test_embed_and_the_older_embeddings(client, model):
    one = client.embed(model=model, input="hello")
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 64 and one.prompt_eval_count > 0
    two = client.embed(model=model, input=["hello", "world"], dimensions=8)
    assert [len(v) for v in two.embeddings] == [8, 8]
    assert client.embed(model=model).embeddings == []
    older = client.embeddings(model=model, prompt="hello")
    assert older.embedding == pytest.approx(one.embeddings[0], abs=1e-5)
    long = client.embed(model=model, input="The quick brown fox jumps over the lazy dog. " * 80)
    assert len(long.embeddings[0]) == 64  # cut to fit the context (truncate, Ollama's default)


# --- errors ---------------------------------------------------------------------------------------


def test_errors_in_ollama_shape(client, model, server):
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="nope:7b", messages=HI)
    assert unknown.value.status_code == 404 and "model 'nope:7b' not found" in unknown.value.error
    assert model in unknown.value.error
    with pytest.raises(ollama.ResponseError) as streamed:
        list(client.generate(model="nope", prompt="hi", stream=True))
    assert streamed.value.status_code == 404
    for call in (
        lambda: client.chat(model=model, messages=HI, options={"temperature": -1}),
        lambda: client.generate(model=model, prompt="hi", suffix="end"),
        lambda: client.generate(model=model, prompt="hi", template="{{ .Prompt }}"),
        lambda: client.chat(model=model, messages=HI, options={"num_predict": 0}),
        lambda: client.chat(model=model, messages=HI, keep_alive="soon"),
        lambda: client.embed(model=model, input="x", dimensions=1000),
    ):
        with pytest.raises(ollama.ResponseError) as bad:
            call()
        assert bad.value.status_code == 400, bad.value
    with pytest.raises(ollama.ResponseError, match="options.temperature"):
        client.chat(model=model, messages=HI, options={"temperature": -1})
    # A schema the grammar cannot compile is named as the client sent it.
    with pytest.raises(ollama.ResponseError, match="^format: ") as schema:
        client.chat(model=model, messages=HI, format={"type": "object", "properties": {"a": {"type": "nope"}}})
    assert schema.value.status_code == 400
    body = {"model": model, "prompt": "hi", "format": "yaml"}
    reply = httpx.post(server.url + "/api/generate", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"].startswith('format: must be "json" or a JSON schema')
    reply = httpx.post(server.url + "/api/chat", content=b"{not json", timeout=30)
    assert reply.status_code == 400 and set(reply.json()) == {"error"}
    reply = httpx.get(server.url + "/api/chat", timeout=30)
    assert reply.status_code == 405 and set(reply.json()) == {"error"}
    reply = httpx.post(server.url + "/api/copy", json={"source": model, "destination": "x"}, timeout=30)
    assert reply.status_code == 501 and "not supported" in reply.json()["error"]
    assert client.chat(model=model, messages=HI, keep_alive="1h30m", options={"num_predict": 1}).done


def test_think_needs_a_model_that_reasons():
    from types import SimpleNamespace

    from cadenza.api.ollama.translate import thinking

    plain = SimpleNamespace(reasoning_parser=None, model_name="tiny")
    with pytest.raises(APIError, match="'tiny:latest' does not support thinking") as refused:
        thinking(plain, True)
    assert refused.value.status == 400
    assert thinking(plain, False) == {"chat_template_kwargs": {"enable_thinking": False}}
    assert thinking(plain, None) == {}
    reasons = SimpleNamespace(reasoning_parser=object(), model_name="tiny")
    assert thinking(reasons, "high") == {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}


def test_a_failure_mid_stream_is_a_last_error_line():
    assert json.loads(_failure(APIError(500, "step_failed", "boom"))) == {"error": "boom"}


def test_keep_alive_durations():
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400 and keep_alive_seconds(-1) == -1
    assert keep_alive_seconds("-1m") == -60 and keep_alive_seconds("0") == 0 and keep_alive_seconds(None) is None
    with pytest.raises(APIError):
        keep_alive_seconds("5 minutes")


def test_a_client_that_leaves_mid_stream_leaves_the_server_healthy(client, model, server):
    body = {"model": model, "messages": HI, "options": {"num_predict": 400, "temperature": 1}}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=30) as reply:
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        lines = reply.iter_lines()
        assert json.loads(next(lines))["done"] is False
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert client.chat(model=model, messages=HI, options={"num_predict": 2}).done
