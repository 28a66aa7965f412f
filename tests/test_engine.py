"""The actor engine on a tiny random model (fp32): batching, prefix sharing, preemption, abort,
failing plugins and chunked prefill, with the cache's invariants checked after every test."""

import random

import anyio
import pytest

from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.plugins.hookspecs import hookimpl
from cadenza.runtime.build import build_runtime
from cadenza.samplers.base import LogitsProcessor
from cadenza.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


def make_runtime(path, extra_plugins=(), **overrides):
    settings = {"model.path": str(path), "model.dtype": "float32", "cache.block_size": 8, "cache.num_blocks": 512}
    settings.update(overrides)
    return build_runtime(load_config(None, overrides=settings, env={}), extra_plugins=extra_plugins)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def collect(engine, prompt, params, **kw):
    text, tokens, outputs = [], [], []
    async for out in engine.generate(prompt, params, **kw):
        outputs.append(out)
        text.append(out.text)
        tokens.extend(out.token_ids)
    assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished, "finishes exactly once, last"
    return "".join(text), tokens, outputs[-1]


async def run_all(engine, prompts, params):
    results = [None] * len(prompts)

    async def one(i):
        results[i] = await collect(engine, prompts[i], params[i] if isinstance(params, list) else params)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


async def assert_no_block_leaked(engine):
    await engine.settle()
    engine.cache_core.check_invariants()
    assert engine.cache_core.num_available == engine.cache_core.num_blocks
    assert not engine.scheduler_core.requests


def random_prompts(n, seed, low=1, high=80):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_64_concurrent_requests_match_each_alone(model_path, async_scheduling):
    rng = random.Random(7)
    prompts = random_prompts(64, seed=1)
    params = [greedy(rng.randint(1, 40)) for _ in prompts]
    runtime = make_runtime(
        model_path,
        **{
            "scheduler.max_num_seqs": 64,
            "scheduler.max_num_batched_tokens": 256,
            "scheduler.chunk_size": 64,
            "scheduler.async_scheduling": async_scheduling,
        },
    )
    async with AsyncEngine.serve(runtime) as engine:
        together = await run_all(engine, prompts, params)
        alone = [await collect(engine, p, sp) for p, sp in zip(prompts, params)]
        assert engine.metrics.num_steps > 0
        for (_, got, last), (_, expected, _), sp in zip(together, alone, params):
            assert got == expected
            assert len(got) == sp.max_tokens and last.finish_reason == "length"
        assert engine.metrics.requests_finished == 128
        # With async scheduling the next step is already queued when one finishes: they overlap.
        assert (engine.metrics.steps_ready_on_finish > 0) == async_scheduling
        await assert_no_block_leaked(engine)


