"""Speculative decoding end to end on a tiny random model (fp32): greedy output identical to plain
decoding, batched and solo, under chunked prefill, async scheduling, preemption and abort; the
sampled distribution unchanged (chi-square); no KV block leaked; and the proposers' contract."""

from __future__ import annotations

import math
import random
from collections import Counter

import anyio
import pytest
from plugin_contracts import covers
from test_engine import assert_no_block_leaked, collect, make_runtime, run_all

from cadenza.plugins.hookspecs import hookimpl
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.base import Proposal, ProposalRequest, Proposer
from cadenza.speculative.ngram import NgramProposer
from cadenza.speculative.suffix import SuffixProposer

pytestmark = pytest.mark.anyio


class OracleProposer(Proposer):
    """Guesses a request's known greedy continuation, wrong on purpose every few guesses, so both
    the accept and the reject paths run many times (the tiny random model rarely repeats itself)."""

    name = "oracle"
    answers: dict[tuple[int, ...], list[int]] = {}  # prompt -> its plain greedy output
    finished: list[str] = []
    resets: list[str] = []

    def __init__(self, context, options=None):
        super().__init__(context, options)
        self.calls = 0

    def propose(self, requests):
        out = []
        for request in requests:
            tokens = list(request.token_ids)
            guess = []
            for prompt, answer in self.answers.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    guess = list(answer[done : done + request.num_tokens])
            self.calls += 1
            if guess and self.calls % 3 == 0:  # a wrong guess somewhere in the run
                i = self.calls % len(guess)
                guess[i] = (guess[i] + 1) % 300
            out.append(guess)
        return out

    def on_request_reset(self, request_id):
        self.resets.append(request_id)

    def on_request_finished(self, request_id):
        self.finished.append(request_id)


class OraclePlugin:
    @staticmethod
    @hookimpl
    def register_proposers(register):
        register("oracle", OracleProposer)


