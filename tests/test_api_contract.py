"""The published API document is the contract: `schemathesis run` (its examples, coverage and
fuzzing phases, valid and invalid bodies, undeclared methods) against a real `cadenza serve`'s own
`/openapi.json`, and the server must keep to what the document says.

The properties (all of schemathesis' checks but positive_data_acceptance, which this
replaces): never a 5xx; every response conforms to the document (status, content type,
headers, body); a body the document forbids is refused; a 405 names the allowed methods in
`Allow`; and a body the document allows is refused (400) only for one of the relations it
documents under `x-cadenza-relations` (`contract_hooks.documented_refusal`).

One rule of the document is global and stated in its description: integers are written as JSON
integers. JSON Schema counts 2.0 as an integer, so the generator writes some integers that way;
they are rewritten as integers before each request (`contract_hooks.before_call`), and
`test_integers_are_json_integers` checks the rule itself.

schemathesis runs as its own process: its hooks and the extra check stay out of this one (the
other fuzz tests run schemathesis' checks as they are), and its pytest plugin's lazy loading
does not run under this pytest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fuzz_values import VOCAB_SIZE
from openai_fixtures import fuzzed_server

from cadenza.api.openai.request_rules import integers_below

# Cases per operation in the fuzzing phase (the coverage phase adds its own, a few per field, and
# the stateful phase its sequences): over 34 operations schemathesis ran 80 s on two cores at load 2-3.
MAX_EXAMPLES = 50
CLI_TIMEOUT_S = 300
# Generation is deterministic for a seed; CONTRACT_SEED runs the test with another one (not
# CADENZA_*: the server reads those as its configuration).
SEED = int(os.environ.get("CONTRACT_SEED", "1"))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with fuzzed_server(tiny_model_dir("llama3")) as process:
        yield process


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(server.url + "/openapi.json", timeout=30).json()


def not_supported_operations(document: dict) -> list[str]:
    """The operation ids the document answers with 501 alone (Ollama's model management)."""
    return [operation["operationId"] for operations in document["paths"].values() for operation in operations.values()
            if set(operation["responses"]) == {"501"}]  # fmt: skip


def test_the_server_keeps_to_its_document(server, document, tmp_path):
    tests = Path(__file__).parent
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "contract_hooks", "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    # A 501 is a 5xx, but where the document says the operation is not supported it is the answer.
    unsupported = not_supported_operations(document)
    assert unsupported, "Ollama's model management routes are documented as 501s"
    config = tmp_path / "schemathesis.toml"
    config.write_text(f"[[operations]]\ninclude-operation-id = {json.dumps(unsupported)}\n"
                      'checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "501"]\n')
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", server.url + "/openapi.json",
        # Stateful: POST /v1/responses' links lead to GET, DELETE and cancel of the stored response.
        # A response created with store: false is not stored, by design: ensure_resource_availability
        # (a created resource must be found) does not hold for it.
        "--phases", "examples,coverage,fuzzing,stateful", "--checks", "all",
        "--exclude-checks", "positive_data_acceptance,ensure_resource_availability",
        "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--seed", str(SEED), "--workers", "1",
        "--request-timeout", "60", "--suppress-health-check", "all", "--no-color", "--report", "junit",
        "--report-dir", str(tmp_path),
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=tmp_path)
    output = done.stdout + done.stderr
    took = time.monotonic() - started
    print(f"\nschemathesis run (seed {SEED}): {took:.0f} s, exit {done.returncode}\n" + output[-3000:])
    assert done.returncode == 0, output[-12000:]


# --- what the document states ---------------------------------------------------------------------


