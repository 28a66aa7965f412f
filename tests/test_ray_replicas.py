"""Data-parallel replicas under Ray actors (`parallel.launcher: ray`), on a local Ray instance that
cadenza starts for this module and stops after it: the same tokens as one engine, prefix routing,
and replicas that die (actor or process) failing only their own requests, then serving again.
Everything started here is stopped in the fixture's teardown, by Ray and then by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import psutil
import pytest

from cadenza.cluster.dp_engine import DataParallelEngine
from cadenza.cluster.replica_client import REPLICA_FAILED
from cadenza.cluster.replicas import ReplicaFrontEnd, start_replicas
from cadenza.cluster.router import Router
from cadenza.config import ConfigError, load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

RESTART_SECONDS = 120  # a bound against hanging: a restart takes a few seconds
STARTED: dict[int, psutil.Process] = {}  # every process started for this module: the teardown ends them


def remember(pids) -> None:
    for pid in pids:
        try:
            STARTED.setdefault(pid, psutil.Process(pid))  # a Process: never mistaken for a later one of its pid
        except psutil.NoSuchProcess:
            pass


def make_config(model, **overrides):
    # No compiled CPU kernels: this is about processes, and a kernel build (~30 s) must not count here.
    values = {"model.path": str(model), "model.dtype": "float32", "model.device": "cpu", "model.cpu_kernels": "off",
              "cache.num_blocks": 64, "logging.level": "warning",
              "parallel.data_parallel_size": 2, "parallel.launcher": "ray", "parallel.max_restarts": 2, **overrides}  # fmt: skip
    return load_config(None, overrides=values, env={})


def replica_pids(runtime: ReplicaFrontEnd) -> set[int]:
    return {r.address.pid for r in runtime.replicas if r.address is not None}


@pytest.fixture(scope="module")
def ray_runtime(model_path):
    """Two replicas on a local Ray instance cadenza starts (RAY_ADDRESS unset, no cluster)."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def remember_children() -> None:
        remember(p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before)

    runtime = None
    try:
        started = time.perf_counter()
        runtime = start_replicas(make_config(model_path))
        print(f"Ray instance and 2 replicas ready in {time.perf_counter() - started:.1f} s")
        remember_children()
        yield runtime
    finally:
        remember_children()
        if runtime is not None:
            remember(replica_pids(runtime))
            runtime.close()
        if ray.is_initialized():
            ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
        _, alive = psutil.wait_procs(list(STARTED.values()), timeout=15)
        for proc in alive:
            proc.kill()
        assert not alive, f"left running: {[p.pid for p in alive]}"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def generate(engine, prompt, params: SamplingParams) -> tuple[list[int], object]:
    tokens, last = [], None
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
        last = out
    return tokens, last


PROMPTS = [[3 + i, 4, 5, 6] * (1 + i % 3) for i in range(6)]


def test_greedy_tokens_through_two_ray_replicas_equal_one_engine(ray_runtime: ReplicaFrontEnd, model_path):
    async def through(engine) -> list[list[int]]:
        results = []
        for prompt in PROMPTS:
            tokens, last = await generate(engine, prompt, greedy(8))
            assert last.finish_reason == "length", last.error
            results.append(tokens)
        return results

    async def replicated():
        async with DataParallelEngine.serve(ray_runtime) as engine:
            engine.router = Router(2, ray_runtime.block_size, "round_robin")
            tokens = await through(engine)
            assert [s.routed for s in engine.router.stats] == [3, 3]
            return tokens

    async def single(runtime):
        async with AsyncEngine.serve(runtime) as engine:
            return await through(engine)

    runtime = build_runtime(make_config(model_path, **{"parallel.data_parallel_size": 1, "parallel.launcher": "local"}))
    try:
        want = anyio.run(single, runtime)
    finally:
        runtime.close()
    assert anyio.run(replicated) == want


def test_the_router_keeps_each_session_on_the_replica_that_caches_it(ray_runtime: ReplicaFrontEnd):
    async def scenario():
        async with DataParallelEngine.serve(ray_runtime) as engine:
            prompts = {s: [300 + s] * 24 for s in range(2)}
            cached = []
            for turn in range(3):
                for s, prompt in prompts.items():
                    reply, last = await generate(engine, prompt, greedy(4))
                    if turn:
                        cached.append(last.num_cached_tokens)
                    prompts[s] = prompt + reply + [turn + 10] * 8
            stats = engine.router.stats
            assert all(s.routed == 3 for s in stats)  # one session on each replica
            assert all(s.matched_blocks > 0 for s in stats)
            assert all(c >= ray_runtime.block_size for c in cached), cached  # each later turn found its history cached

    anyio.run(scenario)


