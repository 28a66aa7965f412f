"""The ingress: validates a request, applies the chat template, tokenizes, checks limits, admits."""

from __future__ import annotations

from typing import Callable

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from cadenza.actors.base import Actor
from cadenza.actors.messages import (
    AdmitRequest,
    DetokenizerMessage,
    IngressMessage,
    NewTokens,
    RequestFailed,
    SchedulerMessage,
    SubmitRequest,
    TrackRequest,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics
from cadenza.models.prompts import PromptError, tokenize_prompt
from cadenza.models.tokenizer import ChatTemplateError, Tokenizer
from cadenza.samplers.extra import ExtraParams, ExtraParamsError
from cadenza.sampling_params import SamplingParams

# Prompts longer than this (in characters) are tokenized in a worker thread, off the event loop.
OFF_LOOP_PROMPT_CHARS = 4096


class RequestRejected(ValueError):
    """A request that cannot be served as asked; `code` names the reason for wire protocols."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PromptValidator:
    """The synchronous core: prompt to token ids, or a `RequestRejected` naming the problem.

    `extra_params` (the runtime's `extra_params`) checks `SamplingParams.extra` against the
    deployment's sampling plugins; without it the runner still checks, when the request first runs.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_prompt_tokens: int | None,
        capacity_tokens: int,
        extra_params: ExtraParams | None = None,
        speculative_methods: frozenset[str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.capacity_tokens = capacity_tokens  # the whole KV cache, in tokens
        self.extra_params = extra_params
        self.speculative_methods = speculative_methods  # proposers built; None: the runner checks

    def check_speculative(self, params: SamplingParams) -> None:
        """A request may pick only a proposer the deployment built."""
        override, built = params.speculative, self.speculative_methods
        if built is None or override is None or override.method is None or override.method in built:
            return
        names = ", ".join(sorted(built)) or "none"
        raise RequestRejected("invalid_value", f"speculative.method: {override.method!r} is not built here; built: {names}")

    def check_extra(self, params: SamplingParams) -> None:
        """Reject `extra` naming no configured plugin, or with params its plugin's model refuses."""
        if self.extra_params is None or not params.extra:
            return
        try:
            self.extra_params.validate(params.extra)
        except ExtraParamsError as exc:
            raise RequestRejected("invalid_extra", str(exc)) from exc

    def needs_preparing(self, params: SamplingParams) -> bool:
        return self.extra_params is not None and self.extra_params.needs_preparing(params)

    def prepare(self, params: SamplingParams) -> None:
        """Plugins' slow per-request set-up (compiling a grammar); a refusal names the problem."""
        try:
            self.extra_params.prepare(params)
        except ExtraParamsError as exc:
            raise RequestRejected(getattr(exc, "code", "invalid_extra"), str(exc)) from exc

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the sampling params must name tokens of this model's vocabulary."""
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestRejected("invalid_value", f"{name}: token ids must be in [0, {self.vocab_size}) (got {bad[:5]})")

    def tokenize(self, prompt) -> tuple[int, ...]:
        try:
            _, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        except ChatTemplateError as exc:
            raise RequestRejected("invalid_messages", str(exc)) from exc
        except PromptError as exc:
            raise RequestRejected("invalid_prompt", str(exc)) from exc
        return tuple(ids)

    def max_tokens(self, prompt_ids: tuple[int, ...], requested: int | None) -> int:
        n = len(prompt_ids)
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise RequestRejected("prompt_too_long", f"prompt has {n} tokens; this server accepts at most {self.max_prompt_tokens}")
        limit = min(self.max_model_len, self.capacity_tokens)
        if n >= limit:
            what = "max_model_len" if limit == self.max_model_len else "the KV cache's capacity"
            raise RequestRejected("prompt_too_long", f"prompt has {n} tokens; {what} is {limit} tokens, leaving no room to generate")
        room = limit - n
        return room if requested is None else min(requested, room)


class IngressActor(Actor[IngressMessage]):
    name = "ingress"

    def __init__(
        self,
        inbox,
        validator: PromptValidator,
        *,
        scheduler: MemoryObjectSendStream[SchedulerMessage],
        detokenizer: MemoryObjectSendStream[DetokenizerMessage],
        metrics: EngineMetrics,
        is_cancelled: Callable[[str], bool],
    ) -> None:
        super().__init__(inbox)
        self.validator = validator
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.is_cancelled = is_cancelled

    async def handle(self, message: IngressMessage) -> None:
        if not isinstance(message, SubmitRequest):
            raise UnexpectedMessageError(self.name, message)
        request_id = message.request_id
        try:
            self.validator.check_extra(message.params)
            self.validator.check_token_ids(message.params)
            self.validator.check_speculative(message.params)
            if isinstance(message.prompt, str) and len(message.prompt) > OFF_LOOP_PROMPT_CHARS:
                prompt_ids = await anyio.to_thread.run_sync(self.validator.tokenize, message.prompt)
            else:
                prompt_ids = self.validator.tokenize(message.prompt)
            max_tokens = self.validator.max_tokens(prompt_ids, message.params.max_tokens)
            if self.validator.needs_preparing(message.params):
                # In a worker thread, before admission: a grammar compiles while steps run on.
                await anyio.to_thread.run_sync(self.validator.prepare, message.params)
        except RequestRejected as exc:
            await self.detokenizer.send(RequestFailed(request_id, str(exc), exc.code))
            return
        await self.detokenizer.send(TrackRequest(request_id, message.params, prompt_ids))
        if self.is_cancelled(request_id):
            await self.detokenizer.send(NewTokens(request_id, (), finish_reason="abort", num_prompt_tokens=len(prompt_ids)))
            return
        self.log.debug("Admitting request", request_id=request_id, prompt_tokens=len(prompt_ids))
        await self.scheduler.send(
            AdmitRequest(request_id, prompt_ids, message.params, max_tokens, message.arrival_time, message.priority)
        )

    async def fail_requests(self, request_ids: tuple[str, ...], message: str) -> None:
        for request_id in request_ids:
            await self.detokenizer.send(RequestFailed(request_id, message, "internal_error"))
