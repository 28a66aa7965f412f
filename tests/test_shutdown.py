"""Shutdown under load: SIGTERM on a real `cadenza serve` with requests running over every protocol,
and the engine's `end_requests` / `shutdown` in process.

The contract: on the signal new requests are refused; running ones get `server.shutdown_grace`
seconds; then each one still running ends with `server_shutdown` in its protocol's shape (an SSE
error event then `[DONE]`, a 503, a WebSocket `error` then close 1001) and the process exits with 0.
"""

import json
import os
import re
import signal
import time

import anyio
import httpx
import openai
import pytest
from server_process import running_server
from tiny_models import build_tiny_model
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from cadenza.config import load_config
from cadenza.engine.async_engine import SERVER_SHUTDOWN, AsyncEngine
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

GRACE = 2.0
EXIT_BOUND = GRACE + 5.0  # the process is gone this long after the signal
LONG = {"max_tokens": 12000, "ignore_eos": True}  # outlasts the grace on any machine


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny llama3 with room for 16k positions, so that a request can outlast the grace."""
    return build_tiny_model(tmp_path_factory.mktemp("long-llama3"), "llama3", max_position_embeddings=16384)


# --- the server under SIGTERM -------------------------------------------------------------------


def sse_frames(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


async def test_sigterm_under_load_ends_every_request_and_exits(long_model):
    env = {"CADENZA_SERVER__SHUTDOWN_GRACE": str(GRACE), "CADENZA_LOGGING__LEVEL": "info"}
    with running_server(long_model, env=env) as server:
        model = long_model.name
        results: dict[str, object] = {}
        first_output = {name: anyio.Event() for name in ("ws-a1", "ws-a2", "sse", "sdk", "short")}
        http = httpx.AsyncClient(base_url=server.url, timeout=30)
        sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def sse(name: str, max_tokens: int) -> None:
            body = {"model": model, "prompt": "The quick brown fox", "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True}
            lines, ended = [], None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)
                        first_output[name].set()
                        ended = time.monotonic()
            results[name] = (response.status_code, sse_frames(lines), ended)

        async def sdk_stream() -> None:
            stream = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
                max_tokens=LONG["max_tokens"], extra_body={"ignore_eos": True},
            )
            try:
                async for _ in stream:
                    first_output["sdk"].set()
            except openai.APIError as exc:
                results["sdk"] = (exc.code, exc.message)
                return
            results["sdk"] = ("finished", None)

        async def plain() -> None:
            body = {"model": model, "prompt": "hello", **LONG}
            response = await http.post("/v1/completions", json=body)
            results["plain"] = (response.status_code, response.json())

        async def session(name: str, requests: list[str]) -> None:
            async with connect(server.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                for rid in requests:
                    generate = {"type": "generate", "request_id": rid, "prompt": "abc", "sampling": LONG}
                    await ws.send(json.dumps(generate))
                messages = []
                sessions[name] = ws
                opened[name].set()
                async for raw in ws:  # ends when the server closes the connection
                    message = json.loads(raw)
                    messages.append(message)
                    if message["type"] == "delta":
                        first_output[f"ws-{message['request_id']}"].set()
                results[name] = (messages, ws.close_code, time.monotonic())

        async def metric(name: str) -> float:
            text = (await http.get("/metrics")).text
            return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

        sessions: dict[str, object] = {}
        opened = {"a": anyio.Event(), "b": anyio.Event()}
        try:
            with anyio.fail_after(25):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(session, "a", ["a1", "a2"])  # two long requests on one connection
                    tg.start_soon(session, "b", [])  # an idle session
                    tg.start_soon(sse, "sse", LONG["max_tokens"])
                    tg.start_soon(sdk_stream)
                    tg.start_soon(plain)
                    for event in ("ws-a1", "ws-a2", "sse", "sdk"):
                        await first_output[event].wait()
                    while await metric("cadenza_requests_running") < 5:  # the non-streamed one too
                        await anyio.sleep(0.02)
                    await opened["b"].wait()
                    # A short request, well under way, that the grace lets finish.
                    tg.start_soon(sse, "short", 4)
                    await first_output["short"].wait()

                    signalled = time.monotonic()
                    os.kill(server.proc.pid, signal.SIGTERM)

                    # Phase 1: new requests are refused, on every protocol.
                    while (await http.get("/health")).status_code != 503:
                        await anyio.sleep(0.02)
                    refused = await http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
                    await sessions["b"].send(json.dumps({"type": "generate", "request_id": "late", "prompt": "x"}))
                    with pytest.raises(InvalidStatus):
                        async with connect(server.ws_url):
                            pass
                    assert time.monotonic() - signalled < GRACE, "the refusals were checked within the grace"
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"

                exit_code = await anyio.to_thread.run_sync(server.proc.wait, EXIT_BOUND)
                exited = time.monotonic() - signalled
        finally:
            await http.aclose()
            await sdk.close()
        server.stop()  # already gone: this only collects the rest of its log

    assert exit_code == 0 and exited <= EXIT_BOUND, f"exit code {exit_code} after {exited:.1f}s"

    # The short request finished normally during the grace.
    status, frames, _ = results["short"]
    assert status == 200 and frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and not any("error" in c for c in chunks)

    # The long ones ended with server_shutdown, in each protocol's shape, once the grace was over.
    status, frames, ended = results["sse"]
    assert status == 200 and frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == SERVER_SHUTDOWN and error["type"] == "server_error" and error["message"]
    assert ended - signalled >= GRACE
    assert results["sdk"][0] == SERVER_SHUTDOWN
    status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == SERVER_SHUTDOWN

    messages, close_code, closed = results["a"]
    assert close_code == 1001 and closed - signalled >= GRACE
    assert not [m for m in messages if m["type"] == "done"]
    for request_id in ("a1", "a2"):
        last = [m for m in messages if m.get("request_id") == request_id][-1]  # then the close
        assert last["type"] == "error" and last["code"] == SERVER_SHUTDOWN, last

    messages, close_code, _ = results["b"]
    assert close_code == 1001
    assert [m["code"] for m in messages if m["type"] == "error"] == ["unavailable"]

    # Each phase is logged.
    for event in ("Draining", "Waiting for requests to finish", "Grace period over; ending the rest",
                  "Closing WebSocket sessions", "Shutting down", "Engine stopped"):
        assert server.log_events(event), f"no {event!r} line"
    ended_line = json.loads(server.log_events("Grace period over; ending the rest")[0])
    assert ended_line["requests_ended"] == 5
    assert any("Finished server process" in line for line in server.lines)


async def test_a_second_signal_ends_requests_at_once(long_model):
    env = {"CADENZA_SERVER__SHUTDOWN_GRACE": "60", "CADENZA_LOGGING__LEVEL": "info"}
    with running_server(long_model, env=env) as server:
        with anyio.fail_after(20):
            async with connect(server.ws_url) as ws, httpx.AsyncClient(base_url=server.url) as http:
                await ws.recv()  # session.created
                await ws.send(json.dumps({"type": "generate", "request_id": "r", "prompt": "abc", "sampling": LONG}))
                assert json.loads(await ws.recv())["type"] == "delta"
                signalled = time.monotonic()
                os.kill(server.proc.pid, signal.SIGTERM)
                while (await http.get("/health")).status_code != 503:
                    await anyio.sleep(0.02)
                os.kill(server.proc.pid, signal.SIGINT)  # Ctrl-C again: no more waiting
                last = None
                async for raw in ws:
                    last = json.loads(raw)
                assert last["type"] == "error" and last["code"] == SERVER_SHUTDOWN and ws.close_code == 1001
            exit_code = await anyio.to_thread.run_sync(server.proc.wait, 10)
        exited = time.monotonic() - signalled
        server.stop()
    assert exit_code == 0 and exited < 5.0, f"exit code {exit_code} after {exited:.1f}s"
    assert server.log_events("Second signal; skipping the rest of the wait")


# --- the engine in process ----------------------------------------------------------------------


def make_runtime(path):
    settings = {"model.path": str(path), "model.dtype": "float32", "cache.block_size": 8, "cache.num_blocks": 2048}
    return build_runtime(load_config(None, overrides=settings, env={}), extra_plugins=())


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def assert_all_blocks_free(engine):
    with anyio.fail_after(10):
        while engine.scheduler_core.requests:  # the aborts reach the scheduler, which frees blocks
            await anyio.sleep(0.01)
    await engine.settle()
    engine.cache_core.check_invariants()
    assert engine.cache_core.num_available == engine.cache_core.num_blocks


async def test_end_requests_finishes_each_once_with_server_shutdown_and_frees_blocks(long_model):
    outputs: dict[str, list] = {}
    started = anyio.Event()

    async def run(engine, request_id, prompt):
        outputs[request_id] = []
        async for out in engine.generate(prompt, greedy(8000), request_id=request_id):
            outputs[request_id].append(out)
            if len(outputs) == 3 and all(outputs.values()):
                started.set()

    async with AsyncEngine.serve(make_runtime(long_model)) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(run, engine, f"r{i}", [5 + i] * (20 + 9 * i))
            with anyio.fail_after(20):
                await started.wait()
            assert await engine.end_requests(SERVER_SHUTDOWN, "the server is shutting down") == 3
        for request_id, outs in outputs.items():
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished, request_id
            last = outs[-1]
            assert last.finish_reason == "error" and last.error_code == SERVER_SHUTDOWN
            assert last.error == "the server is shutting down"
        assert engine.num_active_requests == 0
        await assert_all_blocks_free(engine)
        assert await engine.end_requests(SERVER_SHUTDOWN, "again") == 0


async def test_end_requests_before_admission_leaves_nothing_behind(long_model):
    outs = []
    # A prompt this long is tokenized in a worker thread: the request is still in the ingress.
    prompt = "The quick brown fox jumps over the lazy dog. " * 100

    async def read(engine):
        async for out in engine.generate(prompt, greedy(8000), request_id="early"):
            outs.append(out)

    async with AsyncEngine.serve(make_runtime(long_model)) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, engine)
            while not engine.num_active_requests:  # registered and submitted
                await anyio.sleep(0)
            assert await engine.end_requests(SERVER_SHUTDOWN, "the server is shutting down") == 1
        assert outs[-1].error_code == SERVER_SHUTDOWN and sum(o.finished for o in outs) == 1
        assert outs[-1].num_output_tokens == 0
        await assert_all_blocks_free(engine)


async def test_shutdown_lets_short_requests_finish_and_ends_the_rest(long_model):
    finished: dict[str, object] = {}

    async def run(engine, request_id, n, ready):
        async for out in engine.generate([5, 6, 7], greedy(n), request_id=request_id):
            ready.set()
            if out.finished:
                finished[request_id] = out

    async with AsyncEngine.serve(make_runtime(long_model)) as engine:
        async with anyio.create_task_group() as tg:
            ready = {"short": anyio.Event(), "long": anyio.Event()}
            tg.start_soon(run, engine, "short", 4, ready["short"])
            tg.start_soon(run, engine, "long", 8000, ready["long"])
            with anyio.fail_after(20):
                for event in ready.values():
                    await event.wait()
            with anyio.fail_after(10):
                await engine.shutdown(1.0)
        assert finished["short"].finish_reason == "length"
        assert finished["long"].finish_reason == "error" and finished["long"].error_code == SERVER_SHUTDOWN
        await assert_all_blocks_free(engine)
        # Nothing runs any more: a second shutdown (the one on leaving `serve`) waits no grace.
        started = time.monotonic()
        await engine.shutdown(30.0)
        assert time.monotonic() - started < 1.0