def kill_actor(runtime: ReplicaFrontEnd, index: int) -> int:
    """SIGKILL replica `index`'s actor (Ray restarts it); returns the old replica's pid."""
    replica = runtime.replicas[index]
    ray.kill(replica.actor, no_restart=False)
    return replica.address.pid


def kill_process(runtime: ReplicaFrontEnd, index: int) -> int:
    """SIGKILL replica `index`'s process (its actor exits, Ray restarts it); returns its pid."""
    pid = runtime.replicas[index].address.pid
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize("kill", [kill_actor, kill_process], ids=["actor", "process"])
def test_a_killed_replica_fails_its_requests_the_other_serves_and_it_comes_back(ray_runtime: ReplicaFrontEnd, kill):
    outcomes: dict[int, tuple[str | None, str | None]] = {}
    old_pid = ray_runtime.replicas[1].address.pid

    async def scenario():
        async with DataParallelEngine.serve(ray_runtime) as engine:
            engine.router = Router(2, ray_runtime.block_size, "round_robin")
            running = [anyio.Event(), anyio.Event()]
            failed = anyio.Event()

            async def long_request(i: int):  # round robin: request i runs on replica i
                last = None
                async for out in engine.generate([7 + i, 8, 9], SamplingParams(max_tokens=100_000, ignore_eos=True)):
                    running[i].set()
                    last = out
                    if failed.is_set() and out.token_ids:
                        break  # the survivor has served on after the failure: enough
                outcomes[i] = (last.finish_reason, last.error_code)
                if i == 1:
                    failed.set()

            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(long_request, i)
                for event in running:
                    await event.wait()
                with anyio.fail_after(30):
                    await anyio.to_thread.run_sync(kill, ray_runtime, 1)
                    await failed.wait()
            assert outcomes[1] == ("error", REPLICA_FAILED), outcomes
            assert outcomes[0][1] is None, outcomes  # the other replica's request never failed
            assert engine.healthy, engine.unhealthy_reason  # one replica restarting while the other serves
            # Meanwhile new requests go to the live replica.
            for _ in range(2):
                _, last = await generate(engine, [11, 12, 13], greedy(3))
                assert last.finish_reason == "length", last.error
            with anyio.fail_after(RESTART_SECONDS):
                while not engine.router.stats[1].alive:
                    await anyio.sleep(0.1)
            assert engine.restarted[1] >= 1
            routed = engine.router.stats[1].routed
            for _ in range(2):  # round robin: one of these on the restarted replica
                _, last = await generate(engine, [14, 15, 16], greedy(3))
                assert last.finish_reason == "length", last.error
            assert engine.router.stats[1].routed == routed + 1

    remember([old_pid])
    try:
        anyio.run(scenario)
    finally:
        remember(replica_pids(ray_runtime))
    new_pid = ray_runtime.replicas[1].address.pid
    assert new_pid != old_pid
    psutil.wait_procs([psutil.Process(old_pid)] if psutil.pid_exists(old_pid) else [], timeout=10)
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE


def test_dp2_x_tp2_is_refused_by_the_cluster_s_cores_before_anything_starts(ray_runtime, model_path):
    cores = int(ray.cluster_resources()["CPU"])
    config = make_config(model_path, **{"parallel.tensor_parallel_size": cores})  # 2 x cores ranks
    with pytest.raises(ConfigError, match=rf"= {2 * cores} ranks, one process each, but the Ray cluster has {cores} CPU"):
        start_replicas(config)
    assert ray.is_initialized()  # the instance belongs to the fixture's runtime: still running


def test_ray_address_joins_the_running_instance_instead_of_starting_one(ray_runtime):
    code = ("import ray; from cadenza.cluster.ray_replicas import connect_ray; s = connect_ray(2); "
            "cpus = int(ray.cluster_resources()['CPU']); s.close(); print('session', s.started, s.connected, cpus, ray.is_initialized())")  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("session ")]
    # Not started, connected; the fixture's instance (its CPUs); disconnected after, the instance left running.
    assert line.split() == ["session", "False", "True", str(int(ray.cluster_resources()["CPU"])), "False"]
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] > 0
