"""The scheduler actor: admits requests, plans each step, and turns step outputs into tokens.

Per step: plan (`SchedulerCore.schedule`), ask the cache manager for blocks (`AllocateStep`,
answered on a one-shot channel), hand the chunks to the runner, and when its `StepOutput` arrives,
commit the computed tokens to the prefix cache, forward new tokens to the detokenizer and release
finished requests' blocks. With async scheduling, step N+1 is planned and queued at the runner
while step N runs: a decode whose input token step N is still sampling carries a placeholder the
runner fills in, so planning and messaging overlap the forward pass.
"""

from __future__ import annotations

import time
from collections import deque

import anyio
import torch
from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.request_state import Request
from cadenza.actors.scheduler_core import SchedulerCore, StepPlan
from cadenza.messages import (
    AbortRequest,
    AdmitRequest,
    AllocateStep,
    CacheMessage,
    CommitTokens,
    DetokenizerMessage,
    ExecuteStep,
    FreeBlocks,
    NewTokens,
    RequestFailed,
    RequestsFinished,
    RunnerMessage,
    SchedulerMessage,
    StepAllocation,
    StepFailed,
    StepOutput,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics

# Re-planning after a refused allocation preempts at least one more request each time, so this
# many attempts cannot be needed by a consistent cache; more means a bug, reported loudly.
_MAX_PLAN_ATTEMPTS = 1000


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
        max_waiting: int = 1 << 30,
        async_scheduling: bool = False,
        clock=time.monotonic,
    ) -> None:
        super().__init__(inbox)
        self.core = core
        self.max_waiting = max_waiting
        self.max_in_flight = 2 if async_scheduling else 1
        self.cache = cache
        self.runner = runner
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.clock = clock
        self._in_flight: deque[StepPlan] = deque()
        self._free_count_stale = True
        self._gone: list[str] = []  # requests ended since the runner last heard, for its plugins

    async def handle(self, message: SchedulerMessage) -> None:
        match message:
            case AdmitRequest() if len(self.core.waiting) >= self.max_waiting:
                # Checked here, where the queue's length is exact, not at the ingress.
                waiting = len(self.core.waiting)
                await self.detokenizer.send(
                    RequestFailed(message.request_id, f"{waiting} requests are waiting; try again later", "queue_full")
                )
            case AdmitRequest():
                self._admit(message)
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
            case StepFailed(step_id=step_id, request_ids=request_ids, message=text):
                self._finish_step(step_id)
                for request in self.core.fail(request_ids):
                    await self._fail(request, text, "step_failed")
            case _:
                raise UnexpectedMessageError(self.name, message)
        self._report()

    async def after_messages(self) -> None:
        # Every message queued so far is in: plan, so a burst of arrivals shares one step.
        await self._maybe_step()
        if self._gone and not self._in_flight:
            # No step will carry the news soon (one in flight would: its output wakes us up).
            await self.runner.send(RequestsFinished(self._take_gone()))

    def _admit(self, message: AdmitRequest) -> None:
        params = message.params
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        request = Request(
            message.request_id,
            message.prompt_token_ids,
            params,
            message.max_tokens,
            message.arrival_time,
            message.priority,
            generator=generator,
        )
        self.core.add(request)
        self.metrics.prompt_tokens += request.num_prompt_tokens
        self.log.info("Request admitted", request_id=request.request_id, prompt_tokens=request.num_prompt_tokens)

    def _finish_step(self, step_id: int) -> StepPlan:
        """Steps finish in the order they were sent; anything else is a wiring bug."""
        plan = self._in_flight.popleft() if self._in_flight else None
        if plan is None or plan.step_id != step_id:
            raise RuntimeError(f"step {step_id} finished but step {plan and plan.step_id} was next in flight")
        return plan

    async def _on_step_output(self, output: StepOutput) -> None:
        plan = self._finish_step(output.step_id)
        await self.cache.send(CommitTokens(plan.step_id, tuple(self.core.computed_tokens(plan))))
        for request_id, error in output.failed:
            for request in self.core.fail([request_id]):
                await self._fail(request, error, "sampler_error")
        now = self.clock()
        for event in self.core.update_from_output(output.sampled, plan):
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
            await self.detokenizer.send(
                NewTokens(
                    request.request_id,
                    (token.token_id,),
                    (token.logprob,) if token.logprob is not None else None,
                    event.finish_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_seconds=(request.first_scheduled_time or now) - request.arrival_time if first else None,
                )
            )

    async def _maybe_step(self) -> None:
        while len(self._in_flight) < self.max_in_flight and self.core.has_work:
            if not await self._plan_one_step():
                return

    async def _plan_one_step(self) -> bool:
        """Plan a step and send it to the runner; False when there is nothing to run now."""
        if self._free_count_stale:
            self.core.num_free_blocks = (await self._allocate(0, (), ())).num_free_blocks
            self._free_count_stale = False
        for _ in range(_MAX_PLAN_ATTEMPTS):
            plan = self.core.schedule()
            for request in plan.preempted:
                self.log.info("Request preempted", request_id=request.request_id, times=request.num_preemptions)
                self.metrics.num_preemptions += 1
            released = tuple(r.request_id for r in plan.preempted)
            if plan.is_empty and not released:
                if not self._in_flight:
                    await self._fail_unschedulable()
                return False
            allocation = await self._allocate(plan.step_id, released, plan.block_requests())
            chunks = self.core.apply_allocation(plan, allocation, self.clock())
            if chunks is None:
                continue
            if not chunks:
                if not self._in_flight:
                    await self._fail_unschedulable()
                return False
            self._in_flight.append(plan)
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
        raise RuntimeError("scheduling did not converge: the cache manager keeps refusing running requests")

    async def _allocate(self, step_id: int, release: tuple[str, ...], requests) -> StepAllocation:
        send, receive = anyio.create_memory_object_stream[StepAllocation](1)
        async with receive:
            await self.cache.send(AllocateStep(step_id, release, requests, send))
            return await receive.receive()

    async def _fail_unschedulable(self) -> None:
        """Nothing runs and the queue's head cannot fit: fail it rather than wait forever."""
        if self.core.running or not self.core.waiting:
            return
        request = self.core.waiting[0]
        self.core.abort(request.request_id)
        await self._fail(
            request, f"request needs more KV cache blocks than are free ({self.core.num_free_blocks})", "kv_cache_full"
        )

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
        self._free_count_stale = True
        self._gone.append(request.request_id)

    def _take_gone(self) -> tuple[str, ...]:
        gone, self._gone = tuple(self._gone), []
        return gone

    def _report(self) -> None:
        self.metrics.num_running = len(self.core.running)
        self.metrics.num_waiting = len(self.core.waiting)

    async def fail_requests(self, request_ids: tuple[str, ...], message: str) -> None:
        for request_id in request_ids:
            request = self.core.abort(request_id)
            if request is not None:
                await self._fail(request, message)
            else:  # it never got in (admission raised): only the detokenizer knows it
                self.metrics.requests_failed += 1
                await self.detokenizer.send(NewTokens(request_id, (), finish_reason="error", error=message, error_code="internal_error"))
