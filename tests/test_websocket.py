"""WebSocket sessions against the real server on loopback, driven by the `websockets` client."""

import asyncio
import json
import re
import socket

import httpx
import pytest
from server_process import running_server
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama3")) as process:
        yield process


class Client:
    """A session: send messages, collect what the server says, per request."""

    def __init__(self, ws):
        self.ws = ws
        self.created = None
        self.received = []  # every message, in order

    @classmethod
    async def open(cls, url, **kw):
        ws = await connect(url, **kw)
        client = cls(ws)
        client.created = await client.recv()
        assert client.created["type"] == "session.created"
        return client

    async def send(self, **message):
        await self.ws.send(json.dumps(message))

    async def recv(self, timeout=30):
        message = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.received.append(message)
        return message

    def text_of(self, request_id):
        return "".join(m["text"] for m in self.received if m.get("request_id") == request_id and m["type"] == "delta")

    async def until(self, predicate, timeout=60):
        seen = []
        while True:
            message = await self.recv(timeout)
            seen.append(message)
            if predicate(message):
                return seen

    async def run(self, request_id, **generate):
        await self.send(type="generate", request_id=request_id, **generate)
        seen = await self.until(lambda m: m.get("request_id") == request_id and m["type"] in ("done", "error"))
        mine = [m for m in seen if m.get("request_id") == request_id]
        text = "".join(m["text"] for m in mine if m["type"] == "delta")
        tokens = [t for m in mine if m["type"] == "delta" for t in m["token_ids"]]
        return text, tokens, mine[-1]

    async def close(self):
        await self.ws.close()


GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def kv_usage(server):
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^cadenza_kv_cache_usage_ratio (\S+)$", text, re.M).group(1))


async def wait_kv_free(server, timeout=15):
    for _ in range(int(timeout / 0.05)):
        if kv_usage(server) == 0.0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_session_created_update_get_and_ping(server):
    client = await Client.open(server.ws_url)
    assert client.created["session_id"].startswith("sess-")
    assert client.created["limits"]["max_requests_in_flight"] == 16
    await client.send(type="session.update", system_prompt="Be brief.", sampling={"temperature": 0, "max_tokens": 3})
    updated = await client.recv()
    assert updated["type"] == "session.updated" and updated["system_prompt"] == "Be brief."
    assert updated["sampling"] == {"temperature": 0.0, "max_tokens": 3}
    _, tokens, done = await client.run("a", prompt="hello")  # session defaults apply
    assert done["type"] == "done" and len(tokens) <= 3
    await client.send(type="ping")
    assert (await client.recv())["type"] == "pong"
    await client.send(type="session.get")
    state = await client.recv()
    assert state["type"] == "session.state" and state["history"] == []
    await client.close()


async def test_generate_text_tokens_and_messages_match_greedy(server):
    client = await Client.open(server.ws_url)
    text, tokens, done = await client.run("t", prompt="abc", sampling=GREEDY)
    assert done["finish_reason"] == "length" and len(tokens) == 8
    assert done["usage"]["completion_tokens"] == 8 and done["usage"]["prompt_tokens"] > 0
    assert done["timings"]["ttft_ms"] > 0
    # The same prompt by token ids gives the same tokens.
    prompt_ids = [int(t) for t in range(5, 5 + done["usage"]["prompt_tokens"])]
    _, by_ids, _ = await client.run("ids", token_ids=prompt_ids, sampling=GREEDY)
    _, again, _ = await client.run("ids2", token_ids=prompt_ids, sampling=GREEDY)
    assert by_ids == again
    _, chat, done = await client.run("m", messages=[{"role": "user", "content": "hi"}], sampling=GREEDY)
    assert len(chat) == 8 and done["finish_reason"] == "length"
    await client.close()