async def test_shared_system_prompt_is_computed_once(model_path):
    system = random_prompts(1, seed=2, low=200, high=200)[0]
    suffixes = random_prompts(8, seed=3, low=3, high=12)
    prompts = [system + s for s in suffixes]

    async def run(caching):
        runtime = make_runtime(model_path, **{"cache.enable_prefix_caching": caching})
        async with AsyncEngine.serve(runtime) as engine:
            first = await collect(engine, prompts[0], greedy(8))
            rest = await run_all(engine, prompts[1:], greedy(8))
            computed = engine.metrics.prefill_tokens_computed
            await assert_no_block_leaked(engine)
            return [first] + rest, computed

    cached, computed_cached = await run(True)
    uncached, computed_uncached = await run(False)
    assert [t for _, t, _ in cached] == [t for _, t, _ in uncached]
    assert computed_uncached == sum(map(len, prompts))
    # The first request computes the system prompt; the other 7 reuse its 25 full blocks (200 tokens).
    assert computed_cached == computed_uncached - 7 * 200
    assert all(last.num_cached_tokens == 200 for _, _, last in cached[1:])
    assert cached[0][2].num_cached_tokens == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_small_cache_preempts_and_every_request_finishes_the_same(model_path, async_scheduling):
    prompts = random_prompts(12, seed=4, low=10, high=30)
    params = greedy(40)
    async with AsyncEngine.serve(make_runtime(model_path)) as engine:
        roomy = await run_all(engine, prompts, params)
    # 12 sequences of up to 70 tokens need ~100 blocks of 8; 24 blocks force preemption.
    tight_runtime = make_runtime(
        model_path,
        **{"cache.num_blocks": 24, "cache.enable_prefix_caching": False, "scheduler.async_scheduling": async_scheduling},
    )
    async with AsyncEngine.serve(tight_runtime) as engine:
        tight = await run_all(engine, prompts, params)
        assert engine.metrics.num_preemptions > 0
        await assert_no_block_leaked(engine)
    assert [t for _, t, _ in tight] == [t for _, t, _ in roomy]


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_abort_mid_stream_frees_blocks_at_once(model_path, async_scheduling):
    runtime = make_runtime(
        model_path, **{"cache.enable_prefix_caching": False, "scheduler.async_scheduling": async_scheduling}
    )
    async with AsyncEngine.serve(runtime) as engine:
        seen = 0
        last = None
        async for out in engine.generate(random_prompts(1, seed=5, low=40, high=40)[0], greedy(500), request_id="victim"):
            seen += len(out.token_ids)
            last = out
            if seen >= 3 and not out.finished:
                assert engine.cache_core.num_used > 0
                await engine.abort("victim")
        assert last.finish_reason == "abort"
        assert 3 <= last.num_output_tokens < 500
        await assert_no_block_leaked(engine)
        assert engine.metrics.requests_aborted == 1


async def test_client_that_stops_reading_aborts_its_request(model_path):
    async with AsyncEngine.serve(make_runtime(model_path)) as engine:
        async for out in engine.generate([5, 6, 7], greedy(500)):
            if out.num_output_tokens >= 2:
                break  # the client vanished
        with anyio.fail_after(10):
            while engine.scheduler_core.requests or engine.num_active_requests:
                await anyio.sleep(0.01)
        await assert_no_block_leaked(engine)
        # Others still served afterwards.
        _, tokens, _ = await collect(engine, [5, 6, 7], greedy(4))
        assert len(tokens) == 4


class ExplodingProcessor(LogitsProcessor):
    """Raises for the rows whose requests ask for it via `extra`."""

    name = "explode"

    def is_active(self, batch):
        return any(p.extra.get("explode") for p in batch.params)

    def rows_using(self, batch):
        return [i for i, p in enumerate(batch.params) if p.extra.get("explode")]

    def apply(self, logits, batch):
        raise RuntimeError("boom")


class ExplodingPlugin:
    @hookimpl
    def register_samplers(self, register):
        register("explode", ExplodingProcessor)


async def test_raising_sampler_plugin_fails_only_its_requests(model_path):
    processors = ["explode", "min_tokens", "logit_bias", "penalties", "temperature", "min_p", "top_k_top_p"]
    runtime = make_runtime(model_path, extra_plugins=[ExplodingPlugin()], **{"sampling.logits_processors": processors})
    prompts = random_prompts(6, seed=6)
    params = [greedy(10, extra={"explode": True}) if i % 3 == 0 else greedy(10) for i in range(6)]
    async with AsyncEngine.serve(make_runtime(model_path)) as engine:
        reference = await run_all(engine, prompts, greedy(10))
    async with AsyncEngine.serve(runtime) as engine:
        results = await run_all(engine, prompts, params)
        await assert_no_block_leaked(engine)
        assert engine.healthy
    for i, ((_, tokens, last), (_, expected, _)) in enumerate(zip(results, reference)):
        if i % 3 == 0:
            assert last.finish_reason == "error" and "explode" in last.error and "boom" in last.error
        else:
            assert last.finish_reason == "length" and tokens == expected


