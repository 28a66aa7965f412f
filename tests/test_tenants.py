"""Several API keys, each optionally a named tenant, and `cache.salt_per_api_key`: the keys' config,
the tenants' salts, and a real server where requests under different tenants never share cached
prefix blocks, whichever protocol they come by."""

from __future__ import annotations

import re

import anyio
import pytest

from cadenza.api.tenants import CURRENT_TENANT, NO_TENANT, APIKeys, TenantEngine
from cadenza.config import ConfigError, ServerConfig, load_config
from cadenza.sampling_params import SamplingParams

KEYS = [{"key": "key-acme-1", "tenant": "acme"}, {"key": "key-acme-2", "tenant": "acme"}, "key-bolt"]


# --- config and salts ----------------------------------------------------------------------------


def test_api_keys_are_checked_at_the_config_edge_and_never_quoted():
    config = load_config(None, overrides={"server.api_keys": KEYS, "cache.salt_per_api_key": True}, env={})
    assert [(k.tenant, k.key) for k in config.server.api_keys] == [("acme", "key-acme-1"), ("acme", "key-acme-2"), (None, "key-bolt")]
    assert "key-" not in repr(config.server.api_keys)
    cases = {
        "repeats the key of api_keys[0]": {"server.api_keys": ["key-secret-1", "key-secret-1"]},
        "repeats the key of api_key": {"server.api_key": "key-secret-1", "server.api_keys": ["key-secret-1"]},
        "server.api_keys[0].tenant: String should match pattern": {"server.api_keys": [{"key": "key-secret-1", "tenant": "a b"}]},
        "server.api_keys[0].key: Input should be a valid string": {"server.api_keys": [{"key": 12345}]},
        "cache.salt_per_api_key needs the keys it salts by": {"cache.salt_per_api_key": True},
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as caught:
            load_config(None, overrides=overrides, env={})
        assert "secret" not in str(caught.value) and "12345" not in str(caught.value)


def test_a_tenants_salt_is_its_own_its_requests_salt_hashed_in_and_never_its_key():
    keys = APIKeys(ServerConfig(api_key="key-solo", api_keys=KEYS))
    solo, acme, acme_too, bolt = (keys.match(k) for k in ("key-solo", "key-acme-1", "key-acme-2", "key-bolt"))
    assert all(keys.match(k) is None for k in ("", "key-acme", "key-acme-10", "KEY-BOLT"))
    assert (solo.label, acme.label, bolt.label) == ("api_key", "acme", "api_keys[2]")  # what logs name
    assert acme == acme_too  # a tenant's keys share its cache (and it keeps it when a key is replaced)
    salts = [t.cache_salt(given) for t in (solo, acme, bolt, NO_TENANT) for given in (None, "user-1", "user-2")]
    assert len(set(salts)) == len(salts) and all(re.fullmatch(r"[0-9a-f]{32}", s) for s in salts)
    assert acme.cache_salt("user-1") == acme_too.cache_salt("user-1")
    assert not any("key-" in text for text in (*salts, repr(solo), repr(acme), repr(bolt)))


@pytest.mark.anyio
async def test_the_engine_a_salting_server_sees_salts_every_request():
    class Recorder:
        healthy = True

        def __init__(self):
            self.salts = []

        async def generate(self, prompt, params, *, request_id=None):
            self.salts.append(params.cache_salt)
            yield prompt

    recorder = Recorder()
    engine = TenantEngine(recorder)
    acme = APIKeys(ServerConfig(api_keys=KEYS)).match("key-acme-1")
    token = CURRENT_TENANT.set(acme)
    try:
        [_ async for _ in engine.generate([1], SamplingParams(cache_salt="user-1"), request_id="r1")]
        [_ async for _ in engine.generate([1], None)]
    finally:
        CURRENT_TENANT.reset(token)
    [_ async for _ in engine.generate([1], SamplingParams())]  # outside any connection: a salt no tenant has
    assert recorder.salts == [acme.cache_salt("user-1"), acme.cache_salt(None), NO_TENANT.cache_salt(None)]
    assert engine.healthy  # the rest is the engine's own


# --- a server ------------------------------------------------------------------------------------


def cached(client, model: str, protocol: str, key: str, text: str) -> int:
    """Prompt tokens a request found in the prefix cache, sent by `protocol` with `key`."""
    auth = {"Authorization": f"Bearer {key}"}
    if protocol == "sessions":
        with client.websocket_connect(f"/v1/sessions?api_key={key}") as ws:
            ws.receive_json()  # session.created
            ws.send_json({"type": "generate", "request_id": "r", "user": text, "sampling": {"max_tokens": 1}})
            while (message := ws.receive_json())["type"] != "done":
                assert message["type"] != "error", message
            return message["usage"]["cached_tokens"]
    messages = [{"role": "user", "content": text}]
    if protocol == "anthropic":
        body = client.post("/v1/messages", headers={"x-api-key": key},
                           json={"model": model, "max_tokens": 1, "messages": messages}).json()  # fmt: skip
        return body["usage"]["cache_read_input_tokens"]
    if protocol == "ollama":  # its answers carry no cache count: the server's counter tells
        before = prefix_hits(client)
        response = client.post("/api/chat", headers=auth,
                               json={"model": model, "messages": messages, "stream": False, "options": {"num_predict": 1}})  # fmt: skip
        assert response.status_code == 200, response.text
        return int(prefix_hits(client) - before)
    if protocol == "responses":
        body = client.post("/v1/responses", headers=auth, json={"model": model, "input": text, "max_output_tokens": 1}).json()
        return body["usage"]["input_tokens_details"]["cached_tokens"]
    salt = {"cache_salt": protocol.removeprefix("chat+")} if protocol.startswith("chat+") else {}
    body = client.post("/v1/chat/completions", headers=auth,
                       json={"model": model, "messages": messages, "max_tokens": 1, **salt}).json()  # fmt: skip
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefix_hits(client) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^cadenza_prefix_cache_hits_total (\S+)$", text, re.M).group(1))


PROTOCOLS = ("chat", "chat+user-1", "anthropic", "ollama", "responses", "sessions")


def test_requests_under_different_tenants_never_share_cached_blocks(model_path):
    from fastapi.testclient import TestClient

    from cadenza.api.app import create_app
    from cadenza.runtime.build import build_runtime

    # Per protocol: tenant "<p>-a" with two keys, and a key that is a tenant of its own ("<p>-b").
    keys = [k for p in PROTOCOLS for k in ({"key": f"{p}-a1", "tenant": f"{p.replace('+', '-')}-a"},
                                           {"key": f"{p}-a2", "tenant": f"{p.replace('+', '-')}-a"}, f"{p}-b")]  # fmt: skip
    config = load_config(None, env={}, overrides={
        "model.path": str(model_path), "model.dtype": "float32", "cache.block_size": 8, "cache.num_blocks": 256,
        "server.api_keys": keys, "cache.salt_per_api_key": True,
    })  # fmt: skip
    text = "A prompt long enough for several blocks of eight tokens. " * 2
    with TestClient(create_app(build_runtime(config))) as client:
        model = client.get("/v1/models", headers={"Authorization": "Bearer chat-b"}).json()["data"][0]["id"]
        for protocol in PROTOCOLS:
            assert cached(client, model, protocol, f"{protocol}-a1", text) == 0, protocol  # computed
            assert cached(client, model, protocol, f"{protocol}-b", text) == 0, protocol  # another tenant: computed again
            assert cached(client, model, protocol, f"{protocol}-a2", text) >= 16, protocol  # the same tenant: found
        assert cached(client, model, "chat", "chat-b", text) >= 16  # its own blocks, found
        assert cached(client, model, "chat+user-2", "chat-a1", text) == 0  # its tenant's, under another salt
        refused = client.post("/v1/chat/completions", headers={"Authorization": "Bearer nope"}, json={"model": model, "messages": []})
        assert refused.status_code == 401


def test_stored_responses_are_their_tenants_alone():
    """A stored response (`previous_response_id`, GET, DELETE, cancel) is found only under the
    tenant that made it: another tenant gets the 404 of an id never stored."""
    from cadenza.api.errors import APIError
    from cadenza.api.openai_ws.responses import ResponseStore, _Live
    from cadenza.api.sessions.conversation import Conversation

    keys = APIKeys(ServerConfig(api_keys=KEYS))
    acme, bolt = keys.match("key-acme-1"), keys.match("key-bolt")
    store = ResponseStore(capacity=4)

    async def check() -> None:  # a connection's task: its own context (a live response's event needs a loop)
        CURRENT_TENANT.set(acme)
        store.put({"id": "resp_1"}, Conversation())
        store.live["resp_2"] = _Live("resp:resp_2", acme)
        CURRENT_TENANT.set(keys.match("key-acme-2"))  # the same tenant under its other key
        assert store.get("resp_1")[0] == {"id": "resp_1"} and store.running("resp_2") is not None
        for other in (bolt, None):
            CURRENT_TENANT.set(other)
            with pytest.raises(APIError) as caught:
                store.get("resp_1", "response_id")
            assert caught.value.status == 404 and caught.value.param == "response_id"
            assert store.running("resp_2") is None

    anyio.run(check)
