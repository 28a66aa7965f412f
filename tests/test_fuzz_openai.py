"""Fuzzing the OpenAI-compatible HTTP API of a real `cadenza serve`: schemathesis against the app's
own OpenAPI document, then hypothesis bodies that mix valid and invalid values.

The properties: never a 5xx; every error is OpenAI's `{"error": {message, type, param, code}}` and
names the field at fault; responses conform to the document. Runs are derandomized (the same cases
every run) and bounded; each test prints how many cases it ran.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from fuzz_values import (
    FUZZ_SETTINGS,
    INVALID_SAMPLING,
    NOT_NUMBERS,
    REFUSED_BY_ENGINE,
    SAMPLING,
    TOKEN_IDS,
    VOCAB_SIZE,
    WRONG_TYPES,
    mostly,
    out_of_bounds,
    sampling,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_fixtures import fuzzed_server
from schemathesis import GenerationMode

from cadenza.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from cadenza.api.openai.schema import ChatCompletionResponse, CompletionResponse

ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error", "server_error"}
REQUIRED = {"/v1/completions": ("model", "prompt"), "/v1/chat/completions": ("model", "messages")}
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
RESPONSE_MODELS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionResponse}
# The engine's refusals of a prompt say what is wrong with it ("token ids out of range [0, 320)");
# their param says where.
PROMPT_REFUSALS = ("invalid_prompt", "invalid_messages", "prompt_too_long")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with fuzzed_server(tiny_model_dir("llama3")) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def assert_openai_error(status: int, content_type: str, body) -> dict:
    """An error response in OpenAI's shape, and never a 5xx; returns its `error`."""
    assert status < 500, f"{status}: {body}"
    assert content_type.startswith("application/json"), content_type
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["code"], str) and error["code"], error
    assert error["type"] in ERROR_TYPES, error
    assert error["param"] is None or (isinstance(error["param"], str) and error["param"]), error
    return error


# --- schemathesis against /openapi.json ---------------------------------------------------------

OPERATIONS = [
    ("POST", "/v1/completions", GenerationMode.POSITIVE),
    ("POST", "/v1/completions", GenerationMode.NEGATIVE),
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE),
    *((("POST", path, mode) for path in ("/tokenize", "/detokenize", "/apply-template")
       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))),
    # No parameters, so nothing to negate and a single case each.
    ("GET", "/v1/models", GenerationMode.POSITIVE),
    ("GET", "/health", GenerationMode.POSITIVE),
    ("GET", "/metrics", GenerationMode.POSITIVE),
]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS, ids=lambda v: str(v))
def test_schemathesis(api_schema, server, method, path, mode):
    """Every check schemathesis has (no 5xx; status, content type, headers and body as documented;
    schema-violating bodies refused) but `positive_data_acceptance`: a schema-valid body may still
    be refused for what a JSON Schema cannot say (the vocabulary's size, the context length, rules
    across fields such as min_tokens <= max_tokens). Such a refusal must come from those rules, so
    the body still passes the request model's own validation."""
    operation = api_schema[path][method]
    request_model = REQUEST_MODELS.get(path)
    statuses = Counter()

    @settings(max_examples=40, **FUZZ_SETTINGS)
    @given(case=operation.as_strategy(mode))
    def check(case):
        response = case.call(base_url=server.url, timeout=60)
        statuses[response.status_code] += 1
        case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance])
        if response.status_code >= 400:
            assert_openai_error(response.status_code, response.headers["content-type"][0], response.json())
            if mode.is_positive and request_model is not None and response.status_code == 400:
                request_model.model_validate_json(json.dumps(case.body))

    check()
    print(f"\nfuzz cases: schemathesis {method} {path} {mode}: {statuses.total()} {dict(statuses)}")


# --- hypothesis bodies --------------------------------------------------------------------------

TEXT = st.text(max_size=12)  # any Unicode, control characters included
PROMPTS = mostly(
    st.one_of(
        st.text(min_size=1, max_size=12),
        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
        st.lists(TOKEN_IDS, min_size=1, max_size=6),
        st.lists(st.lists(TOKEN_IDS, min_size=1, max_size=4), min_size=1, max_size=3),
    ),
    st.one_of(
        st.lists(st.integers(-2, VOCAB_SIZE + 2), max_size=6),
        st.sampled_from(["", "\ud800", "a\udfffb", [2**70], [[]], [""], [], [[1], []]]),  # lone surrogates
        WRONG_TYPES,
    ),
)
TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
OTHER_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", ""])}), min_size=1, max_size=1)
CONTENT = mostly(TEXT | TEXT_PARTS, st.none() | OTHER_PARTS | WRONG_TYPES)  # no content: only for assistant
ROLES = mostly(st.sampled_from(["system", "developer", "user", "assistant"]), st.sampled_from(["robot", "", "USER"]))
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT}, optional={"name": TEXT})
MESSAGES = mostly(
    st.lists(MESSAGE, min_size=1, max_size=3),
    st.one_of(st.just([]), st.lists(st.just({"role": "user"}), min_size=1, max_size=1), WRONG_TYPES),
)
UNKNOWN = mostly(st.just({}), st.dictionaries(st.text(min_size=1, max_size=8), st.integers(), min_size=1, max_size=1))


