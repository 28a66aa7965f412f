"""A served tiny model and an official `openai` client of it, for test modules that import these
fixtures (`from openai_fixtures import client, model, server`): one server per importing module.

Also `fuzzed_server`, the server the fuzz and contract suites load with what they generate."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from server_process import running_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama3")) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    # The WebSocket base too: the Responses and Realtime connections (`client.responses.connect()`).
    ws = server.url.replace("http://", "ws://") + "/v1"
    with openai.OpenAI(base_url=server.url + "/v1", websocket_base_url=ws, api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@contextmanager
def fuzzed_server(model_dir: Path):
    """`cadenza serve` with the fuzz suites' arguments. On leaving, whatever was sent, it must
    still be healthy and have logged no failure; it is stopped by its process group either way,
    a failed test or a failed check included."""
    from fuzz_values import FUZZ_ENV, FUZZ_SERVER_ARGS  # here: the other suites need no hypothesis

    with running_server(model_dir, *FUZZ_SERVER_ARGS, env=FUZZ_ENV) as process:
        yield process
        assert httpx.get(process.url + "/health", timeout=10).status_code == 200
        assert not [line for line in process.lines if "Traceback" in line or '"level": "error"' in line]
