"""The detokenizer: turns token ids into clean text, per request, as they arrive.

Text is emitted only when it is final: never a broken UTF-8 sequence or a replacement character
that a later token would have completed, and never text that might still become a stop string.
It is also the one place where a request finishes, so each request finishes exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import structlog
from anyio.streams.memory import MemoryObjectSendStream
from tokenizers.decoders import DecodeStream

from cadenza.actors.base import Actor
from cadenza.actors.messages import (
    AbortRequest,
    DetokenizerMessage,
    NewTokens,
    RequestFailed,
    StepTokens,
    TrackRequest,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import TextDelta
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

# How `tokenizers` words the error of a `DecodeStream` whose decoder rewrote text already emitted.
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass
class _Stream:
    params: SamplingParams
    decoder: DecodeStream
    text: str = ""  # everything decoded so far
    sent: int = 0  # characters of `text` already emitted
    token_ids: list[int] = field(default_factory=list)
    num_decoded: int = 0  # leading `token_ids` whose text is in `text`; the rest the decoder holds
    stop_max: int = field(default=0)
    stopped: bool = False  # a stop string was hit: the request's text is complete
    stop: str | None = None  # the stop string that was hit
    prompt_token_ids: tuple[int, ...] = ()  # kept when it asked for prompt logprobs, to go with them


class IncrementalDetokenizer:
    """Synchronous core: one `DecodeStream` per request plus stop-string hold-back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def start(self, request_id: str, params: SamplingParams, prompt_token_ids: tuple[int, ...] = ()) -> None:
        self._streams[request_id] = _Stream(
            params, DecodeStream(skip_special_tokens=params.skip_special_tokens), stop_max=max(map(len, params.stop), default=0),
            prompt_token_ids=prompt_token_ids if params.prompt_logprobs is not None else (),
        )  # fmt: skip

    def prompt_token_ids(self, request_id: str) -> tuple[int, ...]:
        """The prompt of a request that asked for prompt logprobs (what they align with)."""
        return self._streams[request_id].prompt_token_ids

    def is_active(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, request_id: str, token_ids: tuple[int, ...], finishing: bool) -> tuple[str, bool]:
        """(text to emit now, whether a stop string was hit). Finishing flushes held-back text."""
        stream = self._streams[request_id]
        if stream.stopped:
            return "", False  # tokens that were in flight when the stop string was hit
        for token in token_ids:
            stream.token_ids.append(token)
            piece = self._step(request_id, stream, token)
            if piece:
                stream.text += piece
                stream.num_decoded = len(stream.token_ids)
        if finishing:
            # The stream holds back bytes that do not yet form a character; at the end, the
            # whole decode says what they are (a replacement character, if they never complete).
            skip = stream.params.skip_special_tokens
            full = self.tokenizer.decode(stream.token_ids, skip_special_tokens=skip)
            if full.startswith(stream.text):
                stream.text = full
            else:  # the decoder rewrote emitted text (see `_step`): add what it still held
                stream.text += self.tokenizer.decode(stream.token_ids[stream.num_decoded :], skip_special_tokens=skip)
        params = stream.params
        if params.stop:
            # Only the new text (plus a stop string's length of context) can hold a new match.
            search_from = max(0, stream.sent - stream.stop_max + 1)
            # The stop string that is complete first wins (on a tie, the one that starts first),
            # as if the text had arrived a character at a time, so how tokens were grouped into
            # messages cannot change where the text stops.
            hits = [(i + len(s), i, s) for s in params.stop if (i := stream.text.find(s, search_from)) != -1]
            if hits:
                _, index, stop = min(hits)
                end = index + (len(stop) if params.include_stop_str_in_output else 0)
                stream.stopped, stream.stop = True, stop
                return self._emit(stream, max(end, stream.sent)), True
            if not finishing:
                return self._emit(stream, len(stream.text) - _partial_stop_len(stream.text, params.stop)), False
        return self._emit(stream, len(stream.text)), False

    def stop_reason(self, request_id: str, finish_reason: str | None, token_ids: tuple[int, ...]) -> int | str | None:
        """What ended a request that stops now (vLLM's `stop_reason`): the stop string it hit, or
        the stop token it generated last; None for EOS, length or anything else."""
        stream = self._streams[request_id]
        if stream.stop is not None:
            return stream.stop
        if finish_reason == "stop" and token_ids and token_ids[-1] in stream.params.stop_token_ids:
            return token_ids[-1]
        return None

    def finish(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _step(self, request_id: str, stream: _Stream, token: int) -> str | None:
        backend = self.tokenizer.backend
        try:
            return stream.decoder.step(backend, token)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
        # A byte-fallback decoder (SentencePiece) turns a whole run of byte tokens into
        # replacement characters once the run stops being UTF-8, which changes text already
        # emitted, and the DecodeStream fails from then on. What was emitted stays; decode on
        # with a new stream, starting from the tokens the old one still held.
        log.warning("Decoded text changed after it was emitted; restarting the decode stream", request_id=request_id)
        stream.decoder = DecodeStream(skip_special_tokens=stream.params.skip_special_tokens)
        pieces = [stream.decoder.step(backend, held) for held in stream.token_ids[stream.num_decoded :]]
        return "".join(piece for piece in pieces if piece)

    @staticmethod
    def _emit(stream: _Stream, end: int) -> str:
        text = stream.text[stream.sent : end]
        stream.sent = max(stream.sent, end)
        return text


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string: held back for now."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class DetokenizerActor(Actor[DetokenizerMessage]):
    name = "detokenizer"

    def __init__(
        self,
        inbox,
        core: IncrementalDetokenizer,
        deliver: Callable[[TextDelta], None],
        scheduler: MemoryObjectSendStream,
        metrics: EngineMetrics,
    ) -> None:
        super().__init__(inbox)
        self.core = core
        self.deliver = deliver
        self.scheduler = scheduler
        self.metrics = metrics

    async def handle(self, message: DetokenizerMessage) -> None:
        match message:
            case TrackRequest(request_id=request_id, params=params, prompt_token_ids=prompt_token_ids):
                self.core.start(request_id, params, prompt_token_ids)
            case NewTokens():
                await self._on_tokens(message)
            case StepTokens(items=items):
                # Each request's tokens as their own message: a failure on one fails that request
                # alone (`_handle_contained`), and the rest of the step's requests get theirs.
                for item in items:
                    await self._handle_contained(item)
            case RequestFailed(request_id=request_id, message=text, code=code):
                self.core.finish(request_id)
                self.deliver(TextDelta(request_id, "", (), None, "error", error=text, error_code=code))
            case _:
                raise UnexpectedMessageError(self.name, message)

    async def _on_tokens(self, message: NewTokens) -> None:
        request_id = message.request_id
        if not self.core.is_active(request_id):
            return  # finished already (a stop string), or unknown: each request finishes once
        finishing = message.finish_reason is not None
        prompt_ids = self.core.prompt_token_ids(request_id) if message.prompt_logprobs is not None else None
        text, hit_stop = self.core.add(request_id, message.token_ids, finishing)
        reason = "stop" if hit_stop else message.finish_reason
        stop_reason = None
        if reason is not None:
            stop_reason = self.core.stop_reason(request_id, reason, message.token_ids)
            self.core.finish(request_id)
        if hit_stop and not finishing:
            await self.scheduler.send(AbortRequest(request_id, "stop"))
        self.deliver(
            TextDelta(
                request_id,
                text,
                message.token_ids,
                message.logprobs,
                reason,
                message.num_prompt_tokens,
                message.num_cached_tokens,
                error=message.error,
                error_code=message.error_code or ("internal_error" if message.error else None),
                queue_seconds=message.queue_seconds,
                prompt_logprobs=message.prompt_logprobs,
                prompt_token_ids=prompt_ids,
                embedding=message.embedding,
                stop_reason=stop_reason,
            )
        )

    async def fail_requests(self, request_ids: tuple[str, ...], message: str) -> None:
        # One request's text went wrong: finish it with an error, and stop generating for it.
        for request_id in request_ids:
            self.core.finish(request_id)
            self.deliver(TextDelta(request_id, "", (), None, "error", error=message, error_code="internal_error"))
            await self.scheduler.send(AbortRequest(request_id, "abort"))
