"""Data parallelism: replicas behind one engine interface, and the router that picks among them."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from cadenza.actors.cache_manager import block_hash, prompt_hashes
from cadenza.cluster.dp_engine import DataParallelEngine
from cadenza.cluster.replicas import ReplicaFrontEnd, start_replicas
from cadenza.cluster.router import Router
from cadenza.config import load_config
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


def test_every_request_finishes_exactly_once_across_replicas(replicas: ReplicaFrontEnd):
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


def multi_turn_hit_rate(runtime: ReplicaFrontEnd, policy: str, first_token: int) -> float:
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


def test_a_replica_that_dies_fails_its_requests_and_the_engine(replicas: ReplicaFrontEnd):
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


# --- data parallelism x tensor parallelism ------------------------------------------------------------


def test_the_shape_is_checked_against_the_cores_or_gpus_and_names_the_problem():
    from cadenza.config import ConfigError
    from cadenza.parallel.placement import plan_replicas, visible_devices

    with pytest.raises(ConfigError, match=r"parallel: data_parallel_size 2 x tensor_parallel_size 2 = 4 ranks, "
                                          r"one process each, but this machine has 2 CPU cores"):  # fmt: skip
        plan_replicas(2, 2, None, cores=2, gpus=0, use_gpus=False, where="this machine")
    with pytest.raises(ConfigError, match="= 4 ranks, one GPU each, but the Ray cluster has 3 GPUs"):
        plan_replicas(2, 2, None, cores=64, gpus=3, use_gpus=True, where="the Ray cluster")
    cpu = plan_replicas(2, 2, None, cores=4, gpus=0, use_gpus=False, where="this machine")
    assert (cpu.world_size, cpu.threads, cpu.resources()) == (4, 1, {"CPU": 2.0})
    gpu = plan_replicas(2, 2, 3, cores=16, gpus=4, use_gpus=True, where="this machine")
    assert gpu.resources() == {"CPU": 6.0, "GPU": 2.0}  # a Ray bundle: num_gpus = the replica's TP size
    assert [visible_devices(i, 2, ["0", "1", "2", "3"]) for i in range(2)] == ["0,1", "2,3"]


def test_dp_x_tp_beyond_this_machine_s_cores_is_refused_before_anything_starts(model_path):
    import psutil

    from cadenza.config import ConfigError

    cores = os.cpu_count() or 1
    config = load_config(None, overrides={"model.path": str(model_path), "model.device": "cpu", "parallel.data_parallel_size": 2,
                                          "parallel.tensor_parallel_size": cores}, env={})  # fmt: skip
    before = psutil.Process().children()
    with pytest.raises(ConfigError, match=f"= {2 * cores} ranks, one process each, but this machine has {cores} CPU"):
        start_replicas(config)
    assert psutil.Process().children() == before


def test_a_replica_of_tp2_starts_its_own_group_and_generates_what_one_engine_does(model_path):
    """1 x 2: one replica process that is rank 0 of its own tensor-parallel group (gloo)."""
    import psutil

    from cadenza.engine.async_engine import AsyncEngine
    from cadenza.runtime.build import build_runtime

    overrides = {"model.path": str(model_path), "model.dtype": "float32", "model.cpu_kernels": "off", "cache.num_blocks": 64}
    prompts = [[3 + i, 4, 5] * (1 + i) for i in range(3)]

    async def run(serve, runtime) -> list[list[int]]:
        async with serve(runtime) as engine:
            return [(await generate(engine, p, 6))[0] for p in prompts]

    single = build_runtime(load_config(None, overrides=overrides, env={}))
    try:
        want = anyio.run(run, AsyncEngine.serve, single)
    finally:
        single.close()
    runtime = start_replicas(load_config(None, overrides={**overrides, "parallel.tensor_parallel_size": 2,
                                                          "parallel.timeout_seconds": 30}, env={}))  # fmt: skip
    replica = psutil.Process(runtime.replicas[0].pid)
    try:
        (rank1,) = replica.children()
        assert "cadenza.runtime.worker" in " ".join(rank1.cmdline())
        assert anyio.run(run, DataParallelEngine.serve, runtime) == want
    finally:
        runtime.close()
    psutil.wait_procs([rank1], timeout=10)
    assert not replica.is_running() and not rank1.is_running()


# --- replicas that restart, and one that does not come back (fake replicas in this event loop) -------


class FakeReplica:
    """A `ManagedProcess` whose "process" is a TCP server in the test's event loop: it answers
    every request at once with one token, except prompts starting with 0, which it holds.
    `die()` drops its connection; it comes back (`wait_ready`) `comebacks` times."""

    restarts = True

    def __init__(self, index: int, comebacks: int) -> None:
        self.name, self.comebacks = f"data-parallel replica {index}", comebacks
        self.address, self.alive, self.connection = None, True, None

    async def listen(self, tg) -> None:
        from anyio.abc import SocketAttribute

        from cadenza.parallel.lifecycle import Address

        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.address = Address("127.0.0.1", listener.extra(SocketAttribute.local_port), 64)
        tg.start_soon(listener.serve, self.serve)

    async def serve(self, stream) -> None:
        from cadenza.cluster.wire import FrameStream
        from cadenza.engine.streams import GenerationOutput

        self.connection = frames = FrameStream(stream)
        try:
            while True:
                match await frames.receive():
                    case ("generate", request_id, prompt, _, _) if prompt[0] != 0:
                        await frames.send(("out", [(request_id, GenerationOutput(request_id, "", (1,), None, "length", len(prompt), 1, 0))]))
                    case ("metrics",):
                        await frames.send(("metrics", {}, True))
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def die(self) -> None:
        self.alive = False
        await self.connection.aclose()

    def wait_ready(self, timeout: float):
        from cadenza.parallel.errors import ReplicaFailedError

        if self.comebacks == 0:
            raise ReplicaFailedError(f"{self.name} is past its restarts")
        self.comebacks -= 1
        self.alive = True
        return self.address

    def is_alive(self) -> bool:
        return self.alive

    def failure(self) -> str | None:
        return None if self.alive else f"{self.name} is not running"

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def stop(self, grace: float) -> None: ...


def test_a_restarting_replica_is_routed_around_then_back_and_one_past_its_restarts_fails_the_engine():
    from types import SimpleNamespace

    from cadenza.engine.async_engine import EngineClosedError

    replicas = [FakeReplica(0, 0), FakeReplica(1, 1)]
    runtime = SimpleNamespace(config=load_config(None, env={}), loaded=SimpleNamespace(arch=SimpleNamespace(vocab_size=100)),
                              tokenizer=None, replicas=replicas, num_blocks=64, block_size=4, closed=False)  # fmt: skip

    async def scenario():
        async with anyio.create_task_group() as servers:
            for replica in replicas:
                await replica.listen(servers)
            async with DataParallelEngine.serve(runtime) as engine:
                engine.router = Router(2, 4, "round_robin")
                assert (await generate(engine, [5, 6], 1))[1][-1].finish_reason == "length"  # replica 0
                held = []

                async def hold():  # replica 1 holds it
                    held.extend((await generate(engine, [0, 6], 1))[1])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(hold)
                    await anyio.wait_all_tasks_blocked()
                    await replicas[1].die()
                assert (held[-1].finish_reason, held[-1].error_code) == ("error", "engine_failed")
                with anyio.fail_after(10):
                    while not engine.router.stats[1].alive:
                        assert engine.healthy  # replica 0 serves meanwhile
                        await anyio.sleep(0.01)
                assert engine.restarted == [0, 1]
                assert [(await generate(engine, [5, 6], 1))[1][-1].finish_reason for _ in range(2)] == ["length"] * 2
                await replicas[1].die()  # again: past its restarts
                with anyio.fail_after(10):
                    while engine.healthy:
                        await anyio.sleep(0.01)
                assert "replica 1" in engine.unhealthy_reason and "did not come back" in engine.unhealthy_reason
                with pytest.raises(EngineClosedError):
                    await generate(engine, [5, 6], 1)
            servers.cancel_scope.cancel()

    anyio.run(scenario)
