"""Chaos on loopback: many concurrent clients over WebSocket and OpenAI HTTP send valid and invalid
requests, cancel, interrupt, disconnect mid-stream and read slowly, at random, for a bounded time.
Then the books must balance: every request the server accepted ended exactly once, no KV block is
held, the server is healthy and answers greedy requests exactly as it did before the run.

`CHAOS_SECONDS` sets the run's length (default 20); `CHAOS_REPORT=path` writes the
run's figures as JSON (docs/reliability.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from server_process import running_server
from websockets.asyncio.client import connect

CHAOS_SECONDS = float(os.environ.get("CHAOS_SECONDS", "20"))
WS_CLIENTS = 8
HTTP_CLIENTS = 8
SEED = 20261123

# What a valid request may legitimately end with besides finishing: the server was saturated or the
# client was too slow. Anything else (internal_error, step_failed, engine_failed) is a defect.
ALLOWED_ERRORS = {"queue_full", "too_many_requests", "slow_reader", "kv_cache_full"}
# Answers to a client's cancel or interrupt (the request had already ended): not the request's end.
CANCEL_ANSWERS = {"unknown_request_id", "nothing_to_interrupt"}

BAD_SAMPLING = [
    '{"temperature": Infinity}', '{"temperature": NaN}', '{"top_p": 0}', '{"seed": 18446744073709551616}',
    '{"logit_bias": {"5": NaN}}', '{"logit_bias": {"5": 1e300}}', '{"logit_bias": {"99999": 1}}',
    '{"stop_token_ids": [-3]}', '{"max_tokens": 0}', '{"top_k": "many"}', '{"unknown_knob": 1}',
    '{"min_tokens": 9, "max_tokens": 2}', '[]', '"hot"',
]  # fmt: skip
BAD_FRAMES = ['{"type": "generate"', "[1, 2]", '{"type": "teleport"}', '{"type": "cancel", "request_id": "nope"}', "\u00ff" * 40]


@dataclass
class Tally:
    sent: int = 0
    finished: int = 0  # ended normally (done / [DONE] / 200)
    cancelled: int = 0  # cancelled or interrupted by the client: ended with finish_reason abort
    errored: Counter = field(default_factory=Counter)  # valid requests that ended with an allowed error
    refused: Counter = field(default_factory=Counter)  # invalid requests, refused with a documented error
    dropped: int = 0  # the client disconnected mid-request on purpose
    bad_frames: int = 0
    lost: list[str] = field(default_factory=list)  # no end, two ends, or an undocumented answer

    def report(self) -> dict:
        return {
            "requests_sent": self.sent, "finished": self.finished, "cancelled": self.cancelled,
            "errored": dict(self.errored), "refused": dict(self.refused), "dropped_by_client": self.dropped,
            "bad_frames": self.bad_frames, "lost": len(self.lost),
        }  # fmt: skip


def _sampling(rng: random.Random) -> tuple[str, bool]:
    """A sampling object as raw JSON, and whether it is valid."""
    if rng.random() < 0.25:
        return rng.choice(BAD_SAMPLING), False
    options = {"max_tokens": rng.randint(1, 24), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        options.update(temperature=round(rng.uniform(0.1, 1.5), 2), seed=rng.randrange(2**64))
    else:
        options["temperature"] = 0
    if rng.random() < 0.2:
        options.update(top_k=rng.randint(1, 50), top_p=0.9, repetition_penalty=1.1, logprobs=rng.randint(0, 5))
    if rng.random() < 0.1:
        options["stop"] = ["e", "a"]
    return json.dumps(options), True


def _prompt(rng: random.Random) -> tuple[str, bool]:
    roll = rng.random()
    if roll < 0.05:
        return json.dumps("word " * 5000), False  # longer than the tiny model's context
    if roll < 0.1:
        return '""', False
    return json.dumps(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "é", "漢"]) for _ in range(rng.randint(1, 40)))), True


# --- WebSocket ------------------------------------------------------------------------------------


async def ws_client(url: str, rng: random.Random, deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        ends: dict[str, list[dict]] = {}
        valid: dict[str, bool] = {}
        cancelled: set[str] = set()
        slow = rng.random() < 0.2
        async with connect(url, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"

            async def read() -> None:
                async for raw in ws:
                    message = json.loads(raw)
                    if slow:
                        await asyncio.sleep(rng.uniform(0.01, 0.1))
                    rid = message.get("request_id")
                    if message["type"] == "error" and message["code"] in CANCEL_ANSWERS:
                        continue
                    if message["type"] in ("done", "error") and rid in ends:
                        ends[rid].append(message)
                    elif message["type"] == "error" and rid is None:
                        assert message["code"] and message["message"]

            reader = asyncio.create_task(read())
            drop = rng.random() < 0.2
            for _ in range(rng.randint(1, 10)):
                if time.monotonic() >= deadline:
                    break
                roll = rng.random()
                if roll < 0.1:
                    tally.bad_frames += 1
                    await ws.send(rng.choice(BAD_FRAMES))
                    continue
                rid = f"r{tally.sent}"
                tally.sent += 1
                sampling, ok_sampling = _sampling(rng)
                prompt, ok_prompt = _prompt(rng)
                ends[rid], valid[rid] = [], ok_sampling and ok_prompt
                await ws.send('{"type": "generate", "request_id": "%s", "prompt": %s, "sampling": %s}' % (rid, prompt, sampling))
                await asyncio.sleep(rng.uniform(0, 0.05))
                if rng.random() < 0.2:
                    cancelled.add(rid)
                    await ws.send(json.dumps({"type": rng.choice(["cancel", "interrupt"]), "request_id": rid}))
            if drop:  # leave with requests running: abruptly, or with a close handshake
                reader.cancel()
                if rng.random() < 0.5:
                    ws.transport.abort()
            else:
                try:
                    await asyncio.wait_for(_all_ended(ends), timeout=60)
                finally:
                    reader.cancel()
        for rid, got in ends.items():
            if drop and not got:
                tally.dropped += 1
            else:
                _judge_ws(rid, got, valid[rid], rid in cancelled, tally)


async def _all_ended(ends: dict[str, list]) -> None:
    while any(not got for got in ends.values()):
        await asyncio.sleep(0.01)


def _judge_ws(rid: str, got: list[dict], valid: bool, cancelled: bool, tally: Tally) -> None:
    if len(got) != 1:
        tally.lost.append(f"websocket {rid}: {len(got)} ends: {got}")
        return
    end = got[0]
    if end["type"] == "done":
        if end["finish_reason"] == "abort" or end.get("interrupted"):
            tally.cancelled += 1 if cancelled else 0
            if not cancelled:
                tally.lost.append(f"websocket {rid}: aborted though nobody cancelled it: {end}")
        elif valid:
            tally.finished += 1
        else:
            tally.lost.append(f"websocket {rid}: an invalid request was served: {end}")
    elif valid and end["code"] in ALLOWED_ERRORS:
        tally.errored[end["code"]] += 1
    elif not valid and end["code"] in ("invalid_params", "invalid_value", "invalid_prompt", "prompt_too_long"):
        tally.refused[end["code"]] += 1
    else:
        tally.lost.append(f"websocket {rid}: undocumented end for a {'valid' if valid else 'invalid'} request: {end}")


# --- OpenAI HTTP ----------------------------------------------------------------------------------


async def http_client(base: str, model: str, rng: random.Random, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        while time.monotonic() < deadline:
            tally.sent += 1
            sampling, ok_sampling = _sampling(rng)
            prompt, ok_prompt = _prompt(rng)
            chat = rng.random() < 0.5
            valid = ok_sampling and (ok_prompt or (chat and prompt == '""'))  # an empty chat turn is fine
            if chat and ok_sampling and "logprobs" in sampling:  # chat's logprobs is a switch, its count top_logprobs
                options = json.loads(sampling)
                options.update(logprobs=True, top_logprobs=options["logprobs"])
                sampling = json.dumps(options)
            sampling_body = sampling.strip()[1:-1] if sampling.startswith("{") else '"bad": %s' % sampling
            stream = rng.random() < 0.6
            if chat:
                body = '{"model": "%s", "messages": [{"role": "user", "content": %s}], "stream": %s%s}' % (
                    model, prompt, str(stream).lower(), (", " + sampling_body) if sampling_body else "")
                path = "/v1/chat/completions"
            else:
                body = '{"model": "%s", "prompt": %s, "stream": %s%s}' % (
                    model, prompt, str(stream).lower(), (", " + sampling_body) if sampling_body else "")
                path = "/v1/completions"
            if rng.random() < 0.05:
                body, valid = body[: rng.randrange(len(body))], False  # truncated JSON
            drop = rng.random() < 0.15
            slow = rng.random() < 0.2
            headers = {"content-type": "application/json"}
            if not stream:
                try:
                    response = await asyncio.wait_for(http.post(path, content=body, headers=headers), timeout=rng.uniform(0.01, 0.3) if drop else 120)
                except asyncio.TimeoutError:
                    tally.dropped += 1
                    continue
                _judge_http(path, response.status_code, response.json(), valid, tally)
                continue
            async with http.stream("POST", path, content=body, headers=headers) as response:
                if response.status_code != 200:
                    _judge_http(path, response.status_code, json.loads(await response.aread()), valid, tally)
                    continue
                events: list[str] = []
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if slow:
                        await asyncio.sleep(rng.uniform(0.005, 0.05))
                    if drop and len(events) >= 1:
                        break  # leave mid-stream: the server must abort the request
                if drop and (not events or events[-1] != "[DONE]"):
                    tally.dropped += 1
                    continue
                _judge_sse(path, events, valid, tally)


def _judge_http(path: str, status: int, body: dict, valid: bool, tally: Tally) -> None:
    if status == 200 and valid:
        tally.finished += 1
        return
    error = body.get("error") if isinstance(body, dict) else None
    shaped = isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
    if not shaped:
        tally.lost.append(f"{path}: {status} without OpenAI's error shape: {body}")
    elif 400 <= status < 500 and not valid:
        tally.refused[error["code"]] += 1
    elif valid and error["code"] in ALLOWED_ERRORS:
        tally.errored[error["code"]] += 1
    else:
        tally.lost.append(f"{path}: {status} {error} for a {'valid' if valid else 'invalid'} request")


def _judge_sse(path: str, events: list[str], valid: bool, tally: Tally) -> None:
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        tally.lost.append(f"{path} (stream): no single final [DONE]: {events[-3:]}")
        return
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ()) if ch.get("finish_reason")]
    if errors:
        if len(errors) == 1 and valid and errors[0]["code"] in ALLOWED_ERRORS:
            tally.errored[errors[0]["code"]] += 1
        else:
            tally.lost.append(f"{path} (stream): errors {errors}")
    elif len(finishes) == 1 and valid:
        tally.finished += 1
    else:
        tally.lost.append(f"{path} (stream): {len(finishes)} finishes for a {'valid' if valid else 'invalid'} request")


# --- the run --------------------------------------------------------------------------------------


async def _greedy_answers(server, model: str) -> list[str]:
    prompts = ["the cat sat", "on a mat the", "é 漢 the"]
    answers = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            answers.append((await http.post("/v1/completions", json=body)).json()["choices"][0]["text"])
    async with connect(server.ws_url) as ws:
        await ws.recv()
        for i, prompt in enumerate(prompts):
            await ws.send(json.dumps({"type": "generate", "request_id": f"g{i}", "prompt": prompt,
                                      "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}))
            text = []
            while (message := json.loads(await ws.recv()))["type"] != "done":
                assert message["type"] == "delta", message
                text.append(message["text"])
            answers.append("".join(text))
    return answers


def _metrics(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _settled(server) -> dict[str, float] | None:
    m = _metrics(server)
    quiet = (
        m["cadenza_requests_running"] == 0 and m["cadenza_requests_waiting"] == 0
        and m["cadenza_requests_active"] == 0 and m["cadenza_kv_cache_blocks_used"] == 0
    )  # fmt: skip
    return m if quiet else None


def test_chaos_then_the_books_balance(tiny_model_dir):
    env = {"CADENZA_CACHE__NUM_BLOCKS": "96", "CADENZA_SCHEDULER__MAX_NUM_SEQS": "16", "CADENZA_LOGGING__LEVEL": "warning"}
    with running_server(tiny_model_dir("llama3"), env=env) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        before = asyncio.run(_greedy_answers(server, model))
        tally = Tally()

        async def chaos() -> None:
            deadline = time.monotonic() + CHAOS_SECONDS
            tasks = [ws_client(server.ws_url, random.Random(SEED + i), deadline, tally) for i in range(WS_CLIENTS)]
            tasks += [http_client(server.url, model, random.Random(-SEED - i), deadline, tally) for i in range(HTTP_CLIENTS)]
            await asyncio.gather(*tasks)

        started = time.monotonic()
        asyncio.run(asyncio.wait_for(chaos(), timeout=CHAOS_SECONDS + 120))
        seconds = time.monotonic() - started

        metrics = None
        deadline = time.monotonic() + 30
        while metrics is None and time.monotonic() < deadline:
            metrics = _settled(server)
            time.sleep(0.05)
        assert metrics is not None, f"the server did not settle: {_metrics(server)}"
        assert httpx.get(server.url + "/health").status_code == 200
        assert metrics["cadenza_kv_cache_capacity_tokens"] == 96 * 16  # num_blocks x the default block size
        after = asyncio.run(_greedy_answers(server, model))

        report = {**tally.report(), "seconds": round(seconds, 1),
                  "server_requests_started": metrics["cadenza_requests_started_total"],
                  "server_requests_ended": metrics["cadenza_requests_ended_total"],
                  "kv_blocks_held_after": metrics["cadenza_kv_cache_blocks_used"]}  # fmt: skip
        print("chaos:", json.dumps(report))
        if os.environ.get("CHAOS_REPORT"):
            with open(os.environ["CHAOS_REPORT"], "w") as out:
                json.dump(report, out, indent=2)

        assert not tally.lost, "\n".join(sorted(set(tally.lost))[:30])
        assert metrics["cadenza_requests_started_total"] == metrics["cadenza_requests_ended_total"]
        assert tally.finished > 20 and sum(tally.refused.values()) > 5 and tally.dropped > 0, report
        assert after == before, "greedy answers changed after the chaos"
        assert not server.log_events("Actor failed") and not server.log_events("Engine unhealthy")
