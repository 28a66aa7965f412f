"""Speculative decoding's synchronous parts: the acceptance rule against exact probabilities, the
scheduler core's guess slots and multi-token results, the cache manager's roll-back, the adaptive
policy, and the Prometheus families."""

from __future__ import annotations

import pytest
import torch

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.actors.messages import SampledToken
from cadenza.actors.request_state import Request
from cadenza.actors.scheduler_core import SchedulerCore
from cadenza.config import SchedulerConfig
from cadenza.config.schema import SpeculativeConfig
from cadenza.metrics import EngineMetrics
from cadenza.policies.eviction import LRUPolicy
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.policy import SpeculationPolicy, StepCost, best_num_tokens, expected_tokens
from cadenza.speculative.verify import acceptance_probability, output_distribution, rejection_sample, residual
from cadenza.step import Speculation

# --- the acceptance rule --------------------------------------------------------------------------


def test_rejection_rule_reproduces_the_target_exactly():
    generator = torch.Generator().manual_seed(0)  # not the global one: other tests draw from it
    for _ in range(20):
        p = torch.softmax(torch.randn(2, 6, generator=generator) * 2, dim=-1)
        q = torch.softmax(torch.randn(2, 6, generator=generator) * 2, dim=-1)
        assert torch.allclose(output_distribution(p, q), p, atol=1e-6)
        point = torch.zeros(2, 6).scatter_(-1, torch.tensor([[1], [4]]), 1.0)
        assert torch.allclose(output_distribution(p, point), p, atol=1e-6)


def test_point_mass_rule_keeps_with_p_and_redraws_from_p_without_the_guess():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    guess = torch.tensor([1])
    point = torch.zeros(1, 4).scatter_(-1, guess.unsqueeze(-1), 1.0)
    assert acceptance_probability(p, point, guess).item() == pytest.approx(0.3)
    assert torch.allclose(residual(p, point), torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]]))
    # Monte Carlo over the sampling function itself: the emitted token is distributed as p.
    generator = torch.Generator().manual_seed(1)
    n = 40_000
    accepted, tokens = rejection_sample(p.expand(n, 4), None, guess.expand(n), generator)
    assert abs(accepted.float().mean().item() - 0.3) < 0.015
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, p[0], atol=0.015)


# --- the scheduler core and the cache manager ---------------------------------------------------


def make_core(method="ngram", **spec) -> tuple[SchedulerCore, KVCacheManager]:
    config = SchedulerConfig(max_num_batched_tokens=64, chunk_size=64, async_scheduling=False)
    core = SchedulerCore(
        config, block_size=4, eos_token_ids=(2,), max_model_len=64,
        speculative=SpeculativeConfig(method=method, num_tokens=4, token_cost=0.1, **spec),
    )  # fmt: skip
    return core, KVCacheManager(32, 4, LRUPolicy())


def run_step(core, manager):
    plan = core.schedule()
    allocation = manager.allocate_step(*plan.allocation_request(), plan.step_id)
    return plan, core.apply_allocation(plan, allocation, 0.0)


def finish(core, manager, plan, sampled, speculated=()):
    core.finish_step(plan.step_id)
    for request_id, tokens in core.computed_tokens(plan):
        manager.commit(request_id, tokens)
    events = core.update_from_output(tuple(sampled), plan, tuple(speculated))
    for request_id, tokens in core.accepted_tokens(plan):
        manager.commit(request_id, tokens)
    for event in events:
        if event.finish_reason is not None:
            manager.free(event.request.request_id)
    return events


