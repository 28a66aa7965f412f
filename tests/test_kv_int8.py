"""The int8 KV cache (`cache.dtype: int8`, issue 11): the quantized write and read per token and kv
head, attention over it against a float cache (torch backends and the CPU decode kernel), the engine
end to end on it, its capacity for a memory budget, and the default model's perplexity with it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from model_forward import chunk_metadata
from test_attention_backends import BLOCK, DIM, HEADS, KV_HEADS, NUM_BLOCKS, _kernels, dense_reference, make_step
from test_engine import assert_no_block_leaked, greedy, make_runtime, random_prompts, run_all

from cadenza.attention_backends.eager import EagerBackend
from cadenza.attention_backends.torch_sdpa import TorchSDPABackend
from cadenza.config.errors import ConfigError
from cadenza.engine.async_engine import AsyncEngine
from cadenza.kernels.kv_layout import Int8KVCache, quantize_int8, read_kv, write_kv
from cadenza.plugins.hookspecs import hookimpl
from cadenza.runner.kv_cache import allocate_kv_caches, bytes_per_block, size_cache


def empty_int8_cache(num_blocks=NUM_BLOCKS, block=BLOCK, heads=KV_HEADS, dim=DIM) -> Int8KVCache:
    shape = (2, num_blocks, block, heads, dim)
    return Int8KVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:4], dtype=torch.float16))


def quantized_copy(cache: torch.Tensor) -> Int8KVCache:
    """A float cache [2, blocks, block, heads, dim] written slot by slot into an int8 one."""
    _, num_blocks, block, heads, dim = cache.shape
    out = empty_int8_cache(num_blocks, block, heads, dim)
    flat = cache.view(2, -1, heads, dim)
    write_kv(flat[0], flat[1], out, torch.arange(flat.shape[1]))
    return out


def dequantized(cache: Int8KVCache) -> torch.Tensor:
    keys, values = read_kv(cache, torch.arange(cache.scales[0].numel() // cache.scales.shape[-1]), torch.float32)
    return torch.stack([keys, values]).view(cache.data.shape).contiguous()


def rows_of_many_magnitudes(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(tokens, KV_HEADS, 1).uniform_(-3, 3, generator=g)  # each row its own scale
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g) * magnitude
    v = torch.randn(tokens, KV_HEADS, DIM, generator=g) * magnitude.flip(0)
    k[3, 1] = 0.0  # an all-zero row: scale 0, read back as zeros
    return k, v


def test_write_then_read_is_within_half_a_step_per_token_and_head():
    k, v = rows_of_many_magnitudes(40, seed=0)
    cache = empty_int8_cache()
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(1))[:40]
    write_kv(k, v, cache, slots)
    keys, values = read_kv(cache, slots, torch.float32)
    for x, back in ((k, keys), (v, values)):
        step = x.abs().amax(-1) / 127  # [T, KVH]: one scale per token and kv head
        error = (back - x).abs().amax(-1)
        # Half a quantization step, plus float16's rounding of the stored scale (2^-11 relative).
        assert (error <= step * (0.5 + 127 * 2**-11) + 1e-12).all()
    assert (keys[3, 1] == 0).all()


def test_kernel_write_matches_the_torch_write():
    kernels = _kernels()
    if kernels is None:
        pytest.skip("the CPU kernels are unavailable here")
    k, v = rows_of_many_magnitudes(40, seed=2)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(3))[:40]
    by_torch, by_kernel = empty_int8_cache(), empty_int8_cache()
    write_kv(k, v, by_torch, slots)
    kernels.write_kv_int8_(by_kernel.data, by_kernel.scales, k, v, slots)
    assert torch.equal(by_torch.data, by_kernel.data) and torch.equal(by_torch.scales, by_kernel.scales)


# Prefill chunks mixed with decodes, and a decode-only batch (the CPU kernel's case).
STEPS = [([0, 9, 30, 5], [7, 1, 1, 12]), ([13, 4, 40], [1, 1, 1])]


def _backends():
    def build(cls, kernels=None):
        backend = cls(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM**-0.5, block_size=BLOCK)
        backend.use_cpu_kernels(kernels)
        return backend

    backends = [("eager", build(EagerBackend)), ("torch_sdpa", build(TorchSDPABackend))]
    if (kernels := _kernels()) is not None:
        backends.append(("torch_sdpa+kernels", build(TorchSDPABackend, kernels)))
    return backends


@pytest.mark.parametrize("context_lens,query_lens", STEPS)
def test_attention_over_an_int8_cache_matches_a_float_cache(context_lens, query_lens):
    q, k, v, cache, meta, full_keys, full_values = make_step(context_lens, query_lens, seed=5)
    exact = dense_reference(q, meta, full_keys, full_values, None)
    for name, backend in _backends():
        backend.begin_step(meta)
        quantized = quantized_copy(cache)
        out = backend.forward(q, k, v, quantized, meta)
        # Against the de-quantized cache the same backend reads the int8 one exactly (up to float32
        # summation order); against the unquantized keys and values within int8's rounding.
        float_cache = dequantized(quantized)
        rounded_k, rounded_v = (data.float() * scale.float()[..., None] for data, scale in map(quantize_int8, (k, v)))
        backend.begin_step(meta)
        same_inputs = backend.forward(q, rounded_k, rounded_v, float_cache, meta)
        assert torch.allclose(out, same_inputs, atol=1e-5), name
        error = (out - exact).abs().max().item()
        assert error < 0.03, (name, error)  # N(0, 1) keys and values, head_dim 16: about 0.01 seen


@pytest.mark.parametrize("context_lens,query_lens", STEPS)
def test_bfloat16_activations_read_an_int8_cache_like_float32_ones(context_lens, query_lens):
    # The kernels' int8 decode takes any activations (it computes in float32): bf16 too.
    q, k, v, cache, meta, _, _ = make_step(context_lens, query_lens, seed=7)
    for name, backend in _backends():
        backend.begin_step(meta)
        in_float = backend.forward(q, k, v, quantized_copy(cache), meta)
        backend.begin_step(meta)
        in_bf16 = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), quantized_copy(cache), meta)
        assert in_bf16.dtype == torch.bfloat16
        assert (in_bf16.float() - in_float).abs().max().item() < 0.05, name


def test_kernel_decode_reads_int8_in_place_with_a_window():
    kernels = _kernels()
    if kernels is None:
        pytest.skip("the CPU kernels are unavailable here")
    q, k, v, cache, meta, full_keys, full_values = make_step([13, 4, 40], [1, 1, 1], seed=6)
    quantized = quantized_copy(cache)
    write_kv(k, v, quantized, meta.slot_mapping)
    for window in (0, 5):
        args = (meta.block_tables, meta.seq_lens, DIM**-0.5, window)
        out = kernels.paged_decode_attention_int8(q, quantized.data, quantized.scales, *args)
        reference = kernels.paged_decode_attention(q, dequantized(quantized), *args)
        assert torch.allclose(out, reference, atol=1e-5)
        exact = dense_reference(q, meta, full_keys, full_values, window or None)
        assert (out - exact).abs().max().item() < 0.03


def test_same_budget_holds_about_twice_bfloat16_and_four_times_float32():
    # The cache's shape of SmolLM2-135M: a 64-wide head, the narrowest common one, where scales cost the most.
    arch = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    budget = 256 << 20
    blocks = {
        dtype: size_cache(arch, 16, dtype, num_blocks=None, memory_budget=budget, max_num_seqs=1, max_model_len=1).num_blocks
        for dtype in (torch.float32, torch.bfloat16, torch.int8)
    }
    assert blocks[torch.int8] >= 1.9 * blocks[torch.bfloat16]
    assert blocks[torch.int8] >= 3.8 * blocks[torch.float32]
    caches = allocate_kv_caches(arch, 4, 16, torch.int8, torch.device("cpu"))
    used = sum(c.data.nbytes + c.scales.nbytes for c in caches)
    assert used == 4 * bytes_per_block(arch, 16, torch.int8)


def int8_runtime(path, **overrides):
    return make_runtime(path, **{"cache.dtype": "int8", **overrides})


def test_runtime_counts_int8_blocks_for_its_budget(model_path):
    float_runtime = make_runtime(model_path, **{"cache.num_blocks": None, "cache.memory_budget": "4MiB"})
    runtime = int8_runtime(model_path, **{"cache.num_blocks": None, "cache.memory_budget": "4MiB"})
    assert isinstance(runtime.runner.kv_caches[0], Int8KVCache)
    assert runtime.num_blocks >= 3.5 * float_runtime.num_blocks  # float32 model: ~4x


class FloatOnlyBackend(EagerBackend):
    name = "float_only"
    supports_int8_kv_cache = False


class FloatOnlyPlugin:
    @hookimpl
    def register_attention_backends(self, register):
        register(FloatOnlyBackend.name, FloatOnlyBackend)


def test_a_backend_without_int8_support_is_refused(model_path):
    with pytest.raises(ConfigError, match="cache.dtype: attention backend 'float_only' cannot read an int8"):
        make_runtime(model_path, [FloatOnlyPlugin()], **{"cache.dtype": "int8", "attention_backend": "float_only"})


@pytest.mark.anyio
async def test_engine_on_int8_cache_prefix_caching_preemption_and_chunks(model_path):
    system = random_prompts(1, seed=2, low=100, high=100)[0]
    prompts = [system + s for s in random_prompts(6, seed=3, low=3, high=12)] + random_prompts(6, seed=4, low=10, high=30)
    params = greedy(30)
    async with AsyncEngine.serve(int8_runtime(model_path, **{"cache.enable_prefix_caching": False})) as engine:
        roomy = await run_all(engine, prompts, params)
        await assert_no_block_leaked(engine)
    tight = int8_runtime(
        model_path, **{"cache.num_blocks": 40, "scheduler.chunk_size": 16, "scheduler.max_num_batched_tokens": 32}
    )
    async with AsyncEngine.serve(tight) as engine:
        got = await run_all(engine, prompts, params)
        assert engine.metrics.num_preemptions > 0
        assert sum(last.num_cached_tokens for _, _, last in got) > 0  # the shared prefix was reused
        await assert_no_block_leaked(engine)
    # Same int8 rounding either way: a reused or recomputed block holds the same bytes.
    agree = sum(a == b for (_, a, _), (_, b, _) in zip(got, roomy))
    assert agree >= len(prompts) - 2, agree


def test_default_model_perplexity_with_int8_cache_within_one_percent_of_float32():
    from test_quantized_quality import text_ids

    from cadenza.models.loading import load_model

    loaded = load_model(None, dtype=torch.float32, cpu_kernels="auto", quantization="none")
    arch, block_size = loaded.arch, 16
    ids = text_ids(loaded.tokenizer)
    n = len(ids) - 1
    blocks = -(-n // block_size)
    backend = TorchSDPABackend(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                               scale=arch.softmax_scale, block_size=block_size)  # fmt: skip
    backend.use_cpu_kernels(loaded.model.kernels)
    tokens = torch.tensor(ids)

    def perplexity(kv_dtype):
        caches = allocate_kv_caches(arch, blocks, block_size, kv_dtype, torch.device("cpu"))
        total, start = 0.0, 0
        while start < n:
            # A 64-token chunk, then 16 single-token decode steps: both attention paths read the cache.
            end = min(start + (64 if start % 80 == 0 else 1), n)
            meta = chunk_metadata(start, end, blocks)
            backend.begin_step(meta)
            with torch.inference_mode():
                hidden = loaded.model(tokens[start:end], torch.arange(start, end), caches, meta, backend)
                scores = loaded.model.compute_logits(hidden).float().log_softmax(-1)
            total += scores.gather(1, tokens[start + 1 : end + 1, None]).sum().item()
            start = end
        return math.exp(-total / n)

    exact, int8 = perplexity(torch.float32), perplexity(torch.int8)
    print(f"perplexity: float32 cache {exact:.4f}, int8 cache {int8:.4f} ({(int8 / exact - 1) * 100:+.3f}%)")
    assert abs(int8 / exact - 1) < 0.01
