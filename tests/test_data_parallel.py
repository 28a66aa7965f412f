"""Data parallelism: replicas behind one engine interface, and the router that picks among them."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from cadenza.actors.cache_manager import block_hash
from cadenza.config import load_config
from cadenza.parallel.dp_engine import DataParallelEngine
from cadenza.parallel.replicas import FrontendRuntime, start_replicas
from cadenza.parallel.router import Router, prompt_hashes
from cadenza.sampling_params import SamplingParams

# --- the router alone -------------------------------------------------------------------------------


def test_prompt_hashes_are_the_cache_manager_s_chained_block_hashes():
    tokens = list(range(40))
    assert prompt_hashes(tokens, 16) == [block_hash(None, tokens[:16]), block_hash(block_hash(None, tokens[:16]), tokens[16:32])]
    assert prompt_hashes(tokens[:15], 16) == []  # only full blocks are cached


def test_a_conversation_stays_with_the_replica_that_holds_its_prefix():
    router = Router(2, block_size=4, policy="prefix")
    first = router.route(list(range(10)))
    other = router.route([99] * 10)  # no match anywhere: the least loaded, the other one
    assert other != first
    router.finished(first)
    router.finished(other)
    assert router.route(list(range(10)) + [7, 7, 7, 7]) == first
    assert router.stats[first].matched_blocks == 2


def test_no_match_goes_to_the_least_loaded_and_a_busy_match_is_passed_over():
    router = Router(2, block_size=4, policy="prefix", max_imbalance=2)
    home = router.route(list(range(8)))
    for _ in range(3):
        router.route([50 + len(router.stats)] * 3)  # short prompts, no blocks: least loaded each time
    loads = [s.in_flight for s in router.stats]
    assert abs(loads[0] - loads[1]) <= 1
    for _ in range(3):
        router.route(list(range(8)))  # same prefix: home, until it is max_imbalance busier
    assert router.stats[1 - home].in_flight >= 2


def test_round_robin_alternates_and_dead_replicas_are_skipped():
    router = Router(3, block_size=4, policy="round_robin")
    assert [router.route([1, 2, 3, 4]) for _ in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route([1]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="known: prefix, round_robin, least_loaded"):
        Router(2, 4, policy="random")


# --- two replica processes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("dp"), "llama3")
    config = load_config(None, overrides={"model.path": str(model), "model.dtype": "float32",
                                          "parallel.data_parallel_size": 2}, env={})  # fmt: skip
    runtime = start_replicas(config)
    try:
        yield runtime
    finally:
        runtime.close()
        assert all(r.process.poll() is not None for r in runtime.replicas)


async def generate(engine: DataParallelEngine, prompt, max_tokens: int) -> tuple[list[int], list]:
    tokens, outs = [], []
    async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        tokens += out.token_ids
        outs.append(out)
    return tokens, outs


def test_every_request_finishes_exactly_once_across_replicas(replicas: FrontendRuntime):
    async def scenario():
        finals = {}
        async with DataParallelEngine.serve(replicas) as engine:
            async def one(i: int):
                _, outs = await generate(engine, [3 + i % 50, 4, 5] * (1 + i % 7), 3 + i % 5)
                finals[i] = [o for o in outs if o.finished]
                assert all(o.finish_reason == "length" for o in finals[i])

            async with anyio.create_task_group() as tg:
                for i in range(30):
                    tg.start_soon(one, i)
            stats = engine.router.stats
            assert sum(s.routed for s in stats) == 30 and all(s.routed for s in stats)
            assert all(s.in_flight == 0 for s in stats)
        assert sorted(finals) == list(range(30)) and all(len(f) == 1 for f in finals.values())

    anyio.run(scenario)


def multi_turn_hit_rate(runtime: FrontendRuntime, policy: str, first_token: int) -> float:
    """3 sessions x 4 turns, each turn's prompt the last prompt, its reply and a new user turn:
    the share of prompt tokens the replicas found in their prefix caches. Turns go one at a time,
    session after session in each round: with an odd number of sessions, round-robin moves every
    session to the other replica at each turn (with an even number in lockstep it would keep each on
    one replica by chance, and concurrent turns make it depend on timing)."""

    async def scenario() -> float:
        cached = total = 0
        async with DataParallelEngine.serve(runtime) as engine:
            engine.router = Router(2, runtime.block_size, policy, capacity_blocks=runtime.num_blocks)
            prompts = {s: [first_token + s] * 40 for s in range(3)}
            for turn in range(4):
                for s, prompt in prompts.items():
                    reply, outs = await generate(engine, prompt, 8)
                    cached += outs[-1].num_cached_tokens
                    total += outs[-1].num_prompt_tokens
                    prompts[s] = prompt + reply + [turn + 10] * 20
        return cached / total

    return anyio.run(scenario)


def test_the_cache_aware_router_finds_more_of_each_session_cached_than_round_robin(replicas):
    prefix = multi_turn_hit_rate(replicas, "prefix", first_token=100)
    round_robin = multi_turn_hit_rate(replicas, "round_robin", first_token=200)  # fresh sessions: no help from the first run
    print(f"multi-turn prefix hit rate: prefix router {prefix:.2f}, round robin {round_robin:.2f}")
    assert prefix > round_robin


def test_a_replica_that_dies_fails_its_requests_and_the_engine(replicas: FrontendRuntime):
    # Last of the tests on the shared replicas: it kills one.
    runtime = replicas
    victim = runtime.replicas[1].process
    outcomes = []

    async def scenario():
        async with DataParallelEngine.serve(runtime) as engine:
            engine.router = Router(2, runtime.block_size, "round_robin")
            started = anyio.Event()

            async def one(i: int):
                last = None
                async for out in engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=3000, ignore_eos=True)):
                    started.set()
                    last = out
                    if out.token_ids and i % 2 == 0 and not engine.healthy:
                        break  # the live replica's requests may run on; stop them once the engine failed
                outcomes.append((i, last.finish_reason if last else None))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
                await started.wait()
                os.kill(victim.pid, signal.SIGKILL)
            assert not engine.healthy and "replica 1" in engine.unhealthy_reason

    try:
        anyio.run(scenario)
    finally:
        runtime.close()
    assert sorted(i for i, reason in outcomes if reason == "error") == [1, 3]  # round robin: odd ones on replica 1
    assert all(r.process.poll() is not None for r in runtime.replicas)


def test_serve_with_dp2_answers_and_reports_per_replica_metrics(tiny_model_dir):
    import httpx
    import psutil
    from server_process import running_server

    with running_server(tiny_model_dir("llama3"), "--data-parallel-size", "2") as server:
        children = psutil.Process(server.proc.pid).children()
        assert len(children) == 2
        assert httpx.get(f"{server.url}/health").status_code == 200
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'cadenza_replica_routed{replica="0"}' in metrics
        assert server.stop() == 0
    assert not any(child.is_running() for child in children)
