"""Contracts for logits processors and samplers.

A step's sampling runs once over the whole batch: the runner builds a `SamplingBatch` (one row per
request that needs a token this step), the configured logits processors transform the batch's
logits in order, and the sampler picks one token per row. Nothing here loops over the vocabulary in
Python; a processor may loop over rows only to build its parameter tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from cadenza.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingContext:
    """What a processor or sampler factory is told once, at engine start-up."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device


@dataclass(slots=True)
class SamplingBatch:
    """The rows that sample this step, in the row order of the logits tensor.

    `generators[i]` is the request's own generator when it set a seed (so the same seed gives the
    same tokens whatever else is in the batch), else None.
    """

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    generators: Sequence[torch.Generator | None]

    def __len__(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return all(p.is_greedy for p in self.params)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One chosen token per row, and log-probabilities where a request asked for them.

    `logprobs[i]` is the chosen token's log-probability under the model's raw distribution;
    `top_logprobs` holds (token ids [B, K], log-probabilities [B, K]) with K the largest `logprobs`
    any row asked for. Both are None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class LogitsProcessor(ABC):
    """Transforms a batch's logits before a token is picked.

    Subclasses set `name`, and `argmax_invariant = True` when they never change which token has
    the largest logit (greedy rows may then skip them).
    """

    name: ClassVar[str]
    argmax_invariant: ClassVar[bool] = False

    def __init__(self, context: SamplingContext) -> None:
        self.context = context

    def is_active(self, batch: SamplingBatch) -> bool:
        """Whether any row needs this processor; inactive processors cost nothing."""
        return True

    def rows_using(self, batch: SamplingBatch) -> list[int]:
        """The rows whose requests use this processor: the ones that fail if it raises."""
        return list(range(len(batch)))

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return the transformed float32 logits [B, V] (in place is allowed)."""


class SamplingError(RuntimeError):
    """A processor or sampler failed; `rows` are the batch rows whose requests it takes down."""

    def __init__(self, component: str, rows: list[int], cause: BaseException | str) -> None:
        self.component, self.rows, self.cause = component, rows, cause
        super().__init__(f"{component} failed: {cause!r}" if isinstance(cause, BaseException) else f"{component}: {cause}")


class Sampler(ABC):
    """Picks one token per row from processed logits."""

    name: ClassVar[str]

    def __init__(self, context: SamplingContext) -> None:
        self.context = context

    @abstractmethod
    def sample(
        self, logits: torch.Tensor, raw_logits: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        """`logits` went through the processors; `raw_logits` did not (for logprobs)."""