async def test_prompt_logprobs_come_in_the_first_delta_as_the_python_api_gives_them(server, tiny_model_dir):
    from cadenza.llm import LLM
    from cadenza.sampling_params import SamplingParams

    prompt = list(range(5, 16))
    client = await Client.open(server.ws_url)
    await client.send(type="generate", request_id="p", token_ids=prompt, sampling={**GREEDY, "max_tokens": 2, "prompt_logprobs": 2})
    seen = await client.until(lambda m: m.get("request_id") == "p" and m["type"] in ("done", "error"))
    await client.close()
    deltas = [m for m in seen if m["type"] == "delta"]
    assert "prompt_logprobs" in deltas[0] and all("prompt_logprobs" not in m for m in deltas[1:])
    wire = deltas[0]["prompt_logprobs"]
    with LLM(tiny_model_dir("llama3"), dtype="float32") as llm:  # as the server runs it
        (expected,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    assert len(wire) == len(prompt) and wire[0] is None and expected.prompt_logprobs[0] is None
    for got, want, token in zip(wire[1:], expected.prompt_logprobs[1:], prompt[1:]):
        assert got["token_id"] == next(iter(want)) == token and got["rank"] == want[token].rank and len(got["top"]) == 2
        assert got["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)


async def test_eight_interleaved_requests_on_one_connection(server):
    client = await Client.open(server.ws_url)
    alone = {}
    for i in range(8):
        _, alone[f"r{i}"], _ = await client.run(f"solo{i}", prompt=f"prompt number {i}", sampling={**GREEDY, "max_tokens": 12})
    for i in range(8):
        await client.send(type="generate", request_id=f"r{i}", prompt=f"prompt number {i}", sampling={**GREEDY, "max_tokens": 12})
    seen = await client.until(lambda m, done=set(): (m["type"] == "done" and done.add(m["request_id"])) or len(done) == 8)
    order = [m["request_id"] for m in seen if m["type"] == "delta"]
    assert len(set(order[:16])) > 1, "streams interleave"
    for request_id, tokens in alone.items():
        got = [t for m in seen if m.get("request_id") == request_id and m["type"] == "delta" for t in m["token_ids"]]
        assert got == tokens
    await client.close()


async def test_cancel_mid_stream(server):
    client = await Client.open(server.ws_url)
    await client.send(type="generate", request_id="long", prompt="x", sampling={"max_tokens": 400, "ignore_eos": True})
    await client.until(lambda m: m["type"] == "delta")
    await client.send(type="cancel", request_id="long")
    seen = await client.until(lambda m: m["type"] == "done")
    assert seen[-1]["finish_reason"] == "abort" and seen[-1]["usage"]["completion_tokens"] < 400
    await client.send(type="cancel", request_id="long")
    assert (await client.recv())["code"] == "unknown_request_id"
    assert await wait_kv_free(server)
    await client.close()


async def test_conversation_follow_up_reuses_cache_and_interrupt_keeps_partial(server):
    client = await Client.open(server.ws_url)
    await client.send(type="session.update", system_prompt="You are terse.")
    await client.recv()
    first_text, _, first = await client.run("t1", user="Tell me about paged attention.", sampling=GREEDY)
    assert first["finish_reason"] == "length"
    second_text, _, second = await client.run("t2", user="And prefix caching?", sampling=GREEDY)
    assert second["usage"]["cached_tokens"] > 0, "the follow-up reuses the first turn's cached prefix"
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    # Barge in on a long third turn: its partial answer stays in the history.
    await client.send(type="generate", request_id="t3", user="Now explain everything.", sampling={"max_tokens": 400, "ignore_eos": True})
    await client.until(lambda m: m["type"] == "delta" and m["request_id"] == "t3")
    await client.send(type="generate", request_id="t4", user="too soon", sampling=GREEDY)
    assert (await client.until(lambda m: m["type"] == "error"))[-1]["code"] == "turn_in_progress"
    await client.send(type="interrupt")
    seen = await client.until(lambda m: m["type"] == "done" and m["request_id"] == "t3")
    assert seen[-1]["interrupted"] is True and seen[-1]["finish_reason"] == "abort"
    partial = client.text_of("t3")
    await client.send(type="session.get")
    history = (await client.recv())["history"]
    assert [h["role"] for h in history] == ["user", "assistant"] * 3
    assert history[1]["content"] == first_text and history[3]["content"] == second_text
    assert history[5]["content"] == partial
    # Cancelling a turn undoes it.
    await client.send(type="generate", request_id="t5", user="discard me", sampling={"max_tokens": 400, "ignore_eos": True})
    await client.until(lambda m: m["type"] == "delta" and m["request_id"] == "t5")
    await client.send(type="cancel", request_id="t5")
    await client.until(lambda m: m["type"] == "done" and m["request_id"] == "t5")
    await client.send(type="session.get")
    assert len((await client.recv())["history"]) == 6
    await client.close()


@pytest.mark.parametrize(
    "frame,code",
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_message"),
        (json.dumps({"type": "dance"}), "unknown_type"),
        (json.dumps({"type": "generate", "request_id": "x"}), "invalid_params"),
        (json.dumps({"type": "generate", "request_id": "x", "prompt": "a", "user": "b"}), "invalid_params"),
        (json.dumps({"type": "generate", "request_id": "x", "prompt": "a", "sampling": {"temperature": -1}}), "invalid_params"),
        (json.dumps({"type": "generate", "request_id": "x", "prompt": "a", "sampling": {"tempo": 1}}), "invalid_params"),
        (json.dumps({"type": "generate", "request_id": "x", "prompt": "a", "bogus": 1}), "invalid_params"),
        (json.dumps({"type": "generate", "request_id": "x", "token_ids": [5] * 600}), "prompt_too_long"),
        (json.dumps({"type": "generate", "request_id": "x", "prompt": ""}), "invalid_prompt"),
        (json.dumps({"type": "interrupt"}), "nothing_to_interrupt"),
    ],
)
async def test_bad_input_gets_a_typed_error_and_the_connection_carries_on(server, frame, code):
    client = await Client.open(server.ws_url)
    await client.ws.send(frame)
    message = await client.until(lambda m: m["type"] == "error")
    assert message[-1]["code"] == code, message
    assert message[-1]["message"]
    _, tokens, done = await client.run("after", prompt="still here", sampling=GREEDY)
    assert done["type"] == "done" and len(tokens) == 8
    await client.close()


async def test_error_names_the_bad_field(server):
    client = await Client.open(server.ws_url)
    await client.send(type="generate", request_id="x", prompt="a", sampling={"top_p": 7})
    error = (await client.until(lambda m: m["type"] == "error"))[-1]
    assert error["request_id"] == "x" and "sampling.top_p" in error["message"]
    await client.ws.send(b"\x00binary")
    assert (await client.until(lambda m: m["type"] == "error"))[-1]["code"] == "invalid_message"
    await client.close()


async def test_limits_too_many_in_flight_and_duplicate_ids(server):
    client = await Client.open(server.ws_url)
    for i in range(16):
        await client.send(type="generate", request_id=f"r{i}", prompt="x", sampling={"max_tokens": 300, "ignore_eos": True})
    await client.send(type="generate", request_id="r0", prompt="x")
    await client.send(type="generate", request_id="r16", prompt="x")
    errors = await client.until(lambda m, n=[0]: m["type"] == "error" and (n.__setitem__(0, n[0] + 1) or n[0] == 2))
    codes = {m["request_id"]: m["code"] for m in errors if m["type"] == "error"}
    assert codes == {"r0": "duplicate_request_id", "r16": "too_many_requests"}
    await client.close()  # disconnecting aborts all 16
    assert await wait_kv_free(server)


async def test_disconnect_returns_kv_blocks(server):
    client = await Client.open(server.ws_url)
    for i in range(4):
        await client.send(type="generate", request_id=f"r{i}", prompt="y" * 50, sampling={"max_tokens": 400, "ignore_eos": True})
    await client.until(lambda m: m["type"] == "delta")
    assert kv_usage(server) > 0
    before = websocket_aborts(server)
    client.ws.transport.abort()  # the client vanishes: no close handshake, the TCP connection just drops
    assert await wait_kv_free(server), "the vanished client's requests were aborted and their blocks freed"
    assert server.log_events("Request aborted")
    # ... and counted, as the OpenAI API counts a client that left.
    for _ in range(100):
        if websocket_aborts(server) >= before + 4:
            break
        await asyncio.sleep(0.05)
    assert websocket_aborts(server) == before + 4


def websocket_aborts(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.search(r'^cadenza_requests_total\{api="websocket",finish_reason="abort"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_slow_reader_is_cut_off_without_stalling_others(tiny_model_dir):
    # Small buffers on both ends, so a reader that stops falls behind within a few dozen tokens.
    env = {"CADENZA_SERVER__MAX_PENDING_TOKENS": "16", "CADENZA_SERVER__SOCKET_SEND_BUFFER": "4096"}
    with running_server(tiny_model_dir("llama3"), env=env) as slow_server:
        host, port = slow_server.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow = await Client.open(slow_server.ws_url, sock=sock, max_queue=1, ping_interval=None)
        for i in range(8):
            await slow.send(type="generate", request_id=f"s{i}", prompt="z", sampling={"max_tokens": 480, "ignore_eos": True, "logprobs": 20})
        # Meanwhile another session is served normally.
        other = await Client.open(slow_server.ws_url)
        _, tokens, done = await other.run("fast", prompt="quick", sampling=GREEDY)
        assert done["type"] == "done" and len(tokens) == 8
        await other.close()
        # The slow requests are cut off by the server, not run to the end for nobody.
        for _ in range(600):
            if len(slow_server.log_events("Request aborted")) == 8:
                break
            await asyncio.sleep(0.05)
        assert len(slow_server.log_events("Request aborted")) == 8, "every slow request was aborted"
        assert await wait_kv_free(slow_server, timeout=30)
        codes = []
        while len(codes) < 8:
            message = await slow.recv(timeout=30)
            if message["type"] == "error":
                codes.append(message["code"])
            assert message["type"] != "done", "no slow request ran to its end"
        assert set(codes) == {"slow_reader"}
        await slow.close()


async def test_api_key_on_websocket(tiny_model_dir):
    with running_server(tiny_model_dir("llama3"), "--api-key", "s3cret") as keyed:
        with pytest.raises(InvalidStatus) as refused:
            await Client.open(keyed.ws_url)
        assert refused.value.response.status_code == 403
        with pytest.raises(InvalidStatus):
            await Client.open(keyed.ws_url, additional_headers={"Authorization": "Bearer wrong"})
        client = await Client.open(keyed.ws_url, additional_headers={"Authorization": "Bearer s3cret"})
        _, tokens, _ = await client.run("a", prompt="hi", sampling=GREEDY)
        assert len(tokens) == 8
        await client.close()
        browser_style = await Client.open(keyed.ws_url + "?api_key=s3cret")
        await browser_style.close()
        assert httpx.get(keyed.url + "/v1/models").status_code == 401
        assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(keyed.url + "/health").status_code == 200
