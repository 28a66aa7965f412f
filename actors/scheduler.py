"""The scheduler actor: moves the scheduler core's messages.

Per step: the core plans (`SchedulerCore.schedule`), the cache manager answers the plan in one
exchange (`AllocateStep`, on a one-shot channel), the core turns the answer into chunks for the
runner, and when the runner's `StepOutput` arrives the computed tokens go to the prefix cache,
new tokens to the detokenizer, and finished requests' blocks back to the cache. With async
scheduling, step N+1 is planned and queued at the runner while step N runs: a decode whose input
token step N is still sampling carries a placeholder the runner fills in, so planning and
messaging overlap the forward pass.
"""

from __future__ import annotations

import time

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.messages import (
    AbortRequest,
    AdmitRequest,
    AllocateStep,
    CacheMessage,
    CommitTokens,
    DetokenizerMessage,
    ExecuteStep,
    FreeBlocks,
    NewTokens,
    ReadBack,
    RequestFailed,
    RequestsFinished,
    RunnerMessage,
    SchedulerMessage,
    StepAllocation,
    StepFailed,
    StepOutput,
    StepTokens,
    TierMessage,
    TierReadDone,
    UnexpectedMessageError,
)
from cadenza.actors.request_state import Request
from cadenza.actors.scheduler_core import QueueFullError, SchedulerCore, StepPlan
from cadenza.metrics import EngineMetrics


