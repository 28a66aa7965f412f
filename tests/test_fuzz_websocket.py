"""Fuzzing the WebSocket session protocol: hypothesis over `parse_client_message` (many cases, no
server), then frames over one connection to a real `cadenza serve`, through `websockets`.

The properties: every bad frame gets one `error` with a documented `code`, a `message`, and the
frame's `request_id` when it had a string one; the connection stays open and still answers `ping`
with `pong`; a valid `generate` ends with one `done` or one `error` with a documented code. Runs are
derandomized (the same cases every run) and bounded; each test prints how many cases it ran.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from fuzz_values import (
    FUZZ_ENV,
    FUZZ_SERVER_ARGS,
    FUZZ_SETTINGS,
    INVALID_SAMPLING,
    REFUSED_BY_ENGINE,
        TOKEN_IDS,
    VOCAB_SIZE,
    WRONG_TYPES,
    mostly,
    out_of_bounds,
    sampling,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from server_process import running_server
from websockets.sync.client import connect

from cadenza.api.sessions.protocol import (
    CLIENT_TYPES,
    Cancel,
    Generate,
    Interrupt,
    Ping,
    ProtocolError,
    SessionGet,
    SessionUpdate,
    parse_client_message,
)
from cadenza.api.sessions.websocket import MAX_FRAME_CHARS

DOC = Path(__file__).parents[1] / "docs" / "websocket.md"


def documented_codes() -> set[str]:
    """The error codes in docs/websocket.md's table (its first column)."""
    table = DOC.read_text().split("| error code | when |")[1].split("\n\n")[0]
    return {code for row in table.splitlines()[2:] for code in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


DOCUMENTED_CODES = documented_codes()


# --- frames -------------------------------------------------------------------------------------

TEXT = st.text(max_size=16)  # any Unicode but lone surrogates, control characters included
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
REQUEST_IDS = mostly(
    st.text(min_size=1, max_size=12),
    st.one_of(st.just(""), st.text(min_size=129, max_size=130), WRONG_TYPES, st.none()),  # 1 to 128 characters
)
ROLES = mostly(st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["developer", "tool", ""]))
CHAT = st.fixed_dictionaries({"role": ROLES, "content": mostly(TEXT, WRONG_TYPES | st.none())})
TOKEN_ID_LISTS = mostly(
    st.lists(TOKEN_IDS, min_size=1, max_size=6), st.lists(st.integers(-3, VOCAB_SIZE + 3), max_size=3)
)
INPUTS = st.one_of(
    st.fixed_dictionaries({"prompt": mostly(st.text(min_size=1, max_size=16), st.just("") | WRONG_TYPES)}),
    st.fixed_dictionaries({"token_ids": TOKEN_ID_LISTS}),
    st.fixed_dictionaries({"messages": mostly(st.lists(CHAT, min_size=1, max_size=3), st.just([]) | WRONG_TYPES)}),
    st.fixed_dictionaries({"user": mostly(st.text(min_size=1, max_size=16), WRONG_TYPES)}),
    st.just({}),  # no input
    st.fixed_dictionaries({"prompt": TEXT, "user": TEXT}),  # two inputs
)
SAMPLING_OPTIONS = mostly(sampling(max_size=3), WRONG_TYPES)
UNKNOWN = mostly(st.just({}), st.dictionaries(st.text(min_size=1, max_size=6), st.integers(), min_size=1, max_size=1))


