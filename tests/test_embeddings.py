"""Embeddings (`SamplingParams.pooling`): the served decoder's last hidden states (after the final
norm), pooled `last` or `mean`, equal to transformers' `hidden_states[-1]` on the same weights
(float32) across chunked prefill, batched in the same steps as generation (whose tokens do not
change), a failing request failing alone; the scheduler's side (no token sampled, finished once,
stale vectors ignored); `LLM.embed`; `/v1/embeddings` through the official SDK."""

from __future__ import annotations

import random

import anyio
import httpx
import openai
import pytest
import torch
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from test_scheduler_core import allocate, make_core, make_request

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.llm import LLM
from cadenza.policies.eviction import LRUPolicy
from cadenza.pooling_params import PoolingParams
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams
from cadenza.step import Pooled

TOLERANCE = 1e-4  # float32 through two implementations
BLOCK = 4
MAX_ERROR = {"value": 0.0}  # the largest difference seen, for the report


def make_runtime(path, **overrides):
    settings = {"model.path": str(path), "model.dtype": "float32", "cache.block_size": BLOCK, "cache.num_blocks": 256}
    settings.update(overrides)
    return build_runtime(load_config(None, overrides=settings, env={}), extra_plugins=())


class Reference:
    """transformers' float32 last hidden states (`hidden_states[-1]`: after the final norm)."""

    def __init__(self, path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def embed(self, prompt: list[int], params: PoolingParams) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
        vector = hidden[-1] if params.pooling == "last" else hidden.mean(dim=0)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        return torch.nn.functional.normalize(vector, dim=0) if params.normalize else vector

    def check(self, got, prompt: list[int], params: PoolingParams) -> None:
        assert got is not None
        expected = self.embed(prompt, params)
        error = (torch.tensor(got) - expected).abs().max().item()
        MAX_ERROR["value"] = max(MAX_ERROR["value"], error)
        assert error <= TOLERANCE, (params, error)


@pytest.fixture(scope="module")
def reference(model_path):
    yield Reference(model_path)
    print(f"\nembeddings: largest difference from transformers {MAX_ERROR['value']:.2e}")


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def tokens_of(engine, prompt) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, GREEDY):
        tokens.extend(out.token_ids)
    return tokens


@pytest.mark.anyio
async def test_embeddings_match_transformers_across_chunks_beside_generation(model_path, reference):
    """Chunks of 8 tokens: prompts of 3 to 30 tokens embed in one to four chunks, in the same
    steps as generation requests, whose greedy tokens are those they get alone."""
    runtime = make_runtime(model_path, **{"scheduler.chunk_size": 8, "scheduler.max_num_batched_tokens": 24})
    rng = random.Random(7)
    gen_prompts = [random_prompt(rng, n) for n in (5, 11)]
    cases = [
        (random_prompt(rng, n), PoolingParams(pooling=pooling, normalize=normalize, dimensions=dims))
        for n, pooling, normalize, dims in [
            (3, "last", True, None), (8, "mean", False, None), (13, "last", False, None), (17, "mean", True, None),
            (30, "mean", True, 16), (25, "last", True, 16), (9, "mean", False, None),
        ]
    ]  # fmt: skip
    steps: list[tuple[bool, bool]] = []  # (an embedding chunk in it, a sampling chunk in it)
    execute = runtime.runner.execute

    def spy(chunks, *args, **kwargs):
        steps.append((any(c.params and c.params.pooling for c in chunks), any(c.sample for c in chunks)))
        return execute(chunks, *args, **kwargs)

    async with AsyncEngine.serve(runtime) as engine:
        alone = [await tokens_of(engine, p) for p in gen_prompts]
        runtime.runner.execute = spy
        together: list = [None] * len(gen_prompts)
        embedded: list = [None] * len(cases)
        failed = None

        async def generate(i):
            together[i] = await tokens_of(engine, gen_prompts[i])

        async def embed(i):
            embedded[i] = await engine.embed(cases[i][0], cases[i][1])

        async def embed_too_wide():  # the runner refuses it: it fails alone
            nonlocal failed
            failed = await engine.embed(random_prompt(rng, 6), PoolingParams(dimensions=10**6))

        async with anyio.create_task_group() as tg:
            for i in range(len(gen_prompts)):
                tg.start_soon(generate, i)
            for i in range(len(cases)):
                tg.start_soon(embed, i)
            tg.start_soon(embed_too_wide)
    assert together == alone
    assert (True, True) in steps, steps  # embedding chunks rode in steps that sampled
    for out, (prompt, params) in zip(embedded, cases):
        assert out.finish_reason == "stop" and out.token_ids == () and out.num_output_tokens == 0
        assert out.num_prompt_tokens == len(prompt)
        reference.check(out.embedding, prompt, params)
        if params.dimensions:
            assert len(out.embedding) == params.dimensions
    assert failed.finish_reason == "error" and failed.embedding is None and "dimensions" in failed.error


