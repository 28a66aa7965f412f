"""The OpenAI-compatible HTTP API on a real `cadenza serve`, through the official `openai` SDK
(and httpx where the wire itself is the point)."""

import dataclasses
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from server_process import running_server, wait_for

from cadenza import LLM, SamplingParams
from cadenza.engine.async_engine import EngineClosedError
from cadenza.engine.streams import GenerationOutput


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def kv_usage(server) -> float:
    return float(re.search(r"^cadenza_kv_cache_usage_ratio (\S+)$", metrics(server), re.M).group(1))


def aborted(server) -> float:
    found = re.search(r'^cadenza_requests_total\{api="openai",finish_reason="abort"\} (\S+)$', metrics(server), re.M)
    return float(found.group(1)) if found else 0.0


def chat(content):
    return [{"role": "user", "content": content}]


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


# --- generation ---------------------------------------------------------------------------------


def test_greedy_matches_the_engine_streamed_or_not(client, model, tiny_model_dir):
    messages = [{"role": "system", "content": "Be brief."}, *chat("The quick brown fox")]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, **GREEDY)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == model
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and choice.index == 0
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    text = client.completions.create(model=model, prompt="Paged attention", max_tokens=10, **GREEDY)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    streamed = list(
        client.completions.create(model=model, prompt="Paged attention", max_tokens=10, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text

    with LLM(tiny_model_dir("llama3"), dtype="float32") as llm:
        engine_chat, engine_text = llm.generate(
            [messages, "Paged attention"],
            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 10)],
        )
    assert choice.message.content == engine_chat.outputs[0].text
    assert text.choices[0].text == engine_text.outputs[0].text


def spec_steps(server, method) -> float:
    """Request-steps that asked `method` for guesses so far, from /metrics."""
    found = re.search(rf'^cadenza_spec_decode_steps_total\{{method="{method}"\}} (\S+)$', metrics(server), re.M)
    return float(found.group(1)) if found else 0.0


def test_speculative_per_request_through_the_sdk(server, client, model):
    """`speculative` in the body (the SDK's extra_body) picks a built proposer for one request, with
    the same greedy text as no speculation; an unbuilt proposer or too many tokens is a 400 that
    names the problem."""
    messages = chat("one two three four one two three four one two three four one two")
    create = lambda spec: client.chat.completions.create(  # noqa: E731
        model=model, messages=messages, max_tokens=24, temperature=0, extra_body={"ignore_eos": True, "speculative": spec}
    )
    plain = create({"num_tokens": 0}).choices[0].message.content
    for method in ("ngram", "suffix"):
        before = spec_steps(server, method)
        assert create({"method": method}).choices[0].message.content == plain
        assert spec_steps(server, method) > before, f"{method} was never asked"
    with pytest.raises(openai.BadRequestError, match=r"'draft' is not built here; built: ngram, none, suffix"):
        create({"method": "draft"})
    with pytest.raises(openai.BadRequestError, match=r"speculative.num_tokens: Input should be less than or equal to 16"):
        create({"num_tokens": 99})


