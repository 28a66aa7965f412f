"""Prefill/decode disaggregation: the shape checked up front, the cache manager's held blocks, and
real replica processes (a tiny random model) moving prompt blocks over each connector, dying
mid-transfer, and letting go of every block."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from contextlib import contextmanager
from pathlib import Path

import anyio
import psutil
import pytest

from cadenza.actors.cache_manager import KVCacheManager, prompt_hashes
from cadenza.cluster.replicas import start_replicas
from cadenza.config import ConfigError, load_config
from cadenza.kv_connectors.blocks import block_nbytes, cache_tensors
from cadenza.parallel.disaggregation import plan_disaggregation
from cadenza.plugins.errors import UnknownNameError
from cadenza.policies.eviction import LRUPolicy
from cadenza.sampling_params import SamplingParams

TESTS = Path(__file__).resolve().parent
SCENARIO_SECONDS = 120  # any scenario here ends well within this, or fails: nothing may hang
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5 + (7 * i) % 250 for i in range(50)]  # 3 full blocks of 16 before its last position
SHARED = PROMPT[:48] + [9] * 20  # the same 3 blocks, then a 4th of its own
PROMPTS = [PROMPT, SHARED, [11] * 40 + [12] * 9, [3, 4, 5], PROMPT]


def config(model, **overrides):
    return load_config(None, overrides={"model.path": str(model), "model.dtype": "float32", "cache.num_blocks": 64,
                                        "parallel.timeout_seconds": 20, **overrides}, env={})  # fmt: skip


def disaggregated(model, connector="torch_distributed", **overrides):
    return config(model, **{"parallel.data_parallel_size": 2, "parallel.disaggregation.prefill": 1,
                            "parallel.disaggregation.decode": 1, "parallel.disaggregation.connector": connector,
                            **overrides})  # fmt: skip


# --- the shape, refused before anything starts ------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"parallel.data_parallel_size": 3}, "prefill 1 + decode 1 = 2 replicas, but parallel.data_parallel_size is 3; "
                                             "set data_parallel_size: 2"),
        ({"parallel.disaggregation.decode": 0, "parallel.data_parallel_size": 1}, "needs at least one prefill and one decode"),
        ({"parallel.launcher": "ray", "parallel.max_restarts": 2}, "max_restarts 2 with launcher ray: a restarted "
                                                                    "replica cannot rejoin"),
        ({"parallel.tensor_parallel_size": 2}, "tensor_parallel_size 2: a replica's KV cache must be whole"),
        ({"cache.enable_prefix_caching": False}, "needs cache.enable_prefix_caching: true"),
    ],
)
def test_a_shape_that_cannot_work_is_refused_naming_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_disaggregation(disaggregated("unused", **overrides))


def test_every_problem_is_named_at_once_and_off_means_none():
    with pytest.raises(ConfigError) as caught:
        plan_disaggregation(disaggregated("unused", **{"parallel.data_parallel_size": 4, "parallel.tensor_parallel_size": 2}))
    assert len(caught.value.problems) == 2
    # Ray's default max_restarts (3) left unset: replicas are simply not restarted.
    assert plan_disaggregation(disaggregated("unused", **{"parallel.launcher": "ray"})) is not None
    assert plan_disaggregation(config("unused")) is None
    roles = plan_disaggregation(disaggregated("unused", **{"parallel.data_parallel_size": 3, "parallel.disaggregation.decode": 2}))
    assert (roles.prefill, roles.decode, roles.role(0), roles.role(2)) == ((0,), (1, 2), "prefill", "decode")


def test_start_replicas_refuses_before_any_process_starts(model_path, monkeypatch):
    before = psutil.Process().children()
    with pytest.raises(ConfigError, match="parallel.data_parallel_size is 1"):
        start_replicas(disaggregated(model_path, **{"parallel.data_parallel_size": 1}))
    with pytest.raises(UnknownNameError, match="known KV connectors: nixl, torch_distributed"):
        start_replicas(disaggregated(model_path, connector="mooncake"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    with pytest.raises(ConfigError, match=r"connector: KV connector 'nixl' needs the `nixl` package.*pip install nixl"):
        start_replicas(disaggregated(model_path, connector="nixl"))
    assert psutil.Process().children() == before


def test_one_engine_will_not_pretend_to_be_disaggregated(model_path):
    from cadenza.runtime.build import build_runtime

    with pytest.raises(ConfigError, match=re.escape("= 2 replicas, but parallel.data_parallel_size is 1; set data_parallel_size: 2")):
        build_runtime(disaggregated(model_path, **{"parallel.data_parallel_size": 1}))


# --- the cache manager's held blocks ----------------------------------------------------------------


def test_received_blocks_become_a_prefix_hit_and_every_hold_is_let_go():
    tokens = tuple(range(100, 150))  # 3 full blocks of 16 before its last position
    hashes = prompt_hashes(tokens, 16)[:3]
    source, target = (KVCacheManager(16, 16, LRUPolicy()) for _ in range(2))
    source.admit("a", tokens, len(tokens))  # the prefill side computes the prompt
    source.commit("a", tokens)
    source.free("a")
    assert source.hold_cached("send", hashes) == source.block_table("send") and len(source.block_table("send")) == 3
    source.admit("b", tokens[:32] + (1,) * 30, 62)  # a request beside the transfer reuses what it may
    assert source.num_used == 3 + 4 - 2
    source.free("send")
    source.free("b")
    source.check_invariants()
    assert source.num_used == 0

    assert target.hold_cached("recv", hashes) == ()  # nothing cached here yet: all 3 are missing
    room = target.hold_fresh("recv", 3)
    assert len(room) == 3 and target.num_used == 3
    target.cache_held("recv", hashes)  # the blocks arrived
    grant = target.admit("req", tokens, len(tokens))
    assert grant.num_cached_tokens == 48 and grant.block_table[:3] == room
    target.free("recv")  # the request's own references keep them
    target.check_invariants()
    assert target.num_used == 4
    target.free("req")
    assert target.num_used == 0 and target.num_cached_blocks == 3
    # A later prompt sharing them: the decode side answers with the hashes it has, and holds them.
    assert target.hold_cached("next", hashes + [b"x" * 16]) == room
    assert target.hold_fresh("next", 100) and target.num_available == 0  # no more than there is
    target.free("next")
    target.check_invariants()
    assert target.num_used == 0


def test_a_failed_receive_gives_its_blocks_back_unhashed():
    target = KVCacheManager(8, 4, LRUPolicy())
    target.hold_cached("recv", [b"a" * 16])
    target.hold_fresh("recv", 2)
    with pytest.raises(ValueError, match="3 hashes for 2 unhashed blocks"):
        target.cache_held("recv", [b"a" * 16, b"b" * 16, b"c" * 16])
    target.free("recv")
    target.check_invariants()
    assert (target.num_free, target.num_cached_blocks) == (8, 0)


def test_a_nixl_receive_ends_when_aborted_and_a_notification_wins_over_a_late_abort(monkeypatch):
    """The receive loop alone, over a stand-in for NIXL's agent (no nixl package needed)."""
    import threading
    import time

    import torch

    from cadenza.kv_connectors.base import BlockTransfer, KVTransferError
    from cadenza.kv_connectors.nixl import NixlConnector

    class Agent:  # NIXL's notifications: what the test puts in `inbox`, drained once
        def __init__(self):
            self.inbox = []

        def get_new_notifs(self):
            messages, self.inbox = self.inbox, []
            return {"peer": messages} if messages else {}

    monkeypatch.setattr(NixlConnector, "check_available", classmethod(lambda cls: None))
    connector = NixlConnector([torch.zeros(2, 4, 16, 1, 8)], block_size=16, device=torch.device("cpu"))
    connector.agent, connector.timeout = Agent(), 60.0
    first, second = BlockTransfer(7, 0, 1, (0,), (1,)), BlockTransfer(8, 0, 1, (2,), (3,))
    threading.Timer(0.2, connector.abort, args=(7,)).start()
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="replica 0 died"):
        connector.receive(first)
    assert time.monotonic() - started < 5  # the abort, not the 60 s timeout
    connector.agent.inbox.append(b"cadenza-kv 8 ok")
    connector.abort(8)  # the blocks had arrived: they count
    assert connector.receive(second) == 2 * 16 * 8 * 4
    assert not connector._aborted and not connector._notes


