"""The plugin contracts through the engine, on a tiny random model (fp32): per-request params on
and off in one batch, requests joining and leaving, options from the config, failures that take
down only their own requests."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
import torch
from plugin_contracts import covers
from pydantic import BaseModel, ConfigDict

from cadenza.attention_backends.base import BackendUnavailableError
from cadenza.attention_backends.eager import EagerBackend
from cadenza.attention_backends.triton_paged import TritonPagedBackend
from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.eviction import LRUPolicy
from cadenza.runtime.build import build_runtime
from cadenza.samplers.base import LogitsProcessor
from cadenza.samplers.default_sampler import DefaultSampler
from cadenza.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
DEFAULT_PROCESSORS = ["min_tokens", "logit_bias", "penalties", "temperature", "min_p", "top_k_top_p"]


class Tag(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str = "on"


class Level(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class SpyProcessor(LogitsProcessor):
    """Opt-in, changes nothing; records its hooks (from the runner's thread) and deployment options."""

    name = "spy_test"
    params_model = Tag
    options_model = Level

    def __init__(self, context, options=None):
        super().__init__(context, options)
        self.added, self.finished, self.applied = [], [], 0
        self.all_left = threading.Event()

    def on_request_added(self, request_id, params):
        self.added.append((request_id, params.label))
        super().on_request_added(request_id, params)

    def on_request_finished(self, request_id):
        self.finished.append(request_id)
        super().on_request_finished(request_id)
        if len(self.finished) == len(self.added):
            self.all_left.set()

    def apply(self, logits, batch):
        self.applied += 1
        return logits


class FailingProcessor(LogitsProcessor):
    """Per request, fails the way `extra["failing_test"]["how"]` says."""

    name = "failing_test"

    class Params(BaseModel):
        how: str

    params_model = Params

    def on_request_added(self, request_id, params):
        if params.how == "join":
            raise ValueError("refuses to join")
        super().on_request_added(request_id, params)

    def rows_using(self, batch):
        # Precise blame: only the rows that make it raise, not every row that switched it on.
        return [i for i, p in enumerate(self.params_for(batch)) if p is not None and p.how == "raise"]

    def apply(self, logits, batch):
        if self.rows_using(batch):
            raise RuntimeError("apply blew up")
        return logits


class WrongShapeProcessor(LogitsProcessor):
    """Returns logits one token short whenever a row switched it on."""

    name = "shape_test"
    params_model = Tag

    def apply(self, logits, batch):
        return logits[:, :-1]


class ForceSampler(DefaultSampler):
    """Rows with params get `token` every step; the others are sampled the default way."""

    name = "force_test"

    class Params(BaseModel):
        token: int

    params_model = Params

    def sample(self, logits, raw_logits, batch):
        out = super().sample(logits, raw_logits, batch)
        for row, params in enumerate(self.params_for(batch)):
            if params is not None:
                out.token_ids[row] = params.token
        return out


class CountingBackend(EagerBackend):
    name = "counting_test"
    options_model = Level
    supports_attention_sinks = False  # its forward takes no `sinks`

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = self.layers = 0
        self.kernels_given: list = []

    def use_cpu_kernels(self, kernels):
        self.kernels_given.append(kernels)

    def begin_step(self, meta):
        self.steps += 1
        super().begin_step(meta)

    def forward(self, q, k, v, kv_cache, meta):
        self.layers += 1
        return super().forward(q, k, v, kv_cache, meta)


class SinkBackend(CountingBackend):
    """Takes gpt-oss's sinks, recording each layer's."""

    name = "sinks_test"
    supports_attention_sinks = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sinks_seen: list = []

    def forward(self, q, k, v, kv_cache, meta, sinks=None):
        self.layers += 1
        self.sinks_seen.append(sinks)
        return EagerBackend.forward(self, q, k, v, kv_cache, meta, sinks=sinks)


class UnavailableBackend(EagerBackend):
    name = "unavailable_test"

    @classmethod
    def check_available(cls, device):
        raise BackendUnavailableError("unavailable_test needs a flux capacitor")


class FloatCacheOnlyBackend(CountingBackend):
    name = "float_cache_only_test"
    supports_int8_kv_cache = False


class PaddingBackend(TritonPagedBackend):
    """A backend that pads decodes (the built-in triton's CPU path), counting the rows it sees."""

    name = "padding_test"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.decode_rows = []

    def forward(self, q, k, v, kv_cache, meta):
        if meta.is_decode_only:
            self.decode_rows.append(q.shape[0])
        return super().forward(q, k, v, kv_cache, meta)


class OptionPolicy(LRUPolicy):
    name = "option_policy_test"
    options_model = Level

    def __init__(self, options=None):
        super().__init__()
        self.options = options


class TestPlugin:
    @hookimpl
    def register_samplers(self, register):
        for cls in (SpyProcessor, FailingProcessor, WrongShapeProcessor, ForceSampler):
            register(cls.name, cls)

    @hookimpl
    def register_attention_backends(self, register):
        register(CountingBackend.name, CountingBackend)
        register(UnavailableBackend.name, UnavailableBackend)
        register(FloatCacheOnlyBackend.name, FloatCacheOnlyBackend)
        register(PaddingBackend.name, PaddingBackend)
        register(SinkBackend.name, SinkBackend)

    @hookimpl
    def register_eviction_policies(self, register):
        register(OptionPolicy.name, OptionPolicy)


def make_runtime(path, processors=("spy_test",), **overrides):
    settings = {
        "model.path": str(path), "model.dtype": "float32", "cache.block_size": 8, "cache.num_blocks": 256,
        "sampling.logits_processors": [*processors, *DEFAULT_PROCESSORS],
    }  # fmt: skip
    settings.update(overrides)
    return build_runtime(load_config(None, overrides=settings, env={}), extra_plugins=[TestPlugin()])


def greedy(n=6, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def collect(engine, prompt, params, stop_after=None, request_id=None):
    tokens, last = [], None
    async for out in engine.generate(prompt, params, request_id=request_id):
        tokens.extend(out.token_ids)
        last = out
        if stop_after is not None and len(tokens) >= stop_after:
            break  # leaving the loop aborts the request
    return tokens, last


async def run_all(engine, jobs):
    results = [None] * len(jobs)

    async def one(i):
        results[i] = await collect(engine, *jobs[i], request_id=f"job{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    return results


@covers(
    "SamplingComponent.__init__", "SamplingComponent.options_model", "EvictionPolicy.__init__",
    "EvictionPolicy.options_model", "AttentionBackend.__init__", "AttentionBackend.options_model",
    "register_samplers", "register_attention_backends", "register_eviction_policies",
)  # fmt: skip
def test_plugin_options_from_the_config_reach_every_kind_of_plugin(model_path):
    options = {"spy_test": {"level": 2}, "counting_test": {"level": 3}, "option_policy_test": {"level": 4}}
    runtime = make_runtime(
        model_path, attention_backend="counting_test", **{"cache.eviction_policy": "option_policy_test", "plugin_options": options}
    )
    spy = runtime.runner.sampling_pipeline.processors[0]
    assert spy.context.vocab_size == 320 and spy.context.tokenizer is runtime.tokenizer
    assert spy.options == Level(level=2) and spy.request_params == {}
    assert runtime.runner.backend.options == Level(level=3)
    assert runtime.make_eviction_policy().options == Level(level=4)
    defaults = make_runtime(model_path)  # no plugin_options entry: the options model's defaults
    assert defaults.runner.sampling_pipeline.processors[0].options == Level(level=1)


@covers("EvictionPolicy.tier")
def test_each_tier_gets_its_own_policy_told_where_it_runs(model_path, tmp_path):
    """The KV budget, the host tier and the disk tier each build their own instance of the policy
    their key names, with the plugin's options, and `tier` says which cache it orders."""
    from cadenza.runtime.tiers import build_tiers

    runtime = make_runtime(model_path, **{
        "cache.host_eviction_policy": "fifo", "cache.disk_eviction_policy": "option_policy_test",
        "cache.host_size": "1MiB", "cache.disk_path": str(tmp_path), "plugin_options": {"option_policy_test": {"level": 5}},
    })  # fmt: skip
    budget, host, disk = (runtime.make_eviction_policy(tier) for tier in (None, "host", "disk"))
    assert (budget.name, budget.tier, host.name, host.tier) == ("lru", None, "fifo", "host")
    assert (disk.name, disk.tier, disk.options) == ("option_policy_test", "disk", Level(level=5))
    tiers = build_tiers(runtime)
    assert [(t.name, t.order.policy.name, t.order.policy.tier) for t in tiers] == [
        ("host", "fifo", "host"), ("disk", "option_policy_test", "disk")]
    assert tiers[1].order.policy is not disk  # one instance per tier


@covers("AttentionBackend.begin_step", "AttentionBackend.forward", "AttentionBackend.name", "AttentionBackend.check_available")
async def test_attention_backend_plugin_runs_every_step_and_layer(model_path):
    runtime = make_runtime(model_path, attention_backend="counting_test")
    backend = runtime.runner.backend
    async with AsyncEngine.serve(runtime) as engine:
        tokens, _ = await collect(engine, [5, 6, 7], greedy(6))
    async with AsyncEngine.serve(make_runtime(model_path, attention_backend="eager")) as engine:
        expected, _ = await collect(engine, [5, 6, 7], greedy(6))
    assert tokens == expected and backend.name == "counting_test"
    assert backend.steps >= 6 and backend.layers == 2 * backend.steps  # the tiny model has 2 layers
    with pytest.raises(BackendUnavailableError, match="flux capacitor"):
        make_runtime(model_path, attention_backend="unavailable_test")


@covers("AttentionBackend.supports_int8_kv_cache")
async def test_an_int8_kv_cache_goes_only_to_a_backend_that_reads_it(model_path):
    from cadenza.config import ConfigError
    from cadenza.kernels.kv_layout import Int8KVCache

    runtime = make_runtime(model_path, attention_backend="counting_test", **{"cache.dtype": "int8"})
    assert all(isinstance(cache, Int8KVCache) for cache in runtime.runner.kv_caches)
    async with AsyncEngine.serve(runtime) as engine:
        tokens, _ = await collect(engine, [5, 6, 7], greedy(6))
    assert len(tokens) == 6 and runtime.runner.backend.layers >= 6
    with pytest.raises(ConfigError, match="float_cache_only_test' cannot read an int8 KV cache"):
        make_runtime(model_path, attention_backend="float_cache_only_test", **{"cache.dtype": "int8"})
    make_runtime(model_path, attention_backend="float_cache_only_test")  # a float cache is fine


@covers("AttentionBackend.supports_attention_sinks")
async def test_a_model_with_sinks_goes_only_to_a_backend_that_takes_them(tmp_path):
    """gpt-oss's sinks reach a backend that sets `supports_attention_sinks`, one float32 logit per
    query head each layer, and it computes what the eager backend does; a backend that does not
    set it is refused at start-up, naming it."""
    from cadenza.config import ConfigError
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "gpt_oss", "gpt_oss")
    runtime = make_runtime(path, attention_backend="sinks_test")
    async with AsyncEngine.serve(runtime) as engine:
        tokens, _ = await collect(engine, [5, 6, 7], greedy(6))
    async with AsyncEngine.serve(make_runtime(path, attention_backend="eager")) as engine:
        expected, _ = await collect(engine, [5, 6, 7], greedy(6))
    assert tokens == expected
    seen = runtime.runner.backend.sinks_seen
    assert seen and all(s is not None and s.dtype == torch.float32 and s.shape == (4,) for s in seen)
    with pytest.raises(ConfigError, match="'counting_test' has no attention sinks, which gpt_oss needs"):
        make_runtime(path, attention_backend="counting_test")


@covers("AttentionBackend.supports_cuda_graphs")
async def test_padded_decode_steps_go_only_to_a_backend_that_supports_them(model_path):
    from cadenza.config import ConfigError

    runtime = make_runtime(model_path, attention_backend="padding_test", **{"model.cuda_graphs": "on", "scheduler.max_num_seqs": 4})
    async with AsyncEngine.serve(runtime) as engine:
        results = await asyncio.gather(*(collect(engine, [5, 6, 7 + i], greedy(4 + i)) for i in range(3)))
    async with AsyncEngine.serve(make_runtime(model_path, attention_backend="eager")) as engine:
        expected = await asyncio.gather(*(collect(engine, [5, 6, 7 + i], greedy(4 + i)) for i in range(3)))
    assert [r[0] for r in results] == [r[0] for r in expected]
    rows = runtime.runner.backend.decode_rows
    assert rows and set(rows) <= {1, 2, 4} and 4 in rows  # three decoding requests pad to the bucket of 4
    with pytest.raises(ConfigError, match="'counting_test' cannot pad decode steps"):
        make_runtime(model_path, attention_backend="counting_test", **{"model.cuda_graphs": "on"})
    assert make_runtime(model_path, attention_backend="counting_test").runner.graphs is None  # auto, on the CPU


@covers("AttentionBackend.use_cpu_kernels")
def test_attention_backend_is_offered_the_models_cpu_kernels_once(model_path):
    from cadenza.kernels.cpu.features import cpu_has_avx2_fma

    with_kernels = make_runtime(model_path, attention_backend="counting_test", **{"model.cpu_kernels": "auto"})
    kernels = with_kernels.loaded.model.kernels
    assert with_kernels.runner.backend.kernels_given == [kernels]
    assert (kernels is not None) == cpu_has_avx2_fma()
    without = make_runtime(model_path, attention_backend="counting_test", **{"model.cpu_kernels": "off"})
    assert without.runner.backend.kernels_given == [None] and without.loaded.model.kernels is None


@covers("AttentionBackend.run_decode_stack")
async def test_a_backend_without_a_whole_step_path_gets_every_layer(model_path):
    """The model asks the backend to run a step of few rows in one call (the built-in backend's
    kernel path, tests/test_decode_stack.py); the default says no, and every layer calls forward."""
    runtime = make_runtime(model_path, attention_backend="counting_test", **{"model.quantization": "int8"})
    if runtime.loaded.model.fused_stack is None:
        pytest.skip("the CPU kernels are unavailable here: no layer is fused")
    backend = runtime.runner.backend
    async with AsyncEngine.serve(runtime) as engine:
        tokens, _ = await collect(engine, [5, 6, 7], greedy(6))
    assert len(tokens) == 6 and backend.steps >= 6 and backend.layers == 2 * backend.steps


@covers("Sampler.sample", "SamplingComponent.name")
async def test_sampler_plugin_with_params_on_and_off_in_one_batch(model_path):
    runtime = make_runtime(model_path, processors=(), **{"sampling.sampler": "force_test"})
    async with AsyncEngine.serve(runtime) as engine:
        (reference, _), = await run_all(engine, [([9, 8, 7], greedy())])
        forced, plain = await run_all(engine, [([9, 8, 7], greedy(extra={"force_test": {"token": 42}})), ([9, 8, 7], greedy())])
    assert forced[0] == [42] * 6 and plain[0] == reference  # greedy rows too: the sampler is asked


async def test_requests_leave_the_plugins_when_finished_aborted_or_failed(model_path):
    runtime = make_runtime(model_path, processors=("spy_test", "failing_test"))
    spy = runtime.runner.sampling_pipeline.processors[0]
    async with AsyncEngine.serve(runtime) as engine:
        jobs = [
            ([5, 6, 7], greedy(4, extra={"spy_test": {"label": "finishes"}})),
            ([5, 6, 8], greedy(200, extra={"spy_test": True}), 2),  # aborted after 2 tokens
            ([5, 6, 9], greedy(4, extra={"spy_test": True, "failing_test": {"how": "raise"}})),
            ([5, 6, 9], greedy(4)),  # never switches anything on
        ]
        (done, _), (aborted, _), (_, failed), (plain, _) = await run_all(engine, jobs)
        assert await anyio.to_thread.run_sync(spy.all_left.wait, 30)
        await engine.settle()
    assert len(done) == 4 and len(aborted) >= 2 and failed.finish_reason == "error" and len(plain) == 4
    assert sorted(spy.added) == [("job0", "finishes"), ("job1", "on"), ("job2", "on")]
    assert sorted(spy.finished) == ["job0", "job1", "job2"] and spy.request_params == {}
    assert runtime.runner.sampling_pipeline.num_joined == 0


async def test_a_plugin_switched_off_is_never_called(model_path):
    runtime = make_runtime(model_path)
    spy = runtime.runner.sampling_pipeline.processors[0]
    async with AsyncEngine.serve(runtime) as engine:
        await run_all(engine, [([5 + i, 6], greedy(8)) for i in range(4)])
        assert spy.applied == 0 and spy.added == []
        await run_all(engine, [([5, 6], greedy(8, extra={"spy_test": False}))])
        assert spy.applied == 0 and runtime.runner.sampling_pipeline.num_joined <= 1


async def test_failing_plugins_fail_only_their_own_requests(model_path):
    """Three plugins fail three ways in one step (joining, raising, a wrong shape), plus invalid
    params: each takes down only the requests that switched it on."""
    runtime = make_runtime(model_path, processors=("failing_test", "spy_test", "shape_test"))
    prompts = [[20 + i, 21, 22] for i in range(7)]
    params = [
        greedy(8, extra={"failing_test": {"how": "join"}}),
        greedy(8, extra={"spy_test": True}),
        greedy(8, extra={"shape_test": True}),
        greedy(8),
        greedy(8, extra={"failing_test": {"how": "raise"}}),
        greedy(8, extra={"failing_test": {"how": "fine"}}),
        greedy(8, extra={"failing_test": {}}),  # invalid params: refused, the field named
    ]
    async with AsyncEngine.serve(make_runtime(model_path)) as engine:
        reference = await run_all(engine, [(p, greedy(8)) for p in prompts])
    async with AsyncEngine.serve(runtime) as engine:
        results = await run_all(engine, list(zip(prompts, params)))
        assert engine.healthy
        await engine.settle()
        engine.cache_core.check_invariants()
        assert engine.cache_core.num_available == engine.cache_core.num_blocks
    messages = {
        0: "logits processor 'failing_test' failed in on_request_added: ValueError('refuses to join')",
        2: "logits processor 'shape_test': returned (",
        4: "logits processor 'failing_test' failed: RuntimeError('apply blew up')",
        6: "extra.failing_test.how: Field required",
    }
    for i, (tokens, last) in enumerate(results):
        if i in messages:
            assert last.finish_reason == "error" and messages[i] in last.error, (i, last.error)
        else:
            assert last.finish_reason == "length" and tokens == reference[i][0]
