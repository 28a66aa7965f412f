"""Prompt logprobs (`SamplingParams.prompt_logprobs`): computed in the prefill chunks the scheduler
runs anyway, equal to transformers' log-softmax on the same weights (float32) at every prompt
position, across chunks, beside requests that do not ask, over a prefix another request cached,
and through preemption (each position reported once); then over the OpenAI API (echo with
logprobs, max_tokens 0, vLLM's prompt_logprobs) through the official SDK."""

from __future__ import annotations

import random

import anyio
import httpx
import pytest
import torch
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from test_scheduler_core import allocate, make_core, make_request

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.actors.messages import SampledToken
from cadenza.actors.scheduler_core import SchedulerCore
from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.llm import LLM
from cadenza.outputs import TokenLogprob
from cadenza.policies.eviction import LRUPolicy
from cadenza.runner import model_runner
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams
from cadenza.step import PromptLogprobs, ScheduledChunk

TOLERANCE = 1e-4  # float32 through two implementations; measured: at most 4e-6 on these models
BLOCK = 4


def make_runtime(path, **overrides):
    settings = {"model.path": str(path), "model.dtype": "float32", "cache.block_size": BLOCK, "cache.num_blocks": 256}
    settings.update(overrides)
    return build_runtime(load_config(None, overrides=settings, env={}), extra_plugins=())


def asking(k: int | None, max_tokens: int = 3, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k, **kw)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


