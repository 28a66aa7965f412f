"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` SDK against a real
`cadenza serve`.

The served model is a tiny random llama3 model, so its text is noise: the tests check shapes,
events, stop reasons, token counts, and outputs a grammar constrains (a forced tool call). The
thinking tests serve a tiny Qwen3 with Qwen3's template and a test logits processor
(`anthropic_test_plugins.py`) that makes it write one known text, reasoning then answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import pytest
from server_process import running_server

from cadenza.api.anthropic.events import MessageEvents, failure
from cadenza.api.errors import APIError

KEY = "sk-test-anthropic"
TESTS = Path(__file__).resolve().parent
WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                     "required": ["zone"], "additionalProperties": False},
}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama3"), "--api-key", KEY) as process:
        yield process
        assert not [line for line in process.lines if "Traceback" in line or '"level": "error"' in line]


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=10).json()["data"][0]["id"]


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def check_weather(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input["city"] in ("Paris", "Oslo") and block.input["days"] in (1, 2, 3)
    assert set(block.input) == {"city", "days"}


# --- plain messages -------------------------------------------------------------------------------


def test_a_message_has_anthropic_shape_and_stops_at_max_tokens(client, model):
    message = client.messages.create(model=model, max_tokens=3, messages=HELLO, extra_body={"temperature": 0},
                                      metadata={"user_id": "u1"}, extra_headers={"anthropic-version": "2023-06-01"})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == model
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 3


def test_a_stream_gives_anthropic_events_and_the_same_message(client, model):
    whole = client.messages.create(model=model, max_tokens=12, messages=HELLO, extra_body={"temperature": 0})
    with client.messages.stream(model=model, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert "content_block_start" in kinds and kinds.count("content_block_start") == kinds.count("content_block_stop")
    deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert "".join(deltas) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens - \
        final.usage.cache_read_input_tokens
    assert final.id.startswith("msg_")


def test_system_blocks_and_several_turns(client, model):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    message = client.messages.create(model=model, max_tokens=4, system=system, messages=turns)
    counted = client.messages.count_tokens(model=model, system=system, messages=turns).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    assert counted > client.messages.count_tokens(model=model, messages=turns).input_tokens
    assert client.messages.count_tokens(model=model, system="You are terse.", messages=turns).input_tokens == counted


def test_a_stop_sequence_ends_the_text_and_is_named(client, model):
    text = text_of(client.messages.create(model=model, max_tokens=24, messages=HELLO, extra_body={"temperature": 0}))
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip())
    message = client.messages.create(model=model, max_tokens=24, messages=HELLO, stop_sequences=[stop],
                                     extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == text[: text.index(stop)]
    with client.messages.stream(model=model, max_tokens=24, messages=HELLO, extra_body={"temperature": 0},
                                stop_sequences=["never written", stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


# --- tools ----------------------------------------------------------------------------------------


def test_a_forced_tool_call_then_its_result(client, model):
    message = client.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                                     tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["tool_use"]
    call = message.content[0]
    check_weather(call)
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": message.content},  # the SDK's blocks, as they came
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                 {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                  "content": [{"type": "text", "text": "second call failed"}]},
                 {"type": "text", "text": "Thanks."}]}]
    answer = client.messages.create(model=model, max_tokens=5, messages=turns, tools=[WEATHER, TIME],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(block.type == "text" for block in answer.content)
    # The results reach the template: the prompt holds them.
    bare = client.messages.count_tokens(model=model, messages=turns[:2] + [{"role": "user", "content": "Thanks."}],
                                        tools=[WEATHER, TIME]).input_tokens
    assert client.messages.count_tokens(model=model, messages=turns, tools=[WEATHER, TIME]).input_tokens > bare
    # The SDK's blocks dumped whole (fields it sets to null included) are accepted too.
    turns[1]["content"] = [block.model_dump() for block in message.content]
    assert client.messages.create(model=model, max_tokens=1, messages=turns).usage.output_tokens == 1


def test_a_forced_tool_call_streams_its_input_as_json_deltas(client, model):
    with client.messages.stream(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                                tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].input == {}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == final.content[0].input
    check_weather(final.content[0])
    assert final.stop_reason == "tool_use" and final.content[0].id == starts[0].id


def test_any_tool_with_one_call(client, model):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Do it"}],
                                     tools=[WEATHER, TIME], tool_choice=choice)
    assert message.stop_reason == "tool_use" and len(message.content) == 1
    block = message.content[0]
    if block.name == "get_weather":
        check_weather(block)
    else:
        assert block.name == "get_time" and block.input in ({"zone": "UTC"}, {"zone": "CET"})


def test_count_tokens_is_what_the_message_uses(client, model):
    counted = client.messages.count_tokens(model=model, messages=HELLO, tools=[WEATHER]).input_tokens
    message = client.messages.create(model=model, max_tokens=1, messages=HELLO, tools=[WEATHER])
    assert counted > 0 and message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=HELLO)


# --- errors ---------------------------------------------------------------------------------------


def test_a_prefill_is_continued_not_answered(client, model):
    """A last assistant turn with text is a prefill: the prompt ends inside it (no end of turn, no
    new header), and the answer is what the model writes after it."""
    turns = [{"role": "user", "content": "Count to five."}]
    prefilled = [*turns, {"role": "assistant", "content": "One, two,"}]
    answered = [*prefilled, {"role": "user", "content": "Go on."}]
    counts = {name: client.messages.count_tokens(model=model, messages=m).input_tokens
              for name, m in (("turns", turns), ("prefilled", prefilled), ("answered", answered))}  # fmt: skip
    assert counts["turns"] < counts["prefilled"] < counts["answered"]
    message = client.messages.create(model=model, max_tokens=3, messages=prefilled)
    assert message.stop_reason == "max_tokens" and message.usage.input_tokens + message.usage.cache_read_input_tokens == counts["prefilled"]