def test_completion_prompt_kinds_and_echo(client, model):
    batch = client.completions.create(model=model, prompt=["one", "two"], max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both choices of "one" agree
    assert batch.usage.completion_tokens == 12
    ids = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3, **GREEDY)
    assert ids.choices[0].finish_reason == "length"
    token_batch = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, **GREEDY)
    assert token_batch.choices[0].text == ids.choices[0].text and len(token_batch.choices) == 2
    echoed = client.completions.create(model=model, prompt="one", max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text == "one" + batch.choices[0].text


def test_n_seeded_choices(client, model):
    def run(**kw):
        out = client.chat.completions.create(
            model=model, messages=chat("hi"), n=3, temperature=1.0, seed=7, max_tokens=8, **kw
        )
        return out

    first, again = run(), run()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # seeded: repeatable
    assert len(set(texts)) > 1  # choice i samples with seed + i
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in run(stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and [streamed[i] for i in range(3)] == texts


def test_stop_strings_and_max_tokens(client, model):
    full = client.completions.create(model=model, prompt="Continuous batching", max_tokens=24, **GREEDY).choices[0]
    assert full.finish_reason == "length"
    start = next(i for i in range(2, len(full.text) - 2) if "\ufffd" not in full.text[i : i + 2])
    stop = full.text[start : start + 2]
    for stops in (stop, ["never-there", stop]):
        cut = client.completions.create(model=model, prompt="Continuous batching", max_tokens=24, stop=stops, **GREEDY)
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full.text[: full.text.index(stop)]


def test_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=chat("hi"), max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
    plain = client.chat.completions.create(model=model, messages=chat("hi"), max_tokens=5, **GREEDY)
    assert plain.choices[0].logprobs is None

    legacy = client.completions.create(model=model, prompt="hello", max_tokens=4, logprobs=2, **GREEDY)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0

    streamed = client.chat.completions.create(
        model=model, messages=chat("hi"), max_tokens=5, logprobs=True, top_logprobs=1, stream=True, **GREEDY
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_usage_cached_tokens_and_include_usage(client, model):
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 5
    first = client.chat.completions.create(model=model, messages=chat(prompt), max_tokens=2, **GREEDY)
    second = client.chat.completions.create(model=model, messages=chat(prompt), max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 100
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens

    chunks = list(client.completions.create(
        model=model, prompt="hello", max_tokens=4, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_wire_format(server, model):
    body = {"model": model, "messages": chat("hi"), "max_tokens": 2, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant"} and "usage" not in first
    extra = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "extra": {}, "user": "u"})
    assert extra.status_code == 200


# --- errors -------------------------------------------------------------------------------------


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_bad_requests(server, client, model):
    error = error_of(post(server, "/v1/completions", {"model": model, "prompt": "x", "bogus": 1}), 400)
    assert error["code"] == "unknown_field" and error["param"] == "bogus" and "bogus" in error["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=chat("x"), temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    for stream in (False, True):  # rejected before the stream starts: a real status, not an SSE error
        with pytest.raises(openai.BadRequestError) as long:
            client.completions.create(model=model, prompt="the quick brown fox " * 300, stream=stream)
        assert long.value.body["code"] == "prompt_too_long" and "max_model_len" in long.value.body["message"]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    error = error_of(post(server, "/v1/chat/completions", {"model": model, "messages": chat(image)}), 400)
    assert "only 'text' content parts" in error["message"] and error["param"] == "messages.0.content"
    functions = [{"name": "f"}]  # the deprecated function calling; tools are supported (tests/test_tool_calls.py)
    error = error_of(post(server, "/v1/chat/completions", {"model": model, "messages": chat("x"), "functions": functions}), 400)
    assert error["param"] == "functions"
    error = error_of(httpx.post(server.url + "/v1/completions", content=b"{nope", timeout=10), 400)
    assert error["code"] == "invalid_json"
    huge = json.dumps({"model": model, "prompt": "x" * (9 << 20)})
    error = error_of(httpx.post(server.url + "/v1/completions", content=huge, timeout=30), 413)
    assert error["code"] == "request_too_large"
    assert httpx.get(server.url + "/v1/nothing-here", timeout=10).status_code == 404


def test_api_key(tiny_model_dir):
    with running_server(tiny_model_dir("llama3"), "--api-key", "sekrit") as keyed:
        base = keyed.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        no_key = httpx.post(base + "/completions", json={"model": "m", "prompt": "x"}, timeout=10)
        assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
        assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
        right = openai.OpenAI(base_url=base, api_key="sekrit", max_retries=0)
        out = right.completions.create(model=right.models.list().data[0].id, prompt="x", max_tokens=2)
        assert out.usage.completion_tokens <= 2


# --- clients that leave -------------------------------------------------------------------------

LONG = {"max_tokens": 480, "ignore_eos": True}


def test_stream_disconnect_frees_blocks(server, model):
    idle, aborts = kv_usage(server), aborted(server)
    body = {"model": model, "prompt": "hello", "stream": True, **LONG}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        completion_id = json.loads(next(lines)[6:])["id"]
        assert kv_usage(server) > idle  # generating: it holds blocks
    assert wait_for(lambda: kv_usage(server) == idle, timeout=10)
    assert wait_for(lambda: aborted(server) == aborts + 1, timeout=10)
    assert any(completion_id in line for line in server.log_events("Request aborted"))


def test_non_streaming_disconnect_aborts(server, model):
    aborts = aborted(server)
    body = {"model": model, "messages": chat("hello"), "n": 4, **LONG}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3, headers={"x-request-id": "leaver-1"})
    assert wait_for(lambda: any('"leaver-1"' in line for line in server.log_events("Client disconnected")), timeout=10)
    line = next(line for line in server.log_events("Client disconnected") if '"leaver-1"' in line)
    completion_id = json.loads(line)["completion_id"]
    assert wait_for(lambda: aborted(server) == aborts + 4, timeout=10)
    assert sum(completion_id in line for line in server.log_events("Request aborted")) == 4
    assert wait_for(lambda: kv_usage(server) == 0.0, timeout=10)


def test_models_and_metrics(server, model):
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == model
    text = metrics(server)
    for name in ("cadenza_time_to_first_token_seconds_bucket", "cadenza_time_per_output_token_seconds_bucket",
                 "cadenza_request_seconds_bucket", "cadenza_kv_cache_usage_ratio"):  # fmt: skip
        assert name in text
    assert re.search(r'^cadenza_requests_total\{api="openai",finish_reason="length"\} [1-9]', text, re.M)


# --- engine failures, in process with a scripted engine -----------------------------------------


class ScriptedEngine:
    """Stands in for `AsyncEngine`: every request gets `script` (GenerationOutputs, or an exception)."""

    def __init__(self, script):
        self.script = script
        self.healthy = True
        self.runtime = SimpleNamespace(tokenizer=None, loaded=SimpleNamespace(arch=SimpleNamespace(vocab_size=320)))

    async def generate(self, prompt, params, *, request_id):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield dataclasses.replace(item, request_id=request_id)


def output(text="", finish=None, code=None, tokens=1):
    return GenerationOutput("r", text, (1,) * tokens, None, finish, 3, tokens, 0, None, code and "it broke", code)


def scripted_app(*script):
    from fastapi import FastAPI

    from cadenza.api.errors import install_error_handlers
    from cadenza.api.metrics import ServerMetrics
    from cadenza.api.openai import completions
    from cadenza.api.state import ServerState
    from cadenza.config import CadenzaConfig
    from cadenza.metrics import EngineMetrics

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(completions.router)
    app.state.server = ServerState(ScriptedEngine(script), CadenzaConfig(), "m", ServerMetrics(EngineMetrics()))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.anyio
async def test_error_mid_stream_is_an_sse_error_event():
    async with scripted_app(output("he"), output("llo", "error", "engine_failed")) as http:
        response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.status_code == 200
        events = [e[6:] for e in response.text.split("\n\n") if e]
        assert json.loads(events[1])["choices"][0]["delta"] == {"content": "he"}
        assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
        whole = await http.post("/v1/chat/completions", json=CHAT)
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_failed"


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_refusals_get_their_status(stream):
    cases = [
        ((output(finish="error", code="queue_full", tokens=0),), 429, "queue_full"),
        ((EngineClosedError("draining"),), 503, "draining"),
        ((output("x"), output(finish="abort", tokens=0)), 503, "aborted"),
    ]
    for script, status, code in cases:
        async with scripted_app(*script) as http:
            response = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream})
            if stream and code == "aborted":  # the stream had started: an error event
                assert f'"code": "{code}"' in response.text and response.text.endswith("data: [DONE]\n\n")
            else:
                assert response.status_code == status and response.json()["error"]["code"] == code


def test_logprob_token_text_keeps_a_sentencepiece_space():
    # A SentencePiece decoder strips the text's first space, so decoding one token alone loses the
    # space it carries; a logprob's token text is what the token adds to the output instead.
    from tokenizers import Tokenizer, decoders, models

    from cadenza.api.openai.completions import _TokenTexts

    vocab = {"<unk>": 0, "▁hello": 1, "▁wor": 2, "ld": 3, "<0xC3>": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    assert tok.decode([1]) == "hello"
    texts = _TokenTexts(tok)
    assert [texts(i)[0] for i in (1, 2, 3)] == [" hello", " wor", "ld"]
    assert texts(1)[1] == list(b" hello")
    assert texts(4) == ("\ufffd", [0xC3])  # half of a character: its exact byte


@pytest.mark.parametrize("field, value", [("max_tokens", "8"), ("echo", 0), ("stream", "true"), ("temperature", "0.5"),
                                          ("n", 1.0), ("logprobs", True), ("prompt", [1, "2"]), ("prompt", ["a", 1]),
                                          ("prompt", [[1], "a"])])
def test_json_types_are_checked_as_the_schema_gives_them(server, model, field, value):
    # OpenAI answers 400 to a number in a string or a 0 for false; so does cadenza (not a coercion).
    error = error_of(post(server, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2, field: value}), 400)
    assert error["param"].split(".")[0] == field, error
    ok = post(server, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2, "temperature": 1, "logit_bias": {"5": 1}})
    assert ok.status_code == 200, ok.text  # an integer is a number; JSON's keys stand for token ids


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "strict": 0}}]}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 0}}}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "strict": "true"}}]}),
])  # fmt: skip
def test_strict_of_the_wrong_type_is_a_400_naming_it(server, model, path, body):
    messages = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    error = error_of(post(server, path, {"model": model, **messages, **body}), 400)
    assert error["param"].endswith(".strict"), error