def spec_runtime(model_path, method, **overrides):
    settings = {"speculative.method": method, "speculative.max_batch_size": 64, "speculative.num_tokens": 4,
                "speculative.token_cost": 0.05}  # fmt: skip
    settings.update(overrides)
    return make_runtime(model_path, extra_plugins=[OraclePlugin], **settings)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def prompts_with_repeats(n, seed):
    """Half random prompts, half a random passage written out twice (what n-gram lookup finds)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, 300) for _ in range(rng.randint(4, 30))]
        prompts.append(body + body if i % 2 else body)
    return prompts


async def oracle_knows(model_path, seed: int, params) -> tuple[list[int], list[int]]:
    """A prompt with repeats and its plain (greedy) output under `params`, which the oracle then guesses."""
    prompt = prompts_with_repeats(2, seed=seed)[1]
    (expected,) = await plain_outputs(model_path, [prompt], params)
    OracleProposer.answers = {tuple(prompt): expected}
    return prompt, expected


async def plain_outputs(model_path, prompts, params, **overrides):
    from cadenza.engine.async_engine import AsyncEngine

    async with AsyncEngine.serve(make_runtime(model_path, **overrides)) as engine:
        results = await run_all(engine, prompts, params)
    return [tokens for _, tokens, _ in results]


@covers("register_proposers", "Proposer.propose", "Proposer.on_request_finished")
@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_greedy_batched_identical_with_every_proposer(model_path, async_scheduling):
    from cadenza.engine.async_engine import AsyncEngine

    prompts = prompts_with_repeats(24, seed=3)
    rng = random.Random(5)
    params = [greedy(rng.randint(1, 30)) for _ in prompts]
    sched = {"scheduler.async_scheduling": async_scheduling, "scheduler.chunk_size": 16, "scheduler.max_num_batched_tokens": 64}
    expected = await plain_outputs(model_path, prompts, params, **sched)
    OracleProposer.answers = {tuple(p): e for p, e in zip(prompts, expected)}
    for method in ("ngram", "suffix", "oracle"):
        OracleProposer.finished = []
        async with AsyncEngine.serve(spec_runtime(model_path, method, **sched)) as engine:
            results = await run_all(engine, prompts, params)
            assert [tokens for _, tokens, _ in results] == expected, method
            for (_, tokens, last), p in zip(results, params):
                assert len(tokens) == p.max_tokens and last.finish_reason == "length"
            await assert_no_block_leaked(engine)
            counts = engine.metrics.speculation
            if method == "oracle":
                with anyio.fail_after(10):  # departures reach the runner with its next message
                    while len(set(OracleProposer.finished)) < len(prompts):
                        await anyio.sleep(0.01)
        assert counts[method][1] > 0, f"{method} proposed nothing"
        if method == "oracle":
            proposed, accepted = counts["oracle"][1:]
            assert 0 < accepted < proposed  # both paths ran


async def test_greedy_solo_identical_and_many_tokens_per_step(model_path):
    from cadenza.engine.async_engine import AsyncEngine

    prompt, expected = await oracle_knows(model_path, 11, greedy(40))
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle")) as engine:
        _, tokens, _ = await collect(engine, prompt, greedy(40))
        steps = engine.metrics.num_steps
        await assert_no_block_leaked(engine)
    assert tokens == expected
    assert steps < 30  # 40 tokens (one from the prefill) in fewer steps: several tokens a step


async def test_stop_token_and_max_tokens_inside_accepted_guesses(model_path):
    from cadenza.engine.async_engine import AsyncEngine

    prompt, expected = await oracle_knows(model_path, 13, greedy(30))
    stop = expected[9]
    cut = expected.index(stop) + 1
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle")) as engine:
        _, tokens, last = await collect(engine, prompt, greedy(30, stop_token_ids=[stop]))
        assert tokens == expected[:cut] and last.finish_reason == "stop"
        for n in (1, 2, 5, 7):  # never a token past max_tokens, whatever was guessed
            _, tokens, last = await collect(engine, prompt, greedy(n))
            assert tokens == expected[:n] and last.finish_reason == "length"
        await assert_no_block_leaked(engine)


async def test_request_can_switch_speculation_off_or_pick_a_proposer(model_path):
    from cadenza.engine.async_engine import AsyncEngine

    prompt, expected = await oracle_knows(model_path, 17, greedy(20))
    async with AsyncEngine.serve(spec_runtime(model_path, "none")) as engine:
        _, tokens, _ = await collect(engine, prompt, greedy(20))
        assert tokens == expected and not engine.metrics.speculation
        _, tokens, _ = await collect(engine, prompt, greedy(20, speculative={"method": "suffix"}))
        assert tokens == expected and engine.metrics.speculation["suffix"][0] > 0
        _, tokens, last = await collect(engine, prompt, greedy(5, speculative={"method": "nonesuch"}))
        assert last.finish_reason == "error" and last.error_code == "invalid_value" and "nonesuch" in last.error
        await assert_no_block_leaked(engine)
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle")) as engine:
        _, tokens, _ = await collect(engine, prompt, greedy(20, speculative={"num_tokens": 0}))
        assert tokens == expected and not engine.metrics.speculation
        await assert_no_block_leaked(engine)


@covers("Proposer.on_request_reset")
async def test_preemption_and_abort_while_speculating_leak_nothing(model_path):
    from cadenza.engine.async_engine import AsyncEngine

    prompts = prompts_with_repeats(12, seed=19)
    params = greedy(40)
    overrides = {"cache.num_blocks": 24, "scheduler.chunk_size": 16, "scheduler.max_num_batched_tokens": 64}
    expected = await plain_outputs(model_path, prompts, params, **{"cache.num_blocks": 512})
    OracleProposer.answers = {tuple(p): e for p, e in zip(prompts, expected)}
    OracleProposer.resets = []
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle", **overrides)) as engine:
        results = await run_all(engine, prompts, params)
        assert engine.metrics.num_preemptions > 0, "the test needs preemptions"
        assert [tokens for _, tokens, _ in results] == expected
        await assert_no_block_leaked(engine)

        async def abort_after(prompt, n):
            async for out in engine.generate(prompt, greedy(60)):
                n -= len(out.token_ids)
                if n <= 0:
                    break  # leaving the loop aborts the request

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(prompts):
                tg.start_soon(abort_after, prompt, 3 + i)
        with anyio.fail_after(10):  # the aborts travel through the actors
            while engine.scheduler_core.requests or engine.num_active_requests:
                await anyio.sleep(0.01)
        await assert_no_block_leaked(engine)
        assert engine.runtime.runner.sampling_pipeline.num_joined == 0


async def test_structured_output_identical_under_speculation(model_path):
    from cadenza.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": "(ab|cd|[0-9]){1,40}"})
    prompt, expected = await oracle_knows(model_path, 23, params)
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle")) as engine:
        _, tokens, _ = await collect(engine, prompt, params)
        assert engine.metrics.speculation["oracle"][2] > 0
        await assert_no_block_leaked(engine)
    assert tokens == expected


# --- the sampled distribution ---------------------------------------------------------------------

# Chi-square critical values at significance 0.001 by degrees of freedom (Wilson-Hilferty beyond).
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59}


def chi_square_two_samples(a: Counter, b: Counter, min_count: int = 5) -> tuple[float, int]:
    """The two-sample chi-square statistic over categories (rare ones pooled) and its dof."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cats, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 2 * min_count:
            cats.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest) >= 2 * min_count:
        cats.append(tuple(rest))
    na, nb = sum(x for x, _ in cats), sum(y for _, y in cats)
    stat = 0.0
    for x, y in cats:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(cats) - 1