async def test_long_prompt_chunks_while_sixteen_requests_decode(model_path):
    runtime = make_runtime(
        model_path, **{"scheduler.max_num_batched_tokens": 48, "scheduler.chunk_size": 32, "scheduler.max_num_seqs": 32}
    )
    steps: list[list[tuple[str, int]]] = []
    execute = runtime.runner.execute

    def logging_execute(chunks, **kw):
        steps.append([(c.request_id, len(c.token_ids)) for c in chunks])
        return execute(chunks, **kw)

    runtime.runner.execute = logging_execute
    long_prompt = random_prompts(1, seed=8, low=200, high=200)[0]
    async with AsyncEngine.serve(runtime) as engine:
        decode_started = anyio.Event()
        results = {}

        async def decoder(i):
            async for out in engine.generate([10 + i, 11, 12], greedy(30), request_id=f"d{i}"):
                if out.num_output_tokens >= 2 and i == 15:
                    decode_started.set()
            results[i] = True

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(decoder, i)
            await decode_started.wait()
            _, tokens, _ = await collect(engine, long_prompt, greedy(5), request_id="long")
        assert len(results) == 16 and len(tokens) == 5
        await assert_no_block_leaked(engine)
    with_long = [i for i, step in enumerate(steps) if any(rid == "long" for rid, _ in step)]
    chunk_sizes = [n for i in with_long for rid, n in steps[i] if rid == "long"]
    assert sum(chunk_sizes[:-4]) + sum(chunk_sizes[-4:]) >= 200 and max(chunk_sizes) <= 32
    prefill_steps = [i for i in with_long if dict(steps[i])["long"] > 1]
    assert len(prefill_steps) >= 200 // 32  # the prompt really was split
    for i in prefill_steps:
        decodes = [rid for rid, n in steps[i] if rid.startswith("d") and n == 1]
        assert len(decodes) == 16, f"step {i}: the long prompt's chunk ran without the 16 decodes: {steps[i]}"


async def test_rejected_requests_get_a_clear_error(model_path):
    async with AsyncEngine.serve(make_runtime(model_path, **{"model.max_model_len": 64})) as engine:
        _, _, last = await collect(engine, [5] * 64, greedy(4))
        assert last.finish_reason == "error" and last.error_code == "prompt_too_long" and "64" in last.error
        _, _, last = await collect(engine, "", greedy(4))
        assert last.error_code == "invalid_prompt"
        _, _, last = await collect(engine, [{"role": "user"}], greedy(4))
        assert last.error_code == "invalid_prompt"
        _, tokens, last = await collect(engine, [5] * 10, greedy(100))
        assert last.finish_reason == "length" and len(tokens) == 54  # capped by max_model_len
        await assert_no_block_leaked(engine)


async def test_queue_limit_rejects_with_queue_full(model_path):
    runtime = make_runtime(model_path, **{"scheduler.max_waiting": 2, "scheduler.max_num_seqs": 1})
    async with AsyncEngine.serve(runtime) as engine:
        results = await run_all(engine, random_prompts(8, seed=9), greedy(20))
        codes = [last.error_code for _, _, last in results]
        assert "queue_full" in codes and codes.count(None) >= 2
        assert all(len(tokens) == 20 for _, tokens, last in results if last.error_code is None)
        assert next(last.error for _, _, last in results if last.error_code == "queue_full").endswith("try again later")
        await assert_no_block_leaked(engine)


