"""Context providers and pluggable context policies through the real server: a provider that
raises or hangs fails only its own turn, with a typed error; the example packages
`cadenza-folder-retrieval` (BM25, dense or hybrid retrieval over a folder) and
`cadenza-summarize-context` (the served model summarises the oldest turns) end to end. Dense
retrieval is checked against `LLM.embed` on the same passages, its cache by counting embed calls."""

import asyncio
import json
import os
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from example_plugins import install_example_plugins
from plugin_contracts import covers
from server_process import running_server, wait_for
from websockets.asyncio.client import connect

from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.llm import LLM
from cadenza.policies.context import ProviderRequest, engine_embedder
from cadenza.runtime.build import build_runtime

pytestmark = pytest.mark.anyio
TESTS = Path(__file__).parent
TURN = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
DOCS = {
    "animals.txt": "The cat sat on the red mat in the kitchen.\n\nDogs bark at the mailman every morning.",
    "engines.md": "Paged attention stores keys and values in fixed-size blocks.\n\nA prefix cache shares blocks.",
}
# Paragraphs of about 65 characters: with passage_chars 100, each is a passage of its own.
PARAGRAPHS = {
    "animals.txt": ["The cat sat on the red mat in the warm kitchen all afternoon long.",
                    "Dogs bark at the mailman every single morning before breakfast."],
    "engines.md": ["Paged attention stores keys and values in blocks of a fixed size.",
                   "A prefix cache lets two requests share the blocks of a common prompt."],
    "notes/travel.txt": ["The night train to Vienna leaves at ten and arrives before dawn.",
                         "Pack a warm coat: the mountain pass is cold even in the summer.",
                         "Museums close on Mondays, so plan the galleries for another day."],
}  # fmt: skip
PASSAGES = [(Path(name).name, text) for name, paragraphs in PARAGRAPHS.items() for text in paragraphs]  # as (file, text)
QUERY = "Where did the cat sit?"  # BM25 finds the cat by its name; the tiny random model, elsewhere
MAX_MODEL_LEN = 512  # the tiny model's positions: two turns with a passage each fit


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


@pytest.fixture(scope="module")
def dense_server(tiny_model_dir, tmp_path_factory):
    """`cadenza serve` with folder_retrieval switched on for every session, by the served model's embeddings."""
    install_example_plugins()
    folder = tmp_path_factory.mktemp("paragraphs")
    write_paragraphs(folder)
    config = tmp_path_factory.mktemp("config") / "dense.yaml"
    options = {"folder": str(folder), "method": "dense", "top_k": 1, "passage_chars": 100}
    config.write_text(
        f"model: {{max_model_len: {MAX_MODEL_LEN}}}\n"
        "sessions: {context_providers: [folder_retrieval], provider_timeout: 60.0}\n"
        f"plugin_options:\n  folder_retrieval: {json.dumps(options)}\n"
    )
    with running_server(tiny_model_dir("llama3"), "--config", str(config)) as process:
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

    from cadenza.policies.context import ProviderRequest

    for name, text in DOCS.items():
        (tmp_path / name).write_text(text)
    provider = FolderRetrieval(FolderRetrievalOptions(folder=str(tmp_path), top_k=2))
    assert [name for name, _ in provider.search("fixed-size blocks of keys")][0] == "engines.md"
    request = ProviderRequest("s", "r", [], [{"role": "user", "content": "Which animal barks at the mailman?"}])
    (message,) = await provider.provide(request)
    assert "Dogs bark" in message["content"]
    with pytest.raises(ValueError, match="is not a folder"):
        FolderRetrievalOptions(folder=str(tmp_path / "missing"))


def folder_retrieval():
    install_example_plugins()
    import cadenza_folder_retrieval

    return cadenza_folder_retrieval


def write_paragraphs(folder: Path) -> list[tuple[str, str]]:
    """PARAGRAPHS as files under `folder`; returns PASSAGES."""
    for name, paragraphs in PARAGRAPHS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n\n".join(paragraphs))
    return PASSAGES


