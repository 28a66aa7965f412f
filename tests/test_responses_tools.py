"""The Responses API with tools, structured output and agent frameworks, against the real server
(a tiny random llama3-template model): forced function calls (non-stream and streamed, the SDK
accumulating the events), a second turn with the call's output (inline items and through
previous_response_id), `responses.parse` into a nested pydantic model, OpenAI's agents SDK and
pydantic-ai's Responses model running their tools and outputs, and hosted tools refused.

The model's text is random: the assertions are on shapes, events and what the grammar forces
(arguments valid for the tool's schema, enums and bounded integers so the output ends quickly)."""

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False},
    "strict": True,
}  # fmt: skip
NAMED = {"type": "function", "name": "get_weather"}


def _valid_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 3, args
    return args


def _only_call(response):
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    assert call.status == "completed"
    return call


def test_forced_call_then_its_output_inline_and_by_previous_response(client, model):
    first = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED,
                                    max_output_tokens=200)  # fmt: skip
    assert (
        first.status == "completed" and first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    )
    call = _only_call(first)
    _valid_weather(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}

    # The whole conversation inline: the call as the SDK returned it, then its output.
    inline = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=8, store=False,
                                     input=[{"role": "user", "content": "Weather in Paris?"}, call, result])  # fmt: skip
    assert inline.status in ("completed", "incomplete") and inline.output

    # The same turn through the stored response: only the output is sent.
    chained = client.responses.create(model=model, tools=[WEATHER], previous_response_id=first.id, input=[result],
                                      max_output_tokens=8)  # fmt: skip
    assert chained.previous_response_id == first.id and chained.output
    assert chained.usage.input_tokens > first.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens > 0  # the stored prompt's prefix


def test_required_call_streamed_and_accumulated_by_the_sdk(client, model):
    with client.responses.stream(model=model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):  # fmt: skip
        assert kind in kinds
    call = _only_call(final)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.item_id == call.id
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    _valid_weather(call.arguments)
    # A strict tool's arguments are parsed by the SDK into the call.
    assert final.output[0].parsed_arguments == json.loads(call.arguments)


class Place(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    floor: int = Field(ge=0, le=9)


class Booking(BaseModel):
    place: Place
    nights: Literal[1, 2, 3]
    confirmed: bool


def test_parse_into_a_nested_model(client, model):
    parsed = client.responses.parse(model=model, input="Book a room.", text_format=Booking, max_output_tokens=200)
    assert parsed.status == "completed" and parsed.text.format.type == "json_schema"
    assert isinstance(parsed.output_parsed, Booking)
    assert Booking.model_validate_json(parsed.output_text) == parsed.output_parsed

    json_object = client.responses.create(model=model, input="Any JSON, please.", text={"format": {"type": "json_object"}},
                                          max_output_tokens=200)  # fmt: skip
    assert json_object.output_text.lstrip().startswith("{")


def test_openai_agents_sdk_runs_its_tool(server, model):
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], days: Literal[1, 2, 3]) -> str:
        """The weather in a city.

        Args:
            city: The city.
            days: How many days ahead (1 to 3).
        """
        ran.append((city, days))
        return f"Sunny in {city}"

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            agent = agents.Agent(
                name="weather", instructions="Use the tool.", tools=[get_weather],
                model=OpenAIResponsesModel(model, client),
                model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
                tool_use_behavior="stop_on_first_tool",
            )  # fmt: skip
            return await agents.Runner.run(agent, "Weather in Oslo?", max_turns=2)

    result = asyncio.run(run())
    assert len(ran) == 1 and ran[0][0] in ("Paris", "Oslo") and ran[0][1] in (1, 2, 3)
    assert result.final_output == f"Sunny in {ran[0][0]}"


def test_openai_agents_sdk_calls_then_answers_in_its_output_type(server, model):
    """The whole loop: a forced call, the tool's result sent back inline (function_call and
    function_call_output items), then the answer in the agent's output type (text.format)."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def find_room(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """A free room in a city."""
        ran.append(city)
        return f"Room 4 in {city}"

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            agent = agents.Agent(
                name="booker", instructions="Find a room, then book it.", tools=[find_room], output_type=Booking,
                model=OpenAIResponsesModel(model, client),
                model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
            )  # fmt: skip
            return await agents.Runner.run(agent, "Book a room.", max_turns=3)

    result = asyncio.run(run())
    assert len(ran) == 1 and isinstance(result.final_output, Booking)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_pydantic_ai_responses_model_structured_output(server, model):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="x")
    agent = pydantic_ai.Agent(OpenAIResponsesModel(model, provider=provider), output_type=Booking)
    result = agent.run_sync("Book a room.", model_settings={"max_tokens": 200})
    assert isinstance(result.output, Booking)


def test_hosted_tools_and_bad_items_are_400s_naming_the_field(client, model, server):
    with pytest.raises(openai.BadRequestError) as hosted:
        client.responses.create(model=model, input="x", tools=[WEATHER, {"type": "web_search"}])
    assert hosted.value.body["param"] == "tools.1.type" and "web_search" in hosted.value.body["message"]
    with pytest.raises(openai.BadRequestError) as named:
        client.responses.create(
            model=model, input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}
        )
    assert named.value.body["param"] == "tool_choice"
    body = {"input": [{"type": "computer_call_output", "call_id": "c"}]}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input.0.type", response.text
    body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("text.format"), response.text


def test_responses_websocket_forced_call(client, model):
    with client.responses.connect() as connection:
        connection.send({"type": "response.create", "model": model, "input": "Weather?", "tools": [WEATHER],
                         "tool_choice": NAMED, "max_output_tokens": 200})  # fmt: skip
        for event in connection:
            assert event.type != "error", event
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                break
    assert event.type == "response.completed"
    _valid_weather(_only_call(event.response).arguments)


# --- the output items from chat deltas, without a server -------------------------------------------


def test_output_items_from_reasoning_text_and_a_call():
    from cadenza.api.openai_ws.responses_items import answer_message
    from cadenza.api.openai_ws.responses_output import OutputItems

    output = OutputItems()
    events = []
    for delta in ({"reasoning_content": "Let me "}, {"reasoning_content": "think."}, {"content": "Checking."},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}):  # fmt: skip
        events += output.feed(delta)
    events += output.finish("completed")
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    reasoning, message, call = output.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}] and reasoning["id"].startswith(
        "rs_"
    )
    assert message["content"][0]["text"] == "Checking." and [e["output_index"] for e in events[-4:]] == [2, 2, 2, 2]
    assert call["call_id"] == "call_1" and call["arguments"] == '{"a": 1}' and call["id"].startswith("fc_")
    assert answer_message(output.items) == {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Let me think.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}  # fmt: skip


def test_input_items_become_chat_messages():
    from cadenza.api.openai_ws.responses_protocol import ResponseCreateRequest

    body = ResponseCreateRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call f."}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
    ]})  # fmt: skip
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    assert body.messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": "Call f."},
        {"role": "tool", "content": "1", "tool_call_id": "call_1"}, {"role": "tool", "content": "2", "tool_call_id": "call_2"},
    ]  # fmt: skip