@pytest.mark.anyio
async def test_last_pooling_over_a_cached_prefix_and_blocks_freed(model_path, reference):
    """Last pooling may start from a prefix another request cached (the last token's state needs
    only the prefix's keys and values); every block is free once the requests are done."""
    runtime = make_runtime(model_path, **{"scheduler.chunk_size": 8, "scheduler.max_num_batched_tokens": 16})
    prompt = random_prompt(random.Random(3), 21)
    last, mean = PoolingParams(), PoolingParams(pooling="mean")
    async with AsyncEngine.serve(runtime) as engine:
        first = await engine.embed(prompt, last)
        again = await engine.embed(prompt, last)
        averaged = await engine.embed(prompt, mean)
        await engine.settle()
        used = engine.cache_core.num_used
    assert used == 0  # no request holds a block: the computed ones stay cached, evictable
    assert again.num_cached_tokens > 0 and averaged.num_cached_tokens == 0  # mean computes every row
    for out, params in ((first, last), (again, last), (averaged, mean)):
        reference.check(out.embedding, prompt, params)


def test_the_scheduler_pools_the_last_chunk_and_finishes_once():
    core = make_core(chunk_size=4, max_num_batched_tokens=8)
    manager = KVCacheManager(32, 4, LRUPolicy())
    request = make_request("e", prompt_len=10, pooling=PoolingParams(pooling="mean"))
    assert request.max_cached_tokens == 0
    core.add(request)
    plans = []
    while len(plans) < 3:
        plan, chunks = allocate(core, manager)
        plans.append(plan)
        (chunk,) = chunks
        assert not chunk.sample and chunk.pool == (chunk.start_position + len(chunk.token_ids) == 10)
        core.finish_step(plan.step_id)
    assert core.schedule() is None  # nothing left to plan: it waits for its vector
    assert core.finish_pooled(plans[-1], (Pooled("e", (1.0,)),)) == [(request, (1.0,))]
    assert core.finish_pooled(plans[-1], (Pooled("e", (1.0,)),)) == []  # once
    assert not core.has_work


def test_llm_embed(model_path, reference):
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (4, 19)]
    with LLM(str(model_path), dtype="float32", **{"scheduler.chunk_size": 8, "embeddings.pooling": "mean"}) as llm:
        outputs = llm.embed(prompts)
        text = llm.embed("Hello there")[0]
    for out, prompt in zip(outputs, prompts):
        assert out.error is None and out.num_prompt_tokens == len(prompt)
        reference.check(out.embedding, prompt, PoolingParams(pooling="mean"))
    assert text.embedding is not None and abs(sum(v * v for v in text.embedding) - 1) < 1e-4


def test_openai_embeddings(client, model, server, reference):
    rng = random.Random(5)
    ids = [random_prompt(rng, n) for n in (6, 15)]
    response = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert [d.index for d in response.data] == [0, 1]
    assert response.usage.prompt_tokens == response.usage.total_tokens == 21
    for item, prompt in zip(response.data, ids):
        reference.check(item.embedding, prompt, PoolingParams())  # the deployment's default: last, normalized
    # The SDK asks for base64 by default and decodes it.
    decoded = client.embeddings.create(model=model, input=ids[0]).data[0].embedding
    assert max(abs(a - b) for a, b in zip(decoded, response.data[0].embedding)) < 1e-6
    texts = client.embeddings.create(model=model, input=["Hello", "a longer piece of text"], dimensions=8, encoding_format="float")
    for item in texts.data:
        assert len(item.embedding) == 8 and abs(sum(v * v for v in item.embedding) - 1) < 1e-4

    for body, param in [
        ({"input": "hi", "dimensions": 10**6}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 2], [10**9]]}, "input"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=model, **body)
        assert info.value.body["param"] == param, (body, info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    document = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/embeddings" in document["paths"]
    assert "EmbeddingRequest" in document["components"]["schemas"]
