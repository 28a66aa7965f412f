"""What a request hands back, one record per stage on its way out (plain data: no torch, no actor).

    detokenizer --TextDelta--> RequestStream --GenerationOutput--> AsyncEngine.generate's caller
                                                                   (the WebSocket and OpenAI APIs)
                                              LLM.generate --RequestOutput--> its caller

`TextDelta` is what the detokenizer produced since its last one; the stream merges the deltas its
reader has not read yet into one `GenerationOutput` (defined beside `RequestStream` in
`engine/streams.py`), and adds running counts and, on the last, the `RequestTimings`. `LLM.generate`
joins a request's `GenerationOutput`s into one `CompletionOutput`, and a prompt's completions into
one `RequestOutput`, in vLLM's shape (`out.outputs[0].text`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability at its position (a sampled token's, or a prompt token's given the
    tokens before it) and the `top` most likely tokens there, most likely first; `rank`: the token's
    1-based rank in that distribution, where it was computed (prompt tokens)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Detokenizer -> a request's stream: what the request produced since its last delta.

    The last one has `finish_reason` (with `error` and `error_code` when it is "error"). The first
    one of a request that asked for `prompt_logprobs` carries them, aligned with `prompt_token_ids`
    (None for the first token).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    queue_seconds: float | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, on its last delta
    stop_reason: int | str | None = None  # on the last: the stop string or stop token id that ended it


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """How long a finished request took, measured by its stream (seconds)."""

    queue_seconds: float | None
    ttft_seconds: float | None  # time to first token, from arrival
    tpot_seconds: float | None  # mean time per output token after the first
    e2e_seconds: float


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's record of one token at one position: its log-probability, its 1-based rank in the
    distribution there (None where it was not computed) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities, as vLLM gives them: token id -> Logprob, the sampled (or prompt)
# token first, then the most likely tokens there, most likely first.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM's `CompletionOutput`.

    `cumulative_logprob`: the sum of the sampled tokens' log-probabilities, where logprobs were
    asked for (None otherwise). `stop_reason`: the stop string or stop token id that ended it
    (None when it ended on EOS or length). `error`/`error_code`: why a completion that failed
    alone (`finish_reason` "error") failed.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """`LLM.generate`'s and `LLM.chat`'s result for one prompt, shaped as vLLM's: its `n`
    completions in `outputs` (`index` 0..n-1), the prompt and its `prompt_logprobs` (when the
    params asked: one per prompt token, None for the first), and `metrics` (the first
    completion's timings)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestTimings | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """`LLM.embed`'s result for one prompt: its vector (None when the request failed, with
    `error` and `error_code`) and how many prompt tokens it embedded."""

    request_id: str
    embedding: list[float] | None
    num_prompt_tokens: int
    error: str | None = None
    error_code: str | None = None