# --- replicas --------------------------------------------------------------------------------------


@contextmanager
def running(cfg):
    """Replicas started for `cfg`, stopped by pid in the end whatever happened."""
    runtime = start_replicas(cfg)
    pids = [r.pid for r in runtime.replicas]
    try:
        yield runtime
    finally:
        runtime.close()
        gone, alive = psutil.wait_procs([p for p in map(_process, pids) if p], timeout=15)
        for process in alive:
            process.kill()
        assert not alive, f"replicas still running after close: {alive}"


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


async def complete(engine, prompt, params=GREEDY):
    tokens, last = [], None
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
        last = out
    return tokens, last


@pytest.fixture(scope="module")
def colocated(model_path):
    """What one engine on its own generates greedily for PROMPTS."""
    from cadenza.engine.async_engine import AsyncEngine
    from cadenza.runtime.build import build_runtime

    runtime = build_runtime(config(model_path))

    async def run():
        async with AsyncEngine.serve(runtime) as engine:
            return [(await complete(engine, p))[0] for p in PROMPTS]

    try:
        return anyio.run(run)
    finally:
        runtime.close()


def block_bytes(model_path) -> int:
    """One block's keys and values across layers, as the replicas' caches hold them."""
    from cadenza.runtime.build import build_runtime

    runtime = build_runtime(config(model_path))
    try:
        return block_nbytes(cache_tensors(runtime.runner.kv_caches))
    finally:
        runtime.close()