class SchedulerActor(Actor[SchedulerMessage]):
    name = "scheduler"

    def __init__(
        self,
        inbox,
        core: SchedulerCore,
        *,
        cache: MemoryObjectSendStream[CacheMessage],
        runner: MemoryObjectSendStream[RunnerMessage],
        detokenizer: MemoryObjectSendStream[DetokenizerMessage],
        metrics: EngineMetrics,
        clock=time.monotonic,
        tiers: MemoryObjectSendStream[TierMessage] | None = None,
    ) -> None:
        super().__init__(inbox)
        self.core = core
        self.cache = cache
        self.runner = runner
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.clock = clock
        self.tiers = tiers  # the tier agent's inbox: a new request's prefix is read back before it queues
        self._gone: list[str] = []  # requests ended since the runner last heard, for its plugins

    async def handle(self, message: SchedulerMessage) -> None:
        match message:
            case AdmitRequest():
                await self._admit(message)
            case AbortRequest(request_id=request_id, reason=reason):
                request = self.core.abort(request_id)
                if request is not None:
                    self.log.info("Request aborted", request_id=request_id, reason=reason)
                    if reason == "abort":
                        self.metrics.requests_aborted += 1
                    await self._release(request)
                    await self.detokenizer.send(NewTokens(request_id, (), finish_reason=reason))
            case StepOutput():
                await self._on_step_output(message)
            case TierReadDone(request_id=request_id, num_blocks=num_blocks):
                if self.core.open_gate(request_id) and num_blocks:
                    self.log.info("Prefix read back from a KV tier", request_id=request_id, blocks=num_blocks)
            case StepFailed(step_id=step_id, request_ids=request_ids, message=text):
                self.core.finish_step(step_id)
                for request in self.core.fail(request_ids):
                    await self._fail(request, text, "step_failed")
            case _:
                raise UnexpectedMessageError(self.name, message)
        self._report()

    async def after_messages(self) -> None:
        # Every message queued so far is in: plan, so a burst of arrivals shares one step.
        while self.core.can_schedule and await self._step():
            pass
        if self._gone and not self.core.in_flight:
            # No step will carry the news soon (one in flight would: its output wakes us up).
            await self.runner.send(RequestsFinished(self._take_gone()))

    async def _admit(self, message: AdmitRequest) -> None:
        request = Request(
            message.request_id,
            message.prompt_token_ids,
            message.params,
            message.max_tokens,
            message.arrival_time,
            message.priority,
        )
        gated = self.core.wants_read(request.num_prompt_tokens)
        try:
            self.core.add(request, gated)
        except QueueFullError as exc:
            await self.detokenizer.send(RequestFailed(message.request_id, str(exc), "queue_full"))
            return
        if gated:
            self._read_back(request, request.prompt_token_ids)
        self.metrics.prompt_tokens += request.num_prompt_tokens
        self.log.info("Request admitted", request_id=request.request_id, prompt_tokens=request.num_prompt_tokens)

    async def _on_step_output(self, output: StepOutput) -> None:
        plan = self.core.finish_step(output.step_id)
        await self.cache.send(CommitTokens(plan.step_id, tuple(self.core.computed_tokens(plan))))
        for request_id, error in output.failed:
            for request in self.core.fail([request_id]):
                await self._fail(request, error, "sampler_error")
        self.core.record_prompt_logprobs(plan, output.prompt_logprobs)
        events = self.core.update_from_output(output.sampled, plan, output.speculated, output.seconds)
        if plan.accepted:  # verified guesses; before a finished request's FreeBlocks, so its full blocks are cached
            await self.cache.send(CommitTokens(plan.step_id, tuple(self.core.accepted_tokens(plan))))
        now = self.clock()
        for request, embedding in self.core.finish_pooled(plan, output.pooled):
            await self._finish_pooled(request, embedding, now)
        step_tokens: list[NewTokens] = []
        for event in events:
            request, token = event.request, event.token
            first = len(request.output_token_ids) == 1
            self.metrics.generation_tokens += 1
            if event.finish_reason is not None:
                # Blocks go back before anyone hears of the finish, so a caller who sees it can
                # count on the cache being free.
                await self._release(request)
                self.metrics.requests_finished += 1
                self.log.info(
                    "Request finished",
                    request_id=request.request_id,
                    finish_reason=event.finish_reason,
                    output_tokens=len(request.output_token_ids),
                    preemptions=request.num_preemptions,
                )
            step_tokens.append(
                NewTokens(
                    request.request_id,
                    (token.token_id,),
                    (token.logprob,) if token.logprob is not None else None,
                    event.finish_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_seconds=(request.first_scheduled_time or now) - request.arrival_time if first else None,
                    prompt_logprobs=request.take_prompt_logprobs() if first else None,
                )
            )
        if step_tokens:  # finished requests' blocks went back above, before anyone hears of the finish
            await self.detokenizer.send(StepTokens(tuple(step_tokens)))

    async def _finish_pooled(self, request: Request, embedding: tuple[float, ...], now: float) -> None:
        """An embedding request's last chunk ran: its blocks go back (its computed blocks stay in
        the prefix cache, evictable, like a finished generation's: the same prompt's keys and
        values), then its vector goes to the detokenizer, which finishes it."""
        await self._release(request)
        self.metrics.requests_finished += 1
        self.log.info("Request finished", request_id=request.request_id, finish_reason="stop", embedded_tokens=request.num_prompt_tokens)
        await self.detokenizer.send(
            NewTokens(
                request.request_id,
                (),
                finish_reason="stop",
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                queue_seconds=(request.first_scheduled_time or now) - request.arrival_time,
                embedding=embedding,
            )
        )

    def _read_back(self, request: Request, token_ids: tuple[int, ...]) -> None:
        """Ask the tier agent for the blocks of `token_ids` the tiers hold; the gated request joins
        the queue at its TierReadDone, or at once where there is no agent or it cannot take the ask."""
        if self.tiers is None:
            self.core.open_gate(request.request_id)
            return
        try:
            self.tiers.send_nowait(ReadBack(request.request_id, tuple(token_ids), request.params.cache_salt))
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):  # compute rather than wait
            self.core.open_gate(request.request_id)

    async def _step(self) -> bool:
        """Plan a step, allocate it, send it to the runner; False when there is nothing to run now."""
        plan = self.core.schedule()
        if plan is None:
            return False
        chunks = self.core.apply_allocation(plan, await self._allocate(plan), self.clock())
        for request in plan.preempted:
            self.log.info("Request preempted", request_id=request.request_id, times=request.num_preemptions)
            self.metrics.num_preemptions += 1
            if request.request_id in self.core.reading:  # gated: a tier may hold the blocks it lost
                self._read_back(request, request.all_tokens())
        if plan.unschedulable is not None:
            await self._fail(plan.unschedulable, "the request needs more KV cache blocks than the cache has", "kv_cache_full")
        if not chunks:
            return False
        self.metrics.num_steps += 1
        self.metrics.prefill_tokens_computed += sum(len(c.token_ids) for c in chunks if c.start_position < len(c.prompt_token_ids))
        self.log.debug(
            "Step scheduled",
            step=plan.step_id,
            decodes=sum(1 for c in chunks if len(c.token_ids) == 1 and c.sample),
            prefill_tokens=sum(len(c.token_ids) for c in chunks if not (len(c.token_ids) == 1 and c.sample)),
            requests=[(c.request_id, len(c.token_ids)) for c in chunks],
        )
        await self.runner.send(ExecuteStep(plan.step_id, tuple(chunks), self._take_gone()))
        self._report()
        return True

    async def _allocate(self, plan: StepPlan) -> StepAllocation:
        send, receive = anyio.create_memory_object_stream[StepAllocation](1)
        async with receive:
            await self.cache.send(AllocateStep(plan.step_id, *plan.allocation_request(), send))
            return await receive.receive()

    async def _fail(self, request: Request, message: str, code: str = "internal_error") -> None:
        self.metrics.requests_failed += 1
        self.log.error("Request failed", request_id=request.request_id, error=message)
        await self._release(request)
        await self.detokenizer.send(
            NewTokens(
                request.request_id,
                (),
                finish_reason="error",
                num_prompt_tokens=request.num_prompt_tokens,
                error=message,
                error_code=code,
            )
        )

    async def _release(self, request: Request) -> None:
        """The request has ended (finished, aborted or failed): its blocks and plugin state go."""
        await self.cache.send(FreeBlocks(request.request_id))
        self._gone.append(request.request_id)

    def _take_gone(self) -> tuple[str, ...]:
        gone, self._gone = tuple(self._gone), []
        return gone

    def _report(self) -> None:
        self.metrics.num_running = len(self.core.running)
        self.metrics.num_waiting = len(self.core.waiting) + len(self.core.reading)

    async def fail_requests(self, request_ids: tuple[str, ...], message: str) -> None:
        for request_id in request_ids:
            request = self.core.abort(request_id)
            if request is not None:
                await self._fail(request, message)
            else:  # it never got in (admission raised): only the detokenizer knows it
                self.metrics.requests_failed += 1
                await self.detokenizer.send(NewTokens(request_id, (), finish_reason="error", error=message, error_code="internal_error"))