def shared_fields() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {},
        optional={
            "n": mostly(st.integers(1, 3), st.sampled_from([0, -1, 65, 1.5, "x"])),
            "stream": mostly(st.booleans(), st.just("x")),
            "stream_options": mostly(st.none(), st.just({"include_usage": True}) | WRONG_TYPES),
            "user": mostly(TEXT, WRONG_TYPES),
            "metadata": mostly(st.dictionaries(TEXT, TEXT, max_size=2), WRONG_TYPES),
        },
    )


@st.composite
def bodies(draw, path: str, model: str) -> dict:
    body = {"model": draw(mostly(st.just(model), st.sampled_from(["nope", ""]) | WRONG_TYPES))}
    if path == "/v1/completions":
        body["prompt"] = draw(PROMPTS)
        fields = st.fixed_dictionaries(
            {},
            optional={
                "echo": mostly(st.booleans(), WRONG_TYPES),
                "best_of": mostly(st.just(1), st.integers(-1, 3)),
                "suffix": mostly(st.just(""), TEXT),
            },
        )
        body.update(draw(sampling()))
    else:
        body["messages"] = draw(MESSAGES)
        fields = st.fixed_dictionaries(
            {},
            optional={
                "max_completion_tokens": SAMPLING["max_tokens"],
                "logprobs": mostly(st.booleans(), WRONG_TYPES),
                "top_logprobs": SAMPLING["logprobs"],
                "tools": mostly(st.just([]), st.lists(st.just({"type": "function"}), min_size=1, max_size=1)),
                "tool_choice": st.sampled_from(["none", "auto", "required"]),
                "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]),
            },
        )
        body.update(draw(sampling(set(SAMPLING) - {"logprobs"})))
    body.update(draw(fields))
    body.update(draw(shared_fields()))
    body.setdefault("max_tokens", draw(st.integers(1, 4)))  # cheap, unless a case says otherwise
    body.update(draw(UNKNOWN))
    for name in draw(mostly(st.just([]), st.lists(st.sampled_from(REQUIRED[path]), min_size=1, max_size=1))):
        del body[name]
    return body


def post(http: httpx.Client, path: str, body) -> httpx.Response:
    return http.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})


def check_answer(path: str, body, response: httpx.Response) -> dict | None:
    """A 200 with the documented body, or a 4xx in OpenAI's error shape naming a field of the
    request: returns the error, or None for a 200."""
    if response.status_code == 200:
        if body.get("stream") is True:
            events = [event[6:] for event in response.text.split("\n\n") if event.startswith("data: ")]
            assert events[-1] == "[DONE]", response.text
            chunks = [json.loads(event) for event in events[:-1]]
            assert chunks and not [c for c in chunks if "error" in c], response.text
        else:
            request = REQUEST_MODELS[path].model_validate_json(json.dumps(body))
            answer = RESPONSE_MODELS[path].model_validate_json(response.content)
            prompts = request.prompts() if path == "/v1/completions" else [request.messages]
            assert len(answer.choices) == request.n * len(prompts)
        return None
    error = assert_openai_error(response.status_code, response.headers.get("content-type", ""), response.json())
    if error["code"] == "invalid_json":  # not JSON text (a lone surrogate): no field to name
        assert error["param"] is None, error
        return error
    fields = (*body, *REQUIRED[path])
    if error["param"] is None:  # a rule across fields: the message names them
        assert any(field in error["message"] for field in fields), error
    else:
        field = error["param"].split(".")[0]
        assert field in fields, error
        assert field in error["message"] or error["code"] in PROMPT_REFUSALS, error
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_mixed_bodies(http, model, path):
    """Bodies mixing valid and invalid values in every field: each gets a 200 with a documented
    body or a 4xx in OpenAI's error shape that names a field of the request; never a 5xx."""
    outcomes = Counter()

    @settings(max_examples=100, **FUZZ_SETTINGS)
    @given(body=bodies(path, model))
    def check(body):
        error = check_answer(path, body, post(http, path, body))
        outcomes["200" if error is None else error["code"]] += 1

    check()
    print(f"\nfuzz cases: mixed {path}: {outcomes.total()} {dict(outcomes)}")
    assert outcomes["200"] >= 10, outcomes  # the mix still reaches generation


