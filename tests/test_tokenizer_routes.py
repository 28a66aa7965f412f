"""`/tokenize`, `/detokenize` and `/apply-template` on a served model: the counts and renderings the
engine itself uses (the prompt tokens a chat completion reports), and bad input as 400s."""

from __future__ import annotations

import httpx
import pytest
from openai_fixtures import client, model, server  # noqa: F401  (fixtures)

from cadenza.models.tokenizer import load_hf_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂 there"}]


def post(server, path, body):  # noqa: F811
    return httpx.post(server.url + path, json=body, timeout=30)


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_tokenize_counts_what_a_chat_completion_counts(server, client, model, tiny_model_dir):  # noqa: F811
    counted = post(server, "/tokenize", {"model": model, "messages": MESSAGES}).json()
    done = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    assert counted["count"] == done.usage.prompt_tokens == len(counted["tokens"])
    assert counted["max_model_len"] > 0 and counted["token_strs"] is None
    rendered = post(server, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    tokenizer = load_hf_tokenizer(tiny_model_dir("llama3"), ())
    assert rendered == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert counted["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"] == rendered


def test_tokenize_text_with_and_without_special_tokens_and_strs(server):  # noqa: F811
    text = "The quick brown fox"
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert "".join(plain["token_strs"]) == text and plain["count"] == len(plain["token_strs"])
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": text}
    without_turn = post(server, "/apply-template", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    with_turn = post(server, "/apply-template", {"messages": MESSAGES}).json()
    assert with_turn["prompt"].startswith(without_turn["prompt"]) and with_turn["prompt"] != without_turn["prompt"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),  # both inputs
        ("/tokenize", {}, None),  # neither
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "tools": []}, None),  # tools without messages
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
        ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
        ("/apply-template", {"messages": []}, "messages"),
        ("/apply-template", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ("/apply-template", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ],
)
def test_bad_bodies_are_400s_that_name_the_problem(server, path, body, param):  # noqa: F811
    error = error_of(post(server, path, body), 400)
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_another_model_is_a_404_and_bad_json_a_400(server):  # noqa: F811
    assert error_of(post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"}), 404)["code"] == "model_not_found"
    assert error_of(httpx.post(server.url + "/detokenize", content=b"{nope", timeout=10), 400)["code"] == "invalid_json"


def test_the_routes_are_in_the_api_schema(server):  # noqa: F811
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path in ("/tokenize", "/detokenize", "/apply-template"):
        assert "post" in document["paths"][path]
    for name in ("TokenizeRequest", "DetokenizeRequest", "ApplyTemplateRequest"):
        assert name in document["components"]["schemas"]
