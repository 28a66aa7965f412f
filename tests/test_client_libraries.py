"""The client libraries people point at an OpenAI-compatible server, each as its documentation
shows it, against a served tiny model on loopback: instructor (a nested model in TOOLS mode),
langchain-openai (tools bound and structured output), litellm (chat and a forced tool call) and
pydantic-ai's chat model (a nested output type). The Responses API's clients (OpenAI's agents SDK,
pydantic-ai's Responses model) are in test_responses_tools.py.

The tiny model is random, so what is asserted is what the server guarantees: the shape each
library parses, and arguments that validate, since a forced call is written under a grammar.
"""

from __future__ import annotations

import json
import os
from typing import Literal

import openai
import pytest
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from pydantic import BaseModel, Field


class Address(BaseModel):
    city: Literal["Oslo", "Rome"]
    floor: int = Field(ge=0, le=9)


class Person(BaseModel):
    """A person and where they live."""

    name: Literal["Ann", "Bo"]
    home: Address


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip


def test_instructor_tools_mode_with_a_nested_model(server, model):
    import instructor

    patched = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
                                     mode=instructor.Mode.TOOLS)  # fmt: skip
    person = patched.chat.completions.create(model=model, response_model=Person, max_tokens=300, max_retries=0,
                                             messages=[{"role": "user", "content": "Who lives where?"}])  # fmt: skip
    assert isinstance(person, Person) and isinstance(person.home, Address)
    # Streamed partial objects (create_partial): the last one is the whole, valid object.
    partials = list(patched.chat.completions.create_partial(
        model=model, response_model=Person, max_tokens=300, max_retries=0,
        messages=[{"role": "user", "content": "Who lives where?"}]))  # fmt: skip
    assert partials and Person.model_validate(partials[-1].model_dump())


def test_langchain_openai_bind_tools_and_structured_output(server, model):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=server.url + "/v1", api_key="x", max_tokens=300, max_retries=0,
                      temperature=1.0)  # fmt: skip
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo")
    # A nested model as a function call, and as a JSON schema response format.
    for method in ("function_calling", "json_schema"):
        person = chat.with_structured_output(Person, method=method).invoke("Who lives where?")
        assert isinstance(person, Person), method


LITELLM_SCRIPT = """
import json, sys
import litellm

url, model, tool = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
common = dict(model=f"openai/{model}", api_base=url + "/v1", api_key="x", max_tokens=8)
answer = litellm.completion(messages=[{"role": "user", "content": "hi"}], **common)
forced = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], tools=[tool], tool_choice="required",
                            **{**common, "max_tokens": 300})
(call,) = forced.choices[0].message.tool_calls
streamed = litellm.completion(messages=[{"role": "user", "content": "hi"}], stream=True, **common)
text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
print(json.dumps({"finish": answer.choices[0].finish_reason, "tokens": answer.usage.completion_tokens,
                  "name": call.function.name, "arguments": call.function.arguments, "streamed": text}))
"""


def test_litellm_chat_and_a_forced_tool_call(server, model):
    """litellm as its documentation shows it, in a process of its own: importing it installs a
    process-wide logging filter of its own that would rewrite every other test's log lines."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LITELLM_SCRIPT, server.url, model, json.dumps(WEATHER)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finish"] in ("stop", "length") and result["tokens"] > 0
    assert result["name"] == "get_weather" and json.loads(result["arguments"])["city"] in ("Paris", "Tokyo")
    assert isinstance(result["streamed"], str)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_pydantic_function_tool_with_a_nested_model(client, model, stream):
    """openai's own helper for a nested model, forced and parsed back by `.parse()`."""
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Who?"}], max_tokens=300,
                  tools=[openai.pydantic_function_tool(Person)],
                  tool_choice={"type": "function", "function": {"name": "Person"}})  # fmt: skip
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            final = events.get_final_completion()
    else:
        final = client.chat.completions.parse(**kwargs)
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Person)


def test_pydantic_ai_chat_model_with_a_nested_output_type(server, model):
    """pydantic-ai's chat model (Chat Completions): its output tool carries the nested model's
    `$defs`, and it is forced, so the run's output validates."""
    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="x")
    agent = pydantic_ai.Agent(OpenAIChatModel(model, provider=provider), output_type=Person)
    result = agent.run_sync("Who lives where?", model_settings={"max_tokens": 300})
    assert isinstance(result.output, Person) and isinstance(result.output.home, Address)