async def test_model_failure_fails_the_step_and_engine_carries_on(model_path):
    runtime = make_runtime(model_path)
    execute = runtime.runner.execute
    calls = {"n": 0}

    def flaky(chunks, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return execute(chunks, **kw)

    runtime.runner.execute = flaky
    async with AsyncEngine.serve(runtime) as engine:
        _, _, last = await collect(engine, [5, 6, 7], greedy(10))
        assert last.finish_reason == "error" and "device lost" in last.error
        _, tokens, last = await collect(engine, [5, 6, 7], greedy(10))
        assert last.finish_reason == "length" and len(tokens) == 10
        assert engine.healthy
        await assert_no_block_leaked(engine)


async def test_stop_string_finishes_and_frees(model_path):
    async with AsyncEngine.serve(make_runtime(model_path)) as engine:
        full, _, _ = await collect(engine, "abc", greedy(24))
        stop = full[3:5]
        text, _, last = await collect(engine, "abc", greedy(24, stop=[stop]))
        assert last.finish_reason == "stop" and text == full[: full.index(stop)]
        with anyio.fail_after(10):
            while engine.scheduler_core.requests:
                await anyio.sleep(0.01)
        await assert_no_block_leaked(engine)


async def test_shutdown_waits_then_ends_the_rest(model_path):
    outputs = []
    async with AsyncEngine.serve(make_runtime(model_path), shutdown_grace=0.2) as engine:

        async def long_request():
            async for out in engine.generate([5, 6, 7], greedy(100000 // 1000 * 4)):
                outputs.append(out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await anyio.sleep(0)
            await engine.shutdown(0.05)
    assert outputs and outputs[-1].finish_reason == "error" and outputs[-1].error_code == "server_shutdown"


async def test_slow_reader_is_cut_off_and_its_request_stops(model_path):
    async with AsyncEngine.serve(make_runtime(model_path), max_pending_tokens=8) as engine:
        stream = engine.generate([5, 6, 7], greedy(400), request_id="slow")
        first = await stream.__anext__()
        # Stop reading: more than 8 tokens pile up, the stream is cut off, the request aborted.
        with anyio.fail_after(20):
            while "slow" in engine.scheduler_core.requests or first.finished:
                await anyio.sleep(0.01)
        last = first
        async for last in stream:
            pass
        assert last.finish_reason == "error" and last.error_code == "slow_reader"
        assert engine.metrics.generation_tokens < 400
        await assert_no_block_leaked(engine)
        _, tokens, _ = await collect(engine, [5, 6, 7], greedy(4))  # others carry on
        assert len(tokens) == 4


async def test_random_load_tight_cache_shared_prefixes_and_aborts(model_path):
    """Everything at once: what survives gives the tokens a roomy, synchronous engine gives."""
    rng = random.Random(11)
    prefixes = random_prompts(3, seed=12, low=20, high=40)
    prompts = [rng.choice(prefixes) + p for p in random_prompts(40, seed=13, low=1, high=20)]
    params = [greedy(rng.randint(1, 30)) for _ in prompts]
    doomed = set(rng.sample(range(len(prompts)), 8))

    roomy = make_runtime(model_path, **{"scheduler.async_scheduling": False, "cache.enable_prefix_caching": False})
    async with AsyncEngine.serve(roomy) as engine:
        expected = await run_all(engine, prompts, params)

    tight = make_runtime(
        model_path, **{"cache.num_blocks": 40, "scheduler.max_num_batched_tokens": 64, "scheduler.chunk_size": 16}
    )
    results: dict[int, tuple] = {}
    async with AsyncEngine.serve(tight) as engine:

        async def one(i):
            if i in doomed:
                async for out in engine.generate(prompts[i], params[i], request_id=f"r{i}"):
                    if out.num_output_tokens >= 1 and not out.finished:
                        await engine.abort(f"r{i}")
                    last = out
                results[i] = ("aborted-or-done", last)
            else:
                results[i] = await collect(engine, prompts[i], params[i], request_id=f"r{i}")

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        await assert_no_block_leaked(engine)
        assert engine.metrics.num_preemptions > 0
        assert engine.cache_core.prefix_hits > 0
    for i, result in results.items():
        if i in doomed:
            assert result[1].finish_reason in ("abort", "length")
        else:
            assert result[1] == expected[i][1], f"request {i}"
