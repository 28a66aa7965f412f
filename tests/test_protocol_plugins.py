"""Wire protocols as plugins (api/protocols.py): a third-party protocol written from the contract
alone is served beside the built-ins, its errors in its own shape; `server.protocols` picks what is
served; and a bad registration fails start-up naming the plugin."""

from __future__ import annotations

import textwrap

import httpx
import pytest
from plugin_contracts import covers
from server_process import running_server

PLUGIN = textwrap.dedent('''
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    from cadenza import SamplingParams
    from cadenza.api.errors import APIError
    from cadenza.api.protocols import Protocol
    from cadenza.api.state import server_state
    from cadenza.plugins.hookspecs import hookimpl


    class EchoProtocol(Protocol):
        """`POST /echo/v0/say {"text": ...}`: the model's greedy continuation, as {"said": ...}."""

        name = "echo_test"
        prefixes = ("/echo/",)

        def router(self):
            router = APIRouter()

            @router.post("/echo/v0/say")
            async def say(request: Request):
                body = await request.json()
                if not isinstance(body.get("text"), str):
                    raise APIError(400, "invalid_value", "text: a string is required", "text")
                state = server_state(request)
                said = ""
                params = SamplingParams(max_tokens=4, temperature=0.0)
                async for out in state.engine.generate(body["text"], params):
                    said += out.text
                return {"said": said, "model": state.model_name}

            return router

        def error_response(self, error):
            return JSONResponse({"echo_error": error.code, "why": error.message}, status_code=error.status)


    @hookimpl
    def register_protocols(register):
        register(EchoProtocol.name, EchoProtocol)
''')


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("protocol-plugin")
    (folder / "echo_protocol_test.py").write_text(PLUGIN)
    return folder


def _config(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text("plugins: [echo_protocol_test]\nmodel: {max_model_len: 256}\n" + text)
    return path


@covers("register_protocols", "Protocol.name", "Protocol.prefixes", "Protocol.router", "Protocol.error_response")
def test_a_protocol_plugin_is_served_beside_the_built_ins_with_its_own_errors(tiny_model_dir, plugin_dir, tmp_path):
    config = _config(tmp_path, "")
    with running_server(tiny_model_dir("llama3"), "--config", str(config), env={"PYTHONPATH": str(plugin_dir)}) as server:
        said = httpx.post(server.url + "/echo/v0/say", json={"text": "Hello"}, timeout=60)
        assert said.status_code == 200, said.text
        assert isinstance(said.json()["said"], str) and said.json()["model"]
        # Its refusals, and an unknown path under its prefix, in its own shape.
        bad = httpx.post(server.url + "/echo/v0/say", json={"text": 3}, timeout=30)
        assert bad.status_code == 400 and bad.json() == {"echo_error": "invalid_value", "why": "text: a string is required"}
        missing = httpx.get(server.url + "/echo/v0/nothing", timeout=30)
        assert missing.status_code == 404 and missing.json()["echo_error"] == "not_found"
        # The built-ins are still served, their errors in OpenAI's shape.
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert httpx.get(server.url + "/v1/nothing", timeout=30).json()["error"]["code"] == "not_found"
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        assert chat.status_code == 200, chat.text


def test_server_protocols_picks_what_is_served(tiny_model_dir, plugin_dir, tmp_path):
    config = _config(tmp_path, "server: {protocols: [echo_test, sessions]}\n")
    with running_server(tiny_model_dir("llama3"), "--config", str(config), env={"PYTHONPATH": str(plugin_dir)}) as server:
        assert httpx.post(server.url + "/echo/v0/say", json={"text": "x"}, timeout=60).status_code == 200
        gone = httpx.post(server.url + "/v1/chat/completions", json={}, timeout=30)
        assert gone.status_code == 404  # the openai protocol is not served


def test_an_unknown_protocol_fails_start_up_naming_the_known_ones():
    from cadenza.api.builtin_protocols import BUILTIN_PROTOCOLS
    from cadenza.api.protocols import select_protocols
    from cadenza.plugins.errors import PluginError

    with pytest.raises(PluginError, match="unknown protocol 'nope'") as caught:
        select_protocols(BUILTIN_PROTOCOLS, [], ["nope"])
    assert "openai" in str(caught.value) and "sessions" in str(caught.value)


def test_a_registration_that_is_not_a_protocol_or_is_twice_fails_naming_the_plugin():
    from cadenza.api.protocols import Protocol, select_protocols
    from cadenza.plugins.errors import PluginError

    class Twice(Protocol):
        name = "openai"

        def router(self):
            raise AssertionError("never made")

    from cadenza.api.builtin_protocols import BUILTIN_PROTOCOLS

    with pytest.raises(PluginError, match="not a subclass of Protocol") as caught:
        select_protocols(BUILTIN_PROTOCOLS, [("broken_test", object, "some_plugin")], None)
    assert "some_plugin" in str(caught.value)
    with pytest.raises(PluginError, match="registered twice: by 'cadenza' and by 'other'"):
        select_protocols(BUILTIN_PROTOCOLS, [("openai", Twice, "other")], None)


@covers("Protocol.openapi_schemas")
def test_a_protocol_hands_the_document_the_components_its_routes_refer_to():
    """None by default; Anthropic's and Ollama's their request models, under their own prefixes,
    with the served model's names."""
    from cadenza.api.anthropic import AnthropicProtocol
    from cadenza.api.ollama import OllamaProtocol
    from cadenza.api.openai.request_rules import ServedLimits
    from cadenza.api.protocols import Protocol

    class Bare(Protocol):
        name = "bare_test"

        def router(self):
            raise AssertionError("not needed")

    limits = ServedLimits(vocab_size=320, hidden_size=64)
    assert Bare().openapi_schemas("tiny", limits) == {}
    anthropic = AnthropicProtocol().openapi_schemas("tiny", limits)
    assert anthropic["AnthropicMessagesRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert "Message" not in anthropic and "AnthropicMessage" in anthropic
    ollama = OllamaProtocol().openapi_schemas("tiny", limits)
    assert ollama["OllamaChatRequest"]["properties"]["model"]["enum"] == ["tiny", "tiny:latest"]
    assert ollama["OllamaEmbedRequest"]["properties"]["dimensions"]["anyOf"][0]["maximum"] == 64
