"""A served tiny model and an official `openai` client of it, for test modules that import these
fixtures (`from openai_fixtures import client, model, server`): one server per importing module."""

from __future__ import annotations

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