def test_every_served_http_route_is_in_the_document(server, document):
    from fastapi.routing import APIRoute

    from cadenza.api import playground, tokenizer
    from cadenza.api.anthropic import routes as anthropic
    from cadenza.api.ollama import routes as ollama
    from cadenza.api.openai import completions, embeddings
    from cadenza.api.openai_ws import realtime, responses
    from cadenza.api.sessions import websocket

    # The app's own: health, metrics, the model list, and loading and unloading models.
    served = {("/health", "get"), ("/metrics", "get"), ("/v1/models", "get"), ("/models/load", "post"),
              ("/models/unload", "post")}  # fmt: skip
    for module in (completions, embeddings, tokenizer, websocket, responses, realtime, playground, anthropic, ollama):
        served |= {(r.path, m.lower()) for r in module.router.routes if isinstance(r, APIRoute) for m in r.methods}
    documented = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert served == documented
    assert ("/v1/responses", "post") in documented and ("/v1/responses/{response_id}", "delete") in documented
    new = {("/v1/messages", "post"), ("/api/chat", "post"), ("/api/tags", "get"), ("/api/blobs/{digest}", "head")}
    assert new <= documented
    for operations in document["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]  # validation errors are 400s here


def test_the_document_states_the_rules(document):
    schemas = document["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    assert chat["properties"]["guided_choice"]["anyOf"][0]["minItems"] == 1
    # Token ids: below the served vocabulary's size, wherever they are written.
    ids = completion["properties"]["prompt"]["anyOf"][2]["items"]
    assert ids["maximum"] == VOCAB_SIZE - 1 and schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == VOCAB_SIZE - 1
    assert chat["properties"]["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB_SIZE - 1
    assert chat["properties"]["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"] == f"^(?:{integers_below(VOCAB_SIZE)})$"
    assert schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]["maximum"] == 64  # the tiny model's hidden size
    # Relations across fields, in the descriptions and listed.
    assert "must not exceed max_tokens" in chat["properties"]["min_tokens"]["description"]
    listed = {p for r in chat["x-cadenza-relations"] for p in r["params"]}
    assert {"min_tokens", "messages", "tools", "tool_choice", "tools.*.function.parameters"} <= listed
    # Rules a JSON Schema can say: stream_options with stream; content but in assistant messages.
    assert any("stream_options" in str(c) for c in chat["allOf"])
    assert "assistant" in str(schemas["ChatMessage"]["allOf"])
    assert "JSON integers" in document["info"]["description"]
    # seed: -1 is documented as a seed like any other.
    assert "-1 is a seed like any other" in chat["properties"]["seed"]["anyOf"][0]["description"]


def test_the_document_states_the_other_protocols(document):
    """Anthropic's and Ollama's routes and model management: the served model's names, errors in
    each protocol's own shape, streams, and the relations a refusal of a valid body names."""
    schemas, paths = document["components"]["schemas"], document["paths"]
    name = schemas["ChatCompletionRequest"]["properties"]["model"]["enum"][0]
    assert schemas["AnthropicMessagesRequest"]["properties"]["model"]["enum"] == [name]
    assert sorted(schemas["OllamaChatRequest"]["properties"]["model"]["enum"]) == sorted([name, f"{name}:latest"])
    assert schemas["ModelUnload"]["properties"]["model"]["enum"] == [name]
    messages, chat = paths["/v1/messages"]["post"]["responses"], paths["/api/chat"]["post"]["responses"]
    assert messages["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    assert "itemSchema" in messages["200"]["content"]["text/event-stream"]
    assert chat["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/OllamaError")
    assert "itemSchema" in chat["200"]["content"]["application/x-ndjson"]
    assert paths["/api/push"]["post"]["responses"].keys() == {"501"}
    assert {"messages", "tools.*.input_schema"} <= {p for r in schemas["AnthropicMessagesRequest"]["x-cadenza-relations"] for p in r["params"]}
    assert "model_pinned" in schemas["ModelUnload"]["x-cadenza-relations"][0]["rule"]
    assert schemas["OllamaOptions"]["properties"]["num_predict"]["not"] == {"const": 0}
    # The error shapes without `param` name the field first, as the description says.
    assert "begin with the field" in document["info"]["description"]


def test_refusals_in_the_other_shapes_name_the_field_first(server, document):
    name = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"][0]
    body = {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("temperature: "), response.text
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "think": True}
    response = httpx.post(server.url + "/api/chat", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"].startswith("think: "), response.text
    response = httpx.post(server.url + "/models/unload", json={"model": name}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_pinned", response.text


def test_an_undeclared_method_is_a_405_naming_the_allowed_ones(server, document):
    for path, operations in document["paths"].items():
        url = server.url + re.sub(r"\{\w+\}", "x1", path)
        declared = {m.upper() for m in operations}
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
            if method in declared:
                continue
            response = httpx.request(method, url, timeout=30)
            assert response.status_code == 405, (method, path, response.status_code)
            allowed = {m.strip() for m in response.headers["allow"].split(",")}
            assert allowed - {"HEAD"} == declared - {"HEAD"}, (method, path, allowed)
            # In the shape of the protocol that owns the path.
            body = response.json()
            if path.startswith("/api/"):
                assert set(body) == {"error"} and body["error"].startswith(f"{method} is not allowed"), body
            elif path.startswith("/v1/messages"):
                assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            else:
                assert body["error"]["code"] == "method_not_allowed"


def test_integers_are_json_integers(server, document):
    model = document["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"][0]
    for field, value in (("n", 2.0), ("max_tokens", 3.0), ("seed", -1.0)):
        response = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", field: value}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
        response = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", field: int(value)}, timeout=30)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("field, value", [("repetition_penalty", 5e-324), ("repetition_penalty", 1e308), ("temperature", 1e308)])
def test_extreme_sampling_values_within_bounds_never_break_a_grammar(server, document, field, value):
    """Each value is within its documented bounds; one once became 0 or inf in float32, made a
    masked logit NaN, and the grammar's refused token was sampled (a 500)."""
    model = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"][0]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 0,
            "structured_outputs": {"json_object": True}, field: value}  # fmt: skip
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_a_failed_response_answers_its_own_status_and_field(server, document):
    """A Responses request the engine refuses is the engine's status (400 here) naming the field
    under `sampling`, not a 500."""
    body = {"input": "hi", "max_output_tokens": 2, "sampling": {"stop_token_ids": [VOCAB_SIZE + 5]}}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "sampling.stop_token_ids", response.text
    cut = {"input": "hi", "max_output_tokens": 2, "sampling": {"min_tokens": 3}}
    response = httpx.post(server.url + "/v1/responses", json=cut, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling.min_tokens", response.text
