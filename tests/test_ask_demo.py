"""`cadenza serve --ask`: piped, the answer comes in whole lines, so the server's log lines (on
stderr) land between them; on a terminal it streams as generated."""

import json
from types import SimpleNamespace

import pytest
import websockets.asyncio.client

from cadenza.api.server import _ask_over_websocket

pytestmark = pytest.mark.anyio

URL = "ws://127.0.0.1:8000/v1/sessions"
DELTAS = ["The capital", " of France\nis", " Paris", ".\n\nIt is", " big."]


class FakeSession:
    """The server's side of one `--ask` turn: session.created, the deltas, done."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._messages = [{"type": "session.created"}, *({"type": "delta", "text": t} for t in DELTAS),
                          {"type": "done", "finish_reason": "stop"}]  # fmt: skip

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def recv(self) -> str:
        return json.dumps(self._messages.pop(0))

    async def send(self, raw: str) -> None:
        self.sent.append(json.loads(raw))

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if not self._messages:
            raise StopAsyncIteration
        return await self.recv()


class Terminal:
    """stdout that records what each flush wrote."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.buffer, self.writes = tty, "", []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.buffer += text
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.writes.append(self.buffer)
        self.buffer = ""


async def ask(monkeypatch, tty: bool) -> tuple[Terminal, FakeSession]:
    session, out = FakeSession(), Terminal(tty)
    monkeypatch.setattr(websockets.asyncio.client, "connect", lambda url, additional_headers: session)
    monkeypatch.setattr("sys.stdout", out)
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(config=SimpleNamespace(server=SimpleNamespace(api_key=None, api_keys=[])))))
    await _ask_over_websocket(URL, "What is the capital of France?", app)
    return out, session


async def test_piped_answer_is_written_in_whole_lines(monkeypatch):
    out, session = await ask(monkeypatch, tty=False)
    assert session.sent[0]["sampling"] == {"temperature": 0}
    assert all(write.endswith("\n") for write in out.writes)  # a log line can only follow a whole line
    assert out.writes[1:] == [
        "The capital of France\n",
        "is Paris.\n\n",
        f"It is big.\n\n[stop; serving on {URL}; Ctrl-C stops]\n\n",
    ]


async def test_on_a_terminal_the_answer_streams(monkeypatch):
    out, _ = await ask(monkeypatch, tty=True)
    assert out.writes[1:-1] == DELTAS
    assert out.writes[-1] == f"\n\n[stop; serving on {URL}; Ctrl-C stops]\n\n"
