"""Per-request output streams between the detokenizer and whoever reads the request's output.

The detokenizer puts `TextDelta`s; each read returns them merged into one `GenerationOutput`
(`outputs.py` shows every record on a request's way out).

Putting never blocks: deltas that arrive while the reader is busy are merged, so a slow reader
costs memory for its own text only and never stalls the engine. A reader that falls more than
`max_pending_tokens` behind is cut off with an error instead of growing without bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from cadenza.outputs import RequestTimings, TextDelta, TokenLogprob


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """A request's stream -> its reader (`AsyncEngine.generate`): what is new since the last read,
    the `TextDelta`s that arrived in between merged, plus running totals; the last has
    `finish_reason` and the request's `timings`. The first carries the request's
    `prompt_logprobs` when it asked, aligned with `prompt_token_ids` (None for the first token)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    timings: RequestTimings | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, on its last output
    stop_reason: int | str | None = None  # on the last: the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SlowReaderError(RuntimeError):
    pass


class RequestStream:
    def __init__(self, request_id: str, arrival_time: float, max_pending_tokens: int = 1 << 16) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.max_pending_tokens = max_pending_tokens
        self.cancelled = False
        self.finished = False
        self._pending: list[TextDelta] = []
        self._pending_tokens = 0
        self._ready = anyio.Event()
        self._num_output = 0
        self._first_token_time: float | None = None
        self._finish_time: float | None = None
        self._queue_seconds: float | None = None
        self._num_prompt = 0
        self._num_cached = 0

    def put(self, delta: TextDelta) -> bool:
        """Queue a delta; True when this put cut a slow reader off (its request should stop)."""
        if self.finished:
            return False
        now = time.monotonic()
        if delta.token_ids and self._first_token_time is None:
            self._first_token_time = now  # when the token reached us, not when the reader looked
        self._pending.append(delta)
        self._pending_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finished = True
            self._finish_time = now
        elif self._pending_tokens > self.max_pending_tokens:
            self.finished = True
            self._finish_time = now
            self._pending.append(
                TextDelta(self.request_id, "", (), None, "error", error="the client read too slowly", error_code="slow_reader")
            )
            self._ready.set()
            return True
        self._ready.set()
        return False

    async def get(self) -> GenerationOutput:
        await self._ready.wait()
        self._ready = anyio.Event()
        pending, self._pending, self._pending_tokens = self._pending, [], 0
        return self._merge(pending)

    def _merge(self, deltas: list[TextDelta]) -> GenerationOutput:
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        finish = error = code = prompt_logprobs = prompt_ids = embedding = stop_reason = None
        for d in deltas:
            stop_reason = d.stop_reason if d.stop_reason is not None else stop_reason
            embedding = d.embedding if d.embedding is not None else embedding
            tokens.extend(d.token_ids)
            if d.prompt_logprobs is not None:  # one delta carries them
                prompt_logprobs, prompt_ids = d.prompt_logprobs, d.prompt_token_ids
            if d.logprobs is not None:
                logprobs = (logprobs or []) + list(d.logprobs)
            finish = d.finish_reason or finish
            error, code = d.error or error, d.error_code or code
            self._num_prompt = d.num_prompt_tokens or self._num_prompt
            self._num_cached = d.num_cached_tokens or self._num_cached
            if d.queue_seconds is not None:
                self._queue_seconds = d.queue_seconds
        self._num_output += len(tokens)
        timings = None
        if finish is not None:
            now = self._finish_time or time.monotonic()
            first = self._first_token_time
            timings = RequestTimings(
                queue_seconds=self._queue_seconds,
                ttft_seconds=None if first is None else first - self.arrival_time,
                tpot_seconds=(now - first) / (self._num_output - 1) if first is not None and self._num_output > 1 else None,
                e2e_seconds=now - self.arrival_time,
            )
        return GenerationOutput(
            self.request_id,
            "".join(d.text for d in deltas),
            tuple(tokens),
            tuple(logprobs) if logprobs is not None else None,
            finish,
            self._num_prompt,
            self._num_output,
            self._num_cached,
            timings,
            error,
            code,
            prompt_logprobs,
            prompt_ids,
            embedding,
            stop_reason,
        )
