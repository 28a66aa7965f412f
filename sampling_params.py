"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPSILON = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` switch those filters off.
    Penalties follow OpenAI (presence, frequency: additive) and HF/vLLM (repetition: multiplicative,
    applied to prompt and output tokens). `logprobs=N` returns the chosen token's log-probability
    and the N most likely tokens of the model's raw distribution at each step.
    `extra` carries parameters for sampler plugins, keyed by plugin name.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._check()

    def _check(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        if self.n < 1:
            fail("n", "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not self.temperature >= 0.0:
            fail("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "must be -1 or 0 (off) or a positive count")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "must be positive")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            fail("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "token ids must be non-negative")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
