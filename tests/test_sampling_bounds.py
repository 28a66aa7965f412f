"""One definition of every sampling field and its bounds: the Python API, the WebSocket protocol,
the OpenAI protocol and the YAML defaults accept and refuse exactly the same values, and every
refusal names the field (and its range)."""

import asyncio
import json
import math

import httpx
import pytest
from server_process import running_server
from tiny_models import VOCAB_SIZE
from websockets.asyncio.client import connect

from cadenza.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from cadenza.api.sessions.protocol import SamplingOptions
from cadenza.config import CadenzaConfig, SamplingDefaults
from cadenza.sampling_params import BOUNDS, SamplingOverrides, SamplingParams, SamplingParamsError

VOCAB = VOCAB_SIZE

# (field, the value as raw JSON, text the error must carry besides the field's name)
REFUSED = [
    ("temperature", "Infinity", "[0, inf)"),
    ("temperature", "NaN", "[0, inf)"),
    ("temperature", "1e400", "[0, inf)"),  # JSON parses it to inf
    ("temperature", "-0.5", "[0, inf)"),
    ("top_p", "0", "(0, 1]"),
    ("top_p", "1.5", "(0, 1]"),
    ("top_k", "-2", "[-1, inf)"),
    ("top_k", "2.5", "[-1, inf)"),
    ("min_p", "2", "[0, 1]"),
    ("repetition_penalty", "0", "(0, inf)"),
    ("repetition_penalty", "Infinity", "(0, inf)"),
    ("presence_penalty", "3", "[-2, 2]"),
    ("frequency_penalty", "-Infinity", "[-2, 2]"),
    ("logit_bias", '{"5": NaN}', "[-100, 100]"),
    ("logit_bias", '{"5": Infinity}', "[-100, 100]"),
    ("logit_bias", '{"5": 1e300}', "[-100, 100]"),
    ("logit_bias", '{"-1": 1}', "token ids"),
    ("logit_bias", '{"abc": 1}', "token ids"),
    ("logit_bias", f'{{"{VOCAB}": 1}}', f"[0, {VOCAB})"),  # beyond the vocabulary: the ingress says so
    ("seed", str(2**64), "18446744073709551615"),
    ("seed", str(-(2**63) - 1), "-9223372036854775808"),
    ("stop_token_ids", "[-1]", "[0, inf)"),
    ("stop_token_ids", f"[{VOCAB + 3}]", f"[0, {VOCAB})"),
    ("max_tokens", "0", "[1, inf)"),
    ("min_tokens", "-1", "[0, inf)"),
    ("logprobs", "21", "[0, 20]"),
    ("prompt_logprobs", "-1", "[0, 20]"),
]
ACCEPTED = [
    ("temperature", "0"), ("temperature", "1e6"), ("top_p", "1"), ("top_k", "-1"), ("min_p", "1"),
    ("logit_bias", '{"5": -100, "6": 100}'), ("seed", str(2**64 - 1)), ("seed", "-1"),
    ("stop_token_ids", f"[{VOCAB - 1}]"), ("logprobs", "20"), ("prompt_logprobs", "20"),
]  # fmt: skip


def _vocab_checked(shown: str) -> bool:
    return shown == f"[0, {VOCAB})"


# The vocabulary is the engine's to check: its ingress does, for every API.
@pytest.mark.parametrize("field,raw,shown", [case for case in REFUSED if not _vocab_checked(case[2])])
def test_the_python_api_refuses_what_the_protocols_refuse(field, raw, shown):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{field: json.loads(raw)})
    assert str(caught.value).startswith(field) and shown in str(caught.value)


def _bounds(model, name):
    """What a field accepts, as its JSON schema says, with null (not set) left out."""
    schema = model.model_json_schema()["properties"][name]
    options = schema.get("anyOf", [schema])
    strip = ("default", "title", "description", "anyOf")
    return [{k: v for k, v in o.items() if k not in strip} for o in options if o.get("type") != "null"]


def test_every_api_declares_each_field_with_the_same_bounds():
    names = {name: name for name in SamplingOverrides.model_fields}
    for model in (SamplingOverrides, SamplingOptions, CompletionRequest, ChatCompletionRequest, SamplingDefaults):
        fields = dict(names)
        if model is ChatCompletionRequest:  # chat's logprobs is a switch; its count is top_logprobs
            fields.update(logprobs="top_logprobs", max_completion_tokens="max_tokens")
            fields["logprobs"], fields["top_logprobs"] = None, "logprobs"
        if model is CompletionRequest:  # also 0, with echo (the prompt alone): OpenAI's legacy scoring
            fields["max_tokens"] = None
            assert _bounds(model, "max_tokens") == [{**_bounds(SamplingParams, "max_tokens")[0], "minimum": 0}]
        for own, reference in fields.items():
            if reference is not None and own in model.model_fields:
                assert _bounds(model, own) == _bounds(SamplingParams, reference), (model.__name__, own)
    assert set(SamplingDefaults.model_fields) < set(names)
    assert set(BOUNDS) <= set(SamplingParams.model_fields)


def test_yaml_defaults_refuse_the_same_values():
    with pytest.raises(ValueError, match="temperature"):
        CadenzaConfig.model_validate({"sampling": {"defaults": {"temperature": math.inf}}})
    with pytest.raises(ValueError, match="top_p"):
        CadenzaConfig.model_validate({"sampling": {"defaults": {"top_p": 0}}})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama3")) as server:
        yield server


async def _http(server, field, raw):
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (_model_name(server), field, raw)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        return await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})


def _model_name(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


async def _websocket(server, field, raw):
    frame = '{"type": "generate", "request_id": "r1", "prompt": "hi", "sampling": {"max_tokens": 2, "%s": %s}}' % (field, raw)
    async with connect(server.ws_url) as ws:
        await ws.recv()  # session.created
        await ws.send(frame)
        while True:
            message = json.loads(await ws.recv())
            if message["type"] in ("done", "error"):
                return message


@pytest.mark.parametrize("field,raw,shown", REFUSED)
def test_http_and_websocket_refuse_alike_naming_field_and_range(server, field, raw, shown):
    response = asyncio.run(_http(server, field, raw))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and shown in error["message"], error
    message = asyncio.run(_websocket(server, field, raw))
    assert message["type"] == "error" and message["request_id"] == "r1", message
    assert message["code"] in ("invalid_params", "invalid_value")
    assert field in message["message"] and shown in message["message"], message


@pytest.mark.parametrize("field,raw", ACCEPTED)
def test_http_and_websocket_accept_alike(server, field, raw):
    response = asyncio.run(_http(server, field, raw))
    assert response.status_code == 200, response.text
    message = asyncio.run(_websocket(server, field, raw))
    assert message["type"] == "done", message
    SamplingParams(**{field: json.loads(raw)})
