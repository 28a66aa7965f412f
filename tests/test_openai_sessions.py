"""The official `openai` SDK, unchanged, against the real server: the Responses API over HTTP and
over its WebSocket (`client.responses.connect()`), and the Realtime API (`client.realtime.connect()`,
text). Two-turn conversations served from the cached prefix, a cancel mid-answer, and bad events
answered with the API's error events on a connection that carries on."""

import httpx
import openai
import pytest
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)

LONG = {"ignore_eos": True, "temperature": 0}
SYSTEM = "You are careful. Paged attention keeps keys and values in blocks."


# --- Responses over HTTP ------------------------------------------------------------------------


def test_http_response_then_continuation_from_the_cached_prefix(client, model):
    first = client.responses.create(model=model, instructions=SYSTEM, input="Tell me about blocks.", max_output_tokens=8,
                                    extra_body={"sampling": LONG})  # fmt: skip
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.usage.output_tokens == 8
    second = client.responses.create(model=model, instructions=SYSTEM, input="And caches?", previous_response_id=first.id,
                                     max_output_tokens=8, extra_body={"sampling": LONG})  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 32
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_http_stream_events_in_order(client, model):
    with client.responses.create(model=model, input="Hello", max_output_tokens=6, stream=True, extra_body={"sampling": LONG}) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_http_errors_name_the_problem(client, model):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=model, input="x", temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as tools:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert "tool" in str(tools.value)


# --- Responses over the WebSocket ---------------------------------------------------------------


def test_websocket_two_turns_cancel_and_bad_events(client, model):
    with client.responses.connect() as connection:
        # `sampling` is cadenza's (ignore_eos, so answers run their length); the SDK passes it through.
        connection.send({"type": "response.create", "model": model, "instructions": SYSTEM, "input": "Tell me about blocks.",
                         "max_output_tokens": 8, "sampling": LONG})  # fmt: skip
        first = _until_final(connection)
        assert first.type == "response.incomplete" and first.response.usage.output_tokens == 8
        connection.send({"type": "response.create", "model": model, "instructions": SYSTEM, "input": "And caches?",
                         "previous_response_id": first.response.id, "max_output_tokens": 8, "sampling": LONG})  # fmt: skip
        second = _until_final(connection)
        assert second.response.usage.input_tokens_details.cached_tokens >= 32

        # Bad events: an error event each, and the connection carries on.
        connection.send({"type": "response.create", "input": "x", "temperature": -1})
        error = _until(connection, "error")
        assert error.error.code == "invalid_request" and "temperature" in error.error.message and error.status == 400
        connection.send({"type": "response.create", "input": "x", "previous_response_id": "resp_nope"})
        assert _until(connection, "error").error.code == "response_not_found"
        connection.send({"type": "response.dance"})
        assert _until(connection, "error").error.code == "unknown_type"

        # Cancel mid-answer, through the SDK's own HTTP call.
        connection.send({"type": "response.create", "input": "Go on and on.", "max_output_tokens": 400, "sampling": LONG})
        created = _until(connection, "response.created")
        _until(connection, "response.output_text.delta")
        cancelled = client.responses.cancel(created.response.id)
        final = _until_final(connection)
        assert final.response.status == "cancelled" and final.response.usage.output_tokens < 400
        assert cancelled.status == "cancelled"

        connection.send({"type": "response.create", "input": "Still here?", "max_output_tokens": 4, "sampling": LONG})
        assert _until_final(connection).response.usage.output_tokens == 4


def _until(connection, kind):
    for event in connection:
        if event.type == kind:
            return event
        assert event.type != "error", event
    raise AssertionError("the connection closed")


def _until_final(connection):
    for event in connection:
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            return event
        assert event.type != "error", event
    raise AssertionError("the connection closed")


# --- Realtime -----------------------------------------------------------------------------------


def test_realtime_text_conversation_cancel_and_errors(client, model):
    with client.realtime.connect(model=model) as connection:
        created = connection.recv()
        assert created.type == "session.created"
        connection.session.update(session={"type": "realtime", "instructions": SYSTEM, "output_modalities": ["text"]})
        assert _rt(connection, "session.updated").session.instructions == SYSTEM

        for i, text in enumerate(["Tell me about blocks.", "And caches?"]):
            connection.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
            assert _rt(connection, "conversation.item.done").item.role == "user"
            connection.send({"type": "response.create", "response": {"max_output_tokens": 8, "sampling": LONG}})
            deltas, done = _rt_response(connection)
            assert done.response.status == "incomplete" and done.response.usage.output_tokens == 8
            assert done.response.output[0].content[0].text == "".join(deltas)
            if i == 1:
                assert done.response.usage.input_token_details.cached_tokens >= 32

        # Bad events: the API's error event each; the session carries on.
        connection.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}})
        assert _rt(connection, "error").error.code == "invalid_value"
        connection.send({"type": "input_audio_buffer.append", "audio": "AAAA"})
        assert _rt(connection, "error").error.code == "unsupported_event"
        connection.response.cancel()
        assert _rt(connection, "error").error.code == "response_cancel_not_active"

        # Cancel mid-answer.
        connection.send({"type": "response.create", "response": {"max_output_tokens": 400, "sampling": LONG}})
        _rt(connection, "response.output_text.delta")
        connection.response.cancel()
        _, done = _rt_response(connection)
        assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"

        connection.send({"type": "response.create", "response": {"max_output_tokens": 4, "sampling": LONG}})
        assert _rt_response(connection)[1].response.usage.output_tokens == 4


def _rt(connection, kind):
    while True:
        event = connection.recv()
        if event.type == kind:
            return event
        assert event.type != "error", event


def _rt_response(connection):
    deltas = []
    while True:
        event = connection.recv()
        assert event.type != "error", event
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.done":
            return deltas, event


def test_playground_page_is_served(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/sessions" in page.text