CONNECTORS = ["torch_distributed", pytest.param("nixl", marks=pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="the nixl package is not installed"))]  # fmt: skip


@pytest.mark.parametrize("connector", CONNECTORS)
def test_greedy_tokens_equal_one_engine_s_and_a_shared_prefix_is_not_sent_again(model_path, colocated, connector):
    per_block = block_bytes(model_path)

    async def scenario(runtime):
        sent = []
        with anyio.fail_after(SCENARIO_SECONDS):
            async with runtime.serve_engine() as engine:
                got = []
                for prompt in PROMPTS:  # one at a time: each step's bytes are its own
                    before = engine.transfers.bytes_sent, engine.transfers.blocks_sent
                    tokens, last = await complete(engine, prompt)
                    assert last.finish_reason == "length", last.error
                    got.append(tokens)
                    sent.append((engine.transfers.blocks_sent - before[1], engine.transfers.bytes_sent - before[0]))
                assert got == colocated
                # Concurrent requests, shared prefixes among them: the same tokens.
                results = {}

                async def one(i, prompt):
                    results[i] = (await complete(engine, prompt))[0]

                async with anyio.create_task_group() as tg:
                    for i, prompt in enumerate(PROMPTS):
                        tg.start_soon(one, i, [1, 2] + prompt)  # new prompts: transferred again
                stats = engine.transfers
                assert (stats.failed, stats.fallbacks, stats.in_flight) == (0, 0, 0)
                audits = [await engine.audit(i) for i in (0, 1)]
        return sent, results, audits

    with running(disaggregated(model_path, connector)) as runtime:
        sent, results, audits = anyio.run(scenario, runtime)
    print(f"{connector}: blocks and bytes sent per prompt: {sent}")
    # PROMPT: its 3 blocks. SHARED: only the 4th (the decode replica answered it had the first 3).
    # Then 3 of its own, nothing for a prompt of no full block, nothing for PROMPT again.
    assert sent == [(3, 3 * per_block), (1, per_block), (3, 3 * per_block), (0, 0), (0, 0)]
    for audit in audits:  # every hold let go, every block free, evictable or referenced once
        assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit
    from cadenza.engine.async_engine import AsyncEngine
    from cadenza.runtime.build import build_runtime

    alone = build_runtime(config(model_path))

    async def reference():
        async with AsyncEngine.serve(alone) as engine:
            return {i: (await complete(engine, [1, 2] + p))[0] for i, p in enumerate(PROMPTS)}

    try:
        assert results == anyio.run(reference)
    finally:
        alone.close()


