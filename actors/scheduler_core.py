"""Iteration-level scheduling: which requests run how many tokens in the next step.

Each step spends a token budget: running requests first (a decode costs one token, a prompt still
being prefilled costs up to a chunk), then waiting requests in queue order while sequences, budget
and KV blocks allow. So a long prompt is split into chunks that ride along with other requests'
decodes instead of stalling them. When running requests need blocks that are not there, the
lowest-ranked running request is preempted: its blocks are released and it is recomputed later
from its prompt and the tokens it already generated.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from cadenza.actors.request_state import Request
from cadenza.config import SchedulerConfig
from cadenza.messages import BlockRequest, SampledToken, StepAllocation
from cadenza.model_runner import ScheduledChunk


@dataclass
class StepPlan:
    step_id: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # running: (request, new tokens)
    admitted: list[tuple[Request, int]] = field(default_factory=list)  # from the queue
    preempted: list[Request] = field(default_factory=list)
    chunks: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, count), once granted
    epochs: dict[str, int] = field(default_factory=dict)  # each chunk's request epoch when planned

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.admitted

    def block_requests(self) -> tuple[BlockRequest, ...]:
        running = [BlockRequest(r.request_id, r.num_computed_tokens + n) for r, n in self.scheduled]
        new = [BlockRequest(r.request_id, n, r.all_tokens()) for r, n in self.admitted]
        return tuple(running + new)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request: Request
    token: SampledToken
    finish_reason: str | None


class SchedulerCore:
    """Synchronous: unit tests drive it directly, the scheduler actor moves its messages."""

    def __init__(self, config: SchedulerConfig, *, block_size: int, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.config = config
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_free_blocks = 0  # as the cache manager last reported
        self.num_preemptions = 0
        self._step_ids = 0
        self._admissions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._admissions += 1
        request.sequence_number = self._admissions
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # Otherwise a plan not yet applied took it from the queue (the actor's error path fails
        # every request after a step failed between `schedule` and `apply_allocation`).
        return request

    # --- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._step_ids += 1
        plan = StepPlan(self._step_ids)
        budget = self.config.max_num_batched_tokens
        chunk = self.config.chunk_size
        free = self.num_free_blocks
        running = self.running
        if self.config.policy == "priority":
            running.sort(key=lambda r: r.queue_key("priority"))
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            remaining = request.num_planned_tokens - request.num_computed_tokens
            if remaining <= 0 or self._will_be_done(request):
                i += 1  # waiting on the token a step in flight samples, or done once it lands
                continue
            n = min(remaining, chunk, budget)
            need = self._blocks_needed(request, n)
            while need > free and running[-1] is not request:
                free += self._preempt(running.pop(), plan)
            if need > free:
                # It does not fit even with every request ranked below it preempted. If nothing is
                # scheduled before it, it needs more than the whole cache: it goes to the head of
                # the queue whatever the policy, so the queue's head is the request that cannot
                # fit (the actor fails the head when nothing runs), not a better-ranked bystander.
                free += self._preempt(running.pop(), plan, front=not plan.scheduled)
                break
            free -= need
            budget -= n
            plan.scheduled.append((request, n))
            i += 1
        # Admitting while preempting would only preempt again next step.
        if not plan.preempted:
            while self.waiting and len(running) + len(plan.admitted) < self.config.max_num_seqs and budget > 0:
                request = self.waiting[0]
                n = min(request.num_tokens, chunk, budget)
                need = -(-n // self.block_size)
                if need > free:
                    break
                self.waiting.pop(0)
                free -= need
                budget -= n
                plan.admitted.append((request, n))
        return plan

    def apply_allocation(self, plan: StepPlan, allocation: StepAllocation, now: float) -> list[ScheduledChunk] | None:
        """Chunks for the runner, or None when running requests got no blocks (plan again)."""
        self.num_free_blocks = allocation.num_free_blocks
        grants = {g.request_id: g for g in allocation.grants}
        if any(not grants[r.request_id].granted for r, _ in plan.scheduled):
            for request, _ in reversed(plan.admitted):
                self.waiting.insert(0, request)
            return None
        for request, n in plan.scheduled:
            self._set_blocks(request, grants[request.request_id].block_table)
            plan.chunks.append((request, request.num_computed_tokens, n))
        refused = [r for r, _ in plan.admitted if not grants[r.request_id].granted]
        for request in reversed(refused):
            self.waiting.insert(0, request)
        for request, n in plan.admitted:
            grant = grants[request.request_id]
            if not grant.granted:
                continue
            self._set_blocks(request, grant.block_table)
            request.num_computed_tokens = grant.num_cached_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = grant.num_cached_tokens
            self.running.append(request)
            plan.chunks.append((request, grant.num_cached_tokens, min(n, request.num_tokens - grant.num_cached_tokens)))
        chunks = []
        for request, start, n in plan.chunks:
            request.num_computed_tokens = start + n
            sample = request.num_computed_tokens == request.num_planned_tokens
            chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=request.tokens(start, start + n),
                    start_position=start,
                    block_table=request.block_table,
                    sample=sample,
                    params=request.params,
                    prompt_token_ids=request.prompt_token_ids,
                    # A snapshot: the scheduler appends to the list while the step runs.
                    output_token_ids=tuple(request.output_token_ids),
                    generator=request.generator,
                )
            )
            plan.epochs[request.request_id] = request.epoch
            if sample:
                request.num_pending += 1
        return chunks

    # --- results --------------------------------------------------------------------------------

    def computed_tokens(self, plan: StepPlan) -> list[tuple[str, tuple[int, ...]]]:
        """What each live request of the step now has in its blocks (for the prefix cache)."""
        return [
            (r.request_id, tuple(r.tokens(start, start + n)))
            for r, start, n in plan.chunks
            if self.requests.get(r.request_id) is r and self._is_current(r, plan)
        ]

    def update_from_output(self, sampled: tuple[SampledToken, ...], plan: StepPlan | None = None) -> list[TokenEvent]:
        """Append each sampled token (`plan`: the step that sampled them, to spot stale ones)."""
        events = []
        for token in sampled:
            request = self.requests.get(token.request_id)
            if request is None or request not in self.running:
                continue  # aborted, finished or preempted while its step ran
            if plan is not None and not self._is_current(request, plan):
                continue  # sampled before a preemption: the request recomputes instead
            request.num_pending = max(0, request.num_pending - 1)
            request.output_token_ids.append(token.token_id)
            reason = self._finish_reason(request, token.token_id)
            if reason is not None:
                self.running.remove(request)
                del self.requests[request.request_id]
            events.append(TokenEvent(request, token, reason))
        return events

    def fail(self, request_ids) -> list[Request]:
        return [r for r in (self.abort(i) for i in request_ids) if r is not None]

    # --- internals ------------------------------------------------------------------------------

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _is_current(request: Request, plan: StepPlan) -> bool:
        return plan.epochs.get(request.request_id, request.epoch) == request.epoch

    def _will_be_done(self, request: Request) -> bool:
        """Its steps in flight already sample its last token (length limit): nothing to plan."""
        if not request.num_pending:
            return False
        produced = len(request.output_token_ids) + request.num_pending
        return produced >= request.max_tokens or request.num_planned_tokens >= self.max_model_len

    def _blocks_needed(self, request: Request, n: int) -> int:
        return max(0, -(-(request.num_computed_tokens + n) // self.block_size) - request.num_blocks)

    def _set_blocks(self, request: Request, table: tuple[int, ...]) -> None:
        request.block_table = table
        request.num_blocks = len(table)

    def _preempt(self, request: Request, plan: StepPlan, front: bool = False) -> int:
        """Back to the queue, to be recomputed; returns the blocks it held."""
        held = request.num_blocks
        request.num_computed_tokens = 0
        request.num_pending = 0
        request.epoch += 1
        request.num_preemptions += 1
        self._set_blocks(request, ())
        self.num_preemptions += 1
        plan.preempted.append(request)
        self._enqueue(request, front=front or self.config.policy == "fcfs")
        return held

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.insert(0, request)
        elif self.config.policy == "priority":
            keys = [r.queue_key("priority") for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, request.queue_key("priority")), request)
        else:
            self.waiting.append(request)
