"""Iteration-level scheduling: which requests run how many tokens in the next step.

Policy is orders, mechanism is prefixes. Each step spends a token budget on the running requests
in rank order (a decode costs one token, a prompt still being prefilled up to a chunk), then
offers the queue's head requests as admission candidates while sequences and budget allow. So a
long prompt is split into chunks that ride along with other requests' decodes instead of stalling
them. The cache manager answers the ranked lists exactly, in one exchange: it keeps the longest
prefix of the running requests that fits (the ones below are preempted: their blocks are released
and they are recomputed later from their prompt and the tokens they already generated) and, if it
preempted none, admits the longest prefix of the candidates that fits.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from cadenza.actors.messages import BlockNeed, Candidate, SampledToken, StepAllocation
from cadenza.actors.request_state import Request
from cadenza.config import SchedulerConfig
from cadenza.config.schema import SpeculativeConfig
from cadenza.speculative.policy import SpeculationPolicy
from cadenza.step import Pooled, PromptLogprobs, ScheduledChunk, Speculation


class QueueFullError(Exception):
    """`max_waiting` requests are queued: a new one is refused (error code `queue_full`)."""


@dataclass
class StepPlan:
    step_id: int
    running: list[tuple[Request, int]] = field(default_factory=list)  # best first: (request, new tokens)
    candidates: list[tuple[Request, int]] = field(default_factory=list)  # queue order: (request, first chunk)
    preempted: list[Request] = field(default_factory=list)  # once allocated
    unschedulable: Request | None = None  # nothing runs and the queue's head did not fit: failed
    chunks: list[tuple[Request, int, int, tuple[int, ...]]] = field(default_factory=list)  # (request, start, count, blocks)
    epochs: dict[str, int] = field(default_factory=dict)  # each chunk's request epoch when planned
    speculative: dict[str, int] = field(default_factory=dict)  # decodes' guess slots, by request id
    accepted: dict[str, int] = field(default_factory=dict)  # guesses kept, once the step is back

    def allocation_request(self) -> tuple[tuple[BlockNeed, ...], tuple[Candidate, ...]]:
        """What to ask the cache manager: every running request with the tokens its blocks must
        cover after this step (guess slots included: of this step, or of its step in flight, whose
        blocks must stay), then the candidates with their tokens for prefix matching."""
        running = tuple(
            BlockNeed(r.request_id, r.num_computed_tokens + n + r.num_draft_slots + self.speculative.get(r.request_id, 0))
            for r, n in self.running
        )
        waiting = tuple(Candidate(r.request_id, r.all_tokens(), n, r.max_cached_tokens, r.params.cache_salt)
                        for r, n in self.candidates)
        return running, waiting


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request: Request
    token: SampledToken
    finish_reason: str | None


class SchedulerCore:
    """Synchronous: unit tests drive it directly, the scheduler actor moves its messages.

    A step: `schedule` plans the budget, the cache manager answers `plan.allocation_request()`,
    `apply_allocation` turns the answer into chunks (the step is then in flight), and when the
    runner is done `finish_step`, `computed_tokens` and `update_from_output` take its results.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        device_type: str = "cpu",
        gate_reads: bool = False,
    ):
        """`device_type`: the model's ("cpu", "cuda"), which sets the token budget and chunk size
        the configuration leaves unset (`SchedulerConfig.for_device`). `gate_reads`: a tier below
        the KV budget may hold a request's blocks (`wants_read`), so the scheduler has them read
        while the request waits outside the queue (`reading`)."""
        self.config = config.for_device(device_type)
        self.gate_reads = gate_reads
        # None: no proposer was built, nothing speculates.
        self.speculation = SpeculationPolicy(speculative) if speculative is not None else None
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_in_flight = 2 if config.async_scheduling else 1
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Gated: requests whose prefix is being read back from a tier below the KV budget; queued
        # once the read ends (`open_gate`), so their admission finds it as a prefix hit.
        self.reading: dict[str, Request] = {}
        self.in_flight: deque[StepPlan] = deque()  # steps sent to the runner, oldest first
        self.num_preemptions = 0
        self._step_ids = 0
        self._admissions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def can_schedule(self) -> bool:
        return self.has_work and len(self.in_flight) < self.max_in_flight

    def add(self, request: Request, gated: bool = False) -> None:
        """Queue a new request; `QueueFullError` past `max_waiting` (the queue's length is exact here).
        `gated`: it waits outside the queue until `open_gate` (a tier read under way)."""
        if len(self.waiting) + len(self.reading) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting) + len(self.reading)} requests are waiting; try again later")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._admissions += 1
        request.sequence_number = self._admissions
        self.requests[request.request_id] = request
        if gated:
            self.reading[request.request_id] = request
        else:
            self._enqueue(request)

    def wants_read(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens (a new one's prompt, a preempted one's prompt
        and output) waits for a tier read before it queues: more than a block, and tiers to read."""
        return self.gate_reads and num_tokens > self.block_size

    def open_gate(self, request_id: str) -> bool:
        """The gated request `request_id` joins the queue; False if it is not gated (gone since).
        A preempted one goes where its preemption would have put it: first, under fcfs."""
        request = self.reading.pop(request_id, None)
        if request is None:
            return False
        self._enqueue(request, front=request.num_preemptions > 0 and self.config.policy == "fcfs")
        return True

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.reading.pop(request_id, None)
        return request

    # --- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step's budget; None when there is nothing to ask for (every running
        request waits on a token in flight and nobody is queued)."""
        budget = self.config.max_num_batched_tokens
        chunk = self.config.chunk_size
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: r.queue_key("priority"))
        plan = StepPlan(self._step_ids + 1)
        for request in self.running:
            n = 0
            remaining = request.num_planned_tokens - request.num_computed_tokens
            # 0 when waiting on the token a step in flight samples, or done once it lands; or while
            # a step in flight verifies guesses: how many tokens it keeps is unknown until it lands
            # (so a speculating request gives up async overlap for that step).
            if budget > 0 and remaining > 0 and not request.num_draft_slots and not self._will_be_done(request):
                n = min(remaining, chunk, budget)
                budget -= n
                if self.speculation is not None and remaining == 1 and request.num_computed_tokens >= request.num_prompt_tokens:
                    k = self.speculation.num_tokens(request, len(self.running), self._guess_room(request, budget))
                    if k:
                        plan.speculative[request.request_id] = k
                        budget -= k
            plan.running.append((request, n))
        seats = self.config.max_num_seqs - len(self.running)
        for request in self.waiting:
            if len(plan.candidates) >= seats or budget <= 0:
                break
            n = min(request.num_tokens, chunk, budget)
            budget -= n
            plan.candidates.append((request, n))
        if not plan.candidates and not any(n for _, n in plan.running):
            return None
        self._step_ids += 1
        return plan

    def apply_allocation(self, plan: StepPlan, allocation: StepAllocation, now: float) -> list[ScheduledChunk]:
        """The chunks for the runner (the step is then in flight; none: nothing to run now).

        Fills `plan.preempted` and, when nothing runs and the queue's head could not be admitted
        even so, `plan.unschedulable`: that request needs more blocks than the whole cache and is
        removed, for the caller to fail.
        """
        kept = plan.running[: len(allocation.kept)]
        for (request, n), grant in zip(kept, allocation.kept):
            if n:
                plan.chunks.append((request, request.num_computed_tokens, n, grant.block_table))
        preempted = plan.running[len(allocation.kept) :]
        if tuple(r.request_id for r, _ in preempted) != allocation.preempted:
            raise RuntimeError(f"step {plan.step_id}: the cache manager preempted {allocation.preempted}, not the tail")
        if preempted:
            self._preempt(preempted, alone=not any(n for _, n in kept), plan=plan)
        for (request, n), grant in zip(plan.candidates, allocation.admitted):
            if self.waiting[0] is not request:
                raise RuntimeError(f"step {plan.step_id}: admitted {request.request_id} is not the queue's head")
            self.waiting.pop(0)
            cached = grant.num_cached_tokens
            request.num_computed_tokens = cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = cached
            self.running.append(request)
            plan.chunks.append((request, cached, min(n, request.num_tokens - cached), grant.block_table))
        chunks = [self._chunk(plan, *entry) for entry in plan.chunks]
        if chunks:
            self.in_flight.append(plan)
        elif not self.running and self.waiting and not self.reading:  # a read's blocks come back when it ends
            plan.unschedulable = self.abort(self.waiting[0].request_id)
        return chunks

    def _chunk(self, plan: StepPlan, request: Request, start: int, n: int, table: tuple[int, ...]) -> ScheduledChunk:
        num_output_tokens = request.num_planned_tokens - request.num_prompt_tokens
        request.num_computed_tokens = start + n
        sample = request.num_computed_tokens == request.num_planned_tokens
        # An embedding request's last chunk pools rather than samples: nothing is pending, and the
        # request waits (planning no tokens) until the step reports its vector (`finish_pooled`).
        pool, sample = sample and request.is_pooling, sample and not request.is_pooling
        plan.epochs[request.request_id] = request.epoch
        num_speculative = plan.speculative.get(request.request_id, 0) if sample else 0
        request.num_draft_slots = num_speculative
        if sample:
            request.num_pending += 1
        # Positions whose prompt logprobs this chunk reports: from the first without one (reported
        # before a preemption, or by a chunk in flight before this one) to the prompt's last but one.
        first = max(start, request.num_prompt_logprobs)
        reports = request.wants_prompt_logprobs and first < min(start + n, request.num_prompt_tokens - 1)
        return ScheduledChunk(
            request.request_id,
            request.tokens(start, start + n),
            start,
            table,
            sample,
            request.params,
            request.prompt_token_ids,
            num_output_tokens,
            num_speculative,
            first if reports else None,
            pool,
        )

    # --- results --------------------------------------------------------------------------------

    def finish_step(self, step_id: int) -> StepPlan:
        """The runner is done with `step_id`. Steps finish in the order they were sent; anything
        else is a wiring bug."""
        plan = self.in_flight.popleft() if self.in_flight else None
        if plan is None or plan.step_id != step_id:
            raise RuntimeError(f"step {step_id} finished but step {plan and plan.step_id} was next in flight")
        return plan

    def computed_tokens(self, plan: StepPlan) -> list[tuple[str, tuple[int, ...]]]:
        """What each live request of the step now has in its blocks (for the prefix cache)."""
        return [
            (r.request_id, tuple(r.tokens(start, start + n)))
            for r, start, n, _ in plan.chunks
            if self.requests.get(r.request_id) is r and self._is_current(r, plan)
        ]

    def record_prompt_logprobs(self, plan: StepPlan, records: tuple[PromptLogprobs, ...]) -> None:
        """Keep the prompt logprobs the step computed, for the request's first token to carry;
        those of a request gone or preempted since the step was planned are dropped (it computes
        them again)."""
        for record in records:
            request = self.requests.get(record.request_id)
            if request is None or request not in self.running or not self._is_current(request, plan):
                continue
            # Entries run from position 1; a record starts where the last one ended.
            if record.start != request.num_prompt_logprobs + 1:
                raise RuntimeError(
                    f"request {record.request_id}: prompt logprobs from position {record.start}, "
                    f"expected {request.num_prompt_logprobs + 1}"
                )
            request.prompt_logprobs.extend(record.entries)
            request.num_prompt_logprobs += len(record.entries)

    def accepted_tokens(self, plan: StepPlan) -> list[tuple[str, tuple[int, ...]]]:
        """The guesses each request kept (after `update_from_output`): their K/V are in its
        blocks too, after the tokens `computed_tokens` named; rejected ones never enter the cache."""
        return [
            (r.request_id, tuple(r.tokens(start + n, start + n + plan.accepted[r.request_id])))
            for r, start, n, _ in plan.chunks
            if plan.accepted.get(r.request_id)
        ]

    def update_from_output(
        self,
        sampled: tuple[SampledToken, ...],
        plan: StepPlan | None = None,
        speculated: tuple[Speculation, ...] = (),
        seconds: float = 0.0,
    ) -> list[TokenEvent]:
        """Append each sampled token (`plan`: the step that sampled them, to spot stale ones).

        A speculating request has several, its accepted guesses first: each token after its first
        means the one before it was computed in the step too. Stop conditions and `max_tokens`
        are checked per token, so nothing past the end is emitted. `seconds`: how long the step
        ran (the speculation policy's cost estimate).
        """
        events = []
        seen: set[str] = set()
        if self.speculation is not None and plan is not None and seconds:
            guesses = sum(o.proposed for o in speculated)
            self.speculation.observe_step(sum(n for _, _, n, _ in plan.chunks) + guesses, seconds)
        for outcome in speculated:
            request = self.requests.get(outcome.request_id)
            if self.speculation is not None and request is not None and (plan is None or self._is_current(request, plan)):
                self.speculation.record(request, outcome.proposed, outcome.accepted, outcome.sized)
        for token in sampled:
            request = self.requests.get(token.request_id)
            if request is None or request not in self.running:
                continue  # aborted, finished or preempted while its step ran
            if plan is not None and not self._is_current(request, plan):
                continue  # sampled before a preemption: the request recomputes instead
            if token.request_id in seen:  # the guess before this token was verified: its K/V stays
                request.num_computed_tokens += 1
                if plan is not None:
                    plan.accepted[token.request_id] = plan.accepted.get(token.request_id, 0) + 1
            else:
                seen.add(token.request_id)
                request.num_pending = max(0, request.num_pending - 1)
                if plan is None or token.request_id in plan.speculative:  # this step's guesses are in
                    request.num_draft_slots = 0
            request.output_token_ids.append(token.token_id)
            reason = self._finish_reason(request, token.token_id)
            if reason is not None:
                self.running.remove(request)
                del self.requests[request.request_id]
            events.append(TokenEvent(request, token, reason))
        return events

    def finish_pooled(self, plan: StepPlan, pooled: tuple[Pooled, ...]) -> list[tuple[Request, tuple[float, ...]]]:
        """The embedding requests whose vectors the step pooled: each ends here, once (a request
        gone or preempted since the step was planned is skipped: it computes its vector again)."""
        done = []
        for entry in pooled:
            request = self.requests.get(entry.request_id)
            if request is None or request not in self.running or not self._is_current(request, plan):
                continue
            self.running.remove(request)
            del self.requests[request.request_id]
            done.append((request, entry.embedding))
        return done

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

    def _guess_room(self, request: Request, budget: int) -> int:
        """Guesses a decode may carry: within the budget, never a token past `max_tokens` (the
        step returns one token more than it keeps guesses) nor a position past the context."""
        produced = len(request.output_token_ids) + request.num_pending
        return min(budget, request.max_tokens - produced - 1, self.max_model_len - request.num_planned_tokens)

    def _will_be_done(self, request: Request) -> bool:
        """Its steps in flight already sample its last token (length limit): nothing to plan."""
        if not request.num_pending:
            return False
        produced = len(request.output_token_ids) + request.num_pending
        return produced >= request.max_tokens or request.num_planned_tokens >= self.max_model_len

    def _preempt(self, preempted: list[tuple[Request, int]], *, alone: bool, plan: StepPlan) -> None:
        """Back to the queue, to be recomputed, the worst-ranked first (their blocks are released).

        `alone`: no request kept has tokens this step. Then the best-ranked preempted request, if
        it had tokens, did not fit even with every request below it released: it needs more than
        the whole cache, so it goes to the head of the queue whatever the policy, and the queue's
        head is the request that cannot fit (failed when nothing runs), not a better-ranked
        bystander.
        """
        first, n = preempted[0]
        too_big = alone and n  # needs more than the whole cache: it heads the queue, not a read's gate
        for request, _ in reversed(preempted):
            request.num_computed_tokens = 0
            request.num_pending = 0
            request.num_draft_slots = 0
            request.epoch += 1
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.running.remove(request)
            if self.wants_read(request.num_tokens) and not (too_big and request is first):
                self.reading[request.request_id] = request  # the scheduler sends its ReadBack
            else:
                self._enqueue(request, front=self.config.policy == "fcfs")
        plan.preempted = [r for r, _ in preempted]
        if too_big and self.waiting[0] is not first:
            self.waiting.remove(first)
            self.waiting.insert(0, first)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.insert(0, request)
        elif self.config.policy == "priority":
            keys = [r.queue_key("priority") for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, request.queue_key("priority")), request)
        else:
            self.waiting.append(request)
