"""What a finished (or streaming) request hands back to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