def merged(*parts: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(*parts).map(lambda dicts: {key: value for d in dicts for key, value in d.items()})


GENERATE = merged(
    st.just({"type": "generate"}),
    mostly(st.fixed_dictionaries({"request_id": REQUEST_IDS}), st.just({})),
    INPUTS,
    st.fixed_dictionaries({}, optional={"sampling": SAMPLING_OPTIONS}),
    UNKNOWN,
)
SYSTEM_PROMPTS = mostly(TEXT | st.none(), WRONG_TYPES)
SESSION_UPDATE = merged(
    st.just({"type": "session.update"}),
    st.fixed_dictionaries({}, optional={"system_prompt": SYSTEM_PROMPTS, "sampling": SAMPLING_OPTIONS}),
    UNKNOWN,
)
STOP = st.fixed_dictionaries({"type": st.sampled_from(["cancel", "interrupt"])}, optional={"request_id": REQUEST_IDS})
OTHER = merged(st.fixed_dictionaries({"type": st.sampled_from(["session.get", "ping"])}), UNKNOWN)
NEAR_MISSES = st.sampled_from(CLIENT_TYPES).flatmap(lambda t: st.sampled_from([t.upper(), f"{t} ", t.replace(".", "")]))
RANDOM_TYPE = st.fixed_dictionaries(
    {"type": st.one_of(TEXT, WRONG_TYPES, st.none(), NEAR_MISSES, st.sampled_from(["session", "done", "delta"]))},
    optional={"request_id": REQUEST_IDS},
)
MESSAGES = st.one_of(GENERATE, SESSION_UPDATE, STOP, OTHER, RANDOM_TYPE, JSON_VALUES)
ODD_TEXT = st.sampled_from(
    [
        "{oops", "", " ", "null", "[]", '"ping"', '{"type": "ping"', "NaN", '{"type": "ping"}{"type": "ping"}',
        "[" * 100_000,  # deeper than json.loads recurses
        "1" * 5000,  # more digits than Python converts to an int
        '{"type": "generate", "request_id": "s1", "prompt": "\\ud800"}',  # a lone surrogate
        '{"type": "generate", "request_id": "s2", "user": "a\\udfffb"}',
        '{"type": "session.update", "system_prompt": "\\udc00"}',
        '{"type": "generate", "request_id": "s3", "prompt": "\\ud83d\\ude00"}',  # a valid surrogate pair
    ]
)  # fmt: skip
TEXT_FRAMES = st.one_of(MESSAGES.map(lambda m: json.dumps(m, allow_nan=True)), TEXT, ODD_TEXT)
FRAMES = st.one_of(TEXT_FRAMES, st.binary(max_size=32))


def check_error(message: dict, code: str | None = None, request_id: str | None = None) -> None:
    assert message["type"] == "error", message
    assert message["code"] in DOCUMENTED_CODES, message
    assert isinstance(message["message"], str) and message["message"], message
    if code is not None:
        assert message["code"] == code, message
    assert message.get("request_id") == request_id, message


def string_request_id(frame: str) -> str | None:
    """The frame's request_id, where it is a string (and a character string: no lone surrogate)."""
    try:
        raw = json.loads(frame)
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if isinstance(request_id, str):
            request_id.encode()  # raises for a lone surrogate
            return request_id
    except (ValueError, RecursionError, UnicodeEncodeError):
        pass
    return None


# --- the pure layer: parse_client_message -------------------------------------------------------


def test_parse_any_frame():
    """Every text frame parses into a message or a ProtocolError with a documented code, a message,
    and the frame's string request_id (none for frames that are not a JSON object)."""
    outcomes = Counter()

    @settings(max_examples=1500, **FUZZ_SETTINGS)
    @given(frame=TEXT_FRAMES)
    def check(frame):
        try:
            message = parse_client_message(frame)
        except ProtocolError as exc:
            assert exc.code in DOCUMENTED_CODES, exc.code
            assert isinstance(exc.message, str) and exc.message
            assert exc.request_id == string_request_id(frame), (frame[:200], exc.code, exc.request_id)
            outcomes[exc.code] += 1
        else:
            assert isinstance(message, (SessionUpdate, Generate, Cancel, Interrupt, SessionGet, Ping))
            assert message.type == json.loads(frame)["type"]
            outcomes[message.type] += 1

    check()
    print(f"\nfuzz cases: parse any frame: {outcomes.total()} {dict(outcomes)}")


def test_parse_one_bad_sampling_field():
    """A generate or session.update whose sampling has one invalid value, every value of the table
    and values outside each field's bound: invalid_params naming `sampling.<field>`."""
    cases = Counter()

    def check(field: str, value) -> None:
        for message in (
            {"type": "generate", "request_id": "r", "prompt": "x", "sampling": {field: value}},
            {"type": "session.update", "sampling": {field: value}},
        ):
            with pytest.raises(ProtocolError) as refused:
                parse_client_message(json.dumps(message, allow_nan=True))
            assert refused.value.code == "invalid_params", refused.value.message
            assert f"sampling.{field}" in refused.value.message, refused.value.message
            assert refused.value.request_id == message.get("request_id")
            cases[message["type"]] += 1

    for field, values in INVALID_SAMPLING.items():
        for value in values:
            check(field, value)

    @settings(max_examples=300, **FUZZ_SETTINGS)
    @given(bad=out_of_bounds(fields=set(INVALID_SAMPLING)))
    def fuzz(bad):
        check(*bad)

    fuzz()
    print(f"\nfuzz cases: parse one bad sampling field: {cases.total()} {dict(cases)}")


# --- frames over a real connection --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama3"), *FUZZ_SERVER_ARGS, env=FUZZ_ENV) as process:
        yield process
        # Whatever the fuzzers sent, the server logged no failure (an escaped exception is logged
        # as "Exception in ASGI application" at error level).
        assert not [line for line in process.lines if "Traceback" in line or '"level": "error"' in line]


class Connection:
    """One session over the `websockets` sync client; `ping()` checks it still answers."""

    def __init__(self, ws) -> None:
        self.ws = ws
        created = self.recv()
        assert created["type"] == "session.created", created

    def recv(self, timeout: float = 60) -> dict:
        return json.loads(self.ws.recv(timeout=timeout))

    def ping(self) -> None:
        self.ws.send('{"type": "ping"}')
        assert self.recv() == {"type": "pong"}

    def generate_outcome(self, request_id: str) -> dict:
        """Deltas of `request_id` until its one `done` or `error`, which it returns."""
        while True:
            message = self.recv()
            assert message.get("request_id") == request_id, message
            if message["type"] != "delta":
                return message


@pytest.fixture
def connection(server):
    with connect(server.ws_url, max_size=None, open_timeout=30) as ws:
        yield Connection(ws)


def expected(frame: str | bytes) -> tuple[str, str | None, str | None]:
    """What the server must answer a frame with nothing running: ("error", code, request_id),
    ("reply", message type, None) or ("generate", None, request_id)."""
    if isinstance(frame, bytes):
        return "error", "invalid_message", None
    if len(frame) > MAX_FRAME_CHARS:
        return "error", "message_too_large", None  # not parsed, so no request_id
    try:
        message = parse_client_message(frame)
    except ProtocolError as exc:
        return "error", exc.code, exc.request_id
    match message:
        case Generate():
            return "generate", None, message.request_id
        case Cancel() | Interrupt() if message.request_id is not None:
            return "error", "unknown_request_id", message.request_id
        case Interrupt():
            return "error", "nothing_to_interrupt", None
        case SessionUpdate():
            return "reply", "session.updated", None
        case SessionGet():
            return "reply", "session.state", None
        case Ping():
            return "reply", "pong", None
    raise AssertionError(message)


def exchange(conn: Connection, frame: str | bytes) -> tuple[str, dict]:
    """Send one frame; check the answer against `expected`, then that the connection still answers
    a ping. Returns what happened (for the case counts) and the answer."""
    kind, what, request_id = expected(frame)
    conn.ws.send(frame)
    if kind == "generate":
        answer = conn.generate_outcome(request_id)
        if answer["type"] == "error":
            check_error(answer, request_id=request_id)
            result = f"generate error {answer['code']}"
        else:
            assert answer["type"] == "done" and answer["finish_reason"] in ("stop", "length"), answer
            result = "generate done"
    else:
        answer = conn.recv()
        if kind == "error":
            check_error(answer, what, request_id)
            result = f"error {what}"
        else:
            assert answer["type"] == what, answer
            result = what
    conn.ping()
    return result, answer


def test_frames_over_one_connection(connection):
    """Arbitrary JSON, random types, generate / session.update / cancel / interrupt with valid and
    invalid fields, non-JSON text and binary frames, one after another on one connection: each
    answered as the protocol says, the connection open throughout."""
    outcomes = Counter()

    @settings(max_examples=200, **FUZZ_SETTINGS)
    @given(frame=FRAMES)
    def check(frame):
        outcomes[exchange(connection, frame)[0]] += 1

    check()
    print(f"\nfuzz cases: websocket frames: {outcomes.total()} {dict(outcomes)}")
    assert outcomes["generate done"] >= 5, outcomes  # the mix still reaches generation


def test_generate_with_random_sampling(connection):
    """Generates with one input and mixed valid and invalid sampling values: a `done`, or an error
    with a documented code (invalid_params naming the field at fault)."""
    outcomes = Counter()
    numbers = iter(range(10**9))
    one_input = INPUTS.filter(lambda fields: len(fields) == 1)

    @settings(max_examples=100, **FUZZ_SETTINGS)
    @given(inputs=one_input, options=sampling(max_size=4))
    def check(inputs, options):
        message = {"type": "generate", "request_id": f"g{next(numbers)}", **inputs, "sampling": options}
        result, answer = exchange(connection, json.dumps(message, allow_nan=True))
        if answer["type"] == "error" and answer["code"] == "invalid_params":
            assert any(name in answer["message"] for name in (*options, *inputs)), (message, answer)
        outcomes[result] += 1

    check()
    print(f"\nfuzz cases: websocket generate sampling: {outcomes.total()} {dict(outcomes)}")
    assert outcomes["generate done"] >= 20, outcomes


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param(field, value, id=f"{field}={value}")
        for field, values in REFUSED_BY_ENGINE.items()
        for value in values
    ],
)
def test_engine_refusals_have_documented_codes(connection, field, value):
    """Sampling values only the engine refuses (token ids beyond the vocabulary, parameters for a
    plugin that does not run): an error with a documented code that names the field."""
    frame = json.dumps({"type": "generate", "request_id": "e1", "prompt": "x", "sampling": {field: value}})
    connection.ws.send(frame)
    outcome = connection.generate_outcome("e1")
    assert field in outcome.get("message", ""), outcome
    check_error(outcome, request_id="e1")
    connection.ping()