def test_under_ray_the_replicas_meet_in_the_server_s_store_and_give_one_engine_s_tokens(model_path, colocated):
    """`launcher: ray` on a local Ray instance cadenza starts: the connectors join through the store
    this process hosts, blocks move, the tokens are one engine's, and no replica is restarted."""
    ray = pytest.importorskip("ray")
    saved = os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = disaggregated(model_path, **{"parallel.launcher": "ray"})

    async def scenario(runtime):
        with anyio.fail_after(SCENARIO_SECONDS):
            async with runtime.serve_engine() as engine:
                got = [(await complete(engine, prompt))[0] for prompt in PROMPTS]
                audits = [await engine.audit(i) for i in (0, 1)]
                return got, engine.transfers.blocks_sent, audits

    runtime = None
    try:
        runtime = start_replicas(cfg)
        assert [r.max_restarts for r in runtime.replicas] == [0, 0]
        got, blocks_sent, audits = anyio.run(scenario, runtime)
    finally:
        if runtime is not None:
            runtime.close()
        if ray.is_initialized():
            ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        _, alive = psutil.wait_procs(started, timeout=15)
        for process in alive:
            process.kill()
    assert got == colocated and blocks_sent == 3 + 1 + 3
    for audit in audits:
        assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit


def killed_mid_transfer(model_path, monkeypatch, victim: int, connector: str = "slow_send_test") -> tuple[list, dict, str]:
    """Kill replica `victim` (0 prefill, 1 decode) while a transfer waits in its send (the test
    connectors sleep 4 s first), beside a request already decoding on the decode replica.
    Returns each request's last output, the survivor's audit once it let go, and the engine's
    unhealthy reason."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    cfg = disaggregated(model_path, connector, plugins=["disagg_test_plugins"],
                        plugin_options={connector: {"send_delay": 4.0}})  # fmt: skip

    async def scenario(runtime):
        outcomes = {}
        with anyio.fail_after(SCENARIO_SECONDS):
            async with runtime.serve_engine() as engine:
                decoding = anyio.Event()

                async def long_decode():  # a prompt of no full block: straight to the decode replica
                    async for out in engine.generate([7, 8, 9], SamplingParams(max_tokens=100_000, ignore_eos=True)):
                        decoding.set()
                        outcomes["decoding"] = out

                async def transferred():
                    outcomes["transferred"] = (await complete(engine, PROMPT))[1]

                async with anyio.create_task_group() as tg:
                    tg.start_soon(long_decode)
                    await decoding.wait()
                    tg.start_soon(transferred)
                    while not engine.transfers.in_flight:
                        await anyio.sleep(0.01)
                    os.kill(runtime.replicas[victim].pid, signal.SIGKILL)
                    with anyio.fail_after(15):  # the lost requests end well before the send's delay elapses twice
                        while len(outcomes) < 2 or any(not o.finished for o in outcomes.values()):
                            await anyio.sleep(0.02)
                    if victim == 0:
                        tg.cancel_scope.cancel()  # the decode replica lives on: stop its long request
                survivor = 1 - victim
                with anyio.fail_after(15):  # the survivor's half ends (the prefill side's after its delay)
                    while (audit := await engine.audit(survivor))["holding"] or audit["used"]:
                        await anyio.sleep(0.1)
                assert engine.transfers.failed == 1 and not engine.healthy
                return outcomes, audit, engine.unhealthy_reason

    with running(cfg) as runtime:
        return anyio.run(scenario, runtime)


def test_a_decode_replica_that_dies_mid_transfer_fails_its_requests_and_the_prefill_side_lets_go(model_path, monkeypatch):
    outcomes, audit, reason = killed_mid_transfer(model_path, monkeypatch, victim=1)
    for out in outcomes.values():  # the transfer's request and the one decoding there: typed errors
        assert (out.finish_reason, out.error_code) == ("error", "engine_failed"), out
    assert "replica 1" in reason
    assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit


def test_a_prefill_replica_that_dies_mid_transfer_fails_its_request_and_the_decode_side_lets_go(model_path, monkeypatch):
    outcomes, audit, reason = killed_mid_transfer(model_path, monkeypatch, victim=0)
    out = outcomes["transferred"]
    assert (out.finish_reason, out.error_code) == ("error", "engine_failed"), out
    assert "replica 0" in reason
    assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit


def test_a_receive_that_waits_on_a_dead_sender_is_aborted_not_timed_out(model_path, monkeypatch):
    """nixl's receive waits for a notification a dead sender never sends: the front-end, which sees
    the prefill replica die, aborts it, so the decode side lets go within seconds, not at the
    60 s timeout (the scenario's 15 s bound fails without the abort)."""
    outcomes, audit, reason = killed_mid_transfer(model_path, monkeypatch, victim=0, connector="deaf_receive_test")
    assert (outcomes["transferred"].finish_reason, outcomes["transferred"].error_code) == ("error", "engine_failed")
    assert "replica 0" in reason
    assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit


def test_a_transfer_that_times_out_between_live_replicas_falls_back_with_the_same_tokens(model_path, colocated, monkeypatch):
    """The prefill side sends 3 s late, the decode side waits 2 s: both live, the transfer fails,
    the decode replica computes the prompt itself, and that pair is not used again."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    cfg = disaggregated(model_path, "slow_send_test", plugins=["disagg_test_plugins"],
                        plugin_options={"slow_send_test": {"send_delay": 3.0}}, **{"parallel.timeout_seconds": 2})  # fmt: skip

    async def scenario(runtime):
        with anyio.fail_after(SCENARIO_SECONDS):
            async with runtime.serve_engine() as engine:
                first = await complete(engine, PROMPT)
                stats = engine.transfers
                assert (stats.fallbacks, stats.broken_pairs, stats.transfers, stats.failed) == (1, 1, 0, 0)
                second = await complete(engine, SHARED)  # no prefill, no transfer: the decode replica alone
                assert (stats.requests, stats.fallbacks, stats.transfers) == (2, 1, 0) and engine.healthy
                with anyio.fail_after(15):  # the prefill side's late send has failed and let go by now
                    while (await engine.audit(0))["holding"]:
                        await anyio.sleep(0.1)
                return first, second, [await engine.audit(i) for i in (0, 1)]

    with running(cfg) as runtime:
        (tokens, last), (shared, _), audits = anyio.run(scenario, runtime)
    assert last.finish_reason == "length" and [tokens, shared] == colocated[:2]
    for audit in audits:
        assert audit["problem"] is None and audit["holding"] == 0 and audit["used"] == 0, audit


# --- the bench's arithmetic (bench/serving/disagg_bench.py; its check run is in benchmarks/README.md) --


def test_the_bench_counts_each_token_of_a_delta_and_only_inside_the_window():
    from cadenza.bench.serving.disagg_bench import TimedRecord, inter_token_latencies, make_disagg_workload

    record = TimedRecord(0, 4, 100)
    for now, count in ((1.0, 1), (1.1, 1), (1.5, 2), (3.0, 1)):
        record.on_tokens(now, count)
    assert record.first_token_at == 1.0 and record.num_streamed_tokens == 5
    assert inter_token_latencies([record], 1.05, 2.0) == pytest.approx([0.1, 0.2, 0.2])
    workload = make_disagg_workload(2, 8, 50, 3, 64, 4, 0.5, seed=1, vocab_size=300)
    assert [len(p) for p in workload.decode_prompts] == [8, 8] and [len(p) for p in workload.long_prompts] == [64] * 3
    assert workload.offsets[0] == 0 and workload.offsets == sorted(workload.offsets)
    assert make_disagg_workload(2, 8, 50, 3, 64, 4, 0.5, seed=1, vocab_size=300) == workload  # seeded
    with pytest.raises(ValueError, match="--long-prompt-len must be at least 1"):
        make_disagg_workload(2, 8, 50, 3, 0, 4, 0.5)