def test_seed_minus_one_is_a_seed_like_any_other(server, client, model):
    """-1 is documented as an ordinary seed (not llama.cpp's "random"): it repeats, and differs
    from other seeds."""
    def text(seed):
        return client.completions.create(model=model, prompt="The quick", max_tokens=12, temperature=1.0, seed=seed).choices[0].text

    first = text(-1)
    assert text(-1) == first
    assert any(text(seed) != first for seed in (0, 1, 2))
    seed_doc = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert "-1 is a seed like any other" in json.dumps(seed_doc)


def test_cache_salt_shares_a_prefix_only_with_the_same_salt(client, model):
    """vLLM's cache_salt: the second request of a tenant reuses its prompt's blocks; another
    tenant's (another salt) computes the same prompt afresh."""
    messages = [{"role": "user", "content": "A long shared system prompt, then a question, " * 6}]

    def cached(salt: str) -> int:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body={"cache_salt": salt})
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_continue_final_message_goes_on_from_the_assistant_s_text(client, model, server):
    """vLLM's continue_final_message: the answer continues the last assistant message; asking it
    with add_generation_prompt left true, or after a user turn, is a 400 naming the field."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    fresh = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    assert answer.usage.prompt_tokens < fresh.usage.prompt_tokens  # no closing of the turn, no new header
    for body in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False,
                                                    "messages": messages[:1]}):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                              json={"model": model, "messages": messages, "max_tokens": 1, **body})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"