def test_odd_frames(connection):
    """Frames that used to close the connection (nesting deeper than json.loads recurses, integers
    of more digits than Python converts) or to reach the tokenizer as text it cannot take (lone
    surrogates), and frames over the size limit: each an error, and the connection carries on."""
    too_large = '{"type": "generate", "request_id": "x' + "y" * MAX_FRAME_CHARS + '", "prompt": "x"}'
    frames = {
        "[" * 100_000: ("invalid_json", None),
        '{"type": "ping", "n": ' + "1" * 5000 + "}": ("invalid_json", None),
        '{"type": "generate", "request_id": "s1", "prompt": "\\ud800"}': ("invalid_json", "s1"),
        '{"type": "generate", "request_id": "s2", "user": "\\udfff"}': ("invalid_json", "s2"),
        '{"type": "session.update", "system_prompt": "a\\ud800b"}': ("invalid_json", None),
        too_large: ("message_too_large", None),
        '{"type": "Generate", "request_id": "r"}': ("unknown_type", "r"),
    }
    for frame, (code, request_id) in frames.items():
        assert expected(frame) == ("error", code, request_id)
        connection.ws.send(frame)
        check_error(connection.recv(), code, request_id)
        connection.ping()
    connection.ws.send(b"\x00\xff")
    check_error(connection.recv(), "invalid_message")
    connection.ping()
    pair = '{"type": "generate", "request_id": "ok", "prompt": "\\ud83d\\ude00"}'  # a valid surrogate pair
    assert exchange(connection, pair)[0] == "generate done"