COMPLETION_ONLY = {
    "prompt": ["", [], [[]], [""], [-1], [VOCAB_SIZE], [2**70], [[1], []], 5, None, {"a": 1}, [1.5]],
    "echo": ["x", [], 2],
    "best_of": [2, 0, "x"],
    "suffix": ["x", 5],
}
CHAT_ONLY = {
    "messages": [
        [], "hi", None, [{}], [5], [{"role": "robot", "content": "x"}], [{"role": "user"}],
        [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": "x", "tool_calls": [{}]}],
        [{"role": "user", "content": "x", "bogus": 1}], [{"role": "user", "content": "x"}, {"role": 5}],
    ],  # fmt: skip
    "max_completion_tokens": [0, -1, 1.5, *NOT_NUMBERS],
    "logprobs": ["x", 2, [], {}],
    "top_logprobs": [-1, 21, 1.5, "x"],
    "tools": [[{"type": "function"}], [{"type": "function", "function": {"name": "bad name"}}], "x"],
    "tool_choice": ["required", 5],
    "functions": [[{"name": "f"}]],
    "function_call": ["required"],
    "response_format": [{"type": "json_schema"}, {"type": "xml"}, "x", {}],
    "modalities": [["audio"], "x"],
}
SHARED = {
    "model": ["nope", "", 5, None, ["x"]],
    "n": [0, -1, 65, 1.5, None, *NOT_NUMBERS],
    "stream": ["x", [], 2, None],
    "stream_options": [{"include_usage": True}, "x", {"bogus": 1}],
    "user": [1, []],
    "metadata": ["x", 1],
}


def invalid_fields(path: str) -> dict[str, list]:
    own = COMPLETION_ONLY if path == "/v1/completions" else CHAT_ONLY
    table = {field: [*values, *REFUSED_BY_ENGINE.get(field, ())] for field, values in INVALID_SAMPLING.items()}
    table.update({**SHARED, **own})
    if path == "/v1/chat/completions":
        del table["logprobs"]  # chat's logprobs is a switch, above; its count is top_logprobs
        table["logprobs"] = CHAT_ONLY["logprobs"]
    return table


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_one_bad_field_is_named(http, model, path):
    """A valid request with one field made invalid (every value of the table, then values outside
    each field's bound and unknown fields) is a 4xx whose param and message name that field."""
    base = {"model": model, "max_tokens": 2}
    base[REQUIRED[path][1]] = "hello" if path == "/v1/completions" else [{"role": "user", "content": "hi"}]
    table = invalid_fields(path)
    known = set(REQUEST_MODELS[path].model_fields)
    cases = Counter()

    def check(field: str, value, kind: str = "table") -> str:
        body = {**base, field: value}
        if field == "top_logprobs":
            body["logprobs"] = True
        response = post(http, path, body)
        assert 400 <= response.status_code < 500, (body, response.text)
        error = assert_openai_error(response.status_code, response.headers["content-type"], response.json())
        if field in known:  # a dotted param locates a problem within the field
            assert (error["param"] or "").split(".")[0] == field, (body, error)
        else:
            assert error["param"] == field and error["code"] == "unknown_field", (body, error)
        assert field in error["message"] or error["code"] in PROMPT_REFUSALS, (body, error)
        return kind

    # The table, a few requests at a time: each answer waits on the network more than on a core.
    with ThreadPoolExecutor(4) as pool:
        cases.update(pool.map(lambda pair: check(*pair), [(f, v) for f, values in table.items() for v in values]))

    unknown = st.text(min_size=1, max_size=10).filter(lambda name: name not in known)
    rename = {"logprobs": "top_logprobs"} if path == "/v1/chat/completions" else {}
    bad = st.one_of(
        st.tuples(st.just("bounds"), out_of_bounds(rename=rename)),
        st.tuples(st.just("unknown"), st.tuples(unknown, WRONG_TYPES)),
    )

    @settings(max_examples=60, **FUZZ_SETTINGS)
    @given(bad=bad)
    def fuzz(bad):
        kind, (field, value) = bad
        cases[check(field, value, kind)] += 1

    fuzz()
    print(f"\nfuzz cases: one bad field {path}: {cases.total()} {dict(cases)}")


def test_odd_bodies(http, model):
    """Bodies that are not a request object at all, or absurdly nested, or too large."""
    odd = [b"", b"null", b"[]", b'"x"', b"5", b"{", b"{}", b"\xff\xfe", b"[" * 100_000, b'{"model": ' + b"[" * 5000]
    for path in REQUIRED:
        for content in odd:
            response = http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400, (content[:20], response.text)
            assert_openai_error(400, response.headers["content-type"], response.json())
        nested = {"model": model, REQUIRED[path][1]: "x", "max_tokens": 1, "metadata": {"a": [[[[[{}]]]]]}}
        if path == "/v1/chat/completions":
            nested["messages"] = [{"role": "user", "content": "x"}]
        assert check_answer(path, nested, post(http, path, nested)) is None
        response = http.post(path, content=json.dumps({"model": model, "prompt": "x" * (9 << 20)}))
        error = assert_openai_error(response.status_code, response.headers["content-type"], response.json())
        assert response.status_code == 413 and error["code"] == "request_too_large", error