def nearest_by_llm_embed(model_dir: Path, passages: list[tuple[str, str]], query: str) -> tuple[list, list[float]]:
    """`passages` nearest `query` first, and their cosine similarities, from `LLM.embed` (an engine
    of its own on the same checkpoint): what dense retrieval must reproduce."""
    with LLM(model_dir, **{"model.dtype": "float32", "model.max_model_len": MAX_MODEL_LEN}) as llm:
        vectors = np.array([out.embedding for out in llm.embed([text for _, text in passages] + [query])])
    similarity = vectors[:-1] @ vectors[-1]  # unit vectors: the dot product is the cosine
    order = np.argsort(-similarity)
    # Rounding differs between two engines' batches (~1e-6): the ranking must not hang on it.
    assert np.all(-np.diff(similarity[order]) > 1e-4), "the tiny model does not separate these passages"
    return [passages[i] for i in order], [float(similarity[i]) for i in order]


@asynccontextmanager
async def serving_engine(model_dir: Path):
    settings = {"model.path": str(model_dir), "model.dtype": "float32", "model.max_model_len": MAX_MODEL_LEN}
    config = load_config(None, overrides=settings, env={})
    async with AsyncEngine.serve(build_runtime(config, extra_plugins=())) as engine:
        yield engine


class CountingEmbed:
    """A `ProviderRequest.embed` that records the texts of every call."""

    def __init__(self, embed) -> None:
        self.embed = embed
        self.calls: list[list[str]] = []

    async def __call__(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        return await self.embed(texts)


async def test_folder_retrieval_dense_and_hybrid_rank_as_llm_embed(model_path, tmp_path):
    plugin = folder_retrieval()
    passages = write_paragraphs(tmp_path)
    nearest, similarity = nearest_by_llm_embed(model_path, passages, QUERY)
    options = {"folder": str(tmp_path), "passage_chars": 100, "top_k": len(passages)}
    by_terms = plugin.FolderRetrieval(plugin.FolderRetrievalOptions(**options)).search(QUERY)
    assert by_terms == [passages[0]]  # BM25: only the cat passage shares a term ("cat")
    assert nearest[0] != passages[0]  # ... and the random model puts another first: the methods differ

    async with serving_engine(model_path) as engine:
        embed = engine_embedder(engine, "turn")
        dense = plugin.FolderRetrieval(plugin.FolderRetrievalOptions(**options, method="dense"))
        assert await dense.retrieve(QUERY, embed) == nearest
        # Through `provide`, with top_k 1: the nearest passage alone, as a system message.
        one = plugin.FolderRetrieval(plugin.FolderRetrievalOptions(**{**options, "top_k": 1}, method="dense"))
        request = ProviderRequest("s", "r", [], [{"role": "user", "content": QUERY}], embed=embed)
        (message,) = await one.provide(request)
        assert message["role"] == "system" and f"[{nearest[0][0]}]\n{nearest[0][1]}" in message["content"]
        assert not any(text in message["content"] for _, text in nearest[1:])
        # min_similarity: between the first and the second, only the first; above all, nothing is added.
        between = (similarity[0] + similarity[1]) / 2
        strict = plugin.FolderRetrieval(plugin.FolderRetrievalOptions(**options, method="dense", min_similarity=between))
        assert await strict.retrieve(QUERY, embed) == nearest[:1]
        strict.options.min_similarity = min(1.0, similarity[0] + 0.01)
        assert await strict.provide(request) == []
        # Hybrid: the cat passage ranks first in BM25 and fifth by embedding, so it leads the fusion
        # (1/61 + 1/65 against 1/61 for the nearest); the rest keep their dense order.
        assert nearest.index(passages[0]) == 4
        hybrid = plugin.FolderRetrieval(plugin.FolderRetrievalOptions(**options, method="hybrid"))
        assert await hybrid.retrieve(QUERY, embed) == [passages[0], *(p for p in nearest if p != passages[0])]


async def test_folder_retrieval_embeds_only_the_files_that_changed(model_path, tmp_path):
    plugin = folder_retrieval()
    passages = write_paragraphs(tmp_path)
    options = plugin.FolderRetrievalOptions(folder=str(tmp_path), passage_chars=100, method="dense", embed_batch=3)
    provider = plugin.FolderRetrieval(options)
    with pytest.raises(RuntimeError, match="ProviderRequest.embed"):
        await provider.retrieve(QUERY, None)  # a server that gives no embeddings: a clear error
    async with serving_engine(model_path) as engine:
        embed = CountingEmbed(engine_embedder(engine, "turn"))
        await provider.retrieve(QUERY, embed)
        in_path_order = [text for name in sorted(PARAGRAPHS, key=lambda n: tmp_path / n) for text in PARAGRAPHS[name]]
        assert embed.calls == [in_path_order[0:3], in_path_order[3:6], in_path_order[6:7], [QUERY]]  # batches of 3
        before = dict(provider.vectors.files)

        async def embedded_on_next_turn(query: str = QUERY) -> list[list[str]]:
            embed.calls.clear()
            await provider.retrieve(query, embed)
            return embed.calls

        assert await embedded_on_next_turn() == [[QUERY]]  # nothing changed: the query alone
        engines = tmp_path / "engines.md"
        engines.write_text("Speculative decoding drafts tokens that the model then verifies.")
        assert await embedded_on_next_turn() == [["Speculative decoding drafts tokens that the model then verifies."], [QUERY]]
        after = provider.vectors.files
        assert all(after[path] is before[path] for path in before if path != engines)  # the others untouched
        assert {text for _, text in provider.corpus.passages} == {text for _, text in passages[:2] + passages[4:]} | {
            "Speculative decoding drafts tokens that the model then verifies."}
        # Keyed by (mtime, size): a touched file is embedded again, though its text is the same.
        stat = engines.stat()
        os.utime(engines, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert await embedded_on_next_turn() == [["Speculative decoding drafts tokens that the model then verifies."], [QUERY]]
        # A deleted file is forgotten, a new one embedded alone.
        engines.unlink()
        (tmp_path / "notes" / "new.md").write_text("Prefill computes the prompt; decode adds one token at a time.")
        assert await embedded_on_next_turn() == [["Prefill computes the prompt; decode adds one token at a time."], [QUERY]]
        assert not any(name == "engines.md" for name, _ in provider.corpus.passages)
        assert len(provider.corpus.passages) == len(provider.corpus.vectors) == 6


async def test_folder_retrieval_dense_in_the_server(dense_server, model_path):
    """Each turn gets the passage nearest its query by `LLM.embed`; the folder is embedded on the
    first turn only (the engine's log names each embedding request `<turn>:embed-<n>`)."""
    plugin = folder_retrieval()
    nearest, _ = nearest_by_llm_embed(model_path, PASSAGES, QUERY)
    ws = await connect(dense_server.ws_url)
    json.loads(await ws.recv())
    for request_id in ("first", "second"):
        await ws.send(json.dumps({"type": "generate", "request_id": request_id, "user": QUERY, "sampling": TURN}))
        done = (await outcomes(ws, request_id))[request_id]
        assert done["type"] == "done" and done["context"]["messages_added"] == 1, done
    added = [m["content"] for m in await history(ws) if m["role"] == "system"]
    await ws.close()
    assert added == [f"{plugin.HEADER}\n\n[{nearest[0][0]}]\n{nearest[0][1]}"] * 2

    def embedded() -> dict[str, int]:
        turns: dict[str, int] = {}
        for line in dense_server.log_events("Request finished"):
            request_id = json.loads(line).get("request_id", "")
            if ":embed-" in request_id:
                turn = request_id.split(":embed-")[0]
                turns[turn] = turns.get(turn, 0) + 1
        return turns

    assert wait_for(lambda: sorted(embedded().values()) == [1, len(PASSAGES) + 1]), embedded()


def test_reciprocal_rank_fusion_order():
    fuse = folder_retrieval().reciprocal_rank_fusion
    # a: 1/61 + 1/62; c: 1/63 + 1/61; b: 1/62; d: 1/63.
    assert fuse([["a", "b", "c"], ["c", "a", "d"]], k=60) == ["a", "c", "b", "d"]
    # Found by both, even lower, beats first in one: y 2/62 against 1/61; x and z tie, x seen first.
    assert fuse([["x", "y"], ["z", "y"]], k=60) == ["y", "x", "z"]
    # k sets how much a first place counts: a is first in one ranking, b fourth in both.
    rankings = [["a", "p", "q", "b"], ["r", "s", "t", "b"]]
    assert fuse(rankings, k=1)[0] == "a"  # 1/2 against 2/5
    assert fuse(rankings, k=60)[0] == "b"  # 1/61 against 2/64
    assert fuse([[], ["only"]], k=60) == ["only"] and fuse([], k=60) == []


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
