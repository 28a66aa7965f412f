"""Every message that passes between actors, grouped by the actor that receives it.

Messages are frozen, slotted dataclasses and carry a `request_id` (or a step id for step-wide
messages). Receivers dispatch with `match` on the type and fail loudly on anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from anyio.streams.memory import MemoryObjectSendStream

from cadenza.outputs import TokenLogprob
from cadenza.sampling_params import SamplingParams
from cadenza.step import Pooled, PromptLogprobs, ScheduledChunk, Speculation

# --- to the ingress -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A caller's request as it arrived: text, token ids or chat messages."""

    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    priority: int = 0


IngressMessage = SubmitRequest

# --- to the scheduler -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """A validated, tokenized request ready to be scheduled."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request now. `reason` becomes its finish reason ("abort", or "stop" for stop strings)."""

    request_id: str
    reason: str = "abort"


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced: a token per sampling request (a speculating request's accepted
    guesses first, then its token, in order); requests that failed alone; what speculation did;
    the prompt logprobs its prompt chunks computed; the vectors of the embedding requests whose
    last chunk it ran."""

    step_id: int
    sampled: tuple[SampledToken, ...]
    failed: tuple[tuple[str, str], ...] = ()  # (request_id, error message)
    seconds: float = 0.0
    speculated: tuple[Speculation, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    pooled: tuple[Pooled, ...] = ()


@dataclass(frozen=True, slots=True)
class StepFailed:
    """The whole step failed (the model raised); every request in it fails with `message`."""

    step_id: int
    request_ids: tuple[str, ...]
    message: str


@dataclass(frozen=True, slots=True)
class TierReadDone:
    """The tier agent has read back what it could of a waiting request's prefix (`num_blocks`
    blocks, now in the prefix cache): the request may be admitted."""

    request_id: str
    num_blocks: int = 0


SchedulerMessage = Union[AdmitRequest, AbortRequest, StepOutput, StepFailed, TierReadDone]

# --- to the cache manager -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockNeed:
    """A running request whose blocks must cover `num_tokens` tokens once this step has run."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """A queued request the step may admit: the cache manager first reuses cached blocks for the
    longest cached prefix of `token_ids` (all its tokens), at most `max_cached_tokens` of them
    (None: no limit; 0: no lookup), then covers `num_new_tokens` more."""

    request_id: str
    token_ids: tuple[int, ...]
    num_new_tokens: int
    max_cached_tokens: int | None = None
    cache_salt: str | None = None  # its hash chain's salt: it shares cached blocks only with the same one


@dataclass(frozen=True, slots=True)
class BlockGrant:
    """A request's block table for this step; `num_cached_tokens`: for an admitted request, the
    leading tokens the prefix cache already holds (the step computes from there)."""

    request_id: str
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepAllocation:
    """The cache manager's answer to `AllocateStep`.

    `kept`: the longest prefix of the ranked running requests that fits once every request ranked
    below is released, in order, their tables grown. `preempted`: the rest, in rank order, their
    blocks released. `admitted`: the longest prefix of the candidates that fits, in order (none
    when a running request was preempted).
    """

    step_id: int
    kept: tuple[BlockGrant, ...]
    preempted: tuple[str, ...]
    admitted: tuple[BlockGrant, ...]


@dataclass(frozen=True, slots=True)
class AllocateStep:
    """The step's one exchange with the cache manager, answered exactly on `reply`.

    `running`: every running request, best-ranked first, with the tokens its blocks must cover
    after this step. `waiting`: admission candidates in queue order. The cache manager keeps the
    running requests that fit, preempting from the tail (the top request too, when it does not
    fit even alone), then, if it preempted none, admits candidates until one does not fit: first
    come, first refused.
    """

    step_id: int
    running: tuple[BlockNeed, ...]
    waiting: tuple[Candidate, ...]
    reply: MemoryObjectSendStream[StepAllocation] = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class CommitTokens:
    """A step's computed tokens, per request: their keys and values are now in the request's
    blocks, so the blocks they complete become cacheable."""

    step_id: int
    entries: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    """The request finished or was aborted: drop its references to its blocks."""

    request_id: str


@dataclass(frozen=True, slots=True)
class SyncCache:
    """A barrier: answered once the cache manager has handled everything sent to it before."""

    reply: MemoryObjectSendStream[None] = field(compare=False, repr=False)


CacheMessage = Union[AllocateStep, CommitTokens, FreeBlocks, SyncCache]

# --- to the runner --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExecuteStep:
    """Run a step. `finished_request_ids`: requests gone since the last message (finished, aborted
    or failed), so the sampling plugins drop their state before this step runs."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    finished_request_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestsFinished:
    """Requests gone while no step was left to carry the news (the engine went idle)."""

    request_ids: tuple[str, ...]


RunnerMessage = Union[ExecuteStep, RequestsFinished]

# --- to the tier agent -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadBack:
    """A new request's prompt: read back the blocks of its prefix found in a tier below the KV
    budget, then answer `TierReadDone` (always, even when nothing was read)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None  # its hash chain's salt


@dataclass(frozen=True, slots=True)
class Offload:
    """Blocks that step `step_id`'s tokens completed entered the prefix cache under `hashes`, at
    `positions` of their sequences (the tiers' eviction policies see them): write them behind."""

    step_id: int
    hashes: tuple[bytes, ...]
    positions: tuple[int, ...]


TierMessage = Union[ReadBack, Offload]

# --- to the detokenizer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrackRequest:
    """Sent by the ingress before it admits a request, so the detokenizer knows it first."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NewTokens:
    """Tokens a request generated; `finish_reason` is set on its last message from the scheduler.
    Its first tokens carry its `prompt_logprobs` when it asked (one per prompt token, None first).
    An embedding request's one message has no tokens, its `embedding` and finish_reason "stop"."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # on a request's first tokens
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    embedding: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class StepTokens:
    """Every NewTokens of one step, in order, in one message: one channel hop a step, not one a
    token (at batch 256 the per-message hops were milliseconds of the event loop's time a step)."""

    items: tuple[NewTokens, ...]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The request ends with `finish_reason="error"` before or without generating."""

    request_id: str
    message: str
    code: str = "internal_error"


DetokenizerMessage = Union[TrackRequest, NewTokens, StepTokens, RequestFailed]


class UnexpectedMessageError(TypeError):
    """An actor received a message type it does not handle: a wiring bug, never silently ignored."""

    def __init__(self, actor: str, message: object) -> None:
        super().__init__(f"{actor} cannot handle {type(message).__name__}: {message!r}")
