"""Context providers and pluggable context policies through the real server: a provider that
raises or hangs fails only its own turn, with a typed error; the example packages
`cadenza-folder-retrieval` (BM25 over a folder) and `cadenza-summarize-context` (the served model
summarises the oldest turns) end to end."""

import asyncio
import json
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from example_plugins import install_example_plugins
from plugin_contracts import covers
from server_process import running_server

pytestmark = pytest.mark.anyio
TESTS = Path(__file__).parent
TURN = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
DOCS = {
    "animals.txt": "The cat sat on the red mat in the kitchen.\n\nDogs bark at the mailman every morning.",
    "engines.md": "Paged attention stores keys and values in fixed-size blocks.\n\nA prefix cache shares blocks.",
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    install_example_plugins()
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    config = tmp_path_factory.mktemp("config") / "deploy.yaml"
    config.write_text(
        "plugins: [context_test_plugins]\n"
        "model: {max_model_len: 256}\n"
        "sessions: {provider_timeout: 1.0}\n"
        f"plugin_options:\n  folder_retrieval: {{folder: {json.dumps(str(folder))}, top_k: 1}}\n"
        "  summarize: {keep_turns: 1, summary_tokens: 16}\n"
    )
    with running_server(tiny_model_dir("llama3"), "--config", str(config), env={"PYTHONPATH": str(TESTS)}) as process:
        yield process


async def open_session(server, **context):
    ws = await connect(server.ws_url)
    created = json.loads(await ws.recv())
    assert {"test_fact", "test_raising", "test_hanging", "folder_retrieval"} <= set(created["available"]["context_providers"])
    if context:
        await ws.send(json.dumps({"type": "session.update", "context": context}))
        assert json.loads(await ws.recv())["type"] == "session.updated"
    return ws


async def outcomes(ws, *request_ids):
    """request id -> its done or error message."""
    found = {}
    while len(found) < len(request_ids):
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if message.get("request_id") in request_ids and message["type"] in ("done", "error"):
            found[message["request_id"]] = message
    return found


async def history(ws):
    await ws.send(json.dumps({"type": "session.get"}))
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if message["type"] == "session.state":
            return message["history"]


@covers("ContextProvider.provide", "register_context_providers")
@pytest.mark.parametrize("provider,code", [("test_raising", "context_provider_error"), ("test_hanging", "context_provider_timeout")])
async def test_a_failing_provider_fails_only_its_turn(server, provider, code):
    ws = await open_session(server, providers=["test_fact", provider])
    await ws.send(json.dumps({"type": "generate", "request_id": "turn", "user": "Hello?", "sampling": TURN}))
    await ws.send(json.dumps({"type": "generate", "request_id": "other", "prompt": "unrelated", "sampling": TURN}))
    got = await outcomes(ws, "turn", "other")
    assert got["turn"]["type"] == "error" and got["turn"]["code"] == code
    assert provider in got["turn"]["message"]
    assert got["other"]["type"] == "done" and got["other"]["usage"]["completion_tokens"] == 8
    assert await history(ws) == [], "the failed turn left no trace"
    # The session carries on: with the good provider alone, the turn runs and keeps its message.
    await ws.send(json.dumps({"type": "session.update", "context": {"providers": ["test_fact"]}}))
    await ws.send(json.dumps({"type": "generate", "request_id": "again", "user": "Hello?", "sampling": TURN}))
    done = (await outcomes(ws, "again"))["again"]
    assert done["type"] == "done" and done["context"]["messages_added"] == 1
    assert [m["role"] for m in await history(ws)] == ["system", "user", "assistant"]
    await ws.close()


async def test_cancel_while_a_provider_runs(server):
    ws = await open_session(server, providers=["test_hanging"])
    await ws.send(json.dumps({"type": "generate", "request_id": "turn", "user": "Hello?", "sampling": TURN}))
    await ws.send(json.dumps({"type": "cancel", "request_id": "turn"}))
    done = (await outcomes(ws, "turn"))["turn"]
    assert done["type"] == "done" and done["finish_reason"] == "abort"
    assert await history(ws) == []
    await ws.close()


async def test_unknown_provider_is_refused(server):
    ws = await open_session(server)
    await ws.send(json.dumps({"type": "session.update", "context": {"providers": ["nope"]}}))
    error = json.loads(await ws.recv())
    assert error["code"] == "invalid_params" and "nope" in error["message"] and "test_fact" in error["message"]
    await ws.close()


@covers("ContextProvider.__init__", "ContextProvider.name", "ContextProvider.options_model")
async def test_folder_retrieval_adds_the_matching_passage(server):
    ws = await open_session(server, providers=["folder_retrieval"])
    await ws.send(json.dumps({"type": "generate", "request_id": "q", "user": "Where did the cat sit?", "sampling": TURN}))
    done = (await outcomes(ws, "q"))["q"]
    assert done["type"] == "done" and done["context"]["messages_added"] == 1
    added = (await history(ws))[0]
    assert added["role"] == "system" and "red mat" in added["content"] and "[animals.txt]" in added["content"]
    assert "Paged attention" not in added["content"]  # top_k 1: only the best passage
    # No shared term: nothing is added.
    await ws.send(json.dumps({"type": "generate", "request_id": "q2", "user": "zzz qqq", "sampling": TURN}))
    assert (await outcomes(ws, "q2"))["q2"]["context"]["messages_added"] == 0
    await ws.close()


async def test_folder_retrieval_search_directly(tmp_path):
    install_example_plugins()
    from cadenza_folder_retrieval import FolderRetrieval, FolderRetrievalOptions

    from cadenza.plugins.context import ProviderRequest

    for name, text in DOCS.items():
        (tmp_path / name).write_text(text)
    provider = FolderRetrieval(FolderRetrievalOptions(folder=str(tmp_path), top_k=2))
    assert [name for name, _ in provider.search("fixed-size blocks of keys")][0] == "engines.md"
    request = ProviderRequest("s", "r", [], [{"role": "user", "content": "Which animal barks at the mailman?"}])
    (message,) = await provider.provide(request)
    assert "Dogs bark" in message["content"]
    with pytest.raises(ValueError, match="is not a folder"):
        FolderRetrievalOptions(folder=str(tmp_path / "missing"))


@covers("ContextPolicy.fit", "ContextPolicy.name", "ContextPolicy.__init__", "ContextPolicy.options_model",
        "register_context_policies")
async def test_summarize_policy_replaces_old_turns_with_a_summary(server):
    ws = await open_session(server, policy="summarize")
    summarized = None
    for i in range(25):
        await ws.send(json.dumps({"type": "generate", "request_id": f"t{i}", "user": f"Fact {i}: blocks hold sixteen tokens.", "sampling": TURN}))
        done = (await outcomes(ws, f"t{i}"))[f"t{i}"]
        assert done["type"] == "done", done
        if done["context"]["cut"]:
            summarized = done
            break
    assert summarized is not None, "the conversation outgrew the model"
    assert summarized["usage"]["prompt_tokens"] <= 256 - 8
    turns = await history(ws)
    assert turns[0]["role"] == "user" and turns[0]["content"].startswith("(Summary of our earlier conversation)")
    assert turns[1] == {"role": "assistant", "content": "Noted."}
    assert turns[-2]["content"] == f"Fact {i}: blocks hold sixteen tokens."
    await ws.close()