class Reference:
    """transformers' float32 log-softmax of the logits at every position of a prompt."""

    def __init__(self, path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.max_error = 0.0

    def logprobs(self, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def check(self, got: list[TokenLogprob | None] | tuple, prompt: list[int], k: int) -> None:
        """`got` is the prompt's logprobs: None first, then each token's given those before it."""
        assert len(got) == len(prompt) and got[0] is None
        rows = self.logprobs(prompt)
        for position in range(1, len(prompt)):
            entry, row, token = got[position], rows[position - 1], prompt[position]
            assert entry.token_id == token
            error = abs(entry.logprob - row[token].item())
            self.max_error = max(self.max_error, error)
            assert error <= TOLERANCE, (position, entry.logprob, row[token].item())
            # The rank, up to tokens within the tolerance of it.
            assert int((row > row[token] + TOLERANCE).sum()) < entry.rank <= int((row > row[token] - TOLERANCE).sum()) + 1
            assert len(entry.top) == k
            values = row.topk(k).values.tolist() if k else []
            for (top_id, value), expected in zip(entry.top, values):
                assert abs(value - expected) <= TOLERANCE and abs(row[top_id].item() - value) <= TOLERANCE


def entries(positions, k: int) -> list[TokenLogprob | None]:
    """`LLM.generate`'s prompt logprobs (vLLM's dicts: the prompt token first, then the top `k`)
    as the engine's `TokenLogprob`s, for `Reference.check`."""
    out: list[TokenLogprob | None] = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        token = next(iter(position))
        top = tuple((t, p.logprob) for t, p in sorted(position.items(), key=lambda item: item[1].rank) if p.rank <= k)
        out.append(TokenLogprob(token, position[token].logprob, top, position[token].rank))
    return out


@pytest.fixture(scope="module")
def reference(model_path):
    return Reference(model_path)


async def generate(engine, prompt, params):
    """(tokens, the one output that carried prompt logprobs or None, how many carried them, last)."""
    tokens, carrying, count, index, last = [], None, 0, 0, None
    async for out in engine.generate(prompt, params):
        if out.prompt_logprobs is not None:
            carrying, count = out, count + 1
            assert index == 0, "the first output carries them"
        tokens.extend(out.token_ids)
        index, last = index + 1, out
    return tokens, carrying, count, last


async def run_all(engine, prompts, params):
    results = [None] * len(prompts)

    async def one(i):
        results[i] = await generate(engine, prompts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


# --- the engine on the tiny model ---------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("arch", ["llama3", "smollm_tied"])
async def test_every_prompt_position_equals_transformers_across_chunks(tiny_model_dir, arch, monkeypatch):
    path = tiny_model_dir(arch)
    ref = Reference(path)
    # Prompts of 1 to 41 tokens in chunks of 8; the logits are taken 3 rows at a time.
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 3)
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (1, 2, 8, 9, 41)]
    runtime = make_runtime(path, **{"scheduler.chunk_size": 8, "scheduler.max_num_batched_tokens": 16})
    async with AsyncEngine.serve(runtime) as engine:
        for k in (0, 5):
            for prompt in prompts:
                tokens, out, count, last = await generate(engine, prompt, asking(k, logprobs=1))
                assert count == 1 and out.prompt_token_ids == tuple(prompt)
                ref.check(out.prompt_logprobs, prompt, k)
                # The last prompt position's next token is the sampled one: the ordinary logprobs.
                first_sampled = out.logprobs[0]
                expected = ref.logprobs(prompt)[-1]
                assert first_sampled.token_id == tokens[0] == int(expected.argmax())
                assert abs(first_sampled.logprob - expected.max().item()) <= TOLERANCE
                assert last.finish_reason == "length"
    print(f"\nprompt logprobs vs transformers ({arch}): max |difference| {ref.max_error:.2e}")


@pytest.mark.anyio
async def test_batched_with_requests_that_do_not_ask(model_path, reference):
    rng = random.Random(2)
    prompts = [random_prompt(rng, rng.randint(5, 40)) for _ in range(10)]
    params = [asking(rng.choice([0, 3]) if i % 2 else None, max_tokens=rng.randint(1, 8)) for i in range(10)]
    runtime = make_runtime(model_path, **{"scheduler.chunk_size": 16, "scheduler.max_num_batched_tokens": 32})
    async with AsyncEngine.serve(runtime) as engine:
        together = await run_all(engine, prompts, params)
        alone = [await generate(engine, p, sp.model_copy(update={"prompt_logprobs": None})) for p, sp in zip(prompts, params)]
    for prompt, sp, (tokens, out, count, _), (expected, _, _, _) in zip(prompts, params, together, alone):
        assert tokens == expected  # asking changes no token
        if sp.prompt_logprobs is None:
            assert out is None and count == 0
        else:
            assert count == 1
            reference.check(out.prompt_logprobs, prompt, sp.prompt_logprobs)


@pytest.mark.anyio
async def test_a_cached_prefix_is_computed_again_and_still_caches_for_others(model_path, reference):
    rng = random.Random(3)
    shared, middle, tail = random_prompt(rng, 24), random_prompt(rng, 10), random_prompt(rng, 6)
    asker = shared + middle
    later = asker + tail

    async def run(ask: bool):
        async with AsyncEngine.serve(make_runtime(model_path)) as engine:
            await generate(engine, shared, asking(None))  # caches 6 blocks of 4
            computed = engine.metrics.prefill_tokens_computed
            _, out, _, last = await generate(engine, asker, asking(2 if ask else None))
            computed = engine.metrics.prefill_tokens_computed - computed
            tokens, _, _, after = await generate(engine, later, asking(None))
            return out, last, computed, tokens, after

    out, last, computed, tokens, after = await run(ask=True)
    # The asker takes no hit: every position is computed, its logprobs reported.
    assert last.num_cached_tokens == 0 and computed == len(asker)
    reference.check(out.prompt_logprobs, asker, 2)
    # Its blocks are a cache like any: the next request hits them exactly as if it had not asked.
    _, plain_last, plain_computed, plain_tokens, plain_after = await run(ask=False)
    assert plain_last.num_cached_tokens == 24 and plain_computed == len(asker) - 24
    assert after.num_cached_tokens == plain_after.num_cached_tokens == len(asker) // BLOCK * BLOCK
    assert tokens == plain_tokens


@pytest.mark.anyio
@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_preemption_reports_each_position_once(model_path, reference, prefix_caching, monkeypatch):
    preempted = []  # per preemption: whether the request was still owed prompt logprobs
    preempt = SchedulerCore._preempt

    def counting(self, requests, **kw):
        preempted.extend(r.wants_prompt_logprobs for r, _ in requests)
        return preempt(self, requests, **kw)

    monkeypatch.setattr(SchedulerCore, "_preempt", counting)
    rng = random.Random(4)
    prompts = [random_prompt(rng, rng.randint(12, 30)) for _ in range(10)]
    params = [asking(rng.choice([0, 2]), max_tokens=24) for _ in prompts]
    # 10 sequences of up to 54 tokens need ~100 blocks of 4; 30 force preemption.
    runtime = make_runtime(
        model_path,
        **{"cache.num_blocks": 30, "cache.enable_prefix_caching": prefix_caching, "scheduler.chunk_size": 8,
           "scheduler.max_num_batched_tokens": 24},
    )  # fmt: skip
    async with AsyncEngine.serve(runtime) as engine:
        results = await run_all(engine, prompts, params)
        await engine.settle()
        engine.cache_core.check_invariants()
        assert engine.cache_core.num_available == 30 and not engine.scheduler_core.requests
    assert True in preempted and False in preempted  # mid-prompt, and once the prompt was done
    for prompt, sp, (tokens, out, count, last) in zip(prompts, params, results):
        assert count == 1 and len(tokens) == 24 and last.finish_reason == "length"
        reference.check(out.prompt_logprobs, prompt, sp.prompt_logprobs)


def test_one_token_prompt_chunks_never_go_through_the_decode_graphs(model_path, reference):
    """The padded decode (model.cuda_graphs, eager here on the CPU) takes steps of one-token chunks;
    prompt chunks of one token that report logprobs run unpadded, beside decodes that do not."""
    settings = {"model.dtype": "float32", "cache.block_size": 8, "model.cpu_kernels": "off", "attention_backend": "triton",
                "model.cuda_graphs": "on", "chunk_size": 1, "max_num_batched_tokens": 4}  # fmt: skip
    prompts = [[9, 8, 7, 6, 5, 4], [30, 31, 32, 33, 34]]
    with LLM(model_path, **settings) as llm:
        graphs, padded = llm.runtime.runner.graphs, []
        run = graphs.run

        def spying(chunks, sample_rows):
            assert all(c.prompt_logprobs_from is None for c in chunks)
            padded.append(len(chunks))
            return run(chunks, sample_rows)

        graphs.run = spying
        asked, plain = llm.generate(prompts, [asking(2, max_tokens=6), asking(None, max_tokens=6)])
        alone = llm.generate(prompts[:1], asking(None, max_tokens=6))[0]
    assert padded  # the decodes did go through them
    reference.check(entries(asked.prompt_logprobs, 2), prompts[0], 2)
    assert asked.outputs[0].token_ids == alone.outputs[0].token_ids and len(plain.outputs[0].token_ids) == 6


def test_llm_generate_returns_them_aligned_with_the_prompt(model_path, reference):
    with LLM(model_path, dtype="float32", block_size=BLOCK, num_blocks=128, chunk_size=8) as llm:
        asked, plain = llm.generate(["The quick brown fox", "The quick brown fox"], [asking(4), asking(None)])
    assert plain.prompt_logprobs is None
    assert len(asked.prompt_logprobs) == len(asked.prompt_token_ids)
    assert asked.outputs[0].token_ids == plain.outputs[0].token_ids
    reference.check(entries(asked.prompt_logprobs, 4), asked.prompt_token_ids, 4)


# --- the pieces -----------------------------------------------------------------------------------


def _pretend_prompt_logprobs(core, chunks) -> tuple[PromptLogprobs, ...]:
    """What the runner reports for `chunks`: position p's entry has logprob -p."""
    records = []
    for chunk in chunks:
        if chunk.prompt_logprobs_from is None:
            continue
        prompt = chunk.prompt_token_ids
        lo = max(chunk.start_position, chunk.prompt_logprobs_from)
        hi = min(chunk.start_position + len(chunk.token_ids), len(prompt) - 1)
        entries = tuple(TokenLogprob(prompt[p + 1], -float(p + 1)) for p in range(lo, hi))
        records.append(PromptLogprobs(chunk.request_id, lo + 1, entries))
    return tuple(records)


def _finish(core, manager, plan, chunks) -> None:
    """What the scheduler actor does with a step's output: commit, prompt logprobs, tokens."""
    assert core.finish_step(plan.step_id) is plan
    for request_id, tokens in core.computed_tokens(plan):
        manager.commit(request_id, tokens)
    core.record_prompt_logprobs(plan, _pretend_prompt_logprobs(core, chunks))
    for event in core.update_from_output(tuple(SampledToken(c.request_id, 9) for c in chunks if c.sample), plan):
        if event.finish_reason is not None:
            manager.free(event.request.request_id)
    manager.check_invariants()


def test_a_request_preempted_mid_prompt_drops_its_stale_step_and_reuses_what_was_reported():
    # 4 blocks of 4, chunks of 4, two steps in flight. a (4 tokens) decodes; p (12 tokens, prompt
    # logprobs) prefills. Step 3 needs a 2nd block for a's decode and a 3rd for p: p is preempted
    # while step 2 (its positions 4-7) is in flight, and that step's logprobs are stale.
    core = make_core(chunk_size=4, max_num_batched_tokens=16, async_scheduling=True)
    manager = KVCacheManager(4, BLOCK, LRUPolicy())
    a = make_request("a", prompt_len=4, max_tokens=6)
    p = make_request("p", prompt_len=12, max_tokens=2, prompt_logprobs=1)
    core.add(a)
    core.add(p)
    step1 = allocate(core, manager)
    assert [c.max_cached_tokens for c in step1[0].allocation_request()[1]] == [None, 0]  # p: no lookup
    assert [(c.request_id, c.start_position, c.prompt_logprobs_from) for c in step1[1]] == [("a", 0, None), ("p", 0, 0)]
    step2 = allocate(core, manager)  # planned while step 1 runs
    assert [(c.request_id, c.start_position, c.prompt_logprobs_from) for c in step2[1]] == [("a", 4, None), ("p", 4, 4)]
    _finish(core, manager, *step1)
    assert p.num_prompt_logprobs == 4
    step3 = allocate(core, manager)
    assert step3[0].preempted == [p] and p.num_prompt_logprobs == 4
    _finish(core, manager, *step2)  # stale for p: dropped, it computes those positions again
    assert p.num_prompt_logprobs == 4 and len(p.prompt_logprobs) == 4
    _finish(core, manager, *step3)
    recomputed = []
    while core.has_work:
        plan, chunks = allocate(core, manager)
        recomputed += [(c.start_position, c.prompt_logprobs_from) for c in chunks if c.request_id == "p"]
        _finish(core, manager, plan, chunks)
    # Back from the queue, the prefix cache gives p its first block (positions 0-3, whose
    # logprobs it has), never the second (positions 4-7, whose logprobs it has not). Preempted
    # again once those are in (a's decode needs a 3rd block), p recomputes 4-7 without reporting
    # them, then reports from 8.
    assert recomputed == [(4, 4), (4, None), (8, 8), (12, None)] and p.num_preemptions == 2
    # Each position once, in order.
    assert p.num_prompt_logprobs == 11 and a.output_token_ids == [9] * 6
    assert [e.logprob for e in p.take_prompt_logprobs()[1:]] == [-float(i) for i in range(1, 12)]
    assert manager.num_available == 4


def test_the_prompt_logprobs_are_handed_over_once():
    core, manager = make_core(chunk_size=4), KVCacheManager(16, BLOCK, LRUPolicy())
    p = make_request("p", prompt_len=10, max_tokens=3, prompt_logprobs=0)
    core.add(p)
    while core.has_work:
        _finish(core, manager, *allocate(core, manager))
    entries = p.take_prompt_logprobs()
    assert entries[0] is None and [e.logprob for e in entries[1:]] == [-float(i) for i in range(1, 10)]
    assert [e.token_id for e in entries[1:]] == list(p.prompt_token_ids[1:])
    assert p.take_prompt_logprobs() == (None,) and p.num_prompt_logprobs == 9  # the list went with the first token
    assert make_request("q").take_prompt_logprobs() is None


def test_the_cache_manager_caps_or_skips_the_prefix_lookup():
    manager = KVCacheManager(16, BLOCK, LRUPolicy())
    prompt = tuple(range(100, 113))
    manager.admit("a", prompt, len(prompt))
    manager.commit("a", prompt)  # three full blocks cached
    queries = manager.prefix_queries
    assert manager.admit("none", prompt, len(prompt), max_cached_tokens=0).num_cached_tokens == 0
    assert manager.prefix_queries == queries  # not looked up
    assert manager.admit("some", prompt, len(prompt), max_cached_tokens=9).num_cached_tokens == 8
    assert manager.admit("any", prompt, len(prompt)).num_cached_tokens == 12
    manager.check_invariants()


def test_prompt_rows_are_the_positions_with_a_next_prompt_token():
    params = SamplingParams(prompt_logprobs=1)
    prompt = tuple(range(50, 60))
    chunks = [
        ScheduledChunk("d", [7], 20, (0,) * 6, True, SamplingParams()),  # a decode: none
        ScheduledChunk("p", prompt[4:10], 4, (0,) * 3, True, params, prompt, prompt_logprobs_from=6),
        ScheduledChunk("q", prompt[0:4], 0, (0,), False, params, prompt, prompt_logprobs_from=0),
    ]
    ends = [1, 7, 11]
    rows, spans = model_runner._prompt_rows(chunks, ends)
    # p: positions 6, 7, 8 (9 is the last: the sampled token's); q: positions 0-3.
    assert rows == [3, 4, 5, 7, 8, 9, 10]
    assert [(s.request_id, s.start, list(s.targets)) for s in spans] == [("p", 7, [57, 58, 59]), ("q", 1, [51, 52, 53, 54])]


# --- the OpenAI API through the official SDK ------------------------------------------------------


@pytest.fixture(scope="module")
def python_api(model_path):
    with LLM(model_path, dtype="float32") as llm:
        yield llm


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) <= 1e-5 for x, y in zip(a, b))