def critical(dof: int) -> float:
    if dof in _CHI2_999:
        return _CHI2_999[dof]
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


async def test_sampled_distribution_unchanged_chi_square(model_path):
    """Temperature 1 with top-k 4: the tokens at output positions 1-3 (speculated ones) over many
    seeds, with and without an always-guessing proposer, agree at significance 0.001."""
    from cadenza.engine.async_engine import AsyncEngine

    prompt = [5, 17, 42, 99, 5, 17, 42]
    n = 400
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    plain = await plain_outputs(model_path, [prompt] * n, params, **{"scheduler.max_num_seqs": 128})
    # The oracle guesses the most common plain continuation: often right, often wrong.
    OracleProposer.answers = {tuple(prompt): list(Counter(tuple(t) for t in plain).most_common(1)[0][0])}
    seeds2 = [SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, seed=10_000 + s) for s in range(n)]
    async with AsyncEngine.serve(spec_runtime(model_path, "oracle", **{"scheduler.max_num_seqs": 128})) as engine:
        results = await run_all(engine, [prompt] * n, seeds2)
        proposed, accepted = engine.metrics.speculation["oracle"][1:]
        await assert_no_block_leaked(engine)
    spec = [tokens for _, tokens, _ in results]
    assert 0 < accepted < proposed
    for position in (1, 2, 3):
        stat, dof = chi_square_two_samples(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert dof >= 1 and stat < critical(dof), (position, stat, dof)
    # And jointly, the pair at positions 1 and 2 (acceptance of the second guess depends on the first).
    stat, dof = chi_square_two_samples(Counter(tuple(t[1:3]) for t in plain), Counter(tuple(t[1:3]) for t in spec))
    assert stat < critical(dof), (stat, dof)


# --- proposers --------------------------------------------------------------------------------------


@covers("Proposer.__init__", "Proposer.name", "Proposer.options_model")
def test_ngram_finds_the_latest_earlier_match():
    proposer = NgramProposer(None, NgramProposer.options_model(min_n=2, max_n=3))
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer.propose([ProposalRequest("a", tokens, 2)]) == [Proposal([7, 8], 3, [False, True])]  # "1 2 3" went on as 9, then 7
    assert [p.token_ids for p in proposer.propose([ProposalRequest("a", [1, 2, 3, 4], 3)])] == [[]]
    # A match just behind the end is a loop: the guess goes on around it.
    assert proposer.propose([ProposalRequest("a", [4, 5, 4, 5], 5)]) == [Proposal([4, 5, 4, 5, 4], 2, [True] * 5)]
    # The match length judged goes on past max_n (the chosen occurrence followed back).
    long = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3, 4, 5, 6]
    assert proposer.propose([ProposalRequest("a", long, 2)]) == [Proposal([8, 9], 6, [True, True])]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer.options_model(min_n=4, max_n=2)


