"""Long WebSocket sessions against the real server: context policies (error, drop_oldest), reset,
truncate and fork of conversations, and no KV block left behind by any of them."""

import asyncio
import json
import re

import httpx
import pytest
from server_process import running_server
from websockets.asyncio.client import connect

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 256
# 40 tokens or more of system prompt: two full blocks of 16, which the prefix cache can serve.
SYSTEM = "You are careful. Paged attention keeps keys and values in blocks."
TURN = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    env = {"CADENZA_MODEL__MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
    with running_server(tiny_model_dir("llama3"), env=env) as process:
        yield process


class Session:
    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def open(cls, server):
        session = cls(await connect(server.ws_url))
        created = await session.recv()
        assert created["type"] == "session.created"
        return session

    async def recv(self):
        return json.loads(await asyncio.wait_for(self.ws.recv(), 60))

    async def ask(self, **message):
        await self.ws.send(json.dumps(message))
        return await self.recv()

    async def turn(self, request_id, user, conversation=None, **sampling):
        message = {"type": "generate", "request_id": request_id, "user": user, "sampling": {**TURN, **sampling}}
        if conversation:
            message["conversation"] = conversation
        await self.ws.send(json.dumps(message))
        while True:
            reply = await self.recv()
            if reply.get("request_id") == request_id and reply["type"] in ("done", "error"):
                return reply

    async def history(self, conversation="main"):
        state = await self.ask(type="session.get", conversation=conversation)
        assert state["type"] == "session.state", state
        return state["history"]


def kv_usage(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^cadenza_kv_cache_usage_ratio (\S+)$", text, re.M).group(1))


async def kv_settles_to_zero(server) -> bool:
    for _ in range(300):
        if kv_usage(server) == 0.0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_forty_turns_under_drop_oldest_keep_the_system_prompt(server):
    session = await Session.open(server)
    updated = await session.ask(type="session.update", system_prompt=SYSTEM, context={"policy": "drop_oldest"})
    assert updated["context"] == {"policy": "drop_oldest", "providers": []}
    cuts = 0
    for i in range(40):
        done = await session.turn(f"t{i}", f"Question number {i}: tell me about blocks.")
        assert done["type"] == "done", done
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == TURN["max_tokens"]
        # Every prompt left room for the whole answer.
        assert done["usage"]["prompt_tokens"] <= MAX_MODEL_LEN - TURN["max_tokens"]
        context = done["context"]
        assert context["policy"] == "drop_oldest"
        if context["cut"]:
            cuts += 1
            assert context["turns_dropped"] >= 1
            # The prefix cache only matches from a prompt's first token: a hit after a cut means
            # the prompt still begins with the system prompt.
            assert done["usage"]["cached_tokens"] >= 32
    assert cuts >= 3
    history = await session.history()
    assert history[-2] == {"role": "user", "content": "Question number 39: tell me about blocks."}
    assert len(history) < 2 * 40 and history[0]["content"] != "Question number 0: tell me about blocks."
    state = await session.ask(type="session.get")
    assert state["system_prompt"] == SYSTEM
    await session.ws.close()
    assert await kv_settles_to_zero(server)


async def test_error_policy_fails_the_turn_and_keeps_the_history(server):
    session = await Session.open(server)
    await session.ask(type="session.update", system_prompt=SYSTEM)
    failed = None
    for i in range(30):
        done = await session.turn(f"t{i}", f"Question number {i}: tell me about blocks.")
        if done["type"] == "error":
            failed = (i, done)
            break
        assert done["context"]["cut"] is False
    assert failed is not None, "the history outgrew max_model_len"
    i, error = failed
    assert error["code"] == "prompt_too_long" and "drop_oldest" in error["message"]
    history = await session.history()
    assert len(history) == 2 * i, "the refused turn left no trace"
    # Switching the policy lets the same turn through.
    await session.ask(type="session.update", context={"policy": "drop_oldest"})
    done = await session.turn("again", f"Question number {i}: tell me about blocks.")
    assert done["type"] == "done" and done["context"]["cut"] is True
    await session.ws.close()


async def test_reset_truncate_fork_and_delete(server):
    session = await Session.open(server)
    await session.ask(type="session.update", system_prompt=SYSTEM)
    first = await session.turn("a", "First question about blocks.")
    second = await session.turn("b", "Second question about caches.")
    assert first["type"] == second["type"] == "done"
    main = await session.history()
    assert len(main) == 4

    forked = await session.ask(type="session.fork", name="alt", turns=1)
    assert forked["conversation"] == "alt" and forked["history"] == main[:2]
    assert forked["conversations"] == ["alt", "main"]
    branch = await session.turn("c", "A different second question.", conversation="alt")
    # The fork's prompt starts like the first turn's: its cached prefix serves it.
    assert branch["type"] == "done" and branch["usage"]["cached_tokens"] >= 32
    assert (await session.history("alt"))[:2] == main[:2] and len(await session.history("alt")) == 4
    assert await session.history() == main, "the fork does not touch its source"

    truncated = await session.ask(type="session.truncate", turns=1)
    assert truncated["history"] == main[:2] and truncated["turns"] == 1
    reset = await session.ask(type="session.reset", conversation="alt")
    assert reset["history"] == [] and reset["system_prompt"] == SYSTEM

    errors = [
        await session.ask(type="session.fork", name="alt"),
        await session.ask(type="session.get", conversation="nope"),
        await session.ask(type="session.delete", conversation="main"),
        await session.ask(type="session.truncate", turns=-1),
    ]
    assert [e["code"] for e in errors] == ["conversation_exists", "unknown_conversation", "invalid_params", "invalid_params"]
    deleted = await session.ask(type="session.delete", conversation="alt")
    assert deleted["conversations"] == ["main"]

    # A running turn blocks edits of its conversation, not of others.
    await session.ws.send(json.dumps({"type": "generate", "request_id": "long", "user": "Go on.", "sampling": {"max_tokens": 100, "ignore_eos": True}}))
    while (await session.recv())["type"] != "delta":
        pass
    refused = await session.ask(type="session.reset")
    while refused["type"] == "delta":
        refused = await session.recv()
    assert refused["type"] == "error" and refused["code"] == "turn_in_progress"
    await session.ws.send(json.dumps({"type": "cancel", "request_id": "long"}))
    while (await session.recv()).get("type") != "done":
        pass
    assert len(await session.history()) == 2, "the cancelled turn was undone"
    await session.ws.close()
    assert await kv_settles_to_zero(server)


async def test_unknown_policy_is_refused_and_changes_nothing(server):
    session = await Session.open(server)
    refused = await session.ask(type="session.update", system_prompt="changed", context={"policy": "no_such_policy"})
    assert refused["type"] == "error" and refused["code"] == "invalid_params"
    assert "no_such_policy" in refused["message"] and "drop_oldest" in refused["message"]
    state = await session.ask(type="session.get")
    assert state["system_prompt"] is None and state["context"]["policy"] == "error"
    await session.ws.close()