def test_echo_with_logprobs_gives_the_python_api_s_prompt_logprobs(client, model, python_api):
    prompt = "Paged attention stores keys"
    (expected,) = python_api.generate([prompt], asking(2, max_tokens=2, logprobs=2))
    n = len(expected.prompt_token_ids)
    prompt_entries, completion = entries(expected.prompt_logprobs, 2), expected.outputs[0]
    sampled = [p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)]
    for max_tokens in (0, 1, 2):
        answer = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0)
        choice, logprobs = answer.choices[0], answer.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == n + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        want = [None] + [e.logprob for e in prompt_entries[1:]] + sampled[:max_tokens]
        assert _close(logprobs.token_logprobs, want), (logprobs.token_logprobs, want)
        # The prompt's tokens spell it, each at its offset; the completion's follow the prompt.
        assert "".join(logprobs.tokens[:n]) == prompt
        assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(n + max_tokens)]
        for top, entry in zip(logprobs.top_logprobs[1:n], prompt_entries[1:]):
            assert len(top) <= 2 and max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
        assert choice.text == prompt + {0: "", 2: completion.text}.get(max_tokens, choice.text[len(prompt) :])
        assert choice.finish_reason == "length"
        assert answer.usage.completion_tokens == max_tokens and answer.usage.prompt_tokens == n


