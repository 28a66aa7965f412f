"""Secrets never reach the log: an API key sent in a WebSocket's query string (what a browser must
do), in a bearer header, or wrong, is masked in every line the real server writes."""

import asyncio
import json

import httpx
import pytest
from server_process import running_server, wait_for
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from cadenza.config.logging_setup import MASK, configure_logging, redact

KEY = "s3cret-key-0123456789"
WRONG = "wr0ng-key-9876543210"


def test_redact_masks_query_values_bearer_tokens_and_known_secrets():
    line = f'127.0.0.1:5 - "WebSocket /v1/sessions?api_key={WRONG}&session=7" 403'
    assert redact(line) == f'127.0.0.1:5 - "WebSocket /v1/sessions?api_key={MASK}&session={MASK}" 403'
    assert redact(f"authorization: Bearer {KEY}") == f"authorization: Bearer {MASK}"
    assert redact(f"the key is {KEY}.", [KEY]) == f"the key is {MASK}."
    assert redact("GET /health 200") == "GET /health 200"


def test_structlog_and_stdlib_lines_are_redacted(capsys):
    import logging

    import structlog

    configure_logging("info", "json", stream=__import__("sys").stdout, secrets=[KEY])
    structlog.get_logger("t").info("access", path=f"/v1/sessions?api_key={KEY}", note=f"key {KEY}")
    logging.getLogger("uvicorn.error").info('%s - "WebSocket %s" [accepted]', "127.0.0.1:1", f"/v1/sessions?api_key={KEY}")
    out = capsys.readouterr().out
    assert KEY not in out
    assert out.count(MASK) >= 3


def test_a_real_server_never_logs_the_api_key(tiny_model_dir):
    model = tiny_model_dir("llama3")
    with running_server(model, "--api-key", KEY, env={"CADENZA_LOGGING__LEVEL": "info"}) as server:

        async def clients():
            async with connect(f"{server.ws_url}?api_key={KEY}") as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "generate", "request_id": "r", "prompt": "hi", "sampling": {"max_tokens": 2}}))
                while json.loads(await ws.recv())["type"] not in ("done", "error"):
                    pass
            with pytest.raises(InvalidStatus):
                async with connect(f"{server.ws_url}?api_key={WRONG}"):
                    pass
            async with httpx.AsyncClient(base_url=server.url) as http:
                ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
                assert ok.status_code == 200
                refused = await http.get(f"/v1/models?api_key={WRONG}", headers={"Authorization": f"Bearer {WRONG}"})
                assert refused.status_code == 401

        asyncio.run(clients())
        # The lines exist (so this test can fail), and are masked.
        assert wait_for(lambda: sum("WebSocket /v1/sessions" in line for line in server.lines) >= 2)
    log = "".join(server.lines)
    assert KEY not in log and WRONG not in log
    assert f"api_key={MASK}" in log
