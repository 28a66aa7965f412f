"""SchedulerCore driven against a real KVCacheManager, with the scheduler actor's own calls."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.actors.messages import SampledToken
from cadenza.actors.request_state import Request
from cadenza.actors.scheduler_core import QueueFullError, SchedulerCore, StepPlan, TokenEvent
from cadenza.config import SchedulerConfig
from cadenza.policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy
from cadenza.sampling_params import SamplingParams
from cadenza.step import PENDING_TOKEN, ScheduledChunk

EOS = 2


def make_core(block_size: int = 4, max_model_len: int = 4096, **config) -> SchedulerCore:
    config.setdefault("max_num_batched_tokens", max(config.get("chunk_size", 512), 512))
    return SchedulerCore(
        SchedulerConfig(**config), block_size=block_size, eos_token_ids=(EOS,), max_model_len=max_model_len
    )


_prompts = itertools.count()


def make_request(
    request_id: str,
    prompt_len: int = 4,
    max_tokens: int = 4,
    *,
    prompt=None,
    priority: int = 0,
    arrival: float = 0.0,
    **params,
) -> Request:
    """A request with `prompt`, or with a prompt of `prompt_len` tokens no other request shares."""
    if prompt is None:
        base = 10_000 + 1000 * next(_prompts)
        prompt = range(base, base + prompt_len)
    tokens = tuple(prompt)
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params), max_tokens, arrival, priority)


def next_token(request: Request) -> int:
    """The pretend model: never EOS, different per position."""
    return 1000 + len(request.output_token_ids)


@dataclass
class Step:
    plan: StepPlan
    chunks: list[ScheduledChunk]
    events: list[TokenEvent] = field(default_factory=list)

    def tokens(self, request_id: str) -> list[int]:
        return [len(c.token_ids) for c in self.chunks if c.request_id == request_id]


class Harness:
    """The scheduler actor's calls, synchronously: `schedule`, the cache manager's `allocate_step`,
    `apply_allocation`; a pretend model; then `finish_step`, commit, `update_from_output`, free."""

    def __init__(self, core: SchedulerCore, manager: KVCacheManager, sample=next_token) -> None:
        self.core = core
        self.manager = manager
        self.sample = sample
        self.finished: dict[str, TokenEvent] = {}  # the finishing event of each request
        self.failed: list[str] = []
        self.steps: list[Step] = []
        self.kv: dict[int, dict[int, int]] = {}  # block -> slot -> token, what the model wrote
        self.now = 0.0

    def add(self, request: Request) -> Request:
        self.core.add(request)
        return request

    def abort(self, request_id: str) -> None:
        if self.core.abort(request_id) is not None:
            self.manager.free(request_id)

    def plan(self) -> Step | None:
        """Plan, allocate and apply one step; None when there is nothing to run."""
        plan = self.core.schedule()
        if plan is None:
            return None
        allocation = self.manager.allocate_step(*plan.allocation_request(), plan.step_id)
        chunks = self.core.apply_allocation(plan, allocation, self.now)
        self.manager.check_invariants()
        for request in plan.preempted:
            assert self.manager.block_table(request.request_id) == ()
            assert request.num_computed_tokens == 0
            assert request in self.core.waiting or request.request_id in self.core.reading or request is plan.unschedulable
        if plan.unschedulable is not None:  # the actor fails it
            assert not self.core.running and not chunks
            self.manager.free(plan.unschedulable.request_id)
            self.failed.append(plan.unschedulable.request_id)
        if not chunks:
            return None
        self._check_step(chunks)
        return Step(plan, chunks)

    def finish(self, step: Step, sampled: tuple[SampledToken, ...]) -> None:
        assert self.core.finish_step(step.plan.step_id) is step.plan
        for request_id, tokens in self.core.computed_tokens(step.plan):
            self.manager.commit(request_id, tokens)
        step.events = self.core.update_from_output(sampled, step.plan)
        for event in step.events:
            if event.finish_reason is not None:
                assert event.request.request_id not in self.finished, "finished twice"
                self.finished[event.request.request_id] = event
                self.manager.free(event.request.request_id)
        self.manager.check_invariants()

    def run_model(self, step: Step) -> tuple[SampledToken, ...]:
        sampled = []
        for chunk in step.chunks:
            request = self.core.requests[chunk.request_id]
            if chunk.sample:
                sampled.append(SampledToken(chunk.request_id, self.sample(request)))
        return tuple(sampled)

    def step(self) -> Step | None:
        self.now += 1.0
        step = self.plan()
        if step is None:
            return None
        self.steps.append(step)
        self.finish(step, self.run_model(step))
        return step

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.core.has_work:
                return
            self.step()
        raise AssertionError("the workload did not finish")

    def _check_step(self, chunks: list[ScheduledChunk]) -> None:
        """Budgets, and what a model would see: every earlier position is in the blocks, none shared is written."""
        config, size = self.core.config, self.core.block_size
        assert sum(len(c.token_ids) for c in chunks) <= config.max_num_batched_tokens
        assert len(self.core.running) <= config.max_num_seqs
        assert len({c.request_id for c in chunks}) == len(chunks)
        for chunk in chunks:
            request = self.core.requests[chunk.request_id]
            start, n = chunk.start_position, len(chunk.token_ids)
            assert n > 0
            assert list(chunk.token_ids) == request.tokens(start, start + n)
            assert tuple(chunk.block_table) == self.manager.block_table(chunk.request_id)
            assert len(chunk.block_table) * size >= start + n
            assert chunk.sample == (start + n == request.num_tokens)
            assert chunk.prompt_token_ids is request.prompt_token_ids  # a reference, never a copy
            assert chunk.num_output_tokens == len(request.output_token_ids)
            tokens = request.all_tokens()
            for position in range(start):
                assert self.kv[chunk.block_table[position // size]][position % size] == tokens[position]
            for position in range(start, start + n):
                block = chunk.block_table[position // size]
                assert self.manager._ref[block] == 1, "a shared block is written"
                self.kv.setdefault(block, {})[position % size] = tokens[position]


def make_harness(num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True, **config) -> Harness:
    core = make_core(block_size=block_size, **config)
    manager = KVCacheManager(num_blocks, block_size, LRUPolicy(), enable_prefix_caching=prefix_caching)
    return Harness(core, manager)


def check_all_finished(h: Harness, requests: list[Request]) -> None:
    assert set(h.finished) == {r.request_id for r in requests}
    for request in requests:
        assert len(request.output_token_ids) == request.max_tokens
        assert h.finished[request.request_id].finish_reason == "length"
    assert not h.core.has_work and not h.core.requests
    h.manager.check_invariants()
    assert h.manager.num_available == h.manager.num_blocks


# --- budgets and chunking ------------------------------------------------------------------------


def test_a_single_request_prefills_then_decodes():
    h = make_harness()
    request = h.add(make_request("a", prompt_len=6, max_tokens=3))
    step = h.step()
    assert [(c.start_position, len(c.token_ids), c.sample) for c in step.chunks] == [(0, 6, True)]
    assert request.first_scheduled_time == 1.0 and request.output_token_ids == [1000]
    step = h.step()
    assert [(c.start_position, list(c.token_ids)) for c in step.chunks] == [(6, [1000])]
    h.run()
    assert request.output_token_ids == [1000, 1001, 1002]
    check_all_finished(h, [request])


def test_long_prompt_runs_in_chunks_beside_other_decodes():
    h = make_harness(chunk_size=32, max_num_batched_tokens=64)
    decoder = h.add(make_request("d", prompt_len=4, max_tokens=20))
    h.step()
    long = h.add(make_request("long", prompt_len=100, max_tokens=2))
    steps = [h.step() for _ in range(4)]
    assert [s.tokens("long") for s in steps] == [[32], [32], [32], [4]]
    assert [[c.sample for c in s.chunks if c.request_id == "long"] for s in steps] == [[False]] * 3 + [[True]]
    assert [c.start_position for s in steps for c in s.chunks if c.request_id == "long"] == [0, 32, 64, 96]
    # Every one of those steps also decodes the running request, first.
    assert [s.chunks[0].request_id for s in steps] == ["d"] * 4
    assert [s.tokens("d") for s in steps] == [[1]] * 4
    assert long.output_token_ids == [1000] and len(decoder.output_token_ids) == 5
    h.run()
    check_all_finished(h, [decoder, long])


def test_chunks_are_bounded_by_what_is_left_of_the_budget():
    h = make_harness(chunk_size=8, max_num_batched_tokens=8)
    running = [h.add(make_request(f"r{i}", prompt_len=2, max_tokens=10)) for i in range(3)]
    h.step()
    assert h.steps[0].tokens("r0") == [2]
    long = h.add(make_request("long", prompt_len=20, max_tokens=1))
    step = h.step()
    # Decodes come first; the new prompt gets what is left of the 8 tokens.
    assert [c.request_id for c in step.chunks] == ["r0", "r1", "r2", "long"]
    assert step.tokens("long") == [5]
    h.run()
    check_all_finished(h, running + [long])


def test_running_never_exceeds_max_num_seqs_and_waiting_is_admitted_fcfs():
    h = make_harness(max_num_seqs=2)
    requests = [h.add(make_request(f"r{i}", prompt_len=3, max_tokens=2 + i)) for i in range(5)]
    first = h.step()
    assert [c.request_id for c in first.chunks] == ["r0", "r1"]
    assert [r.request_id for r in h.core.waiting] == ["r2", "r3", "r4"]
    admitted = []
    while h.core.has_work:
        step = h.step()
        admitted += [c.request_id for c in step.chunks if c.start_position == 0]
    assert admitted == ["r2", "r3", "r4"]
    check_all_finished(h, requests)


def test_budgets_hold_on_a_random_workload():
    rng = random.Random(7)
    h = make_harness(num_blocks=40, max_num_seqs=5, chunk_size=16, max_num_batched_tokens=24)
    requests = []
    for i in range(40):
        requests.append(h.add(make_request(f"r{i}", prompt_len=rng.randrange(1, 40), max_tokens=rng.randrange(1, 12))))
        for _ in range(rng.randrange(3)):
            h.step()  # _check_step asserts the budgets on every step
    h.run()
    check_all_finished(h, requests)
    assert h.core.num_preemptions > 0


# --- preemption ----------------------------------------------------------------------------------


def test_last_admitted_request_is_preempted_to_the_front_of_the_queue():
    # 4 blocks of 4: a and b (4-token prompts) fill two blocks each by their 8th token, and the
    # decode that needs a 3rd block for a preempts b, the last admitted. c waits for a seat.
    h = make_harness(num_blocks=4, prefix_caching=False, max_num_seqs=2, chunk_size=8, max_num_batched_tokens=16)
    a = h.add(make_request("a", max_tokens=8))
    b = h.add(make_request("b", max_tokens=8))
    c = h.add(make_request("c", max_tokens=1))
    while not b.num_preemptions:
        step = h.step()
    assert h.core.num_preemptions == 1
    assert step.plan.preempted == [b]
    assert [r.request_id for r in h.core.running] == ["a"]
    assert [r.request_id for r in h.core.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and h.manager.block_table("b") == ()
    generated = list(b.output_token_ids)
    assert len(generated) == 5
    # b comes back once a has finished, ahead of c, recomputes its prompt and the tokens it
    # generated in chunks of 8, and samples only at the end.
    recompute = []
    while not recompute or not recompute[-1].sample:
        step = h.step()
        recompute += [c for c in step.chunks if c.request_id == "b"]
        if len(recompute) == 1:
            assert "a" in h.finished and [c.request_id for c in step.chunks] == ["b", "c"]
    assert [(c.start_position, len(c.token_ids), c.sample) for c in recompute] == [(0, 8, False), (8, 1, True)]
    assert [t for c in recompute for t in c.token_ids] == list(b.prompt_token_ids) + generated
    assert b.output_token_ids[:5] == generated and len(b.output_token_ids) == 6
    h.run()
    assert b.num_preemptions == 1
    check_all_finished(h, [a, b, c])


def test_a_preempted_request_waits_for_a_tier_read_then_heads_the_queue():
    """With a tier below the budget (gate_reads), a preempted request waits outside the queue
    while the scheduler has its blocks read back, then goes where its preemption would have put it
    (first, under fcfs), and computes from there as it would have."""
    h = make_harness(num_blocks=4, prefix_caching=False, max_num_seqs=2, chunk_size=8, max_num_batched_tokens=16)
    h.core.gate_reads = True
    a = h.add(make_request("a", max_tokens=8))
    b = h.add(make_request("b", max_tokens=8))
    c = h.add(make_request("c", max_tokens=1))
    while not b.num_preemptions:
        step = h.step()
    assert step.plan.preempted == [b] and h.core.reading == {"b": b}
    assert [r.request_id for r in h.core.waiting] == ["c"]  # b is not queued while it reads
    assert h.core.open_gate("b") and not h.core.reading
    assert [r.request_id for r in h.core.waiting] == ["b", "c"]
    h.run()
    assert b.num_preemptions == 1 and len(b.output_token_ids) == 8
    check_all_finished(h, [a, b, c])


def test_running_request_that_cannot_fit_preempts_itself_and_then_fails():
    # a's prompt alone needs more blocks than exist.
    h = make_harness(num_blocks=2, chunk_size=4, max_num_batched_tokens=16)
    a = h.add(make_request("a", prompt_len=12))
    h.run()
    assert h.failed == ["a"] and a.num_preemptions == 1
    assert h.manager.num_available == 2


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_a_tight_cache_finishes_every_request_exactly_once(seed, prefix_caching):
    rng = random.Random(seed)
    h = make_harness(
        num_blocks=12, prefix_caching=prefix_caching, max_num_seqs=6, chunk_size=8, max_num_batched_tokens=16
    )
    shared = tuple(range(200, 208))
    requests = []
    for i in range(30):
        tail = tuple(rng.randrange(300, 400) for _ in range(rng.randrange(1, 10)))
        prompt = (shared if rng.random() < 0.5 else ()) + tail
        requests.append(h.add(make_request(f"r{i}", prompt=prompt, max_tokens=rng.randrange(1, 14))))
        if rng.random() < 0.5:
            h.step()
    h.run()
    assert not h.failed
    check_all_finished(h, requests)
    assert h.core.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == h.core.num_preemptions


def test_preemption_counts_shared_blocks_exactly_in_one_exchange():
    # 5 blocks of 4, chunks of 4. a's prompt is two blocks b shares and a third of its own; b is
    # admitted once a has cached the two. From step 4 on, x, a and b each need a new block and
    # none is free. Releasing b frees only its own block (a still holds the two shared ones), not
    # enough for x and a: the cache manager keeps x alone, preempting a and b in the same answer.
    h = make_harness(num_blocks=5, chunk_size=4, max_num_batched_tokens=64)
    shared = tuple(range(500, 508))
    x = h.add(make_request("x", prompt_len=2, max_tokens=6))
    a = h.add(make_request("a", prompt=shared + (1, 1, 1, 1), max_tokens=4))
    h.step()
    h.step()
    b = h.add(make_request("b", prompt=shared + (7, 7, 7, 7), max_tokens=4))
    h.step()
    assert b.num_cached_tokens == 8 and h.manager.block_table("b")[:2] == h.manager.block_table("a")[:2]
    assert h.manager.num_available == 0 and h.core.running == [x, a, b]
    step = h.step()
    assert step.plan.preempted == [a, b]
    assert [c.request_id for c in step.chunks] == ["x"]
    assert h.core.waiting == [a, b] and h.core.running == [x]
    assert a.num_computed_tokens == 0 and a.num_preemptions == b.num_preemptions == 1
    h.run()
    check_all_finished(h, [x, a, b])


def test_request_too_big_for_the_cache_is_failed_when_nothing_else_runs():
    # fcfs: the request that preempted itself is at the head of the queue, where the actor fails it.
    h = make_harness(num_blocks=4, max_num_seqs=1, chunk_size=4, max_num_batched_tokens=16)
    big = h.add(make_request("big", max_tokens=20))  # 24 tokens: 6 blocks of the 4 there are
    small = h.add(make_request("small", max_tokens=2))
    h.run()
    assert h.failed == ["big"] and big.num_preemptions == 1
    check_all_finished(h, [small])


def test_priority_request_too_big_for_the_cache_is_failed_not_a_better_ranked_one():
    # big runs alone (max_num_seqs=1) until it needs a 5th block of 4: it preempts itself, and
    # although small outranks it, big must be the head of the queue, which the actor fails when
    # nothing runs.
    h = make_harness(num_blocks=4, policy="priority", max_num_seqs=1, chunk_size=4, max_num_batched_tokens=16)
    big = h.add(make_request("big", priority=1, max_tokens=20))
    h.step()
    small = h.add(make_request("small", priority=0, max_tokens=2))
    while big.num_computed_tokens < 16:
        h.step()
    assert h.core.waiting == [small]
    assert h.step() is None
    assert h.failed == ["big"] and big.num_preemptions == 1
    assert h.core.waiting == [small] and not h.core.running
    h.run()
    check_all_finished(h, [small])


def test_priority_self_preemption_behind_others_keeps_the_rank_order():
    # b preempts itself while a runs ahead of it: it is not the whole cache's fault, so it queues
    # by rank, behind c.
    h = make_harness(
        num_blocks=5, prefix_caching=False, policy="priority", max_num_seqs=2, chunk_size=4, max_num_batched_tokens=16
    )
    a = h.add(make_request("a", priority=0, max_tokens=12))
    b = h.add(make_request("b", priority=2, max_tokens=12))
    h.step()
    c = h.add(make_request("c", priority=1, max_tokens=1))
    while a.num_computed_tokens < 8:
        h.step()
    step = h.step()
    assert step.plan.preempted == [b] and [c.request_id for c in step.chunks] == ["a"]
    assert h.core.waiting == [c, b]
    h.run()
    check_all_finished(h, [a, b, c])


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_with_aborts_stops_and_tiny_caches(seed):
    """Whatever the configuration, every request ends exactly once, for a reason that holds, and
    only requests that cannot fit in the whole cache fail."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randrange(2, 30)
    chunk_size = rng.choice([1, 2, 3, 4, 8, 16])
    core = make_core(
        block_size=block_size,
        max_model_len=rng.choice([30, 4096]),
        chunk_size=chunk_size,
        max_num_batched_tokens=chunk_size + rng.randrange(0, 40),
        max_num_seqs=rng.randrange(1, 8),
        policy=rng.choice(["fcfs", "priority"]),
    )
    policy = rng.choice([LRUPolicy, LFUPolicy, FIFOPolicy])()
    manager = KVCacheManager(num_blocks, block_size, policy, enable_prefix_caching=rng.random() < 0.7)

    def sample(request: Request) -> int:
        x = rng.random()
        return EOS if x < 0.03 else 9 if x < 0.05 else rng.choice([1000, 1001, 1002])

    h = Harness(core, manager, sample)
    prefixes = [tuple(rng.randrange(200, 210) for _ in range(rng.randrange(0, 20))) for _ in range(3)]
    requests: dict[str, Request] = {}
    for t in range(300):
        x = rng.random()
        if x < 0.15 and len(requests) < 40:
            tokens = (rng.choice(prefixes) + tuple(rng.randrange(300, 305) for _ in range(rng.randrange(1, 12))))[:25]
            request = make_request(
                f"r{t}",
                prompt=tokens,
                max_tokens=rng.randrange(1, 15),
                priority=rng.randrange(3),
                arrival=float(t),
                stop_token_ids=[9],
                ignore_eos=rng.random() < 0.3,
            )
            requests[request.request_id] = h.add(request)
        elif x < 0.18 and h.core.requests:
            request_id = rng.choice(sorted(h.core.requests))
            h.abort(request_id)
            del requests[request_id]
        elif h.core.has_work:
            h.step()
    h.run()
    for request_id, request in requests.items():
        if request_id in h.failed:
            assert -(-request.num_tokens // block_size) > num_blocks, "a request that fits was failed"
            continue
        reason = h.finished[request_id].finish_reason
        if reason == "length":
            assert len(request.output_token_ids) == request.max_tokens or request.num_tokens >= core.max_model_len
        else:
            assert reason == "stop" and request.output_token_ids[-1] in (9, EOS)
            assert request.output_token_ids[-1] == 9 or not request.params.ignore_eos
    manager.check_invariants()
    assert manager.num_available == num_blocks


# --- priority ------------------------------------------------------------------------------------


def test_priority_policy_admits_lower_values_first():
    h = make_harness(policy="priority", max_num_seqs=1)
    low = h.add(make_request("low", priority=5, max_tokens=1))
    high = h.add(make_request("high", priority=0, max_tokens=1))
    mid = h.add(make_request("mid", priority=2, max_tokens=1))
    assert [r.request_id for r in h.core.waiting] == ["high", "mid", "low"]
    order = [h.step().chunks[0].request_id for _ in range(3)]
    assert order == ["high", "mid", "low"]
    check_all_finished(h, [low, high, mid])


def test_priority_policy_breaks_ties_by_arrival():
    h = make_harness(policy="priority", max_num_seqs=1)
    late = h.add(make_request("late", priority=1, arrival=2.0, max_tokens=1))
    early = h.add(make_request("early", priority=1, arrival=1.0, max_tokens=1))
    assert h.core.waiting == [early, late]


def test_priority_policy_preempts_the_worst_ranked():
    # Same cache as the fcfs case, but the last admitted has the best priority: the middle one goes.
    h = make_harness(num_blocks=6, prefix_caching=False, policy="priority", chunk_size=4, max_num_batched_tokens=16)
    a = h.add(make_request("a", priority=1, max_tokens=8))
    b = h.add(make_request("b", priority=3, max_tokens=8))
    h.step()
    c = h.add(make_request("c", priority=0, prompt_len=3, max_tokens=8))
    while not h.core.num_preemptions:
        step = h.step()
    assert step.plan.preempted == [b]
    assert [r.request_id for r in h.core.running] == ["c", "a"]
    assert h.core.waiting == [b]
    h.run()
    check_all_finished(h, [a, b, c])


def test_priority_preempted_request_queues_by_rank():
    h = make_harness(num_blocks=4, prefix_caching=False, policy="priority", chunk_size=4, max_num_batched_tokens=16)
    a = h.add(make_request("a", priority=1, max_tokens=8))
    b = h.add(make_request("b", priority=2, max_tokens=8))
    h.step()
    better = h.add(make_request("better", priority=0, prompt_len=12, max_tokens=1))
    worse = h.add(make_request("worse", priority=9, max_tokens=1))
    while not h.core.num_preemptions:
        h.step()
    assert [r.request_id for r in h.core.waiting] == ["better", "b", "worse"]
    h.run()
    check_all_finished(h, [a, b, better, worse])


# --- finishing -----------------------------------------------------------------------------------


def run_one(sample, max_model_len: int = 4096, **params) -> tuple[Request, Harness]:
    h = make_harness(max_model_len=max_model_len)
    h.sample = sample
    request = h.add(make_request("a", **params))
    h.run()
    return request, h


def test_eos_finishes_with_stop():
    request, h = run_one(lambda r: EOS if len(r.output_token_ids) == 2 else 7, max_tokens=10)
    assert request.output_token_ids == [7, 7, EOS] and h.finished["a"].finish_reason == "stop"
    assert h.manager.num_available == h.manager.num_blocks


def test_eos_is_ignored_with_ignore_eos():
    request, h = run_one(lambda r: EOS, max_tokens=5, ignore_eos=True)
    assert request.output_token_ids == [EOS] * 5 and h.finished["a"].finish_reason == "length"


def test_stop_token_ids_finish_with_stop():
    request, h = run_one(lambda r: 9 if len(r.output_token_ids) == 1 else 7, max_tokens=10, stop_token_ids=[9])
    assert request.output_token_ids == [7, 9] and h.finished["a"].finish_reason == "stop"


def test_stop_token_ids_apply_even_with_ignore_eos():
    request, h = run_one(lambda r: 9, max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    assert request.output_token_ids == [9] and h.finished["a"].finish_reason == "stop"


def test_max_tokens_finishes_with_length():
    request, h = run_one(next_token, max_tokens=3)
    assert len(request.output_token_ids) == 3 and h.finished["a"].finish_reason == "length"
    # One event per token, the last one finishing.
    events = [e for s in h.steps for e in s.events]
    assert [e.finish_reason for e in events] == [None, None, "length"]


def test_max_model_len_finishes_with_length():
    request, h = run_one(next_token, max_model_len=10, prompt_len=6, max_tokens=100)
    assert request.num_tokens == 10 and len(request.output_token_ids) == 4
    assert h.finished["a"].finish_reason == "length"


# --- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_request():
    h = make_harness(max_num_seqs=1)
    a = h.add(make_request("a", max_tokens=3))
    h.add(make_request("b", max_tokens=3))
    h.step()
    assert h.core.abort("b").request_id == "b"
    assert h.core.waiting == [] and "b" not in h.core.requests
    assert h.core.abort("b") is None
    h.run()
    check_all_finished(h, [a])


def test_abort_running_request_releases_its_blocks():
    h = make_harness()
    a = h.add(make_request("a", max_tokens=5))
    b = h.add(make_request("b", max_tokens=5))
    h.step()
    h.abort("b")
    assert h.core.running == [a] and h.manager.block_table("b") == ()
    h.run()
    check_all_finished(h, [a])
    assert b.output_token_ids == [1000]


def test_tokens_of_a_request_aborted_during_its_step_are_ignored():
    h = make_harness()
    a = h.add(make_request("a", max_tokens=5))
    b = h.add(make_request("b", max_tokens=5))
    step = h.plan()
    sampled = h.run_model(step)
    h.abort("b")  # arrives while the step runs
    assert [rid for rid, _ in h.core.computed_tokens(step.plan)] == ["a"]
    h.finish(step, sampled)
    assert [e.request.request_id for e in step.events] == ["a"]
    assert b.output_token_ids == [] and a.output_token_ids == [1000]
    h.run()
    check_all_finished(h, [a])


def test_a_plan_changes_nothing_until_it_is_applied():
    # If the exchange with the cache manager breaks, the actor fails; until the answer is applied
    # the plan has taken no request from the queue and preempted none.
    h = make_harness(num_blocks=2, chunk_size=4, max_num_batched_tokens=16)
    a = h.add(make_request("a", prompt_len=4, max_tokens=8))
    h.step()
    h.add(make_request("b"))
    plan = h.core.schedule()
    assert [(r.request_id, n) for r, n in plan.running] == [("a", 1)]
    assert [(r.request_id, n) for r, n in plan.candidates] == [("b", 4)]
    assert [r.request_id for r in h.core.waiting] == ["b"] and h.core.running == [a]
    assert not h.core.in_flight and a.num_computed_tokens == 4
    assert [r.request_id for r in h.core.fail(list(h.core.requests))] == ["a", "b"]
    assert not h.core.has_work and not h.core.requests


def test_queue_past_max_waiting_refuses_new_requests():
    h = make_harness(max_waiting=2, max_num_seqs=1)
    h.add(make_request("a"))
    h.add(make_request("b"))
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        h.add(make_request("c"))
    assert "c" not in h.core.requests
    h.step()  # a runs: one seat in the queue again
    h.add(make_request("c"))


def test_fail_removes_requests():
    h = make_harness()
    a = h.add(make_request("a"))
    h.add(make_request("b"))
    h.step()
    assert [r.request_id for r in h.core.fail(["b", "missing"])] == ["b"]
    assert h.core.running == [a]


def test_duplicate_request_id_is_rejected():
    h = make_harness()
    h.add(make_request("a"))
    with pytest.raises(ValueError):
        h.add(make_request("a"))


def test_prefix_hit_skips_cached_prompt_tokens():
    h = make_harness(chunk_size=16, max_num_batched_tokens=64)
    prompt = tuple(range(300, 310))
    a = h.add(make_request("a", prompt=prompt, max_tokens=2))
    h.run()
    b = h.add(make_request("b", prompt=prompt, max_tokens=2))
    step = h.step()
    assert [(c.start_position, len(c.token_ids)) for c in step.chunks] == [(8, 2)]
    assert b.num_cached_tokens == 8 and step.chunks[0].sample
    h.run()
    check_all_finished(h, [a, b])
    assert a.num_cached_tokens == 0


# --- two steps in flight (async scheduling) ---------------------------------------------------------


def allocate(core: SchedulerCore, manager: KVCacheManager) -> tuple[StepPlan, list[ScheduledChunk]]:
    plan = core.schedule()
    chunks = core.apply_allocation(plan, manager.allocate_step(*plan.allocation_request(), plan.step_id), 0.0)
    manager.check_invariants()
    return plan, chunks


def test_the_next_step_is_planned_while_one_runs_with_a_placeholder_token():
    core = make_core(async_scheduling=True)
    manager = KVCacheManager(16, 4, LRUPolicy())
    a = make_request("a", prompt_len=4, max_tokens=2)
    core.add(a)
    first, [prefill] = allocate(core, manager)
    assert (prefill.start_position, prefill.sample, prefill.num_output_tokens) == (0, True, 0)
    assert core.can_schedule  # one step in flight of two
    second, [decode] = allocate(core, manager)
    # Its input is the token the first step is still sampling; counting it, a has one output.
    assert list(decode.token_ids) == [PENDING_TOKEN] and decode.start_position == 4
    assert decode.num_output_tokens == 1 and not core.can_schedule
    # max_tokens=2: both tokens are being sampled, so nothing more is planned for a.
    assert core.finish_step(first.step_id) is first
    assert core.can_schedule and core.schedule() is None
    assert [e.token.token_id for e in core.update_from_output((SampledToken("a", 7),), first)] == [7]
    assert core.finish_step(second.step_id) is second
    events = core.update_from_output((SampledToken("a", 8),), second)
    assert [(e.token.token_id, e.finish_reason) for e in events] == [(8, "length")]
    assert a.output_token_ids == [7, 8] and not core.has_work
    with pytest.raises(RuntimeError):
        core.finish_step(second.step_id)


def test_a_token_sampled_before_a_preemption_is_stale():
    # 3 blocks of 4. a and b fill one block each in the first step; the second, planned while the
    # first runs, needs a new block for each: one is free, so b (the last admitted) is preempted
    # while its first token is being sampled. That token is dropped, and b's recompute tells the
    # runner it has no output yet, so the runner drops the token it kept too.
    core = make_core(async_scheduling=True)
    manager = KVCacheManager(3, 4, LRUPolicy(), enable_prefix_caching=False)
    a = make_request("a", prompt_len=4, max_tokens=3)
    b = make_request("b", prompt_len=4, max_tokens=3)
    core.add(a)
    core.add(b)
    first, chunks = allocate(core, manager)
    assert [(c.request_id, c.sample) for c in chunks] == [("a", True), ("b", True)]
    second, chunks = allocate(core, manager)
    assert second.preempted == [b] and [c.request_id for c in chunks] == ["a"]
    assert core.waiting == [b] and b.epoch == 1 and manager.block_table("b") == ()
    core.finish_step(first.step_id)
    assert [r for r, _ in core.computed_tokens(first)] == ["a"]
    events = core.update_from_output((SampledToken("a", 7), SampledToken("b", 7)), first)
    assert [e.request.request_id for e in events] == ["a"] and b.output_token_ids == []
    core.finish_step(second.step_id)
    core.update_from_output((SampledToken("a", 8),), second)
    while "b" in core.requests:
        plan, chunks = allocate(core, manager)
        for chunk in chunks:
            if chunk.request_id == "b" and chunk.start_position == 0:
                assert chunk.num_output_tokens == 0 and list(chunk.token_ids) == list(b.prompt_token_ids)
        core.finish_step(plan.step_id)
        for event in core.update_from_output(tuple(SampledToken(c.request_id, 9) for c in chunks if c.sample), plan):
            if event.finish_reason is not None:
                manager.free(event.request.request_id)
    assert a.output_token_ids == [7, 8, 9] and b.output_token_ids == [9, 9, 9]
    manager.check_invariants()
    assert manager.num_available == 3
