"""Several models on one server (api/model_pool.py): three tiny models in one deployment, routed by
`model`, loaded on first use, unloaded when idle, for room or on demand, never under a request."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from server_process import running_server, wait_for


def _deployment(tmp_path, tiny_model_dir, **server) -> str:
    models = [
        {"name": "alpha", "path": str(tiny_model_dir("llama3"))},
        {"name": "beta", "path": str(tiny_model_dir("qwen2")), "overrides": {"cache.num_blocks": 64}},
        {"name": "gamma", "path": str(tiny_model_dir("mistral")), "keep_alive": 2},
        {"name": "broken", "path": str(tmp_path / "no-such-model")},
    ]
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps({"models": models, "model": {"dtype": "float32", "max_model_len": 256},
                                "server": {"keep_alive": 600, **server}}))  # YAML reads JSON
    return str(path)


def _listed(server) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}


def _chat(client, model: str, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=kwargs.pop("max_tokens", 4), **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def pool_server(tiny_model_dir, tmp_path_factory):
    # `running_server` passes --model; the deployment's `models` decides what is served.
    config = _deployment(tmp_path_factory.mktemp("pool"), tiny_model_dir, max_loaded_models=1)
    with running_server(tiny_model_dir("llama3"), "--config", config) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            yield server, client


def test_models_route_by_name_and_load_on_first_use(pool_server):
    server, client = pool_server
    listed = _listed(server)
    assert list(listed) == ["alpha", "beta", "gamma", "broken"]
    assert listed["alpha"]["status"] == "loaded" and listed["alpha"]["pinned"]
    assert {listed[n]["status"] for n in ("beta", "gamma", "broken")} == {"unloaded"}
    assert _chat(client, "alpha").model == "alpha"
    answer = _chat(client, "beta")  # loads it, then answers on it
    assert answer.model == "beta" and answer.usage.completion_tokens == 4
    assert _listed(server)["beta"]["status"] == "loaded" and _listed(server)["beta"]["memory_bytes"] > 0
    # Ollama's clients name it with a tag.
    ollama = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": "beta:latest", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": {"num_predict": 2}})  # fmt: skip
    assert ollama.status_code == 200, ollama.text


def test_an_unknown_model_is_a_404_naming_the_models_served(pool_server):
    server, client = pool_server
    with pytest.raises(openai.NotFoundError) as caught:
        _chat(client, "delta")
    message = caught.value.body["message"]
    assert "'delta'" in message and all(f"'{name}'" in message for name in ("alpha", "beta", "gamma"))
    # Under another protocol, in its shape.
    anthropic = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "delta", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"


def test_a_model_that_fails_to_load_is_a_503_and_the_rest_serve_on(pool_server):
    server, client = pool_server
    with pytest.raises(openai.InternalServerError) as caught:
        _chat(client, "broken")
    assert caught.value.status_code == 503 and "could not be loaded" in caught.value.body["message"]
    assert _listed(server)["broken"]["status"] == "unloaded" and _listed(server)["broken"]["error"]
    assert _chat(client, "alpha").model == "alpha"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_loading_one_more_than_max_loaded_models_unloads_the_least_recently_used(pool_server):
    server, client = pool_server
    _chat(client, "beta")
    _chat(client, "gamma")  # max_loaded_models 1 (the default model aside): beta goes
    listed = _listed(server)
    assert listed["gamma"]["status"] == "loaded" and listed["beta"]["status"] == "unloaded"
    assert listed["alpha"]["status"] == "loaded"  # the first model always stays


def test_keep_alive_unloads_an_idle_model(pool_server):
    server, client = pool_server
    _chat(client, "gamma")  # keep_alive 2 s
    assert wait_for(lambda: _listed(server)["gamma"]["status"] == "unloaded", timeout=15)
    # A request's own keep_alive 0 (Ollama's API has one) unloads it once that request is done.
    answer = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": "beta", "prompt": "hi", "stream": False, "keep_alive": 0, "options": {"num_predict": 2}})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert wait_for(lambda: _listed(server)["beta"]["status"] == "unloaded", timeout=15)


def test_unload_under_load_loses_no_request(pool_server):
    """Streams run on beta while it is asked to unload: every one finishes whole, then it unloads."""
    server, client = pool_server
    _chat(client, "beta")

    def stream(i: int) -> tuple[str | None, int]:
        chunks = list(client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": f"story {i}"}], max_tokens=48, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return (reasons[-1] if reasons else None), chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = [pool.submit(stream, i) for i in range(6)]
        time.sleep(0.3)
        unloaded = httpx.post(server.url + "/models/unload", json={"model": "beta"}, timeout=120)
        results = [f.result(timeout=120) for f in running]
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded", unloaded.text
    assert results == [("length", 48)] * 6
    assert _listed(server)["beta"]["status"] == "unloaded"


def test_concurrent_requests_for_an_unloaded_model_share_one_load(pool_server):
    server, client = pool_server
    httpx.post(server.url + "/models/unload", json={"model": "beta"}, timeout=60)
    before = len(server.log_events("Loading model"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _chat(client, "beta"), range(4)))
    assert [a.model for a in answers] == ["beta"] * 4
    loads = [line for line in server.log_events("Loading model")[before:] if '"beta"' in line]
    assert len(loads) == 1


def test_the_load_and_unload_endpoints(pool_server):
    server, _ = pool_server
    loaded = httpx.post(server.url + "/models/load", json={"model": "gamma"}, timeout=120)
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
    pinned = httpx.post(server.url + "/models/unload", json={"model": "alpha"}, timeout=30)
    assert pinned.status_code == 400 and pinned.json()["error"]["code"] == "model_pinned"
    unknown = httpx.post(server.url + "/models/load", json={"model": "delta"}, timeout=30)
    assert unknown.status_code == 404


def test_a_deployment_naming_a_model_twice_fails_to_start():
    from cadenza.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="given more than once: a"):
        load_config(None, overrides={"models": [{"name": "a"}, {"name": "a"}]}, env={})


def test_ollama_s_tags_and_ps_list_the_pool(pool_server):
    server, client = pool_server
    _chat(client, "beta")
    tags = {m["name"]: m for m in httpx.get(server.url + "/api/tags", timeout=30).json()["models"]}
    assert list(tags) == ["alpha:latest", "beta:latest", "gamma:latest", "broken:latest"]
    assert tags["beta:latest"]["details"]["family"] and tags["gamma:latest"]["size"] > 0
    running = {m["name"]: m for m in httpx.get(server.url + "/api/ps", timeout=30).json()["models"]}
    assert {"alpha:latest", "beta:latest"} <= set(running) and "broken:latest" not in running
    assert running["alpha:latest"]["expires_at"] > running["beta:latest"]["expires_at"]  # alpha never expires