def test_ngram_lookup_equals_trying_each_length_longest_first():
    """The one-pass lookup against the plain search: n from max_n down, the latest window wins."""
    import numpy as np

    from cadenza.speculative.ngram import copy_forward, ngram_lookup

    def plain(tokens, min_n, max_n, k):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            hits = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
            if hits:
                return copy_forward(tokens, hits[-1] + n, k)
        return []

    rng = random.Random(5)
    for trial in range(400):
        tokens = [rng.randrange(4 if trial % 2 else 12) for _ in range(rng.randint(1, 60))]
        min_n, max_n = rng.randint(1, 3), rng.randint(3, 9)
        assert ngram_lookup(np.asarray(tokens), min_n, max_n, 5) == plain(tokens, min_n, max_n, 5), (tokens, min_n, max_n)


def brute_force_continuation(tokens, min_match, k):
    """The longest suffix occurring earlier; the tokens after its first occurrence, going on
    around the loop when that runs into the end."""
    n = len(tokens)
    for length in range(n - 1, min_match - 1, -1):
        suffix = tokens[n - length :]
        for start in range(0, n - length):
            if tokens[start : start + length] == suffix:
                looped = list(tokens)
                for i in range(start + length, start + length + k):
                    looped.append(looped[i])
                return looped[start + length : start + length + k]
    return []


def longest_repeated_suffix(tokens) -> int:
    n = len(tokens)
    return max((m for m in range(1, n) if any(tokens[s : s + m] == tokens[n - m :] for s in range(n - m))), default=0)


def brute_force_agreement(tokens, length, guess):
    """For each guessed token: every earlier occurrence of the matched suffix followed by the guess
    so far, that has a next token, has that one."""
    n, agreed = len(tokens), []
    for j, token in enumerate(guess):
        pattern = tokens[n - length :] + guess[:j]
        nexts = {tokens[s + len(pattern)] for s in range(n) if tokens[s : s + len(pattern)] == pattern and s + len(pattern) < n}
        agreed.append(nexts <= {token})
    return agreed


def test_suffix_automaton_matches_brute_force_as_tokens_grow():
    rng = random.Random(0)
    proposer = SuffixProposer(None)
    for trial in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        for _ in range(25):
            got = proposer.propose([ProposalRequest(str(trial), tokens, 3)])[0]
            assert list(got.token_ids) == brute_force_continuation(tokens, 1, 3), tokens
            assert got.match_length == longest_repeated_suffix(tokens), tokens
            assert list(got.agreed) == brute_force_agreement(tokens, got.match_length, list(got.token_ids)), tokens
            tokens = tokens + [rng.randrange(4)]
    proposer.propose([ProposalRequest("x", [1, 2, 3, 1, 2, 4, 4], 2)])
    # Cut back (a preemption): rebuilt from the shorter tokens, not confused by the old ones.
    assert proposer.propose([ProposalRequest("x", [1, 2, 3, 1, 2], 4)]) == [Proposal([3, 1, 2, 3], 2, [True] * 4)]
    for trial in range(30):
        proposer.on_request_finished(str(trial))
    proposer.on_request_finished("x")
    assert proposer.num_requests == 0


async def test_draft_model_proposer_greedy_identical(model_path, tiny_model_dir):
    """The same tiny model drafting for itself (every guess right) and another one (mostly wrong)."""
    from cadenza.engine.async_engine import AsyncEngine

    prompts = prompts_with_repeats(4, seed=29)
    params = greedy(20)
    expected = await plain_outputs(model_path, prompts, params)
    other = tiny_model_dir("qwen2")
    for draft, good in ((None, True), (str(other), False)):
        options = {"draft": {"model": draft, "dtype": "float32", "num_slots": 2, "max_model_len": 256}}
        async with AsyncEngine.serve(spec_runtime(model_path, "draft", plugin_options=options)) as engine:
            results = await run_all(engine, prompts, params)
            assert [tokens for _, tokens, _ in results] == expected
            proposer = engine.runtime.runner.speculator.proposers["draft"]
            steps, proposed, accepted = engine.metrics.speculation["draft"]
            await assert_no_block_leaked(engine)
            # Every slot back, once the runner has heard of the last finishes (its own message,
            # handled after the results went out).
            with anyio.fail_after(10):
                while proposer.num_requests:
                    await anyio.sleep(0.01)
        assert proposed > 0
        if good:
            assert accepted == proposed
        else:
            assert accepted < proposed