def test_guess_slots_are_reserved_then_rolled_back_to_what_was_accepted():
    core, manager = make_core()
    request = Request("a", tuple(range(10, 16)), SamplingParams(max_tokens=20), 20, 0.0)
    core.add(request)
    plan, (chunk,) = run_step(core, manager)
    assert chunk.num_speculative == 0  # a prefill never speculates
    finish(core, manager, plan, [SampledToken("a", 100)])
    plan, (chunk,) = run_step(core, manager)
    assert list(chunk.token_ids) == [100] and chunk.num_speculative == 4
    assert len(manager.block_table("a")) == 3  # 7 tokens + 4 guesses = 11 slots
    # Two guesses kept, then the model's own token: three tokens, two more computed.
    events = finish(core, manager, plan, [SampledToken("a", t) for t in (101, 102, 103)], [Speculation("a", "ngram", 4, 2)])
    assert [e.token.token_id for e in events] == [101, 102, 103]
    assert request.output_token_ids == [100, 101, 102, 103]
    assert request.num_computed_tokens == 9 and request.num_draft_slots == 0
    assert manager._tables["a"].tokens == [*range(10, 16), 100, 101, 102]  # only accepted ones hashed
    plan, (chunk,) = run_step(core, manager)
    assert chunk.start_position == 9 and list(chunk.token_ids) == [103]
    # Nothing accepted this time: the table shrinks to the tokens computed plus the new guesses.
    finish(core, manager, plan, [SampledToken("a", 104)], [Speculation("a", "ngram", 4, 0)])
    plan, (chunk,) = run_step(core, manager)
    assert 0 < chunk.num_speculative < 4  # fewer guesses: the estimated acceptance fell
    assert len(manager.block_table("a")) == -(-(11 + chunk.num_speculative) // 4)
    finish(core, manager, plan, [SampledToken("a", 105)], [Speculation("a", "ngram", 0, 0)])
    manager.check_invariants()
    core.abort("a")
    manager.free("a")
    manager.check_invariants()
    assert manager.num_available == manager.num_blocks


def test_stop_inside_accepted_guesses_and_max_tokens_cap():
    core, manager = make_core()
    request = Request("a", (10, 11, 12), SamplingParams(max_tokens=4), 4, 0.0)
    core.add(request)
    plan, _ = run_step(core, manager)
    finish(core, manager, plan, [SampledToken("a", 100)])
    plan, (chunk,) = run_step(core, manager)
    assert chunk.num_speculative == 2  # 1 produced, the step yields at most guesses + 1: 4 in all
    events = finish(core, manager, plan, [SampledToken("a", t) for t in (101, 2, 103)], [Speculation("a", "ngram", 2, 2)])
    assert [e.token.token_id for e in events] == [101, 2] and events[-1].finish_reason == "stop"
    assert request.output_token_ids == [100, 101, 2]


def test_no_speculation_for_big_batches_logprobs_or_when_switched_off():
    core, manager = make_core(max_batch_size=2)
    for i, params in enumerate([{}, {}, {}]):
        core.add(Request(str(i), (10 + i, 11, 12), SamplingParams(max_tokens=9, **params), 9, 0.0))
    plan, _ = run_step(core, manager)
    finish(core, manager, plan, [SampledToken(str(i), 100) for i in range(3)])
    plan, chunks = run_step(core, manager)
    assert [c.num_speculative for c in chunks] == [0, 0, 0]  # three decode: over max_batch_size
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram"))
    assert policy.cap(SamplingParams(logprobs=1)) == 0
    assert policy.cap(SamplingParams(speculative={"num_tokens": 0})) == 0
    assert policy.cap(SamplingParams(speculative={"num_tokens": 2})) == 2
    off = SpeculationPolicy(SpeculativeConfig())
    assert off.cap(SamplingParams()) == 0 and off.cap(SamplingParams(speculative={"method": "suffix"})) == 16


def test_policy_picks_the_k_that_pays_and_pauses_when_none_does():
    assert best_num_tokens(0.9, 0.05, 8) == 8  # cheap verification, good guesses: guess far
    assert best_num_tokens(0.9, 0.7, 8) == 1  # compute-bound: one guess at most
    assert best_num_tokens(0.5, 0.7, 8) == 0  # nothing beats a plain decode
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", num_tokens=4, cooldown_steps=3, token_cost=0.1))
    request = Request("a", (1,), SamplingParams(), 100, 0.0)
    assert policy.num_tokens(request, 1, 10) == 4  # the prior: a = 0.75
    assert policy.num_tokens(request, 1, 2) == 2  # never past the room left
    for _ in range(2):
        policy.record(request, 4, 0)  # nothing kept, twice: acceptance falls below min_acceptance
    assert request.speculation.acceptance < 0.3
    assert [policy.num_tokens(request, 1, 10) for _ in range(4)] == [0, 0, 0, 1]  # paused, then one probe
    policy.record(request, 1, 0)  # the probe missed too: paused again, twice as long
    assert request.speculation.paused_for == 6
    assert [policy.num_tokens(request, 1, 10) for _ in range(7)] == [0] * 6 + [1]
    for _ in range(4):
        policy.record(request, 4, 4)
    assert policy.num_tokens(request, 1, 10) == 4  # acceptance recovered: guessing far again
    assert policy.num_tokens(request, 5, 10) == 0  # a batch over max_batch_size speculates for none


def test_policy_pauses_briefly_when_the_proposer_keeps_finding_nothing():
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", cooldown_steps=8, token_cost=0.1))
    request = Request("a", (1,), SamplingParams(), 100, 0.0)
    assert policy.num_tokens(request, 1, 10) == 4
    for _ in range(3):
        policy.record(request, 0, 0)
    assert policy.num_tokens(request, 1, 10) == 4  # three empty lookups: still asking
    policy.record(request, 0, 0)
    # Two decodes off (not cooldown_steps), then the full guess again: finding nothing is no failure.
    assert [policy.num_tokens(request, 1, 10) for _ in range(3)] == [0, 0, 4]
    assert request.speculation.acceptance == pytest.approx(0.75) and request.speculation.backoff == 1
    for _ in range(4):  # still nothing: four decodes off, then eight (cooldown_steps) at most
        policy.record(request, 0, 0)
    assert [policy.num_tokens(request, 1, 10) for _ in range(5)] == [0] * 4 + [4]
    for pause in (8, 8):
        for _ in range(4):
            policy.record(request, 0, 0)
        assert request.speculation.paused_for == pause
        request.speculation.paused_for = 0
    policy.record(request, 4, 2)  # a guess found: the next pause for nothing is short again
    for _ in range(4):
        policy.record(request, 0, 0)
    assert request.speculation.paused_for == 2


def test_step_cost_is_measured_from_steps_of_different_sizes():
    cost = StepCost()
    assert cost.per_token == pytest.approx(0.3)  # the prior, before any evidence
    for tokens in (1, 5, 1, 64, 1, 3, 1, 9):
        cost.observe(tokens, 0.008 + 0.017 * tokens)  # this CPU: 8 ms a step plus 17 ms a token
    assert cost.per_token == pytest.approx(0.017 / 0.025, rel=1e-3)
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram"))
    policy.observe_step(1, 0.0)  # a step that took no time tells nothing
    assert policy.cost.per_token == pytest.approx(0.3)


def test_prometheus_reports_speculation_per_proposer():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from cadenza.api.metrics import ServerMetrics

    metrics = EngineMetrics()
    metrics.record_speculation("ngram", 4, 3)
    metrics.record_speculation("ngram", 4, 1)
    text = generate_latest(ServerMetrics(metrics).registry).decode()
    assert 'cadenza_spec_decode_proposed_tokens_total{method="ngram"} 8.0' in text
    assert 'cadenza_spec_decode_accepted_tokens_total{method="ngram"} 4.0' in text
    assert 'cadenza_spec_decode_acceptance_ratio{method="ngram"} 0.5' in text
    assert metrics.snapshot()["spec_acceptance_rate"] == 0.5
