"""One sampling step: the configured logits processors in order, then the sampler."""

from __future__ import annotations

from typing import Sequence

import torch

from cadenza.samplers.base import (
    LogitsProcessor,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingContext,
    SamplingError,
)

# The built-in processors in the order they should run (vLLM's): bans and biases first, as they
# decide what may be emitted at all; penalties next, on the biased logits; then temperature, and
# the truncation filters last, on the tempered distribution a row actually samples from.
DEFAULT_PROCESSORS: tuple[str, ...] = (
    "min_tokens",
    "logit_bias",
    "penalties",
    "temperature",
    "min_p",
    "top_k_top_p",
)


class SamplingPipeline:
    """Applies each active processor to a batch's logits, in order, then calls the sampler.

    Built once at start-up; `__call__` runs on the per-token path, so it does no registry lookups.
    """

    def __init__(
        self, context: SamplingContext, processors: Sequence[LogitsProcessor], sampler: Sampler
    ) -> None:
        self.context = context
        self.processors = list(processors)
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Pick one token per row of `logits` [B, V] (any float dtype).

        The pipeline owns `logits`: processors may edit them in place, so the caller must not reuse
        them afterwards. Log-probabilities are still taken from the raw values: the raw tensor is
        copied first whenever a processor would otherwise overwrite it.
        An all-greedy batch skips argmax-invariant processors, and when nothing else is left to
        run and no row wants log-probabilities it is a bare argmax, without calling the sampler.
        """
        all_greedy = batch.all_greedy
        active = [
            p
            for p in self.processors
            if not (all_greedy and p.argmax_invariant) and p.is_active(batch)
        ]
        wants_logprobs = any(p.logprobs is not None for p in batch.params)
        if all_greedy and not active and not wants_logprobs:
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        raw = logits
        work = logits.float()  # a copy unless the logits already are float32
        if work is raw and active and wants_logprobs:
            work = work.clone()
        for processor in active:
            work = self._apply(processor, work, batch)
        try:
            output = self.sampler.sample(work, raw, batch)
        except Exception as exc:
            raise SamplingError(f"sampler {self.sampler.name!r}", list(range(len(batch))), exc) from exc
        if output.token_ids.shape != (len(batch),):
            raise SamplingError(
                f"sampler {self.sampler.name!r}", list(range(len(batch))),
                f"returned token ids of shape {tuple(output.token_ids.shape)}, expected ({len(batch)},)",
            )
        return output

    @staticmethod
    def _apply(processor: LogitsProcessor, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Run one processor; a raise or a wrong shape fails only the rows that use it."""
        shape = logits.shape
        try:
            result = processor.apply(logits, batch)
        except Exception as exc:
            raise SamplingError(f"logits processor {processor.name!r}", _rows(processor, batch), exc) from exc
        if not isinstance(result, torch.Tensor) or result.shape != shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise SamplingError(
                f"logits processor {processor.name!r}", _rows(processor, batch), f"returned {got}, expected {tuple(shape)}"
            )
        return result


def _rows(processor: LogitsProcessor, batch: SamplingBatch) -> list[int]:
    try:
        return list(processor.rows_using(batch))
    except Exception:
        return list(range(len(batch)))


def build_pipeline(
    context: SamplingContext,
    processor_classes: Sequence[type[LogitsProcessor]],
    sampler_class: type[Sampler],
) -> SamplingPipeline:
    """Instantiate the processors (in the given order) and the sampler for one engine."""
    return SamplingPipeline(
        context, [cls(context) for cls in processor_classes], sampler_class(context)
    )