def test_what_lm_eval_sends(client, model, python_api):
    """lm-evaluation-harness' loglikelihood request: token ids, echo, logprobs 1, max_tokens 1, a
    batch of prompts; it sums token_logprobs[ctxlen:-1] and checks each against max(top_logprobs)."""
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
    answer = client.completions.create(model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    expected = python_api.generate(prompts, asking(1, max_tokens=1))
    for choice, out, prompt in zip(sorted(answer.choices, key=lambda c: c.index), expected, prompts):
        values = choice.logprobs.token_logprobs[1 : len(prompt)]
        got = entries(out.prompt_logprobs, 1)
        assert _close(values, [e.logprob for e in got[1:]])
        greedy = [v == max(top.values()) for v, top in zip(values, choice.logprobs.top_logprobs[1 : len(prompt)])]
        assert greedy == [e.rank == 1 for e in got[1:]]


def test_vllm_prompt_logprobs_and_streamed_echo(client, model, python_api, server):
    prompt = [5, 6, 7, 8, 9]
    (expected,) = python_api.generate([prompt], asking(3, max_tokens=2, logprobs=1))
    prompt_entries = entries(expected.prompt_logprobs, 3)
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3})
    shown = answer.choices[0].model_extra["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompt)
    for wire, entry in zip(shown[1:], prompt_entries[1:]):
        own = wire[str(entry.token_id)]
        assert own["rank"] == entry.rank and own["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
        assert [(int(t), v["rank"]) for t, v in wire.items() if int(t) != entry.token_id] == [
            (t, r) for r, (t, _) in enumerate(entry.top, start=1) if t != entry.token_id
        ]
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0,
    }, timeout=60).json()  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    # Streamed: the prompt and its logprobs open the stream, the completion's follow.
    chunks = list(client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=2, temperature=0, stream=True))
    opening = chunks[0].choices[0]
    assert opening.text == python_api.tokenizer.decode(prompt)
    assert _close(opening.logprobs.token_logprobs, [None] + [e.logprob for e in prompt_entries[1:]])
    later = [t for c in chunks[1:] for t in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    completion = expected.outputs[0]
    assert _close(later, [p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)])
    streamed_only = list(client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed_only) == opening.text
    assert streamed_only[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
     ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs")],
)  # fmt: skip
def test_refusals_name_the_field(server, model, body, param):
    response = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
