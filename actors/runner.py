"""The runner actor: executes scheduled steps on the model, off the event loop."""

from __future__ import annotations

import time

from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.messages import (
    ExecuteStep,
    RequestsFinished,
    RunnerMessage,
    SampledToken,
    SchedulerMessage,
    StepFailed,
    StepOutput,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics
from cadenza.outputs import TokenLogprob
from cadenza.runner.model_runner import ModelRunner, StepResult
from cadenza.threads import compute_thread


class RunnerActor(Actor[RunnerMessage]):
    name = "runner"

    def __init__(self, inbox, runner: ModelRunner, scheduler: MemoryObjectSendStream[SchedulerMessage], metrics: EngineMetrics,
                 governor=None):  # fmt: skip
        """`governor`: a `ThreadGovernor` sizing the compute thread's team before each step, or None."""
        super().__init__(inbox)
        self.runner = runner
        self.scheduler = scheduler
        self.metrics = metrics
        self.governor = governor

    async def handle(self, message: RunnerMessage) -> None:
        match message:
            case ExecuteStep():
                await self._execute(message)
            case RequestsFinished(request_ids=request_ids):
                # Plugin hooks are third-party code: keep them off the event loop too.
                await compute_thread.run_async(self.runner.finish_requests, request_ids)
            case _:
                raise UnexpectedMessageError(self.name, message)

    def _run_step(self, message: ExecuteStep) -> StepResult:
        if self.governor is not None:
            self.governor.before_step()
        # Departures first: a request that left is in no step from now on.
        self.runner.finish_requests(message.finished_request_ids)
        return self.runner.execute(message.chunks)

    async def _execute(self, message: ExecuteStep) -> None:
        started = time.perf_counter()
        try:
            # On the compute thread: the event loop keeps serving I/O, and torch keeps one OpenMP team.
            result = await compute_thread.run_async(self._run_step, message)
        except Exception as exc:
            self.log.error("Step failed", step=message.step_id, error=repr(exc))
            ids = tuple(c.request_id for c in message.chunks)
            await self.scheduler.send(StepFailed(message.step_id, ids, f"model step failed: {exc!r}"))
            return
        seconds = time.perf_counter() - started
        self.metrics.step_seconds_total += seconds
        if self.inbox.statistics().current_buffer_used:
            self.metrics.steps_ready_on_finish += 1
        for outcome in result.speculated:
            self.metrics.record_speculation(outcome.method, outcome.proposed, outcome.accepted)
        await self.scheduler.send(
            StepOutput(
                message.step_id, sampled_tokens(result, message), tuple(result.failed), seconds, tuple(result.speculated),
                tuple(result.prompt_logprobs), tuple(result.pooled),
            )  # fmt: skip
        )


def sampled_tokens(result: StepResult, step: ExecuteStep) -> tuple[SampledToken, ...]:
    if result.sampled is None:
        return ()
    ids = result.sampled.token_ids.tolist()
    logprob_n = {c.request_id: c.params.logprobs for c in step.chunks if c.params is not None}
    out = []
    chosen = result.sampled.logprobs.tolist() if result.sampled.logprobs is not None else None
    top_ids = top_values = None
    if result.sampled.top_logprobs is not None:
        top_ids, top_values = (t.tolist() for t in result.sampled.top_logprobs)
    for row, (request_id, token) in enumerate(zip(result.request_ids, ids)):
        n = logprob_n.get(request_id)
        logprob = None
        if n is not None and chosen is not None:
            top = tuple(zip(top_ids[row][:n], top_values[row][:n])) if top_ids is not None else ()
            logprob = TokenLogprob(token, chosen[row], top)
        # Accepted guesses come first, in order (speculation is off for requests with logprobs).
        out += [SampledToken(request_id, guess) for guess in result.accepted.get(request_id, ())]
        out.append(SampledToken(request_id, token, logprob))
    return tuple(out)