def test_errors_come_in_anthropic_shape_through_the_sdk(server, client, model):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nope", max_tokens=5, messages=HELLO)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert model in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=5, messages=HELLO, extra_body={"frequency_penalty": 1})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "frequency_penalty" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=anthropic.NOT_GIVEN, messages=HELLO)
    assert "max_tokens" in caught.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    assert "image" in caught.value.body["error"]["message"] and "not supported" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # a named tool that is not offered
        client.messages.create(model=model, max_tokens=5, messages=HELLO, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_time"})
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            stranger.messages.create(model=model, max_tokens=5, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        stranger_stream = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
        with stranger_stream.messages.stream(model=model, max_tokens=5, messages=HELLO) as stream:
            list(stream)
    # Bad JSON and an unknown path under /v1/messages are Anthropic's errors too.
    reply = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=10,
                       headers={"x-api-key": KEY, "content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = httpx.post(server.url + "/v1/messages/batches", json={}, headers={"x-api-key": KEY}, timeout=10)
    assert reply.status_code in (404, 405) and reply.json()["type"] == "error"


def test_a_stream_refused_before_it_began_is_an_anthropic_error(client, model):
    long = [{"role": "user", "content": "fox " * 5000}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        with client.messages.stream(model=model, max_tokens=5, messages=long) as stream:
            list(stream)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_mid_stream_leaves_the_server_healthy(server, client, model):
    body = {"model": model, "max_tokens": 400, "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = reply.iter_lines()
        assert next(lines) == "event: message_start"
        seen = [next(lines) for _ in range(12)]
    assert any(line == "event: content_block_delta" for line in seen)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert client.messages.create(model=model, max_tokens=2, messages=HELLO).usage.output_tokens == 2


# --- the stream's events alone --------------------------------------------------------------------


def frames(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for frame in raw:
        kind, data = frame.decode().strip().split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_reasoning_text_and_calls_become_blocks_in_order():
    events = MessageEvents("msg_1", "m")
    chunks = [{"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}], "usage": None},
              {"choices": [{"delta": {"reasoning_content": "hmm"}, "finish_reason": None}], "usage": None},
              {"choices": [{"delta": {"content": "ok"}, "finish_reason": None}], "usage": None},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                      "function": {"name": "f", "arguments": ""}}]}}], "usage": None},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}}]},
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                        "prompt_tokens_details": {"cached_tokens": 2}}}]
    got = frames([frame for chunk in chunks for frame in events.feed(chunk)] + events.end(None))
    assert [kind for kind, _ in got] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    blocks = [body["content_block"] for kind, body in got if kind == "content_block_start"]
    assert blocks[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert blocks[2] == {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}
    assert [body["index"] for kind, body in got if kind.startswith("content_block")] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2][1]["usage"]["input_tokens"] == 5 and got[-2][1]["usage"]["cache_read_input_tokens"] == 2


def test_a_failure_mid_stream_is_an_error_event():
    kind, body = frames([failure(APIError(503, "kv_cache_full", "no room"))])[0]
    assert kind == "error" and body == {"type": "error", "error": {"type": "overloaded_error", "message": "no room"}}


# --- thinking -------------------------------------------------------------------------------------

SCRIPT = "<think>\nTwo and two.\n</think>\n\nIt is 4."


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    from tiny_models import build_tiny_model

    from cadenza.bench.peers.llamacpp_build import source_dir
    from cadenza.config.schema import DEFAULT_LOGITS_PROCESSORS

    directory = build_tiny_model(tmp_path_factory.mktemp("qwen3-anthropic"), "qwen3")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    shutil.copy(source_dir() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja", directory / "chat_template.jinja")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    deployment = tmp_path_factory.mktemp("config") / "scripted.yaml"
    deployment.write_text(json.dumps({
        "plugins": ["anthropic_test_plugins"],
        "sampling": {"logits_processors": [*DEFAULT_LOGITS_PROCESSORS, "scripted"]},
        "plugin_options": {"scripted": {"text": SCRIPT}},
    }))
    with running_server(directory, "--config", str(deployment), env={"PYTHONPATH": str(TESTS)}) as process:
        with anthropic.Anthropic(base_url=process.url, api_key="x", max_retries=0, timeout=60) as c:
            yield c, httpx.get(process.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_thinking_comes_as_a_thinking_block_before_the_text(thinking_client):
    client, model = thinking_client
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model=model, max_tokens=64, messages=HELLO, thinking=thinking)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "Two and two." and message.content[0].signature == ""
    assert message.content[1].text == "It is 4." and message.stop_reason == "end_turn"
    with client.messages.stream(model=model, max_tokens=64, messages=HELLO, thinking=thinking) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and "text_delta" in deltas
    assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking.strip() == "Two and two." and final.content[1].text == "It is 4."


def test_thinking_reaches_the_template_and_comes_back_in_turns(thinking_client):
    client, model = thinking_client
    on = client.messages.count_tokens(model=model, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model=model, messages=HELLO, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens  # Qwen3's template closes an empty <think> in the prompt
    # Qwen3's template writes the tools into the prompt: they are counted.
    assert client.messages.count_tokens(model=model, messages=HELLO, tools=[WEATHER]).input_tokens > \
        client.messages.count_tokens(model=model, messages=HELLO).input_tokens + 20
    turns = [*HELLO, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "They greet me.", "signature": ""},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Hi!"}]}, {"role": "user", "content": "And?"}]
    message = client.messages.create(model=model, max_tokens=64, messages=turns)
    assert [block.type for block in message.content] == ["thinking", "text"]
